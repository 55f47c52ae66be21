"""``HelpScreen``: every key of every view, read from the screens' own ``BINDINGS``.

Generated rather than written, so the list cannot drift from what the keys do. Closes with
``?``, ``q``, Enter or Esc.

The text is laid out by Rich, not wrapped by hand: a key line (two spaces, the keys, two or more
spaces, the description; :func:`binding_lines`) becomes a row of a two-column grid, so that a
description too long for the box continues under the description column; any other line is a
paragraph wrapped at word boundaries (:func:`help_renderable`).
"""

from __future__ import annotations

import re

from rich.console import Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.visual import RichVisual
from textual.widgets import Static

from tui.screens.base import key_label

INTRO = (
    "mdb keys · every action has a letter key (arrows work too); nothing needs a mouse.\n"
    "Tab moves the focus between panes; ↑/↓ move inside the focused tree or table."
)


#: Width of the keys column of a key line; the description starts 2 + 16 + 1 columns in.
KEYS_WIDTH = 16

#: A key line: two spaces, the keys (single spaces between them), at least two spaces, the rest.
_KEY_LINE = re.compile(r"^  (?P<keys>\S+(?: \S+)*)  +(?P<text>\S.*)$")


def binding_lines(bindings) -> list[str]:
    """``  n j →            next`` lines for a list of :class:`textual.binding.Binding`: the
    keys padded to :data:`KEYS_WIDTH`, then the description (its tooltip when it has one).
    Keys and description are always two or more spaces apart, and a description's own line
    breaks continue under its column, so that :func:`help_renderable` can tell them apart."""
    lines = []
    for b in bindings:
        if not isinstance(b, Binding):
            continue
        keys = " ".join(key_label(k.strip()) for k in b.key.split(","))
        text = (b.tooltip or b.description).replace("\n", "\n" + " " * (KEYS_WIDTH + 3))
        lines.append(f"  {keys:<{KEYS_WIDTH}} {text}" if len(keys) < KEYS_WIDTH
                     else f"  {keys}  {text}")
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


def help_renderable(text: str) -> Group:
    """``text`` (:func:`help_text`) as Rich lays it out at any width: each run of key lines
    (:func:`binding_lines`) a grid of two columns, keys (never wrapped, at least
    :data:`KEYS_WIDTH` wide) and descriptions (wrapped at word boundaries inside their
    column, so that a long one continues indented under itself); a line indented deeper than
    the keys continues the description above it; every other line a paragraph."""
    parts: list = []
    grid: Table | None = None
    for line in text.split("\n"):
        key_line = _KEY_LINE.match(line)
        if key_line is None and grid is not None and line.startswith(" " * (KEYS_WIDTH + 3)):
            grid.add_row("", line.strip())  # a description's own second line
            continue
        if key_line is None:
            grid = None
            parts.append(Text(line))
            continue
        if grid is None:
            grid = Table.grid(padding=(0, 1))
            grid.add_column(min_width=KEYS_WIDTH, no_wrap=True)
            grid.add_column(overflow="fold")
            parts.append(Padding(grid, (0, 0, 0, 2)))
        grid.add_row(key_line["keys"], key_line["text"])
    return Group(*parts)


class HelpVisual(RichVisual):
    """The help as a Textual visual: drawn as :func:`help_renderable` lays it out; ``str()``
    is the plain text (as for a :class:`textual.content.Content` of that text)."""

    def __init__(self, widget, text: str) -> None:
        super().__init__(widget, help_renderable(text))
        self.text = text

    def __str__(self) -> str:
        return self.text


class HelpText(Static):
    """A :class:`textual.widgets.Static` showing a :func:`help_text` as :class:`HelpVisual`.

    Args:
        text: the help text; every other argument is :class:`textual.widgets.Static`'s.
    """

    def __init__(self, text: str, **kwargs) -> None:
        super().__init__(text, markup=False, **kwargs)
        self._help_visual: HelpVisual | None = None

    def render(self) -> HelpVisual:
        text = str(self.content)
        if self._help_visual is None or self._help_visual.text != text:
            self._help_visual = HelpVisual(self, text)
        return self._help_visual


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
            yield HelpText(self.text, id="help-text")

    def action_close(self) -> None:
        self.dismiss(None)

    def action_scroll(self, delta: int) -> None:
        self.query_one("#help-box", VerticalScroll).scroll_relative(y=delta, animate=False)
