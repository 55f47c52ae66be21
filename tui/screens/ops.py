"""``OpsScreen``: step into one module call — its torch operations, walked like calls.

Opened with ``i`` from the step view on the current forward call (pdb's *step*, where ``n`` is
*next*). The ops come from :meth:`hooks.Trace.ops`: recorded with the trace, or replayed in a
thread worker (the whole forward re-runs from the captured arguments and RNG state; only the
chosen call is recorded), so the UI never blocks. A replay that did not reproduce the call's
recorded outputs is shown as *diverged*, with no ops: they would describe another computation.

Rows: op, the user's ``file:line``, output shape and a flag; below, the selected op's source
line, input and output statistics, the op's notes (tensors a cap left out) and, for the op
that created NaN/Inf, the offending row.
``f`` jumps to that op; ``u`` (or Esc) steps back out to the step view.
"""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.binding import Binding
from textual.message import Message
from textual.widgets import DataTable, Footer, Static

from hooks.text import printable
from tui.screens.view import VIEW_BINDINGS, ViewScreen
from tui.widgets import fmt
from tui.widgets.call_details import stats_table


class OpsScreen(ViewScreen):
    """The ops of ``module``'s ``call_index``-th call.

    Args:
        step: the step view beneath (its trace, and where ``u`` returns).
        module: qualified module name.
        call_index: the call.
        select: ``(file, line, op)`` of an op to put the cursor on first (the forward op of the
            backward's first non-finite gradient, :class:`hooks.trace.ops.BackwardOrigin`).
    """

    VIEW = "ops"
    BINDINGS = [
        Binding("n,j,down", "cursor(1)", "next op", key_display="n", id="ops.next",
                priority=True, tooltip="next op"),
        Binding("p,k,up", "cursor(-1)", "prev op", key_display="p", id="ops.prev",
                priority=True, tooltip="previous op"),
        Binding("f", "first_nonfinite", "NaN op", id="ops.first_nonfinite",
                tooltip="first op that created NaN (else ±Inf) from finite inputs"),
        Binding("u", "back", "step out", id="ops.out", tooltip="step out: back to the call"),
        *VIEW_BINDINGS,
    ]

    class Ready(Message):
        """The ops (or why there are none) arrived from the worker."""

        def __init__(self, ops, error: str = "") -> None:
            super().__init__()
            self.ops = ops
            self.error = error

    def __init__(self, step, module: str, call_index: int,
                 select: tuple[str, int, str] | None = None) -> None:
        super().__init__(step)
        self.module = module
        self.call_index = call_index
        self.select = select
        self.optrace = None

    def compose(self):
        yield Static(printable(f"step into {self.module or '<root>'} · call {self.call_index}"),
                     id="title", markup=False)
        yield Static("recording the call's ops…", id="ops-status", markup=False)
        yield DataTable(id="ops", cursor_type="row", zebra_stripes=True)
        yield Static("", id="op-detail", markup=False)
        yield Static("", id="hint", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#ops", DataTable)
        for label, key in (("#", "i"), ("op", "op"), ("where", "where"), ("out", "out"),
                           ("", "flag")):
            table.add_column(label, key=key)
        table.focus()
        self.load()

    @work(thread=True, exclusive=True)
    def load(self) -> None:
        """Get the ops off the UI thread (a replay runs the model's forward)."""
        try:
            ops = self.trace.ops(self.module, self.call_index)
        except (LookupError, KeyError) as exc:
            self.post_message(self.Ready(None, str(exc).strip("'\"")))
            return
        except Exception as exc:  # the user's model raised during the replay
            self.post_message(self.Ready(None, f"the replay raised {type(exc).__name__}: {exc}"))
            return
        self.post_message(self.Ready(ops))

    def on_ops_screen_ready(self, message: Ready) -> None:
        message.stop()
        status = self.query_one("#ops-status", Static)
        if message.ops is None:
            status.update(printable(f"not recorded, because {message.error}"))
            return
        ot = self.optrace = message.ops
        call = self.trace.call(self.module, self.call_index)
        self.query_one("#title", Static).update(printable(
            f"step into {self.module or '<root>'} ({call.module_type}) · call "
            f"{self.call_index} · {len(ot.ops)} ops · {ot.source}"))
        if ot.diverged:
            status.update(printable(f"✗ replay diverged: {ot.diverged} — ops not shown"))
            return
        first = ot.first_nonfinite()
        status.update(printable(ot.nonfinite_sentence()))
        table = self.query_one("#ops", DataTable)
        for op in ot.ops:
            out = op.outputs[0] if op.outputs else None
            bad = any(t.stats is not None and not t.stats.finite for t in op.outputs)
            table.add_row(str(op.index), Text(printable(op.short_op)), Text(printable(op.location)),
                          fmt.shape(out.shape) if out else "", fmt.flag("nan") if bad else "",
                          key=str(op.index))
        row = first.index if first is not None else 0
        if self.select is not None:
            file, line, name = self.select
            at_line = [o for o in ot.ops if (o.file, o.line) == (file, line)]
            named = [o for o in at_line if o.short_op.rsplit(".", 1)[-1] == name]
            pick = (named or at_line or [None])[0]
            if pick is not None:
                row = pick.index
                status.update(printable(f"the backward of #{pick.index} {pick.short_op} at "
                                        f"{pick.location} made the first non-finite gradient"))
        if ot.ops:
            table.move_cursor(row=row)
            self.show_op(row)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        if self.optrace is not None and event.row_key is not None:
            self.show_op(int(event.row_key.value))

    def show_op(self, index: int) -> None:
        """Draw the details of op ``index``."""
        from rich.console import Group

        op = self.optrace.ops[index]
        head = Text()
        head.append(printable(f"{op.op}"), style="bold")  # names from the model and its file
        head.append(printable(f" · in {op.module or '<root>'}") + "\n")
        head.append(printable(f"{op.location}: "), style="dim")
        head.append(printable(op.code or "(no source line)"))
        parts = [head]
        row = op.offending_row()
        if row:
            parts.append(Text(printable(row), style="bold red"))
        cols = [(printable(t.path), t.stats) for t in op.inputs if t.stats is not None][:2]
        cols += [(printable(t.path), t.stats) for t in op.outputs if t.stats is not None][:2]
        shapes = ", ".join(f"{t.path} {fmt.shape(t.shape)} {t.dtype}"
                           for t in (op.inputs + op.outputs)[:4])
        parts.append(Text(printable(shapes), style="dim"))
        if cols:
            parts.append(stats_table(cols))
        # what caps left out
        parts.extend(Text(printable(f"• {n}"), style="yellow") for n in op.notes)
        self.query_one("#op-detail", Static).update(Group(*parts))

    def action_cursor(self, delta: int) -> None:
        table = self.query_one("#ops", DataTable)
        if table.row_count:
            table.move_cursor(row=min(max(0, table.cursor_row + delta), table.row_count - 1))

    def action_first_nonfinite(self) -> None:
        ot = self.optrace
        first = ot.first_nonfinite() if ot is not None and not ot.diverged else None
        if first is None:
            self.hint("no op created NaN or Inf in this call")
            return
        self.query_one("#ops", DataTable).move_cursor(row=first.index)
        self.hint(f"#{first.index} {first.short_op} at {first.location} created non-finite "
                  "values")
