"""The options of edits (:mod:`hooks.engine.edits`) shared by ``mdb capture --edit`` and ``mdb diff
--edit``: ``--edit SPEC`` (repeatable) and the batch a ``patch`` takes its outputs from
(``--source-text``, ``--source-ids``, ``--source-batch``), checked against the model before
anything runs (:func:`edit_plan`: bad input is one line, exit 2)."""

from __future__ import annotations

import argparse
from typing import Any

from tui.errors import MdbError

#: The name of the one patch source of the command line when a spec names none (every
#: ``patch ... from=NAME`` resolves to that one source, under the NAME typed).
SOURCE = "source"


def add_edit_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--edit`` and the patch source options."""
    g = parser.add_argument_group("edits (what if)")
    g.add_argument("--edit", metavar="SPEC", action="append", default=[],
                   help="edit the step: 'zero MODULE [q|k|v|pattern] [head=H | expert=E]', "
                        "'drop MODULE expert=E', 'scale MODULE [q|k|v|pattern] [head=H] by=F', "
                        "'mean MODULE', 'patch MODULE [q|k|v|pattern] [head=H] from=source "
                        "[pos=P]', 'add MODULE vector=FILE.safetensors|from=source [scale=F]', "
                        "'clamp MODULE min=A max=B' (repeatable; applied together)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--source-text", metavar="TEXT", default=None,
                     help="patch source: this text, tokenised and cut to the batch's shape as "
                          "the batch is")
    src.add_argument("--source-ids", metavar="IDS", default=None,
                     help="patch source: token ids, '1,2,3' (every row) or '1,2,3;4,5,6' (one "
                          "row each), of the batch's shape")
    src.add_argument("--source-batch", metavar="MODULE:FUNCTION", default=None,
                     help="patch source: FUNCTION() returns the batch (a tensor of ids, a "
                          "tuple, a dict of keyword arguments or a hooks.Batch)")


def _ids_rows(text: str, shape: tuple[int, ...]):
    import torch

    try:
        rows = [[int(x) for x in r.split(",") if x.strip()] for r in text.split(";")]
    except ValueError:
        raise MdbError(f"--source-ids {text!r}: give integers, '1,2,3' or '1,2;3,4'") from None
    if not rows or not all(rows):
        raise MdbError(f"--source-ids {text!r}: no ids")
    b, t = shape[0], shape[-1]
    if len(rows) == 1:
        rows = rows * b
    if len(rows) != b or any(len(r) != t for r in rows):
        raise MdbError(f"--source-ids: {len(rows)} row(s) of {sorted({len(r) for r in rows})} "
                       f"ids; the batch is {b}×{t}")
    return torch.tensor(rows, dtype=torch.long)


def _with_ids(batch, new_ids):
    """``batch`` with its input ids (the tensor, wherever it appears) replaced by ``new_ids``."""
    old = batch.ids()
    if old is None:
        raise MdbError("--source-text/--source-ids: the batch has no token ids to replace; use "
                       "--source-batch")
    swap = (lambda v: new_ids if v is old else v)  # noqa: E731
    return batch.replace(args=tuple(swap(v) for v in batch.args),
                         kwargs={k: swap(v) for k, v in batch.kwargs.items()})


def source_batch(args: argparse.Namespace, workload) -> Any:
    """The patch source the options give, or None.

    Raises:
        MdbError: ids of the wrong shape, text the tokenizer cannot encode, a workload without
            token ids, a ``--source-batch`` that cannot be imported or returns no batch.
    """
    if args.source_batch:
        from hooks.batch import Batch, BatchError
        from tui.commands.workload import exits_reported, import_factory_module

        module_name, sep, func_name = args.source_batch.partition(":")
        if not sep or not module_name or not func_name:
            raise MdbError(f"--source-batch {args.source_batch!r}: expected MODULE:FUNCTION")
        with exits_reported(f"--source-batch {args.source_batch}", "instead of a batch"):
            module = import_factory_module(args.source_batch, module_name, "--source-batch")
            func = getattr(module, func_name, None)
            if not callable(func):
                raise MdbError(f"--source-batch: {module_name} has no function {func_name}")
            try:
                result = func()
            except Exception as exc:
                raise MdbError(f"--source-batch: {func_name}() raised {type(exc).__name__}: "
                               f"{exc}") from None
        try:
            return Batch.of(result)
        except BatchError as exc:
            raise MdbError(f"--source-batch: {func_name}() {exc}") from None
    if args.source_ids is None and args.source_text is None:
        return None
    ids = workload.batch.ids(workload.model)
    if ids is None:
        raise MdbError("--source-text/--source-ids: the batch has no token ids; use "
                       "--source-batch")
    if args.source_ids is not None:
        return _with_ids(workload.batch, _ids_rows(args.source_ids, tuple(ids.shape)))
    if workload.tokenizer is None:
        raise MdbError("--source-text: this model has no tokenizer mdb knows; use --source-ids "
                       "or --source-batch")
    from tui.commands.inputs import batch_from_text

    if not args.source_text:
        raise MdbError("--source-text: give the text")
    try:
        new = batch_from_text(args.source_text, workload.tokenizer, ids.shape[0], ids.shape[-1])
    except (KeyError, ValueError) as exc:
        raise MdbError(f"--source-text: the model's tokenizer cannot encode it ({exc})") from None
    return _with_ids(workload.batch, new.view(ids.shape))


def edit_plan(args: argparse.Namespace, workload) -> tuple[list[str], dict[str, Any]]:
    """``(edits, sources)`` of the options, checked against the workload's model before
    anything runs (:func:`hooks.engine.edits.resolve_edits`).

    Every ``patch ... from=NAME`` and ``add ... from=NAME`` takes the one source the options
    give.

    Raises:
        MdbError: a bad spec (one line), a patch without a source, a source given without a
            patch, or a bad source.
    """
    from hooks.engine.edits import parse_edit, resolve_edits

    specs = list(args.edit or [])
    try:
        parsed = [parse_edit(s) for s in specs]
    except ValueError as exc:
        raise MdbError(str(exc)) from None
    patches = [e for e in parsed if e.needs_source]
    given = any(getattr(args, o, None) is not None
                for o in ("source_text", "source_ids", "source_batch"))
    if patches and not given:
        raise MdbError(f"edit {patches[0].spec!r}: give the patch source: --source-text TEXT, "
                       "--source-ids IDS or --source-batch MODULE:FUNCTION")
    if given and not patches:
        raise MdbError("--source-text/--source-ids/--source-batch are for a 'patch' edit (or "
                       "'add … from='); none was given")
    src = source_batch(args, workload)
    # every name typed after from= is the one source the options give; the spec keeps the name
    # that was typed, so it is echoed back as written (``from=clean``)
    sources = {e.source or SOURCE: src for e in patches} if src is not None else {}
    try:
        resolve_edits(workload.model, parsed, sources)
    except ValueError as exc:
        raise MdbError(str(exc)) from None
    return [e.spec for e in parsed], sources


def edit_lines(trace) -> list[str]:
    """``edit: zero …: 1 of 1 call(s) changed`` per applied edit of ``trace``."""
    return [f"edit: {e.describe()}" for e in trace.edits]


__all__ = ["SOURCE", "add_edit_arguments", "edit_lines", "edit_plan", "source_batch"]
