"""``mdb summary``: a torchinfo-style table of the model, from one captured step.

One row per module of ``model.named_modules()`` (indented by depth): class, output shape of its
first call (and the number of calls when more than one), parameters (own and descendants', tied
ones once), share of the model's parameters, mean and standard deviation of the first output,
and the L2 norm of the gradients of all its parameters, ``sqrt(Σ ‖∇p‖²)``
(:func:`hooks.tensors.norms.combine_norms`: NaN when one is NaN); from the step's memory
accounting (:func:`hooks.trace.memory_view.module_bytes`), the bytes autograd saved for backward
during its calls and its bytes of every kind (parameters, gradients, optimizer state, saved;
``mdb memory`` shows them apart).

Width: in a terminal the table fits the terminal: the columns are kept in order of priority
(:data:`PRIORITY`; numbers are never cut), module names are indented less and then cut in the
middle, and a line under the table says which columns were left out; ``--wide`` prints every
column at full width. Piped, it is plain text (no colour) at ``$COLUMNS`` when that is set, else
at full width with every column.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from hooks.text import printable
from tui.commands.options import add_model_arguments
from tui.commands.process import is_terminal
from tui.commands.step import add_run_arguments, add_threads_argument, set_threads
from tui.widgets.fmt import loss_line

HELP = "print a torchinfo-style table of the model (shapes, parameters, output stats, grad norms)"

#: Columns, in the order they are printed: key, header when fitted, header at full width, justify.
COLUMNS = (
    ("module", "module", "module", "left"),
    ("class", "class", "class", "left"),
    ("shape", "output", "output shape", "left"),
    ("params", "params", "params", "right"),
    ("pct", "% params", "% params", "right"),
    ("mean", "out mean", "out mean", "right"),
    ("std", "out std", "out std", "right"),
    ("grad", "param ‖∇‖", "param ‖∇‖", "right"),
    ("saved", "saved", "saved for bwd", "right"),
    ("mem", "bytes", "bytes (all kinds)", "right"),
)
#: The order in which columns are kept when the table must fit a width (module always).
PRIORITY = ("module", "params", "shape", "grad", "mean", "std", "pct", "class", "mem", "saved")
#: Cells between two columns of a fitted table.
GAP = 2
#: A lower-priority column is added only while the module column keeps this many cells (or
#: its full width, when narrower).
MIN_MODULE = 22


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_threads_argument(parser)
    parser.add_argument("--depth", type=int, default=None, metavar="N",
                        help="only modules at most N levels deep (the root is 0)")
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="summarise a saved trace instead of capturing a step")
    parser.add_argument("--wide", action="store_true",
                        help="every column at full width, whatever the terminal's width "
                             "(piped output without $COLUMNS is always full width)")
    add_run_arguments(parser)


def grad_norms_by_module(trace) -> dict[str, float]:
    """``sqrt(Σ ‖∇p‖²)`` over the parameters under each module (None-grad ones skipped;
    :func:`hooks.tensors.norms.combine_norms`, so a NaN gradient gives NaN).

    Returns:
        dict[str, float]: by qualified module name; modules without gradients are absent.
    """
    from hooks.tensors.norms import combine_norms

    norms: dict[str, list[float]] = {}
    for name, p in trace.params.items():
        if p.grad_norm is None:
            continue
        parts = name.split(".")[:-1]
        prefixes = [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]
        for prefix in prefixes:
            norms.setdefault(prefix, []).append(p.grad_norm)
    return {k: combine_norms(v) for k, v in norms.items()}


@dataclass
class Row:
    """One module's cells (plain strings), its depth and leaf name."""

    depth: int
    leaf: str
    called: bool
    cells: dict[str, str]


