"""``SearchScreen``: find a module by (part of) its qualified name.

Type to filter (case-insensitive substring; space-separated words must all match), ↑/↓ to pick,
Enter to jump (to the first match when none is highlighted), Esc, Ctrl-C or Enter on an empty
query to cancel (as in less and vim: a second Ctrl-C then does what it does in the view beneath,
quit). Dismisses with the chosen qualified name, or None.
"""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, OptionList, Static

from hooks.text import printable

MAX_SHOWN = 200


def matches(names: list[str], query: str) -> list[str]:
    """Names containing every whitespace-separated word of ``query`` (case-insensitive), as
    shown (:func:`hooks.text.printable`: an ESC in a name is found as ``x1b``)."""
    words = query.lower().split()
    return [n for n in names if all(w in printable(n).lower() for w in words)]


def _prompt(name: str) -> Text:
    return Text(printable(name))  # as typed, never markup; a control character escaped


class SearchScreen(ModalScreen[str | None]):
    """A query box over the list of matching module names."""

    BINDINGS = [
        Binding("escape", "cancel", "cancel", id="search.cancel"),
        # a priority binding: the focused Input's own Ctrl-C (copy) would otherwise swallow it
        Binding("ctrl+c", "cancel", "cancel", show=False, priority=True, id="search.ctrl_c"),
        Binding("down", "move(1)", "down", show=False, id="search.down"),
        Binding("up", "move(-1)", "up", show=False, id="search.up"),
    ]

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names = names
        self.shown: list[str] = names[:MAX_SHOWN]

    def compose(self):
        with Vertical(id="search-box"):
            yield Static("find module · type part of a name · Enter jumps · "
                         "empty Enter or Esc cancels", id="search-help", markup=False)
            yield Input(placeholder="e.g. layers.1 gate", id="search-input")
            yield OptionList(*map(_prompt, self.shown), id="search-results")

    def on_mount(self) -> None:
        self.query_one("#search-input", Input).focus()
        self.query_one("#search-results", OptionList).highlighted = 0 if self.shown else None

    def on_input_changed(self, event: Input.Changed) -> None:
        self.shown = matches(self.names, event.value)[:MAX_SHOWN]
        results = self.query_one("#search-results", OptionList)
        results.clear_options()
        results.add_options(map(_prompt, self.shown))
        results.highlighted = 0 if self.shown else None

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if not event.value.strip():
            self.dismiss(None)
            return
        results = self.query_one("#search-results", OptionList)
        i = results.highlighted
        if not self.shown:
            self.query_one("#search-help", Static).update(f"no module matches {event.value!r}")
            return
        self.dismiss(self.shown[i if i is not None else 0])

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.shown[event.option_index])

    def action_move(self, delta: int) -> None:
        results = self.query_one("#search-results", OptionList)
        if not self.shown:
            return
        i = results.highlighted or 0
        results.highlighted = max(0, min(len(self.shown) - 1, i + delta))

    def action_cancel(self) -> None:
        self.dismiss(None)
