"""``mdb summary``: a torchinfo-style table of the model, from one captured step.

One row per module of ``model.named_modules()`` (indented by depth): class, output shape of its
first call (and the number of calls when more than one), parameters (own and descendants', tied
ones once), share of the model's parameters, mean and standard deviation of the first output,
and the L2 norm of the gradients of all its parameters, ``sqrt(Σ ‖∇p‖²)``. Printed with Rich
to stdout; piped to a file it is plain text (no colour) at a fixed width.
"""

from __future__ import annotations

import argparse
import math
import sys

from tui.commands._common import add_model_arguments
from tui.commands.step import add_run_arguments, add_threads_argument, set_threads
from tui.widgets.fmt import loss_line

HELP = "print a torchinfo-style table of the model (shapes, parameters, output stats, grad norms)"

#: Width of the table when stdout is not a terminal.
PIPE_WIDTH = 140


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_threads_argument(parser)
    parser.add_argument("--depth", type=int, default=None, metavar="N",
                        help="only modules at most N levels deep (the root is 0)")
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="summarise a saved trace instead of capturing a step")
    add_run_arguments(parser)


def grad_norms_by_module(trace) -> dict[str, float]:
    """``sqrt(Σ ‖∇p‖²)`` over the parameters under each module (None-grad ones skipped).

    Returns:
        dict[str, float]: by qualified module name; modules without gradients are absent.
    """
    sq: dict[str, float] = {}
    for name, p in trace.params.items():
        if p.grad_norm is None:
            continue
        parts = name.split(".")[:-1]
        prefixes = [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]
        for prefix in prefixes:
            sq[prefix] = sq.get(prefix, 0.0) + p.grad_norm**2
    return {k: math.sqrt(v) if math.isfinite(v) else v for k, v in sq.items()}


def build_table(trace, *, depth: int | None = None):
    """The Rich table for ``trace`` (rows in ``named_modules()`` order)."""
    from rich.table import Table
    from rich.text import Text

    from tui.widgets import fmt

    calls: dict[str, list] = {}
    for rec in trace.forward:
        calls.setdefault(rec.module, []).append(rec)
    grads = grad_norms_by_module(trace)
    total = trace.modules[0].total_params if trace.modules else 0
    table = Table(title=trace.meta.get("description") or trace.model_type, title_justify="left",
                  show_lines=False, header_style="bold")
    for name, justify in (("module", "left"), ("class", "left"), ("output shape", "left"),
                          ("params", "right"), ("% params", "right"), ("out mean", "right"),
                          ("out std", "right"), ("param ‖∇‖", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    for info in trace.modules:
        if depth is not None and info.depth > depth:
            continue
        recs = calls.get(info.name, [])
        out = recs[0].outputs[0] if recs and recs[0].outputs else None
        shape = fmt.shape(out.shape) if out is not None else "—"
        if len(recs) > 1:
            shape += f" ×{len(recs)}"
        elif not recs:
            shape = "not called"
        leaf = info.name.rsplit(".", 1)[-1] if info.name else "(root)"
        label = Text("  " * info.depth + leaf, style="" if recs else "dim")
        stats = out.stats if out is not None else None
        table.add_row(
            label, info.module_type, shape,
            f"{info.total_params:,}" if info.total_params else "—",
            fmt.pct(info.total_params / total) if total and info.total_params else "—",
            fmt.sci(stats.mean) if stats else "—", fmt.sci(stats.std) if stats else "—",
            fmt.sci(grads.get(info.name)),
        )  # fmt: skip
    return table


def footer_lines(trace) -> list[str]:
    """Totals under the table: parameters, calls, gradients, losses, notes."""
    total = trace.modules[0].total_params if trace.modules else 0
    meta = trace.meta
    lines = [
        f"parameters: {total:,} (tied ones counted once) · {len(trace.forward)} module calls · "
        f"{len(trace.backward)} output gradients · {len(trace.params)} parameter gradients",
    ]
    if "loss" in meta:
        lines.append(loss_line(meta))
    bad = trace.first_nonfinite("forward") or trace.first_nonfinite("backward")
    if bad is not None:
        lines.append(f"first non-finite value: {bad.describe()}")
    for note in trace.notes:
        lines.append(f"note: {note.message}" + (f" ({note.module})" if note.module else ""))
    return lines


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tui.commands.step import check_run_options

    check_run_options(args)
    if args.run:
        from tui.commands.step import load_run_trace

        trace = load_run_trace(args.run, args.db)
    elif args.trace:
        from tui.commands.step import load_trace

        trace = load_trace(args.trace)
    else:
        from tui.commands._common import build_workload, capture_step

        set_threads(args)
        trace = capture_step(build_workload(args), attention=False)
    tty = sys.stdout.isatty()
    console = Console(file=sys.stdout, width=None if tty else PIPE_WIDTH,
                      no_color=not tty or None, highlight=False)
    console.print(build_table(trace, depth=args.depth))
    for line in footer_lines(trace):
        console.print(line, markup=False)
    return 0