def table_rows(trace, *, depth: int | None = None, compact: bool = False) -> list[Row]:
    """The rows of the summary, in ``named_modules()`` order (``compact``: ``2×64×256``
    shapes instead of ``(2, 64, 256)``)."""
    from tui.widgets import fmt

    calls: dict[str, list] = {}
    for rec in trace.forward:
        calls.setdefault(rec.module, []).append(rec)
    grads = grad_norms_by_module(trace)
    memory = _memory_rows(trace)
    total = trace.modules[0].total_params if trace.modules else 0
    rows = []
    for info in trace.modules:
        if depth is not None and info.depth > depth:
            continue
        recs = calls.get(info.name, [])
        out = recs[0].outputs[0] if recs and recs[0].outputs else None
        if out is None:
            shape = "not called" if not recs else "—"
        else:
            shape = fmt.dims(out.shape) if compact else fmt.shape(out.shape)
        if len(recs) > 1:
            shape += f" ×{len(recs)}"
        stats = out.stats if out is not None else None
        leaf = printable(info.name.rsplit(".", 1)[-1]) if info.name else "(root)"
        rows.append(Row(info.depth, leaf,
                        bool(recs), {
            "class": printable(info.module_type),
            "shape": shape,
            "params": f"{info.total_params:,}" if info.total_params else "—",
            "pct": fmt.pct(info.total_params / total) if total and info.total_params else "—",
            "mean": fmt.sci(stats.mean) if stats else "—",
            "std": fmt.sci(stats.std) if stats else "—",
            "grad": fmt.sci(grads.get(info.name)),
            **memory.get(info.name, {"saved": "—", "mem": "—"}),
        }))  # fmt: skip
    return rows


def _memory_rows(trace) -> dict[str, dict[str, str]]:
    """The memory cells by module name (none when the trace has no memory record)."""
    if trace.memory is None:
        return {}
    from hooks.trace.memory_view import module_bytes, walk
    from hooks.whatif.memory_fit import human_bytes

    return {r.name: {"saved": human_bytes(r.bytes["saved"]) if r.bytes["saved"] else "—",
                     "mem": human_bytes(r.total) if r.total else "—"}
            for r in walk(module_bytes(trace))}


def module_labels(rows: list[Row], width: int | None) -> list[str]:
    """The module column: leaves indented two cells per level; to fit ``width``, one cell per
    level if that makes every name fit, else the names that do not fit are cut in the middle
    (``post_att…layernorm``) — never a number."""
    from rich.cells import cell_len

    from tui.widgets import fmt

    for step in (2, 1):
        labels = [" " * (step * r.depth) + r.leaf for r in rows]
        if width is None or max(map(cell_len, labels), default=0) <= width:
            return labels
    out = []
    for r in rows:
        indent = min(2 * r.depth, max(width - 6, 0))
        out.append(" " * indent + fmt.middle(r.leaf, max(width - indent, 1)))
    return out


def fit_columns(rows: list[Row], width: int) -> tuple[list[str], int]:
    """The columns to print within ``width`` cells, by :data:`PRIORITY`, and the module
    column's width."""
    from rich.cells import cell_len

    headers = {k: h for k, h, _, _ in COLUMNS}
    natural = {k: max([cell_len(headers[k])] + [cell_len(r.cells[k]) for r in rows])
               for k in headers if k != "module"}
    module_full = max([cell_len(x) for x in module_labels(rows, None)] + [6])
    chosen = ["module"]
    used = 0
    for key in PRIORITY[1:]:
        extra = natural[key] + GAP
        if width - (used + extra) >= min(module_full, MIN_MODULE):
            chosen.append(key)
            used += extra
    return [k for k, *_ in COLUMNS if k in chosen], max(min(module_full, width - used), 6)


def build_table(trace, *, depth: int | None = None, width: int | None = None):
    """The Rich table for ``trace`` (rows in ``named_modules()`` order); see
    :func:`fit_table` for the arguments."""
    return fit_table(trace, depth=depth, width=width)[0]


