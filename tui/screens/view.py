"""``ViewScreen``: base of the views pushed on top of the step view (router, attention,
gradients), with the keys every view shares.

Every view can be left with a letter: ``s`` (or Esc) back to the step view, ``r`` / ``a`` /
``g`` / ``d`` straight to another view, ``?`` for the keys, ``q`` to quit (from the step view
beneath: the app exits, or an embedding app gets its screen back).
"""

from __future__ import annotations

from textual.binding import Binding

from tui.screens.base import MdbScreen

#: Bindings shared by every view on top of the step view.
VIEW_BINDINGS = [
    Binding("s,escape", "back", "step", key_display="s", id="view.step",
            tooltip="back to the step view"),
    Binding("r", "view('router')", "router", id="view.router", tooltip="router view"),
    Binding("a", "view('attention')", "attn", id="view.attention", tooltip="attention view"),
    Binding("g", "view('gradients')", "grads", id="view.gradients", tooltip="gradients view"),
    Binding("d", "view('doctor')", "doctor", show=False, id="view.doctor",
            tooltip="doctor results"),
    Binding("question_mark", "help", "keys", key_display="?", id="app.help",
            tooltip="this list of keys"),
    Binding("q", "quit_view", "quit", id="app.quit", tooltip="quit mdb"),
]


class ViewScreen(MdbScreen):
    """A view over the step screen's trace.

    Args:
        step: the :class:`tui.screens.step.StepScreen` beneath (gives the trace and the jumps).
    """

    #: Name used by ``action_view`` to tell "this view" from another.
    VIEW = ""

    def __init__(self, step) -> None:
        super().__init__()
        self.step = step
        self.trace = step.trace

    def follow_step(self) -> None:
        """Called when the view is shown again: move to the step view's layer if it has one."""

    def on_screen_resume(self) -> None:
        if self.is_mounted:
            self.follow_step()

    def action_back(self) -> None:
        self.app.pop_screen()

    def action_view(self, view: str) -> None:
        if view == self.VIEW:
            self.hint(f"this is the {view} view · s returns to the step view")
            return
        self.step.open_view(view, replace=True)

    def action_help(self) -> None:
        from tui.screens.help import HelpScreen

        self.app.push_screen(HelpScreen(self.step.help_text()))

    def action_quit_view(self) -> None:
        self.app.pop_screen()
        self.step.action_quit_view()

    def jump_to(self, module: str) -> None:
        """Close this view and select ``module``'s first call in the step view."""
        self.app.pop_screen()
        self.step.jump(module)


class LayerViewScreen(ViewScreen):
    """A view that shows one record per layer (router, attention) and follows the step view.

    Subclasses set ``records`` (each with a ``layer`` attribute) in ``__init__`` before calling
    :meth:`start_at_step_layer`, name the records in ``LAYER_KIND`` and draw the current one in
    :meth:`show`.
    """

    #: What one record is, for hints ("MoE layers", "attention layers").
    LAYER_KIND = "layers"

    def __init__(self, step) -> None:
        super().__init__(step)
        self.records: list = []
        self.position = 0
        self._shown_for: tuple | None = None

    def start_at_step_layer(self) -> None:
        """Select the record of the step view's current layer (call once records are set)."""
        self.position = self.layer_position()
        self._shown_for = (self.step.stepper.direction, self.step.stepper.index)

    @property
    def record(self):
        """The record on show, or None when there are none."""
        return self.records[self.position] if self.records else None

    def layer_position(self) -> int:
        """Index of the record of the step view's current layer (else the current one)."""
        here = self.step.stepper.layer()
        for i, rec in enumerate(self.records):
            if here is not None and rec.layer == here:
                return i
        return self.position

    def follow_step(self) -> None:
        where = (self.step.stepper.direction, self.step.stepper.index)
        if where == self._shown_for or not self.records:
            return
        self._shown_for = where
        position = self.layer_position()
        if position != self.position:
            self.position = position
            self.show()

    def action_layer(self, delta: int) -> None:
        new = self.position + delta
        if not self.records or not 0 <= new < len(self.records):
            self.hint(f"no more {self.LAYER_KIND} in that direction")
            return
        self.position = new
        self.on_layer_changed()
        self.hint("")
        self.show()

    def on_layer_changed(self) -> None:
        """Called after ``action_layer`` moved to another record, before :meth:`show`."""

    def show(self) -> None:
        """Draw the current record."""
        raise NotImplementedError
