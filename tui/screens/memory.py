"""``MemoryScreen``: where the step's bytes go (``m`` in the step view).

The module tree with each module's bytes by kind (parameters, gradients, optimizer state,
activations autograd saved for backward during its calls), the bytes its calls left alive,
the total and the kind that dominates, siblings largest first
(:func:`hooks.trace.memory_view.module_bytes`); below it the step's totals, the peak of its
live bytes and the calls whose saved activations were alive there
(:func:`hooks.trace.memory_view.peak_report`). Enter on a row opens that module's first call
in the step view. The numbers are computed once in hooks; a trace without a memory record
(an older mdb, ``memory=False``) says so.
"""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable, Footer, Static

from hooks.text import printable
from tui.screens.view import VIEW_BINDINGS, ViewScreen

#: Widest the module column gets (cells); deeper names are cut with an ellipsis.
MODULE_WIDTH = 26
#: Narrowest it gets on a small terminal, where the byte columns take the rest.
MODULE_MIN_WIDTH = 12
#: Cells a byte column takes ("75.5 MiB" and the table's padding).
BYTES_WIDTH = 10


class MemoryScreen(ViewScreen):
    """The memory view over the step screen's trace.

    Args:
        step: the step screen beneath.
    """

    VIEW = "memory"
    BINDINGS = [
        Binding("enter", "open", "open", id="memory.open",
                tooltip="the selected module's first call in the step view"),
        *VIEW_BINDINGS,
    ]
    CSS_PATH = "memory.tcss"

    def __init__(self, step) -> None:
        super().__init__(step)
        self.names: list[str] = []

    def compose(self):
        yield Static("memory", id="title", markup=False)
        yield Static("", id="status", markup=False)
        yield DataTable(id="memory-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="memory-peak", markup=False)
        yield Static("", id="hint", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        from hooks.trace.memory_view import NoMemoryError, module_bytes, peak_report

        try:
            tree, peak = module_bytes(self.trace), peak_report(self.trace)
        except NoMemoryError as exc:
            self.query_one("#title", Static).update("memory · not available")
            self.hint(str(exc))
            return
        self.draw(tree, peak)

    def draw(self, tree, peak) -> None:
        """Fill the table with the module tree and the lines below it."""
        from hooks.trace.memory_view import KINDS, walk
        from hooks.whatif.memory_fit import human_bytes
        from tui.widgets.memory_text import HEADERS, total_lines

        mem = self.trace.memory
        self.query_one("#title", Static).update(
            f"memory · {human_bytes(mem.total_bytes)} in all · peak {human_bytes(peak.bytes)}")
        self.query_one("#status", Static).update(
            "bytes per module, descendants included, largest first · Enter: its first call")
        table = self.query_one("#memory-table", DataTable)
        rows = walk(tree)
        # a kind with no byte anywhere (no optimizer given) is left out: its 0 B is in the totals
        kinds = [k for k in KINDS if any(r.bytes[k] for r in rows)]
        heads = ["retained", "total"]
        # the byte columns first: the module column takes what an 80-column terminal leaves
        most = max((len(r.dominant) for r in rows if r.total), default=4)
        fixed = BYTES_WIDTH * (len(kinds) + len(heads)) + most + 6  # padding, scrollbar
        width = max(MODULE_MIN_WIDTH, min(MODULE_WIDTH, self.app.size.width - fixed))
        indent = 2 if width == MODULE_WIDTH else 1
        labels = [printable(" " * indent * r.depth
                            + (r.name.rsplit(".", 1)[-1] if r.name else "(root)"))
                  for r in rows]
        table.add_column("module", key="module", width=min(max(map(len, labels), default=6),
                                                           width))
        table.add_column("most", key="most")  # before the numbers: never cut off at the edge
        for kind in kinds:
            table.add_column(HEADERS[kind], key=kind)
        for head in heads:
            table.add_column(head, key=head)
        for row, label in zip(rows, labels, strict=True):
            cells = [Text(label, overflow="ellipsis", no_wrap=True),  # never markup
                     Text(row.dominant if row.total else "—")]
            cells += [Text(human_bytes(row.bytes[k]) if row.bytes[k] else "—", justify="right")
                      for k in kinds]
            cells += [Text(human_bytes(row.retained) if row.retained else "—", justify="right"),
                      Text(human_bytes(row.total), justify="right")]
            table.add_row(*cells, key=str(len(self.names)))
            self.names.append(row.name)
        self.query_one("#memory-peak", Static).update(
            "\n".join(printable(line) for line in total_lines(self.trace, peak)))
        table.focus()

    def action_open(self) -> None:
        table = self.query_one("#memory-table", DataTable)
        if not self.names:
            self.hint("no memory record in this trace")
            return
        name = self.names[table.cursor_row]
        if not self.trace.calls(name):
            self.hint(f"{name or '<root>'} was not called in this step")
            return
        self.jump_to(name)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()  # Enter on the focused table
        self.action_open()
