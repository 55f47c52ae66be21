"""What ``mdb memory`` prints: the module table, the totals and the peak (Rich tables in a
terminal, plain text piped), its ``--json`` document, and the ``--at`` estimate. The numbers
come from :mod:`hooks.trace.memory_view` and :mod:`hooks.whatif.memory_fit`; nothing is
computed here but their layout."""

from __future__ import annotations

import sys
from typing import Any

from hooks.text import printable
from hooks.trace.memory_view import KINDS, ModuleBytes, PeakReport, walk
from hooks.whatif.memory_fit import Estimate, human_bytes
from tui.widgets.memory_text import HEADERS, total_lines

#: The order in which columns are kept when the table must fit a width (module always).
PRIORITY = ("total", "param", "grad", "saved", "optimizer", "retained", "most")
#: A lower-priority column is added only while the module column keeps this many cells.
MIN_MODULE = 16


def _width() -> int | None:
    """Cells the table must fit (``mdb summary``'s rule: the terminal, ``$COLUMNS`` piped,
    else None: full width)."""
    from tui.commands.process import is_terminal
    from tui.commands.summary import output_width

    return output_width(is_terminal(sys.stdout), False)


def _console(width: int | None = None):
    from rich.console import Console

    from tui.commands.process import is_terminal

    return Console(file=sys.stdout, width=width or 200,
                   no_color=not is_terminal(sys.stdout) or None, highlight=False)


def _cells(tree: ModuleBytes, depth: int | None) -> tuple[list[Any], dict[str, list[str]]]:
    """The rows and, per column key, its cells (bytes as ``human_bytes``, ``—`` for none); a
    kind with no byte anywhere is left out (its 0 B is in the totals)."""
    rows = list(walk(tree, depth))
    kinds = [k for k in KINDS if any(r.bytes[k] for r in rows)]
    cells = {k: [human_bytes(r.bytes[k]) if r.bytes[k] else "—" for r in rows] for k in kinds}
    cells["retained"] = [human_bytes(r.retained) if r.retained else "—" for r in rows]
    cells["total"] = [human_bytes(r.total) for r in rows]
    cells["most"] = [r.dominant if r.total else "—" for r in rows]
    return rows, cells


def module_table(tree: ModuleBytes, depth: int | None, width: int | None = None):
    """The Rich table of the module tree: one row per module (indented, children largest
    first), bytes per kind, bytes retained, total and the dominant kind. Within ``width``
    cells the columns are kept by :data:`PRIORITY` and module names are indented less, then
    cut — never a number; None: every column."""
    from rich import box
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text

    from tui.commands.summary import module_labels

    rows, cells = _cells(tree, depth)
    heads = {**HEADERS, "retained": "retained", "total": "total", "most": "most"}
    items = [_Label(r.depth, r.name.rsplit(".", 1)[-1] if r.name else "(root)") for r in rows]
    keys, module_width = list(cells), None
    if width is not None:
        natural = {k: max(cell_len(heads[k]), *map(cell_len, v)) for k, v in cells.items()}
        full = max(cell_len(x) for x in module_labels(items, None))
        used, keys = 0, []
        for key in (k for k in PRIORITY if k in cells):
            if width - (used + natural[key] + 2) >= min(full, MIN_MODULE):
                keys.append(key)
                used += natural[key] + 2
        keys = [k for k in cells if k in keys]
        module_width = max(min(full, width - used), 6)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold",
                  padding=(0, 1, 0, 0), collapse_padding=True)
    table.add_column("module", no_wrap=True, width=module_width)
    for key in keys:
        table.add_column(heads[key], justify="left" if key == "most" else "right",
                         no_wrap=True)
    for i, label in enumerate(module_labels(items, module_width)):
        table.add_row(Text(printable(label)), *(Text(cells[k][i]) for k in keys))
    table.left_out = [heads[k] for k in cells if k not in keys]  # said under the table
    return table


class _Label:
    """A row as ``tui.commands.summary.module_labels`` reads it: depth and leaf name."""

    __slots__ = ("depth", "leaf")

    def __init__(self, depth: int, leaf: str) -> None:
        self.depth, self.leaf = depth, leaf


def print_memory(title: str, trace: Any, tree: ModuleBytes, peak: PeakReport,
                 depth: int | None) -> None:
    """Print the title, the module table (fitted to the terminal, or ``$COLUMNS`` piped) and
    :func:`total_lines`."""
    width = _width()
    console = _console(width)
    console.print(title, markup=False, style="bold")
    table = module_table(tree, depth, width)
    console.print(table)
    if table.left_out:
        console.print(f"left out to fit {width} columns: {', '.join(table.left_out)} "
                      "(--json has every figure)", markup=False, soft_wrap=True)
    for line in total_lines(trace, peak):
        console.print(printable(line), markup=False, soft_wrap=True)


def document(trace: Any, tree: ModuleBytes, peak: PeakReport, depth: int | None) -> dict:
    """The ``--json`` document: totals, peak, modules (bytes by kind) and the whole
    :class:`hooks.trace.memory.StepMemory`; every figure in bytes."""
    mem = trace.memory
    return {
        "description": trace.meta.get("description") or trace.model_type,
        "total_bytes": mem.total_bytes,
        "peak": {"bytes": peak.bytes, "where": peak.where, "parts": peak.parts,
                 "holders": [{"module": m, "call_index": c, "bytes": b}
                             for m, c, b in peak.holders]},
        "modules": [{"name": r.name, "type": r.module_type, "depth": r.depth, **r.bytes,
                     "retained": r.retained, "total": r.total, "dominant": r.dominant}
                    for r in walk(tree, depth)],
        "memory": mem.to_dict(),
    }


def print_estimate(est: Estimate, optimizer: str) -> None:
    """The ``--at`` figure first, then how it was reached, line by line."""
    console = _console(_width())
    console.print(f"will it fit: batch {est.batch} × seq {est.seq} needs about "
                  f"{human_bytes(est.total)} ({est.total:,} bytes) with optimizer {optimizer}",
                  markup=False, style="bold")
    from rich.table import Table

    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("term")
    table.add_column("bytes", justify="right")
    for k, v in est.terms.items():
        table.add_row(k, human_bytes(v))
    console.print(table)
    console.print("how:", markup=False)
    for line in est.steps:
        console.print(printable(f"  {line}"), markup=False, soft_wrap=True)
    console.print("  (parameters + buffers + gradients + optimizer state + every saved "
                  "activation: what the step holds when forward is done and every gradient "
                  "exists; allocator caching and single ops' temporaries are not in it)",
                  markup=False, soft_wrap=True)
