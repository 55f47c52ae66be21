"""What several subcommands share: choosing a model and a batch, and one captured step.

``mdb step``, ``mdb summary``, ``mdb capture`` and ``mdb doctor`` all take the same options:
``--preset``/``--config`` (a minillm config), ``--text`` (the batch's text), ``--seq-len``,
``--batch-size``, ``--seed``, or ``--model module:function`` for a user's own model. Bad input
raises :class:`tui.errors.MdbError` with one line that says what to fix.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import importlib.util
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tui.errors import MdbError, ModelError

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
    g.add_argument("--seed", type=seed_int, default=0,
                   help="torch seed for weights (default 0)")


def _number(text: str, kind: type, ok, requirement: str):
    try:
        value = kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
    return value


#: Largest count any integer option takes (steps, sizes, intervals): 2**31 - 1.
MAX_COUNT = 2**31 - 1


def positive_int(text: str) -> int:
    """argparse type: an integer in [1, :data:`MAX_COUNT`]."""
    return _number(text, int, lambda v: 0 < v <= MAX_COUNT,
                   f"a positive integer up to {MAX_COUNT:,}")


def nonneg_int(text: str) -> int:
    """argparse type: an integer in [0, :data:`MAX_COUNT`]."""
    return _number(text, int, lambda v: 0 <= v <= MAX_COUNT,
                   f"0 or a positive integer up to {MAX_COUNT:,}")


def seed_int(text: str) -> int:
    """argparse type: a seed ``torch.manual_seed`` takes, in [0, 2**63)."""
    return _number(text, int, lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, float, lambda v: 0 < v < float("inf"), "a positive number")


def cpu_count() -> int:
    """Logical CPUs of this machine (``os.cpu_count()``, 1 when unknown)."""
    return os.cpu_count() or 1


def check_threads(threads: int) -> None:
    """Refuse a ``--threads`` above the machine's CPUs (:func:`cpu_count`): more threads than
    CPUs only slow torch down, and thousands crash it (``--threads 10000`` ended in a
    segmentation fault). 0 (torch's default) and negative values are left to each command.

    Raises:
        MdbError: ``--threads 10000: more than this machine's 2 CPUs; give at most 2``.
    """
    cpus = cpu_count()
    if threads > cpus:
        raise MdbError(f"--threads {threads}: more than this machine's {cpus} CPUs; give at "
                       f"most {cpus}")


def check_path(option: str, value: str) -> None:
    """Refuse a path no file can have: a name longer than the file system allows
    (``ENAMETOOLONG``), a loop of symbolic links (``ELOOP``) or a NUL character. A path that
    does not exist, or any other problem, passes: the command says what it needs.

    Args:
        option: the option, e.g. ``"--db"`` (``""`` for a positional argument).
        value: the path given.

    Raises:
        MdbError: one line naming ``option`` and what is wrong with ``value``.
    """
    where = f"{option} {value}" if option else value
    try:
        os.stat(value)
    except ValueError:  # embedded NUL
        raise MdbError(f"{where}: a file name cannot contain a NUL character") from None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            longest = max((len(os.fsencode(part)) for part in Path(value).parts), default=0)
            raise MdbError(
                f"{where}: file name too long ({len(os.fsencode(value)):,} bytes, the longest "
                f"part {longest:,}; file systems allow about 255 per part and 4,096 in all)"
            ) from None
        if exc.errno == errno.ELOOP:
            raise MdbError(f"{where}: a loop of symbolic links (a link that leads back to "
                           "itself); give a real file") from None


@contextlib.contextmanager
def stdout_to_stderr():
    """Send whatever is written to stdout to stderr while the block runs: ``sys.stdout``
    (``print``) and file descriptor 1 itself (``os.write(1, …)``, a C extension's ``printf``,
    a child process), so that stdout carries only what mdb writes there afterwards (the
    table, the JSON document). Both are restored on exit, also when the block raises."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 (closed): only sys.stdout can be redirected
        saved = None
    try:
        if saved is not None:
            os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            _flush_c_stdio()  # what C code buffered for descriptor 1 belongs to stderr too
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 1)
            os.close(saved)


