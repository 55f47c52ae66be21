"""``PrecisionDiffScreen``: ``mdb diff --dtype`` in a terminal — the diff view of the step in
fp32 (A) against the same step under bf16/fp16 (B), with the first divergent call and the
first non-finite call on top (:func:`hooks.precision_diff` computes them; this only lays them
out).

The rows, Enter (A beside B), ``o`` and ``?`` are :class:`tui.screens.diff.DiffScreen`'s; the
cursor starts on the first divergent call's row, and ``v`` comes back to it.
"""

from __future__ import annotations

from textual.binding import Binding
from textual.widgets import DataTable, Footer, Static

from hooks.text import printable
from tui.screens.diff import DiffScreen
from tui.widgets.diff_rows import summary_line


def header_lines(pd) -> tuple[str, str, str]:
    """(first divergent, first non-finite, how and threshold) as the screen shows them."""
    div, bad = pd.first_divergent, pd.first_nonfinite
    first = "first divergent: " + (div.describe() if div else
                                   f"none beyond what {pd.dtype} explains")
    nonfinite = "first non-finite: " + (bad.describe() if bad else "none")
    how = (f"B = a copy cast to {pd.dtype}" if pd.how == "cast"
           else f"B = fp32 weights under autocast to {pd.dtype}")
    return first, nonfinite, f"{how} · {pd.threshold_text}"


class PrecisionDiffScreen(DiffScreen):
    """The diff of a step under a low dtype against fp32.

    Args:
        pd: the :class:`hooks.whatif.precision.PrecisionDiff` to show.
    """

    CSS_PATH = "precision_diff.tcss"
    BINDINGS = [
        *DiffScreen.BINDINGS,
        Binding("v", "first_divergent", "first divergent", id="precision.first",
                tooltip="move to the first divergent call's row"),
    ]

    def __init__(self, pd) -> None:
        super().__init__(pd.reference, pd.low, pd.diff, "fp32", pd.dtype)
        self.pd = pd

    def compose(self):
        first, nonfinite, rule = header_lines(self.pd)
        loss = " · ".join(f"{k} {v:.6g}" for k, v in self.pd.loss.items())
        yield Static(f"mdb diff --dtype {self.pd.dtype} · A fp32 · B {self.pd.dtype}",
                     id="title", markup=False)
        yield Static(f"loss {loss} · {summary_line(self.diff, 'A', 'B')}", id="status",
                     markup=False)
        # the calls and notes name modules: shown printable
        yield Static(printable(first), id="precision-first", markup=False)
        yield Static(printable(nonfinite), id="precision-nonfinite", markup=False,
                     classes="found" if self.pd.first_nonfinite else "")
        yield Static(printable(rule + "".join(f" · {n}" for n in self.pd.notes)),
                     id="precision-rule", markup=False)
        yield DataTable(id="diff-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="hint", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        # Textual runs this class's handler before DiffScreen's, which fills the table
        self.call_after_refresh(self.action_first_divergent, True)

    def divergent_row(self) -> int | None:
        """The row of the first divergent call (or of the first non-finite one), or None."""
        for div in (self.pd.first_divergent, self.pd.first_nonfinite):
            if div is None:
                continue
            for i, r in enumerate(self.rows):
                d = r["diff"]
                if (d.direction, d.module, d.call_index, d.tensor) == (
                        div.direction, div.module, div.call_index, div.tensor):
                    return i
        return None

    def action_first_divergent(self, quiet: bool = False) -> None:
        row = self.divergent_row()
        if row is None:
            if not quiet:
                self.hint("no divergent call to move to")
            return
        self.query_one("#diff-table", DataTable).move_cursor(row=row)
        if not quiet:
            self.hint("")

