"""``EditDiffScreen``: what an edit changed ("what if"), the diff view with A = the step as is
and B = the step edited, the loss change on top.

Opened by the edit form (``e`` in the step view, :mod:`tui.screens.edit_form`) and by ``mdb diff
--edit``. The rows are :class:`tui.screens.diff.DiffScreen`'s, ordered for an edit
(:meth:`hooks.trace.diff.TraceDiff.ranked_for_edit`): the loss and the edited module's own output
first, then the rest largest first, the calls whose token count changed last; Enter shows a call
of A beside B. ``e`` edits again on top of these edits (the form opens for the selected row's
module), Esc goes back.
"""

from __future__ import annotations

from textual.binding import Binding
from textual.widgets import DataTable, Footer, Static

from hooks.text import printable
from tui.screens.diff import QUIT, DiffScreen
from tui.widgets.diff_rows import rows, summary_line


def loss_change_line(a, b) -> str:
    """``loss 5.5605 → 5.5601 (Δ -3.6e-04)`` from the traces' ``meta['loss']`` (computed by
    the capture), or a line saying which side has none."""
    la, lb = (a.meta or {}).get("loss"), (b.meta or {}).get("loss")
    if la is None or lb is None:
        return "loss: not recorded on both sides"
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (la, lb)):
        return printable(f"loss {la} → {lb}")  # "nan", or a caller's own meta["loss"]
    return f"loss {la:.6g} → {lb:.6g} (Δ {lb - la:+.3g})"


def edits_line(b) -> str:
    """One phrase per edit of trace ``b`` (:meth:`hooks.engine.edits.AppliedEdit.describe`)."""
    return " · ".join(e.describe() for e in getattr(b, "edits", [])) or "no edits"


def open_edit_form(screen, trace, module: str | None, *, base: list[str] | None = None,
                   loss_fn=None, embedded: bool = True) -> None:
    """Push the edit form (:class:`tui.screens.edit_form.EditFormScreen`) for ``module`` of the
    step ``trace`` over ``screen``, and the what-if diff view when it has re-run the step; or
    say on ``screen``'s hint line why not (no call selected, a trace loaded from disk)."""
    from tui.screens.edit_form import EditFormScreen

    if module is None:
        screen.hint("select a call first: e edits the selected call's module")
        return
    if getattr(trace, "replay", None) is None:
        screen.hint("this trace was loaded from disk: it holds no model to re-run · use "
                    "mdb diff --edit SPEC with the model options")
        return

    def done(result) -> None:
        if result is not None:
            b, diff, edits = result
            screen.app.push_screen(EditDiffScreen(trace, b, diff, edits, embedded=embedded,
                                                  loss_fn=loss_fn))

    screen.app.push_screen(EditFormScreen(trace, module, base=base, loss_fn=loss_fn,
                                          embedded=embedded), done)


class EditDiffScreen(DiffScreen):
    """The diff of an edited step against the step as is.

    Args:
        a: the step as is (a :class:`hooks.Trace` with its replay, for ``e``).
        b: the edited step (``b.edits`` says what was applied).
        diff: ``a.diff(b)``.
        edits: the edit specs applied in ``b`` (``e`` adds to them).
        embedded: True when pushed over the step view (Esc / q go back); False as the main
            screen of ``mdb diff --edit`` (q quits).
        loss_fn: the step's loss function, when it had one (for ``e``).
    """

    CSS_PATH = "edit.tcss"
    BINDINGS = [
        *[b for b in DiffScreen.BINDINGS if b is not QUIT],
        Binding("e", "edit_again", "edit again", id="editdiff.edit",
                tooltip="edit the selected row's module on top of these edits"),
        Binding("escape,backspace", "back", "back", id="editdiff.back",
                tooltip="back to the step view (or to the previous edit)"),
        Binding("q", "quit_view", "quit", id="editdiff.quit",
                tooltip="quit (over the step view: back to it)"),
    ]

    def __init__(self, a, b, diff, edits: list[str], *, embedded: bool = True,
                 loss_fn=None) -> None:
        super().__init__(a, b, diff, "as is", "edited")
        # the loss and the edited module's own output first, then the rest (issue 35: a head's
        # edit was buried under the downstream experts' changed token counts)
        edited = [n for e in getattr(b, "edits", []) for n in (e.module, e.hooked)]
        self.rows = rows(diff, diff.ranked_for_edit(edited, (b.meta or {}).get("loss_source")))
        self.edits = list(edits)
        self.embedded = embedded
        self.loss_fn = loss_fn

    def compose(self):
        # the edits name modules; a trace's loss may be a string: all shown printable
        yield Static(printable(f"what if · {' + '.join(self.edits)}"), id="title", markup=False)
        yield Static(printable(f"{loss_change_line(self.a, self.b)} · "
                               f"{summary_line(self.diff, 'A (as is)', 'B (edited)')}"),
                     id="status", markup=False)
        yield Static(printable(edits_line(self.b)), id="edit-applied", markup=False)
        yield DataTable(id="diff-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="hint", markup=False)
        yield Footer()

    def on_mount(self) -> None:  # after DiffScreen's (Textual runs each class's handler)
        notes = [n.message for n in self.b.notes if n.kind == "edit"]
        if notes:
            self.hint(f"⚠ {notes[0]}")

    def selected_module(self) -> str | None:
        """The module of the selected row, or None when there are no rows."""
        if not self.rows:
            return None
        row = self.query_one("#diff-table", DataTable).cursor_row
        return self.rows[min(max(row, 0), len(self.rows) - 1)]["diff"].module

    def action_edit_again(self) -> None:
        module = self.selected_module()
        if module is None:
            self.hint("no changed call to edit: the form needs a module")
            return
        open_edit_form(self, self.a, module, base=self.edits, loss_fn=self.loss_fn,
                       embedded=self.embedded)

    def action_back(self) -> None:
        if self.embedded:
            self.app.pop_screen()
        else:
            self.hint("q quits")

    def action_quit_view(self) -> None:
        if self.embedded:
            self.app.pop_screen()
        else:
            self.app.exit()

    def action_help(self) -> None:
        from tui.screens.diff import CallPairScreen
        from tui.screens.help import HelpScreen, help_text

        self.app.push_screen(HelpScreen(help_text([
            ("what-if view (A as is, B edited)", self.BINDINGS),
            ("A | B view", CallPairScreen.BINDINGS),
        ])))


__all__ = ["EditDiffScreen", "edits_line", "loss_change_line", "open_edit_form"]
