"""``HelpScreen``: every key of every view, read from the screens' own ``BINDINGS``.

Generated rather than written, so the list cannot drift from what the keys do. Closes with
``?``, ``q``, Enter or Esc.
"""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from tui.screens.base import key_label

INTRO = (
    "mdb keys · every action has a letter key (arrows work too); nothing needs a mouse.\n"
    "Tab moves the focus between panes; ↑/↓ move inside the focused tree or table."
)


def binding_lines(bindings) -> list[str]:
    """``  n j →        next`` lines for a list of :class:`textual.binding.Binding`."""
    lines = []
    for b in bindings:
        if not isinstance(b, Binding):
            continue
        keys = " ".join(key_label(k.strip()) for k in b.key.split(","))
        lines.append(f"  {keys:<16} {b.tooltip or b.description}")
    return lines


def help_text(sections: list[tuple[str, list]]) -> str:
    """The key reference: :data:`INTRO`, then one titled block of :func:`binding_lines` per
    ``(title, bindings)`` section."""
    out = [INTRO]
    for title, bindings in sections:
        out.append("")
        out.append(title)
        out.extend(binding_lines(bindings))
    return "\n".join(out)


class HelpScreen(ModalScreen[None]):
    """The key reference as a scrollable modal.

    Args:
        text: what to show (:func:`help_text`); the screen that opens help knows its keys, so
            this module imports no other screen.
    """

    BINDINGS = [
        Binding("question_mark,q,escape,enter", "close", "close", id="help.close"),
        Binding("j,down", "scroll(1)", "down", show=False, id="help.down"),
        Binding("k,up", "scroll(-1)", "up", show=False, id="help.up"),
    ]

    def __init__(self, text: str = INTRO) -> None:
        super().__init__()
        self.text = text

    def compose(self):
        with VerticalScroll(id="help-box"):
            yield Static(self.text, id="help-text", markup=False)

    def action_close(self) -> None:
        self.dismiss(None)

    def action_scroll(self, delta: int) -> None:
        self.query_one("#help-box", VerticalScroll).scroll_relative(y=delta, animate=False)
