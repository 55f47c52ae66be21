"""What several subcommands share: choosing a model and a batch, and one captured step.

``mdb step``, ``mdb summary``, ``mdb capture`` and ``mdb doctor`` all take the same options:
``--preset``/``--config`` (a minillm config), ``--text`` (the batch's text), ``--seq-len``,
``--batch-size``, ``--seed``, or ``--model module:function`` for a user's own model. Bad input
raises :class:`tui.errors.MdbError` with one line that says what to fix.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tui.errors import MdbError

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def require_terminal(command: str, instead: str) -> None:
    """Raise :class:`MdbError` unless stdin and stdout are a terminal (a Textual app needs one;
    without it the app would draw into a pipe and wait for keys that never come).

    Args:
        command: the command, e.g. ``"mdb step"``.
        instead: what to run without a terminal, e.g. ``"mdb summary"``.
    """
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise MdbError(f"{command} needs a terminal (without one, use {instead})")


def samples_dir() -> Path:
    """The ``samples/`` folder: ``$MDB_SAMPLES`` if set, else the one beside the packages."""
    env = os.environ.get("MDB_SAMPLES")
    return Path(env) if env else REPO_ROOT / "samples"


def default_text_path() -> Path:
    """The text ``mdb step`` runs on when ``--text`` is not given."""
    return samples_dir() / "alice.txt"


def add_model_arguments(
    parser: argparse.ArgumentParser, *, seq_len: int = 64, batch_size: int = 2
) -> None:
    """Add the options that choose the model and the batch."""
    g = parser.add_argument_group("model and batch")
    src = g.add_mutually_exclusive_group()
    src.add_argument(
        "--preset",
        default=None,
        help="a named minillm config (default, seed-test-c, mha, mqa, dense, "
        "learned-pos, tiny); default: default",
    )
    src.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="a minillm config as TOML (see samples/presets/)",
    )
    src.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        default=None,
        help="debug your own model: FUNCTION() returns (model, batch); batch is a "
        "tensor of input ids, a tuple of positional args or a dict of kwargs",
    )
    g.add_argument(
        "--text",
        metavar="FILE",
        default=None,
        help="UTF-8 text the batch is cut from (default: samples/alice.txt)",
    )
    g.add_argument(
        "--seq-len",
        type=positive_int,
        default=seq_len,
        help=f"tokens per sequence (default {seq_len})",
    )
    g.add_argument(
        "--batch-size",
        type=positive_int,
        default=batch_size,
        help=f"sequences per batch (default {batch_size})",
    )
    g.add_argument("--seed", type=int, default=0, help="torch seed for weights (default 0)")


def _number(text: str, kind: type, ok, requirement: str):
    try:
        value = kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    return _number(text, int, lambda v: v > 0, "a positive integer")


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _number(text, int, lambda v: v >= 0, "0 or a positive integer")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, float, lambda v: 0 < v < float("inf"), "a positive number")


@dataclass
class Workload:
    """A model with the batch to run it on.

    Attributes:
        model: the ``nn.Module``.
        batch: the :class:`hooks.Batch` of the forward call (arguments, their roles, token
            labels).
        loss_fn: ``loss_fn(output, batch)`` from a factory that returned one, else None.
        config: the minillm config as a dict, or None for a user model.
        description: one line saying what runs (shown in the UI).
        tokenizer: the tokenizer used, or None.
    """

    model: Any
    batch: Any = None
    loss_fn: Any = None
    config: dict[str, Any] | None = None
    description: str = ""
    tokenizer: Any = None

    @property
    def args(self) -> tuple:
        """Positional arguments of the forward call."""
        return self.batch.args

    @property
    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the forward call."""
        return self.batch.kwargs

    @property
    def input_ids(self):
        """(B, T) integer token ids when the batch has them, else None."""
        return self.batch.ids(self.model)

    @property
    def token_strings(self) -> list[str]:
        """A printable label per token of :attr:`input_ids`, row-major, or []."""
        return self.batch.token_labels(self.model)


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of ``path``; missing, unreadable, empty or non-UTF-8 -> MdbError."""
    p = Path(path)
    if not p.exists():
        raise MdbError(f"--text {p}: no such file")
    if p.is_dir():
        raise MdbError(f"--text {p}: is a directory, not a text file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MdbError(f"--text {p}: not UTF-8 text (bad byte at offset {exc.start})") from None
    except OSError as exc:
        raise MdbError(f"--text {p}: cannot read ({exc.strerror})") from None
    if not text.strip():
        raise MdbError(f"--text {p}: the file is empty")
    return text


def load_config(args: argparse.Namespace):
    """The minillm config chosen by ``--preset`` / ``--config`` (default preset ``default``)."""
    from minillm import MiniLLMConfig, load_preset

    if getattr(args, "config", None):
        path = Path(args.config)
        if not path.exists():
            raise MdbError(f"--config {path}: no such file")
        try:
            return MiniLLMConfig.from_toml(path)
        except (ValueError, TypeError) as exc:
            raise MdbError(f"--config {path}: {exc}") from None
    try:
        return load_preset(getattr(args, "preset", None) or "default")
    except ValueError as exc:
        raise MdbError(str(exc)) from None


def tokenizer_for(text: str, vocab_size: int):
    """UTF-8 bytes when the vocabulary holds 256 ids, else the text's characters."""
    from minillm import ByteTokenizer, CharTokenizer

    if vocab_size >= ByteTokenizer.vocab_size:
        return ByteTokenizer()
    tok = CharTokenizer.from_text(text)
    if tok.vocab_size > vocab_size:
        raise MdbError(
            f"the text has {tok.vocab_size} distinct characters but the model's vocab_size is "
            f"{vocab_size}; use a config with vocab_size >= 256 (bytes) or >= {tok.vocab_size}"
        )
    return tok


