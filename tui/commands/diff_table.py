"""The table of a :class:`hooks.TraceDiff` as ``mdb diff`` prints it (piped, or ``--table``):
the two sides, the summary line, the calls that changed most (B - A), and what only one side
has. Shared by ``mdb diff A B``, ``--edit`` and ``--dtype``."""

from __future__ import annotations

import os
import sys

from hooks.text import printable
from tui.commands.process import is_terminal


def print_table(diff, a: str, b: str, limit: int) -> None:
    """Print ``diff`` (B = ``b`` against A = ``a``) with Rich: at most ``limit`` rows (0: all),
    largest change first; wide enough for long module names when piped ($COLUMNS, else 160)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from tui.widgets.diff_rows import rows, summary_line

    tty = is_terminal(sys.stdout)
    width = None
    if not tty:  # piped: $COLUMNS when set, else wide enough for the longest module names
        cols = os.environ.get("COLUMNS", "")
        width = int(cols) if cols.isdigit() and int(cols) > 0 else 160
    console = Console(file=sys.stdout, width=width, no_color=not tty or None, highlight=False)
    for line in (f"A = {a}", f"B = {b}", summary_line(diff, a, b)):
        console.print(printable(line), markup=False)
    if diff.is_zero():
        return
    table = Table(title="B - A per module call, largest change first", title_justify="left",
                  show_edge=False, pad_edge=False)
    for col, just in (("pass", "left"), ("call", "left"), ("tensor", "left"),
                      ("shape", "left"), ("Δmean", "right"), ("Δstd", "right"),
                      ("change", "right")):
        table.add_column(col, justify=just, no_wrap=col in ("call", "change"))
    rs = rows(diff)
    for r in rs[:limit] if limit else rs:
        table.add_row(*(Text(r[k]) for k in ("pass", "call", "tensor", "shape", "mean", "std",
                                             "change")))  # names are never markup
    console.print(table)
    if limit and len(rs) > limit:
        console.print(f"… {len(rs) - limit} more (--limit 0 lists all)", markup=False)
    for label, keys in (("only in A", diff.only_in_self), ("only in B", diff.only_in_other)):
        if keys:
            shown = ", ".join(map(printable, keys[:12])) + (
                f", … {len(keys) - 12} more" if len(keys) > 12 else "")
            console.print(f"{label}: {shown}", markup=False)
