"""The model and the batch a command runs on (:class:`Workload`): a minillm built from the
options (:func:`build_workload`), or the ``(model, batch)`` of a user's ``--model
module:function`` (:func:`load_user_workload`), whose exits and errors are reported on one
line."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from hooks.doctor.model.target import Target
from tui.commands.inputs import (
    batch_from_text,
    check_memory,
    default_text_path,
    human_count,
    load_config,
    read_text,
    tokenizer_for,
)
from tui.errors import MdbError, ModelError


class Workload(Target):
    """A :class:`hooks.doctor.model.target.Target` (the model, its batch and loss convention: the
    doctor's checks run on it as it is) with what the commands show of it.

    Args:
        model: the ``nn.Module``.
        batch: the :class:`hooks.Batch` of the forward call (arguments, their roles, token
            labels), or what :meth:`hooks.Batch.of` takes.
        loss_fn: ``loss_fn(output, batch)`` from a factory that returned one, else None.
        config: the minillm config as a dict, or None for a user model; kept as
            :attr:`config_dict` (:attr:`Target.config` is ``model.config``).
        description: one line saying what runs (shown in the UI).
        tokenizer: the tokenizer used, or None.
    """

    def __init__(self, model: Any, batch: Any = None, loss_fn: Any = None,
                 config: dict[str, Any] | None = None, description: str = "",
                 tokenizer: Any = None) -> None:
        super().__init__(model, batch, loss_fn)
        self.config_dict = config
        self.description = description
        self.tokenizer = tokenizer

    @property
    def token_strings(self) -> list[str]:
        """A printable label per token of :attr:`input_ids`, row-major, or []."""
        return self.batch.token_labels(self.model)


def build_workload(args: argparse.Namespace, *, default_text: Path | None = None) -> Workload:
    """Build the model and batch the options describe (seeded with ``--seed``)."""
    import torch

    torch.manual_seed(args.seed)
    if getattr(args, "model", None):
        if getattr(args, "text", None):
            raise MdbError("--text does not apply with --model: your function returns the batch")
        return load_user_workload(args.model)

    from minillm import MiniLLM

    config = load_config(args)
    if args.seq_len > config.max_position_embeddings:
        raise MdbError(
            f"--seq-len {args.seq_len} is longer than the model allows "
            f"(max_position_embeddings = {config.max_position_embeddings})"
        )
    check_memory(config, args.batch_size, args.seq_len)
    text_path = Path(args.text) if args.text else (default_text or default_text_path())
    text = read_text(text_path)
    tokenizer = tokenizer_for(text, config.vocab_size)
    input_ids = batch_from_text(text, tokenizer, args.batch_size, args.seq_len)
    model = MiniLLM(config)
    name = args.config or args.preset or "default"
    from hooks.batch import Batch

    batch = Batch((input_ids,), {"labels": input_ids},
                  token_text=tokenizer.token_strings(input_ids.reshape(-1).tolist()))
    return Workload(
        model=model,
        batch=batch,
        config=config.to_dict(),
        description=(
            f"minillm {name} · {human_count(model.num_parameters())} params · "
            f"{args.batch_size}×{args.seq_len} of {text_path.name}"
        ),
        tokenizer=tokenizer,
    )


def load_user_workload(spec: str) -> Workload:
    """Import ``module:function`` (a module name or a ``path/to/file.py``), call it, and check
    that it returned ``(model, batch)`` with a model that holds data.

    Raises:
        MdbError: a malformed ``spec``; a module that cannot be imported or has no such
            function; a result that is not ``(model, batch)``; a model on the ``meta`` device
            (no data: the line says how to materialise it).
        ModelError: the function raised, or the module or the function exited
            (``sys.exit(n)``, ``os._exit(n)``) instead of returning; the line gives the code.
    """
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise MdbError(f"--model {spec!r}: expected MODULE:FUNCTION, e.g. mymodels:build")
    with exits_reported(f"--model {spec}: importing {module_name}",
                        f"instead of defining {func_name}"):
        module = import_factory_module(spec, module_name)
    func = getattr(module, func_name, None)
    if not callable(func):
        raise MdbError(f"--model {spec}: {module_name} has no function {func_name}")
    with exits_reported(f"--model {spec}: {func_name}()"):
        try:
            result = func()
        except Exception as exc:
            from hooks.errors import describe_error

            raise ModelError(f"--model {spec}: {func_name}() raised "
                             f"{describe_error(exc)}") from None
    from hooks.batch import BatchError, from_factory

    try:
        model, batch, loss_fn = from_factory(result)
    except BatchError as exc:
        raise MdbError(f"--model {spec}: {func_name}() {exc}") from None
    check_has_data(model, f"--model {spec}: {func_name}()")
    from hooks.engine.capture import unwrap_compiled

    n_params = sum(p.numel() for p in model.parameters())
    inner = unwrap_compiled(model)  # torch.compile(m) is an OptimizedModule around m
    compiled = " (torch.compile'd)" if inner is not model else ""
    return Workload(
        model=model,
        batch=batch,
        loss_fn=loss_fn,
        config=None,
        description=f"{type(inner).__name__}{compiled} from {Path(module_name).name}:"
                    f"{func_name} · {human_count(n_params)} params",
        tokenizer=batch.tokenizer,
    )


def import_factory_module(spec: str, module_name: str, option: str = "--model"):
    """The module of ``--model`` (or of ``option``, e.g. ``--source-batch``, which the error
    line names): a ``.py`` file (or a path) run as a module, with the file's
    folder put first on ``sys.path`` (and left there, as ``python FILE`` does) so that it and
    its factory import the modules beside it; else imported by name from the current directory
    or ``sys.path``. mdb's own packages are bound first (their ``__init__`` is cheap), so a
    folder ``hooks/`` or ``minillm/`` beside the file does not take their place. Any failure ->
    one MdbError line."""
    import hooks  # noqa: F401  (bound before the user's folder joins sys.path)
    import minillm  # noqa: F401

    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = Path(module_name)
            if not path.exists():
                raise MdbError(f"{option} {spec}: no such file {path}")
            folder = str(path.resolve().parent)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            module_spec = importlib.util.spec_from_file_location(f"_mdb_model_{path.stem}",
                                                                 path)
            module = importlib.util.module_from_spec(module_spec)
            # registered while it runs: dataclasses and pickle look the module up by name
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)
            return module
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        return importlib.import_module(module_name)
    except MdbError:
        raise
    except Exception as exc:  # the user's code: any failure is theirs to see, on one line
        raise MdbError(
            f"{option} {spec}: cannot import {module_name}: {type(exc).__name__}: {exc}"
        ) from None


def check_has_data(model, what: str) -> None:
    """Refuse a model whose parameters or buffers are on PyTorch's ``meta`` device: they have
    shapes but no values, so nothing can be measured.

    Raises:
        MdbError: ``{what} returned a model with no data: <name> is on the meta device; …``
            with how to materialise it.
    """
    on_meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if on_meta:
        more = f" (and {len(on_meta) - 1} more)" if len(on_meta) > 1 else ""
        raise MdbError(f"{what} returned a model with no data: {on_meta[0]}{more} is on the "
                       "meta device; materialise it before returning it: "
                       "model.to_empty(device='cpu'), then initialise its weights (e.g. "
                       "model.apply(init_fn)) or load them (model.load_state_dict(...))")


class _Exited(BaseException):
    """Raised by the stand-in of ``os._exit`` (:func:`exits_reported`) with its code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def exits_reported(what: str, instead: str = "instead of returning (model, batch)"):
    """Run the user's code of the block (a factory, its module) so that its exiting is said.

    ``sys.exit(n)`` (``SystemExit``) and ``os._exit(n)`` become a :class:`ModelError`:
    ``{what} called sys.exit(7) at model.py:12 {instead}``. A real
    ``os._exit`` ends the process at once (no handler, no ``finally``, no atexit runs), so for
    the block ``os._exit`` is replaced by a stand-in that raises; in a forked child or another
    thread it exits as asked.

    Raises:
        ModelError: the block exited.
    """
    import threading

    real_exit, pid, main = os._exit, os.getpid(), threading.main_thread()

    def stand_in(code: int) -> None:
        if os.getpid() != pid or threading.current_thread() is not main:
            real_exit(code)
        raise _Exited(code)

    os._exit = stand_in
    try:
        yield
    except (SystemExit, _Exited) as exc:
        from hooks.errors import locate_error

        code = "" if exc.code is None else repr(exc.code)
        call = f"sys.exit({code})" if isinstance(exc, SystemExit) else f"os._exit({code})"
        where = locate_error(exc).where
        raise ModelError(f"{what} called {call}{f' at {where}' if where else ''} {instead}") \
            from None
    finally:
        os._exit = real_exit
