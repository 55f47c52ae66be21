"""``mdb capture``: run one forward and backward pass and save the trace, without the UI.

The trace is a directory (``trace.json`` + ``tensors.safetensors``, see :mod:`hooks.trace.trace`)
that ``mdb step --trace`` and ``mdb summary --trace`` open, and that :meth:`hooks.Trace.load` reads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tui.commands.options import add_model_arguments, nonneg_int
from tui.commands.step import add_threads_argument, set_threads
from tui.errors import MdbError

HELP = "capture one forward+backward step to a trace directory (open it with mdb step --trace)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="FILE", required=True,
                        help="trace directory to write (conventionally NAME.mdbtrace)")
    add_model_arguments(parser)
    add_threads_argument(parser)
    parser.add_argument("--keep-bytes", type=nonneg_int, default=0, metavar="N",
                        help="also keep full copies of outputs and gradients up to N bytes "
                             "(default 0: statistics only)")
    parser.add_argument("--ops", metavar="MODULE", action="append", default=[],
                        help="also record the torch ops of every call of MODULE (a name or "
                        "fnmatch pattern; repeatable); the first non-finite call's ops are "
                        "always recorded")
    parser.add_argument("--no-attention", action="store_true",
                        help="do not record attention probabilities (smaller trace)")
    from tui.commands.editing import add_edit_arguments

    add_edit_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from tui.commands.capturing import capture_step
    from tui.commands.workload import build_workload

    if not args.out.strip():
        raise MdbError("--out: give the trace directory to write, e.g. --out step.mdbtrace")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise MdbError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "trace.json").exists():
        raise MdbError(f"--out {out}: a directory that is not a trace; name a new directory")
    from tui.commands.editing import edit_lines, edit_plan

    set_threads(args)
    workload = build_workload(args)
    edits, sources = edit_plan(args, workload)  # checked before anything runs
    trace = capture_step(workload, attention=not args.no_attention,
                         keep_bytes=args.keep_bytes, ops=args.ops, edits=edits or None,
                         sources=sources)
    try:
        trace.save(out)
    except OSError as exc:
        raise MdbError(f"--out {out}: cannot write ({exc.strerror or exc})") from None
    from tui.widgets.fmt import loss_line

    loss = loss_line(trace.meta)
    loss_text = f" · {loss}" if loss else ""
    print(
        f"saved {out}: {len(trace.forward)} calls, {len(trace.backward)} gradients, "
        f"{len(trace.params)} parameters, {len(trace.routing)} routing and "
        f"{len(trace.attention)} attention records{loss_text}"
    )
    for line in edit_lines(trace):
        print(line)
    bad = trace.first_nonfinite("forward") or trace.first_nonfinite("backward")
    if bad is not None:
        print(f"first non-finite value: {bad.describe()}")
    for ot in trace.op_traces.values():
        first = ot.first_nonfinite()
        where = (f"; first non-finite: {first.short_op} at {first.location}: {first.code}"
                 if first is not None else "")
        state = f" (replay diverged: {ot.diverged})" if ot.diverged else ""
        print(f"ops of {ot.module or '<root>'} call {ot.call_index}: {len(ot.ops)}{state}{where}")
    if trace.backward_origin is not None:
        print(f"first non-finite gradient made by {trace.backward_origin.describe()}")
    return 0