def _flush_c_stdio() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)


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


#: Largest ``--text`` file read (bytes); a batch needs far less.
MAX_TEXT_BYTES = 64 << 20


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of ``path``; missing, unreadable, empty, non-UTF-8, not a regular file
    (a FIFO or ``/dev/zero`` would hang or never end) or larger than :data:`MAX_TEXT_BYTES`
    -> MdbError."""
    import stat

    p = Path(path)
    if not p.exists():
        raise MdbError(f"--text {p}: no such file")
    if p.is_dir():
        raise MdbError(f"--text {p}: is a directory, not a text file")
    try:
        st = p.stat()
    except OSError as exc:
        raise MdbError(f"--text {p}: cannot read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise MdbError(f"--text {p}: not a regular file (a device, FIFO or socket); give a "
                       "text file")
    if st.st_size > MAX_TEXT_BYTES:
        raise MdbError(f"--text {p}: {human_bytes(st.st_size)} is more text than a batch "
                       f"needs (at most {human_bytes(MAX_TEXT_BYTES)}); cut a part of it")
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)
        text = data.decode("utf-8")
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
        if not path.is_file():
            raise MdbError(f"--config {path}: not a file (give a .toml file, see samples/presets)")
        try:
            return MiniLLMConfig.from_toml(path)
        except (ValueError, TypeError) as exc:
            raise MdbError(f"--config {path}: {exc}") from None
        except OSError as exc:
            raise MdbError(f"--config {path}: cannot read ({exc.strerror or exc})") from None
    try:
        return load_preset(getattr(args, "preset", None) or "default")
    except ValueError as exc:
        raise MdbError(str(exc)) from None


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (``MemAvailable`` of /proc/meminfo, else
    the free physical pages), or None when the system does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def human_bytes(n: float) -> str:
    """``4.1 TB``, ``23.1 GB``, ``512 MB`` (powers of 1000, like disk sizes)."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000:
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:,.3g} EB" if n < 1000 else f"{n:,.0f} EB"


