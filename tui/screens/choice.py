"""``ChoiceScreen``: a one-line question answered with a key, for the live screen's ``q``
(detach or stop?) and ``x`` (stop the run?).

Each choice is ``(key, label, value)``; the screen dismisses with the value of the key pressed,
with ``default`` for Enter, and with ``None`` for Esc (nothing happens).
"""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static


class ChoiceScreen(ModalScreen[str | None]):
    """A question over the current screen.

    Args:
        question: One line, e.g. ``run r1 is still training``.
        choices: ``(key, label, value)`` for each answer, in the order shown.
        default: The value Enter chooses.
    """

    BINDINGS = [
        Binding("escape", "answer('')", "cancel", id="choice.cancel"),
        Binding("enter", "answer_default", "default", id="choice.default"),
    ]

    def __init__(self, question: str, choices: list[tuple[str, str, str]],
                 default: str) -> None:
        super().__init__()
        self.question = question
        self.choices = choices
        self.default = default

    def compose(self):
        keys = " · ".join(
            f"{key} {label}" + (" (Enter)" if value == self.default else "")
            for key, label, value in self.choices)
        with Vertical(id="choice-box"):
            yield Static(self.question, id="choice-question", markup=False)
            yield Static(f"{keys} · Esc cancels", id="choice-keys", markup=False)

    def on_key(self, event) -> None:
        for key, _label, value in self.choices:
            if event.key == key:
                event.stop()
                self.dismiss(value)
                return

    def action_answer(self, value: str) -> None:
        self.dismiss(value or None)

    def action_answer_default(self) -> None:
        self.dismiss(self.default)
