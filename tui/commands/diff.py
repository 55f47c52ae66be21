"""``mdb diff A B``: what changed between two captured steps, call by call.

``mdb diff --edit SPEC [model options]`` compares the model's step as is (A) with the same step
edited (B; :mod:`tui.commands.diff_edit`), ``mdb diff --dtype DTYPE`` the step in fp32 with the
step in bfloat16 or float16 (:mod:`tui.commands.diff_dtype`).

``A`` and ``B`` are trace directories (``mdb capture --out``) or stored captures of a run,
``RUN@STEP`` (``mdb watch``'s ``c``, ``hooks.run(...).watch``). Calls are matched by module name
and call index (:meth:`hooks.Trace.diff`); where the architectures differ (GQA against MHA) the
names that agree are matched, tensors whose shape changed come first, and the rest are listed
as only in A or only in B. In a terminal the rows open in a Textual screen (Enter shows the
call of A and of B side by side); without one, or with ``--table``, the table is printed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tui.commands.diff_table import print_table
from tui.commands.options import check_path, nonneg_int
from tui.commands.process import has_screen
from tui.errors import MdbError

HELP = ("compare two captured steps (trace directories or RUN@STEP), call by call; --edit: "
        "the step as is vs edited; --dtype: fp32 vs bf16/fp16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", nargs="?", default=None,
                        help="a trace directory, or RUN@STEP of the run store")
    parser.add_argument("b", metavar="B", nargs="?", default=None,
                        help="the trace to compare A with (B - A is shown)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default=None,
                        help="instead of A B: run the model's step in fp32 and in DTYPE (same "
                             "weights and batch) and show where they part")
    from tui.commands.editing import add_edit_arguments
    from tui.commands.options import add_model_arguments
    from tui.commands.step import add_threads_argument

    add_edit_arguments(parser)  # --edit SPEC: instead of A B, the step as is vs edited
    add_model_arguments(parser)
    add_threads_argument(parser)
    parser.add_argument("--db", metavar="FILE", default=None,
                        help="run store for RUN@STEP (default: $MDB_DB or ./runs/mdb.sqlite)")
    parser.add_argument("--table", action="store_true",
                        help="print the table even in a terminal")
    parser.add_argument("--json", action="store_true", help="print the diff as JSON")
    parser.add_argument("--limit", type=nonneg_int, default=40, metavar="N",
                        help="rows of the printed table (default 40; 0: all)")


def resolve_trace(spec: str, db: str | None = None):
    """The :class:`hooks.Trace` that ``spec`` names: a trace directory if one exists there,
    else ``RUN@STEP`` of the run store.

    Raises:
        MdbError: neither (also a name too long to be a file, or a symbolic-link loop), or the
            run/step/file cannot be read (a trace.json that is a FIFO or a device, too big).
    """
    from hooks import Trace, TraceFormatError

    path = Path(spec)
    try:
        exists = path.exists()
    except (OSError, ValueError):  # a name too long for a file: RUN@STEP, or said below
        exists = False
    if exists:
        try:
            return Trace.load(path)
        except FileNotFoundError:
            raise MdbError(f"{spec}: not a trace (no trace.json in it)") from None
        except TraceFormatError as exc:
            raise MdbError(f"{spec}: {exc}") from None
        except OSError as exc:
            raise MdbError(f"{spec}: cannot read ({exc.strerror or exc})") from None
    name, sep, step = spec.rpartition("@")
    if not sep or not name or not step.isdigit():
        check_path("", spec)  # a name too long, a symbolic-link loop: say that
        raise MdbError(f"{spec}: no such trace directory, and not RUN@STEP")
    from tui.commands.step import load_run_trace

    return load_run_trace(spec, db, label="")


def _strict(value):
    """``value`` for strict JSON: a NaN or Inf (an aux loss that turned NaN) as ``"nan"``,
    ``"inf"``, ``"-inf"`` (:func:`hooks.tensors.stats.encode_float`)."""
    from hooks.tensors.stats import encode_float

    if isinstance(value, float):
        return encode_float(value)
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


_MODEL_OPTIONS = ("preset", "config", "model", "text", "source_text", "source_ids",
                  "source_batch")


def _mode(args: argparse.Namespace) -> str:
    """``traces`` (A B), ``edit`` (--edit) or ``dtype`` (--dtype): exactly one.

    Raises:
        MdbError: none or several of them, A without B, model options with A B.
    """
    given = [m for m, on in (("traces", args.a is not None), ("edit", bool(args.edit)),
                             ("dtype", args.dtype is not None)) if on]
    if len(given) != 1:
        raise MdbError("give two traces A B, or --edit SPEC (the step as is vs edited), or "
                       "--dtype bfloat16|float16 (fp32 vs that dtype): one of them"
                       + (f", not {' and '.join(given)}" if given else ""))
    if given == ["traces"]:
        if args.b is None:
            raise MdbError(f"{args.a}: give the trace to compare it with (mdb diff A B)")
        extra = [f"--{o.replace('_', '-')}" for o in _MODEL_OPTIONS if getattr(args, o, None)]
        if extra:
            raise MdbError(f"{', '.join(extra)}: model options go with --edit or --dtype, not "
                           "with two traces")
    return given[0]


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb diff``."""
    mode = _mode(args)
    if mode == "dtype":
        from tui.commands.diff_dtype import run_dtype

        return run_dtype(args)
    if mode == "edit":
        from tui.commands.diff_edit import run_edit

        return run_edit(args)
    a = resolve_trace(args.a, args.db)
    b = resolve_trace(args.b, args.db)
    diff = a.diff(b)
    if args.json:
        doc = {"a": args.a, "b": args.b, "no_differences": diff.is_zero(), **diff.to_dict()}
        print(json.dumps(_strict(doc), allow_nan=False, default=str))
        return 0
    if args.table or not has_screen():
        print_table(diff, args.a, args.b, args.limit)
        return 0
    from tui.app import make_diff_app

    make_diff_app(a, b, diff, args.a, args.b).run()
    return 0