def fit_table(trace, *, depth: int | None = None, width: int | None = None):
    """The Rich table for ``trace`` (rows in ``named_modules()`` order).

    Args:
        trace: the :class:`hooks.Trace`.
        depth: only modules at most this deep.
        width: fit the table in this many cells (see :func:`fit_columns`); None: every column
            at full width.

    Returns:
        ``(table, left_out)``: the table and the headers of the columns left out.
    """
    from rich import box
    from rich.table import Table
    from rich.text import Text

    rows = table_rows(trace, depth=depth, compact=width is not None)
    if width is None:
        keys, module_width = [k for k, *_ in COLUMNS], None
        table = Table(show_lines=False, header_style="bold")
    else:
        keys, module_width = fit_columns(rows, width)
        table = Table(header_style="bold", box=box.SIMPLE_HEAD, show_edge=False,
                      pad_edge=False, padding=(0, 1, 0, 0), collapse_padding=True)
    spec = {k: (fitted if width is not None else full, justify)
            for k, fitted, full, justify in COLUMNS}
    for key in keys:
        header, justify = spec[key]
        table.add_column(header, justify=justify, no_wrap=True,
                         width=module_width if key == "module" else None)
    labels = module_labels(rows, module_width)
    for row, label in zip(rows, labels, strict=True):
        cells = [Text(label, style="" if row.called else "dim")]
        cells += [Text(row.cells[k]) for k in keys if k != "module"]  # never markup
        table.add_row(*cells)
    left_out = [spec[k][0] for k, *_ in COLUMNS if k not in keys]
    return table, left_out


def footer_lines(trace) -> list[str]:
    """Totals under the table: parameters, calls, gradients, losses, notes."""
    total = trace.modules[0].total_params if trace.modules else 0
    meta = trace.meta
    lines = [
        f"parameters: {total:,} (tied ones counted once) · {len(trace.forward)} module calls · "
        f"{len(trace.backward)} output gradients · {len(trace.params)} parameter gradients",
    ]
    if trace.memory is not None:
        from hooks.whatif.memory_fit import human_bytes

        mem = trace.memory
        lines.append(f"memory: {human_bytes(mem.total_bytes)} (saved for backward "
                     f"{human_bytes(mem.saved_bytes)}, peak {human_bytes(mem.peak_bytes)}; "
                     "mdb memory for the rest)")
    if "loss" in meta:
        lines.append(loss_line(meta))
    bad = trace.first_nonfinite("forward") or trace.first_nonfinite("backward")
    if bad is not None:
        lines.append(f"first non-finite value: {bad.describe()}")
    lines += spike_lines(meta)
    for note in trace.notes:
        lines.append(f"note: {note.message}" + (f" ({note.module})" if note.module else ""))
    return lines


def spike_lines(meta: dict) -> list[str]:
    """A capture taken before its update because it spiked (:mod:`hooks.recorder.story`): its
    story, the batch it ran on (shapes) and its tokens with the largest loss."""
    spike = meta.get("spike")
    if not isinstance(spike, dict) or not isinstance(spike.get("line"), str):
        return []
    lines = [f"captured before its update: {spike['line']}"]
    batch = meta.get("batch")
    if isinstance(batch, dict) and batch:
        shapes = ", ".join(f"{k} {'×'.join(map(str, v))}" for k, v in batch.items())
        lines.append(f"batch (stored with the capture): {shapes}")
    top = spike.get("top_tokens") or []
    if top:
        lines.append("largest loss: " + ", ".join(
            f"{t['token']!r} (row {t['row']}, position {t['position']}) {t['loss']:.3g}"
            for t in top))
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
        from tui.commands.capturing import capture_step
        from tui.commands.workload import build_workload

        set_threads(args)
        trace = capture_step(build_workload(args), attention=False)
    tty = is_terminal(sys.stdout)
    width = output_width(tty, args.wide)
    console = Console(file=sys.stdout, width=width or 10_000, no_color=not tty or None,
                      highlight=False, soft_wrap=width is None)
    table, left_out = fit_table(trace, depth=args.depth, width=width)
    if width is None:  # full width: as wide as the table
        console.width = console.measure(table).maximum
    console.print(printable(trace.meta.get("description") or trace.model_type), markup=False,
                  soft_wrap=width is None, style="bold")
    console.print(table)
    lines = footer_lines(trace)
    if left_out:
        lines.append(f"left out to fit {width} columns: {', '.join(left_out)} "
                     "(--wide shows every column)")
    for line in lines:
        console.print(printable(line), markup=False, soft_wrap=width is None)
    return 0


def output_width(tty: bool, wide: bool) -> int | None:
    """Cells the table must fit: the terminal's width, or ``$COLUMNS`` when piped; None for
    full width (``--wide``, or piped without ``$COLUMNS``)."""
    if wide:
        return None
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if tty:
        import shutil

        return shutil.get_terminal_size().columns
    return None
