"""``EditFormScreen``: ``e`` in the step view — change one call and re-run the step.

A small form over the current screen: the edits that fit the selected module
(:func:`hooks.engine.edits.edit_options`: zero, a head, its pattern, q, k, v, an expert, drop,
scale, mean, patch, add, clamp) in a
list, and the spec itself in an input line to adjust (``head=3``, ``by=0.1``, ``pos=5``).
Enter on a choice copies it to the input; Enter in the input checks the spec against the model
(a bad one is said in the form, nothing runs), then re-runs the step with it
(:func:`hooks.whatif.rerun.rerun_edited`, on top of the edits already applied) in a Textual thread
worker; the form then closes with ``(b, diff, edits)`` and the what-if diff view opens
(:func:`tui.screens.edit_diff.open_edit_form` pushed the form). ``patch`` and ``add … from=``
in the form take their source from the batch's rows rolled by one (``from=rolled``). Esc
cancels.
"""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, OptionList, Static
from textual.worker import Worker, WorkerState

from hooks.text import printable

#: The form's hint line, until it has something to say.
HINT = ("Enter on a choice copies it below, where typing continues it (head=3, by=0.1) · "
        "Enter below runs it · Esc cancels")


class EditFormScreen(ModalScreen[tuple | None]):
    """The edit form; dismissed with ``(edited trace, diff, edits)`` after the re-run, or
    None when cancelled.

    Args:
        trace: the step as is (A), captured in this process (its replay re-runs it).
        module: the selected call's module.
        base: edits already applied (the new one is added on top).
        loss_fn: the step's loss function, when it had one.
        embedded: for the diff view the opener shows (Esc there goes back).
    """

    CSS_PATH = "edit.tcss"
    BINDINGS = [
        Binding("escape", "cancel", "cancel", id="edit.cancel", tooltip="close the form"),
        # as in the / search box: the focused Input's own Ctrl-C (copy) would swallow it
        Binding("ctrl+c", "cancel", "cancel", show=False, priority=True, id="edit.ctrl_c"),
    ]

    def __init__(self, trace, module: str, *, base: list[str] | None = None, loss_fn=None,
                 embedded: bool = True) -> None:
        super().__init__()
        from hooks.engine.edits import edit_options

        self.trace = trace
        self.module = module
        self.base = list(base or [])
        self.loss_fn = loss_fn
        self.embedded = embedded
        self.options = edit_options(trace.replay.model, module)
        self.running = False

    def compose(self):
        on_top = f" (on top of: {' + '.join(self.base)})" if self.base else ""
        with Vertical(id="edit-box"):
            yield Static(printable(f"what if · edit {self.module or '<root>'}{on_top}"),
                         id="edit-title", markup=False)
            yield OptionList(*(Text(printable(o)) for o in self.options), id="edit-options")
            # no select-all on focus: typing after a pick continues the spec, never replaces it
            yield Input(value=printable(self.options[0]) if self.options else "", id="edit-spec",
                        select_on_focus=False,
                        placeholder="zero MODULE [q|k|v|pattern] [head=H | expert=E] · drop "
                                    "MODULE expert=E · scale MODULE by=F · mean MODULE · patch "
                                    "MODULE [head=H] from=rolled · add MODULE from=rolled · "
                                    "clamp MODULE min=A max=B")
            yield Static(HINT, id="edit-hint", markup=False)

    def on_mount(self) -> None:
        if self.options:
            self.query_one("#edit-options", OptionList).focus()
        else:
            self.say(f"{self.module or 'the model itself'} cannot be edited (the model itself "
                     "or a container): choose one of its modules")

    def say(self, text: str) -> None:
        """Show ``text`` (it may repeat a module name, an exception's message) in the form's
        hint line, :func:`hooks.text.printable`."""
        self.query_one("#edit-hint", Static).update(printable(text))

    def raw_spec(self, spec: str) -> str:
        """``spec`` as typed, with each word that is a module's name as shown (escaped by
        :func:`hooks.text.printable`, ``d.a\\x1b]0;x\\x07``) put back as the name itself; a
        word that is a module's own name is kept."""
        modules = [n for n, _ in self.trace.replay.model.named_modules()]
        names = {printable(n): n for n in modules}
        names.update((n, n) for n in modules)
        return " ".join(names.get(w, w) for w in spec.split())

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        spec = printable(self.options[event.option_index])  # raw_spec reads it back
        box = self.query_one("#edit-spec", Input)
        box.value = spec
        box.focus()
        box.cursor_position = len(spec)  # at the end, nothing selected: typing continues it

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if self.running:
            self.say("already re-running the step…")
            return
        spec = self.raw_spec(event.value.strip())
        edits = [*self.base, spec]
        try:
            self._check(edits)
        except ValueError as exc:
            self.say(f"✗ {exc}")
            return
        self.running = True
        self.say(f"re-running the step with {len(edits)} edit(s)…")
        self.run_worker(lambda: self._rerun(edits), thread=True, exclusive=True,
                        name="mdb-edit")

    def _check(self, edits: list[str]) -> None:
        """Parse and bind ``edits`` to the model (ValueError with one line when bad)."""
        from hooks.engine.edits import parse_edit, resolve_edits
        from hooks.whatif.rerun import ROLLED

        parsed = [parse_edit(e) for e in edits]
        sources = {e.source: None for e in parsed if e.needs_source}
        bad = [s for s in sources if s != ROLLED]
        if bad:
            raise ValueError(f"patch and add in the step view take from={ROLLED} (the batch's rows "
                             f"rolled by one), not from={bad[0]}")
        resolve_edits(self.trace.replay.model, parsed, sources)

    def _rerun(self, edits: list[str]):
        """In the worker thread: the edited step and its diff from the step as is."""
        from hooks.whatif.rerun import rerun_edited

        b = rerun_edited(self.trace, edits, loss_fn=self.loss_fn)
        return b, self.trace.diff(b), edits

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.name != "mdb-edit":
            return
        if event.state == WorkerState.ERROR:
            self.running = False
            err = event.worker.error
            self.say(f"✗ the edited step failed: {type(err).__name__}: {err}")
        elif event.state == WorkerState.SUCCESS:
            self.dismiss(event.worker.result)  # (b, diff, edits): the opener shows the diff

    def action_cancel(self) -> None:
        if not self.running:
            self.dismiss(None)
        else:
            self.say("the step is re-running; the diff view opens when it is done")


__all__ = ["EditFormScreen"]
