"""The step view's ``d`` key: the doctor's results when there are some, else how to get them.

``tui/screens/doctor.py`` (``DoctorScreen``) is written separately; it lists
``hooks.checks.CheckResult`` rows and posts :class:`tui.messages.JumpToModule` to open a
module in the step view (handled by :class:`tui.app.MdbApp` and by the step screen). A screen
that returns a module name through ``dismiss`` is handled too.
"""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

NO_RESULTS = (
    "doctor · no check results for this trace\n\n"
    "`mdb doctor` runs the model's sanity checks (initial loss, causality, tied weights, "
    "routing, gradients...) and opens its findings here, with a key to jump to the module "
    "each one is about.\n\nq, d or Esc closes this."
)


class NoDoctorScreen(ModalScreen[None]):
    """Says that no doctor results were given, and how to get them."""

    BINDINGS = [Binding("q,d,escape,enter", "close", "close", id="nodoctor.close")]

    def compose(self):
        with Vertical(id="nodoctor-box"):
            yield Static(NO_RESULTS, id="nodoctor-text", markup=False)

    def action_close(self) -> None:
        self.dismiss(None)


def doctor_screen(step):
    """The screen ``d`` opens from ``step`` (a :class:`tui.screens.step.StepScreen`)."""
    results = step.doctor_results
    runner = getattr(step, "doctor_runner", None)
    if not results and runner is None:
        return NoDoctorScreen()
    from tui.screens.doctor import DoctorScreen

    if results:
        return DoctorScreen(results)
    return DoctorScreen(runner=runner)
