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


def help_text() -> str:
    """The full key reference, one section per view."""
    from tui.screens.attention import AttentionScreen
    from tui.screens.gradients import GradientsScreen
    from tui.screens.router import RouterScreen
    from tui.screens.search import SearchScreen
    from tui.screens.step import StepScreen
    from tui.screens.view import VIEW_BINDINGS

    own = {id(b) for b in VIEW_BINDINGS}
    sections = [
        ("step view", StepScreen.BINDINGS + [Binding("enter", "", "jump to the tree node's "
                                                     "first call")]),
        ("router view", [b for b in RouterScreen.BINDINGS if id(b) not in own]),
        ("attention view", [b for b in AttentionScreen.BINDINGS if id(b) not in own]),
        ("gradients view", [b for b in GradientsScreen.BINDINGS if id(b) not in own]
         + [Binding("enter", "", "open the parameter's module in the step view")]),
        ("every view", VIEW_BINDINGS),
        ("find (/)", SearchScreen.BINDINGS + [Binding("enter", "", "jump to the match")]),
    ]
    out = [INTRO]
    for title, bindings in sections:
        out.append("")
        out.append(title)
        out.extend(binding_lines(bindings))
    return "\n".join(out)


class HelpScreen(ModalScreen[None]):
    """The key reference as a scrollable modal."""

    BINDINGS = [
        Binding("question_mark,q,escape,enter", "close", "close", id="help.close"),
        Binding("j,down", "scroll(1)", "down", show=False, id="help.down"),
        Binding("k,up", "scroll(-1)", "up", show=False, id="help.up"),
    ]

    def compose(self):
        with VerticalScroll(id="help-box"):
            yield Static(help_text(), id="help-text", markup=False)

    def action_close(self) -> None:
        self.dismiss(None)

    def action_scroll(self, delta: int) -> None:
        self.query_one("#help-box", VerticalScroll).scroll_relative(y=delta, animate=False)