def human_count(n: int) -> str:
    """``19.8M``, ``113k``, ``950`` — a parameter count in three significant digits."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def step_memory(config, batch_size: int, seq_len: int) -> tuple[int, int]:
    """A lower bound of the bytes one captured fp32 forward+backward of a minillm needs:
    ``(parameters and their gradients, activations)``. Activations count per token the
    residual-stream tensors of each layer (~16·D), the k routed SwiGLU widths (3·k·I or 3·I),
    the attention scores (2·H·T) and the logits with their gradient (3·V); the RoPE cos/sin
    tables (2·P·Dh) count with the parameters."""
    params = config.parameter_count()
    rope = 2 * config.max_position_embeddings * config.head_dim * 4 \
        if config.position_embedding == "rope" else 0
    k = config.num_experts_per_tok if config.num_local_experts else 1
    d, i = config.hidden_size, config.intermediate_size
    per_token = config.num_hidden_layers * (16 * d + 3 * k * i
                                            + 2 * config.num_attention_heads * seq_len)
    per_token += 3 * config.vocab_size
    return 8 * params + rope, 4 * per_token * batch_size * seq_len


def check_memory(config, batch_size: int, seq_len: int) -> None:
    """Refuse, before allocating anything, a model and batch that cannot fit in memory.

    Raises:
        MdbError: ``needs 4.1 TB (parameters and gradients 4.1 TB, activations 2.1 GB) for one
            step; this machine has 23.1 GB available``.
    """
    params, acts = step_memory(config, batch_size, seq_len)
    free = available_memory()
    if free is not None and params + acts > free:
        raise MdbError(
            f"this model and batch need at least {human_bytes(params + acts)} (parameters, "
            f"gradients and tables {human_bytes(params)}, activations {human_bytes(acts)}) for "
            f"one step; this machine has {human_bytes(free)} available: choose a smaller config, "
            f"--batch-size or --seq-len")


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
        module = _import_factory_module(spec, module_name)
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
    from hooks.capture import unwrap_compiled

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


def _import_factory_module(spec: str, module_name: str):
    """The module of ``--model``: a ``.py`` file (or a path) run as a module, with the file's
    folder put first on ``sys.path`` (and left there, as ``python FILE`` does) so that it and
    its factory import the modules beside it; else imported by name from the current directory
    or ``sys.path``. Any failure -> one MdbError line."""
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = Path(module_name)
            if not path.exists():
                raise MdbError(f"--model {spec}: no such file {path}")
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
            f"--model {spec}: cannot import {module_name}: {type(exc).__name__}: {exc}"
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


def capture_step(workload: Workload, *, attention: bool = True, keep_bytes: int = 0,
                 ops: list[str] | None = None):
    """Run one forward and backward pass of ``workload`` under :func:`hooks.capture`.

    When the forward produced NaN/Inf, the ops of the first non-finite call are recorded
    (:meth:`hooks.Trace.ops`, a replay); when only the backward did, the forward op whose
    backward created them is located (:meth:`hooks.Trace.locate_backward_origin`). Both are
    saved with the trace.

    Args:
        workload: the model, batch and loss function.
        attention: record attention probabilities.
        keep_bytes: budget for full tensor copies.
        ops: ``fnmatch`` patterns of module names whose every call's ops are recorded too.

    Returns:
        The :class:`hooks.Trace`, with ``meta`` holding the description, token labels,
        config, input shape and the loss values (``loss``, ``ce_loss``, ``aux_loss``).
        A non-finite loss does not stop the capture: the trace shows where it started.

    Raises:
        MdbError: ``ops`` matches no recorded call.
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
    from hooks.errors import describe_error

    batch = workload.batch
    with hooks.capture(model, attention=attention, keep_bytes=keep_bytes, meta=meta) as trace:
        try:
            output = batch.call(model)
        except Exception as exc:  # the user's model: one line with the module and its line
            raise ModelError(describe_error(exc, model, "the forward pass")) from None
        try:
            choice = select_loss(output, workload.loss_fn, batch)
        except BatchError as exc:
            raise MdbError(str(exc)) from None
        except Exception as exc:  # the user's loss_fn raised
            raise ModelError(describe_error(exc, model, "loss_fn")) from None
        try:
            choice.loss.backward()
        except Exception as exc:
            raise ModelError(describe_error(exc, model, "the backward pass")) from None
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
    _step_into(trace, workload, ops or [])
    return trace


def _step_into(trace, workload: Workload, patterns: list[str]) -> None:
    """The ops :func:`capture_step` records: the first non-finite call's, the backward
    origin, and every call of the modules ``patterns`` match."""
    import fnmatch

    from hooks.batch import select_loss

    calls = [r for r in trace.forward
             if any(fnmatch.fnmatchcase(r.module, p) for p in patterns)]
    if patterns and not calls:
        raise MdbError(f"--ops {' '.join(patterns)}: no recorded module call matches")
    bad = trace.first_nonfinite("forward")
    if bad is not None:
        calls.append(trace.forward[bad.index])
    for rec in calls:
        try:
            trace.ops(rec.module, rec.call_index)
        except Exception as exc:  # the user's model raised on the replay: say so, go on
            trace.meta.setdefault("ops_errors", []).append(
                f"{rec.module} call {rec.call_index}: {type(exc).__name__}: {exc}")
    if bad is None and trace.first_nonfinite("backward") is not None:
        batch, loss_fn = workload.batch, workload.loss_fn
        try:
            trace.locate_backward_origin(lambda out: select_loss(out, loss_fn, batch).loss)
        except Exception as exc:
            trace.meta["backward_origin_error"] = f"{type(exc).__name__}: {exc}"


def release_stop_signals(control, restore) -> None:
    """End a run's signal handling (``restore`` from
    :func:`hooks.runs.trainer.install_stop_signals`): the previous handlers come back, unless a
    signal stopped the run. The process then exits with 128 + n right away, and a signal
    repeated meanwhile is ignored, so that no ``KeyboardInterrupt`` reaches an atexit handler
    (a traceback on stderr)."""
    if control.stop_reason in ("SIGINT", "SIGTERM", "SIGHUP"):
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is not None:
                signal.signal(sig, signal.SIG_IGN)
    else:
        restore()