def batch_from_text(text: str, tokenizer, batch_size: int, seq_len: int):
    """(B, T) ids: B consecutive windows of T tokens from the start of the text (the token
    stream is repeated when the text is shorter than B·T tokens)."""
    import torch

    ids = tokenizer.encode(text)
    need = batch_size * seq_len
    if len(ids) < need:
        ids = (ids * (need // len(ids) + 1))[:need]
    return torch.tensor(ids[:need], dtype=torch.long).view(batch_size, seq_len)


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
            f"minillm {name} · {model.num_parameters():,} params · batch "
            f"{args.batch_size}×{args.seq_len} of {text_path.name}"
        ),
        tokenizer=tokenizer,
    )


def load_user_workload(spec: str) -> Workload:
    """Import ``module:function`` (a module name or a ``path/to/file.py``), call it, and check
    that it returned ``(model, batch)``."""

    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise MdbError(f"--model {spec!r}: expected MODULE:FUNCTION, e.g. mymodels:build")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = Path(module_name)
            if not path.exists():
                raise MdbError(f"--model {spec}: no such file {path}")
            module_spec = importlib.util.spec_from_file_location(f"_mdb_model_{path.stem}",
                                                                 path)
            module = importlib.util.module_from_spec(module_spec)
            # registered while it runs: dataclasses and pickle look the module up by name
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except MdbError:
        raise
    except Exception as exc:  # the user's code: any failure is theirs to see, on one line
        raise MdbError(
            f"--model {spec}: cannot import {module_name}: {type(exc).__name__}: {exc}"
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise MdbError(f"--model {spec}: {module_name} has no function {func_name}")
    try:
        result = func()
    except Exception as exc:
        raise MdbError(
            f"--model {spec}: {func_name}() raised {type(exc).__name__}: {exc}"
        ) from None
    from hooks.batch import BatchError, from_factory

    try:
        model, batch, loss_fn = from_factory(result)
    except BatchError as exc:
        raise MdbError(f"--model {spec}: {func_name}() {exc}") from None
    n_params = sum(p.numel() for p in model.parameters())
    return Workload(
        model=model,
        batch=batch,
        loss_fn=loss_fn,
        config=None,
        description=f"{type(model).__name__} from {spec} · {n_params:,} params",
        tokenizer=batch.tokenizer,
    )


def capture_step(workload: Workload, *, attention: bool = True, keep_bytes: int = 0):
    """Run one forward and backward pass of ``workload`` under :func:`hooks.capture`.

    Returns:
        The :class:`hooks.Trace`, with ``meta`` holding the description, token labels,
        config, input shape and the loss values (``loss``, ``ce_loss``, ``aux_loss``).
        A non-finite loss does not stop the capture: the trace shows where it started.
    """
    import math

    import torch

    import hooks

    model = workload.model
    meta: dict[str, Any] = {
        "description": workload.description,
        "tokens": workload.token_strings,
        "config": workload.config,
        "input_shape": list(workload.input_ids.shape) if workload.input_ids is not None else None,
    }
    from hooks.batch import BatchError, select_loss

    batch = workload.batch
    with hooks.capture(model, attention=attention, keep_bytes=keep_bytes, meta=meta) as trace:
        output = batch.call(model)
        try:
            choice = select_loss(output, workload.loss_fn, batch)
        except BatchError as exc:
            raise MdbError(str(exc)) from None
        choice.loss.backward()
    meta["loss_source"] = choice.source
    meta["loss_fallback"] = choice.fallback
    for name in ("loss", "ce_loss", "aux_loss"):
        value = choice.loss if name == "loss" else getattr(output, name, None)
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            value = float(value.detach())
            meta[name] = value if math.isfinite(value) else str(value)
    aux_losses = getattr(output, "aux_losses", None)
    if aux_losses is not None:
        meta["aux_losses"] = [float(v) for v in aux_losses.detach()]
    trace.meta.update(meta)
    return trace
