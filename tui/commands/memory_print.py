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


def _console():
    from rich.console import Console

    from tui.commands.process import is_terminal
    from tui.commands.summary import output_width

    tty = is_terminal(sys.stdout)
    width = output_width(tty, False)
    return Console(file=sys.stdout, width=width or 200, no_color=not tty or None,
                   highlight=False)


def module_table(tree: ModuleBytes, depth: int | None):
    """The Rich table of the module tree: one row per module (indented, children largest
    first), bytes per kind, bytes retained, total and the dominant kind."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("module", no_wrap=True)
    for kind in KINDS:
        table.add_column(HEADERS[kind], justify="right", no_wrap=True)
    for head in ("retained", "total", "most"):
        table.add_column(head, justify="right" if head != "most" else "left", no_wrap=True)
    for row in walk(tree, depth):
        leaf = row.name.rsplit(".", 1)[-1] if row.name else "(root)"
        cells = [Text(printable("  " * row.depth + leaf))]
        cells += [Text(human_bytes(row.bytes[k]) if row.bytes[k] else "—") for k in KINDS]
        cells += [Text(human_bytes(row.retained) if row.retained else "—"),
                  Text(human_bytes(row.total)), Text(row.dominant if row.total else "—")]
        table.add_row(*cells)
    return table


def print_memory(title: str, trace: Any, tree: ModuleBytes, peak: PeakReport,
                 depth: int | None) -> None:
    """Print the title, the module table and :func:`total_lines`."""
    console = _console()
    console.print(title, markup=False, style="bold")
    console.print(module_table(tree, depth))
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
    console = _console()
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
