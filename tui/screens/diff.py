"""``DiffScreen`` and ``CallPairScreen``: ``mdb diff A B`` in a terminal.

``DiffScreen`` lists every tensor (module output or gradient) whose statistics changed from A to
B, largest change first (:meth:`hooks.trace.diff.TraceDiff.ranked`: shape changes and new NaN/Inf on
top), with the calls only in A or only in B below. Enter opens ``CallPairScreen``: the call in
A beside the same call in B, each drawn like the step view's details pane; ``n``/``p`` walk the
changed rows without going back.
"""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import DataTable, Footer, Static

from hooks.text import printable
from tui.screens.base import MdbScreen
from tui.widgets import fmt
from tui.widgets.call_details import CallDetails
from tui.widgets.diff_rows import rows, summary_line

QUIT = Binding("q", "app.quit", "quit", id="diff.quit", tooltip="quit mdb diff")
CALL_WIDTH = 32
SHAPE_WIDTH = 15


def _left_cut(text: str, width: int) -> str:
    """``…ers.3.self_attn.k_proj#0``: keep the end of a long name (the leaf is what tells)."""
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _shape(d) -> str:
    """``2×16×64→2×16×256`` when the shape changed, else ``2×16×64`` (cut to fit)."""
    text = fmt.dims(d.shape_self)
    if d.shape_changed:
        text += "→" + fmt.dims(d.shape_other)
    return _left_cut(text, SHAPE_WIDTH)


class DiffScreen(MdbScreen):
    """The changed tensors of ``diff`` (B - A), one row each.

    Args:
        a, b: the two :class:`hooks.Trace` objects.
        diff: ``a.diff(b)``.
        name_a, name_b: what the user called them (paths or RUN@STEP).
    """

    BINDINGS = [
        Binding("enter", "open", "A | B", id="diff.open", tooltip="the call in A beside B"),
        Binding("j", "cursor(1)", "down", show=False, id="diff.down"),
        Binding("k", "cursor(-1)", "up", show=False, id="diff.up"),
        Binding("o", "only", "only in A/B", id="diff.only",
                tooltip="list what only one side recorded"),
        Binding("question_mark", "help", "keys", key_display="?", id="diff.help"),
        QUIT,
    ]

    def __init__(self, a, b, diff, name_a: str, name_b: str) -> None:
        super().__init__()

        self.a, self.b, self.diff = a, b, diff
        self.name_a, self.name_b = name_a, name_b
        self.rows = rows(diff)

    def compose(self):
        yield Static(printable(f"mdb diff · A {self.name_a} · B {self.name_b}"), id="title",
                     markup=False)
        yield Static(summary_line(self.diff, "A", "B"), id="status", markup=False)
        yield DataTable(id="diff-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="hint", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#diff-table", DataTable)
        for label, key, width in (("", "pass", 3), ("call", "call", CALL_WIDTH),
                                  ("shape", "shape", SHAPE_WIDTH), ("Δmean", "mean", 8),
                                  ("change", "change", 10)):
            table.add_column(label, key=key, width=width)
        for i, r in enumerate(self.rows):
            d = r["diff"]
            call = f"{(d.module or '<root>').removeprefix('model.')}#{d.call_index}"
            if d.tensor != "out":
                call += f" {d.tensor}"
            table.add_row(r["pass"], Text(_left_cut(printable(call), CALL_WIDTH)), _shape(d),
                          r["mean"], r["change"], key=str(i))
        table.focus()
        if self.diff.is_zero():
            self.hint("no differences: every call matched and no statistic changed")
        elif not self.rows:
            self.hint("no statistic changed; o lists the calls only one side recorded")
        else:  # the focused table's Enter hides the screen's binding from the footer
            self.hint("Enter: the selected call in A beside B · j/k move")

    def action_cursor(self, delta: int) -> None:
        table = self.query_one("#diff-table", DataTable)
        if table.row_count:
            table.move_cursor(row=min(max(0, table.cursor_row + delta), table.row_count - 1))

    def action_open(self) -> None:
        table = self.query_one("#diff-table", DataTable)
        if not self.rows:
            self.hint("nothing to open")
            return
        self.app.push_screen(CallPairScreen(self, table.cursor_row))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()  # Enter on the focused table
        self.action_open()

    def action_only(self) -> None:
        only_a, only_b = self.diff.only_in_self, self.diff.only_in_other
        if not (only_a or only_b):
            self.hint("both traces recorded the same calls")
            return
        self.hint(f"only in A: {', '.join(only_a[:4]) or '—'} · only in B: "
                  f"{', '.join(only_b[:4]) or '—'}")

    def action_help(self) -> None:
        from tui.screens.help import HelpScreen, help_text

        self.app.push_screen(HelpScreen(help_text([
            ("diff view", self.BINDINGS),
            ("A | B view", CallPairScreen.BINDINGS),
        ])))


class CallPairScreen(MdbScreen):
    """One changed row: its call in A (left) and in B (right)."""

    BINDINGS = [
        Binding("n,right", "move(1)", "next", key_display="n", id="pair.next",
                tooltip="next changed tensor"),
        Binding("p,left", "move(-1)", "prev", key_display="p", id="pair.prev",
                tooltip="previous changed tensor"),
        Binding("s,escape", "back", "list", key_display="s", id="pair.back",
                tooltip="back to the list"),
        QUIT,
    ]

    def __init__(self, parent: DiffScreen, row: int) -> None:
        super().__init__()
        self.parent_screen = parent
        self.row = row

    def compose(self):
        yield Static("", id="title", markup=False)
        yield Static("", id="status", markup=False)
        with Horizontal(id="pair"):
            yield CallDetails(id="pair-a")
            yield CallDetails(id="pair-b")
        yield Static("", id="hint", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.draw()

    def draw(self) -> None:
        from tui.screens.stepper import BACKWARD, FORWARD, Stepper

        r = self.parent_screen.rows[self.row]
        d = r["diff"]
        n = len(self.parent_screen.rows)
        self.query_one("#title", Static).update(
            f"A | B · {r['call']} {r['tensor']} · {self.row + 1}/{n}")
        self.query_one("#status", Static).update(
            f"{'forward' if d.direction == 'forward' else 'backward'} · shape {r['shape']} · "
            f"Δmean {r['mean']} · Δstd {r['std']} · change {r['change']}")
        for trace, pane in ((self.parent_screen.a, "#pair-a"), (self.parent_screen.b, "#pair-b")):
            st = Stepper(trace)
            if d.direction == "forward":
                idx = next((c.index for c in trace.forward
                            if (c.module, c.call_index) == (d.module, d.call_index)), None)
                if idx is not None:
                    st.go(FORWARD, idx)
            else:
                idx = next((g.index for g in trace.backward
                            if (g.module, g.call_index, g.output) ==
                            (d.module, d.call_index, d.tensor)), None)
                if idx is not None:
                    st.go(BACKWARD, idx)
            self.query_one(pane, CallDetails).show(st)

    def action_move(self, delta: int) -> None:
        n = len(self.parent_screen.rows)
        new = self.row + delta
        if not 0 <= new < n:
            self.hint("no more changed tensors this way")
            return
        self.row = new
        self.parent_screen.query_one("#diff-table", DataTable).move_cursor(row=new)
        self.hint("")
        self.draw()

    def action_back(self) -> None:
        self.app.pop_screen()
