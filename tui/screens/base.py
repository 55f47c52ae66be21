"""``MdbScreen``: what every full-screen mdb view shares.

* Below 80×24 the view is replaced by one centred line, "terminal too small (WxH), need 80×24",
  and comes back as soon as the terminal is large enough again (checked on mount, on resize and
  when the screen becomes current again).
* While the view is too small every key but quitting is ignored (:meth:`MdbScreen.check_action`):
  a key that acted on an invisible view would change what the user sees when it comes back.
  The focused widget loses the focus meanwhile (and gets it back), so its own keys (Enter on a
  hidden table or tree) do not act either.
* A one-line ``#hint`` area above the footer for messages such as "already at the last call"
  (instead of toasts, which would cover the view at 80×24).
"""

from __future__ import annotations

from rich.cells import cell_len
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Static

from hooks.text import printable

#: Every mdb app quits on Ctrl-C (Textual's default only says "press ctrl+q to quit"); a
#: screen with its own Ctrl-C (the live screen detaches, mdb ablate stops its workers) wins.
CTRL_C_QUITS = Binding("ctrl+c", "quit", "quit", show=False, id="app.ctrl_c")

MIN_WIDTH = 80
MIN_HEIGHT = 24


def key_label(key: str) -> str:
    """How a Textual key name is written for a person (``right`` → ``→``, ``slash`` → ``/``)."""
    names = {
        "right": "→", "left": "←", "up": "↑", "down": "↓", "pagedown": "PgDn",
        "pageup": "PgUp", "slash": "/", "question_mark": "?", "escape": "Esc",
        "left_square_bracket": "[", "right_square_bracket": "]", "enter": "Enter",
        "home": "Home", "end": "End", "tab": "Tab", "minus": "-", "plus": "+",
        "full_stop": ".", "comma": ",",
    }  # fmt: skip
    return names.get(key, key)


def show(widget, visible: bool) -> None:
    """Show or hide a direct child of an :class:`MdbScreen`: hidden by an inline ``display:
    none``, shown by removing it, so that the too-small rule of ``app.tcss`` (``Screen.-too-small
    > * { display: none }``) still hides it (an inline ``display: block`` would win over it)."""
    if visible:
        widget.styles.clear_rule("display")
    else:
        widget.display = False


#: Actions that still work while the terminal is too small (leaving must always be possible).
ALWAYS_ALLOWED = frozenset({"quit", "quit_view", "app.quit"})


class MdbScreen(Screen):
    """Base of mdb's full-screen views (too-small guard and hint line)."""

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Disable every action but quitting while the too-small message is shown."""
        if self.has_class("-too-small") and action not in ALWAYS_ALLOWED:
            return False
        return True

    def on_mount(self) -> None:
        self.mount(Static("", id="too-small"))
        self.check_size()
        # again once the screen's own on_mount has run (it may focus a widget)
        self.call_after_refresh(self.check_size)

    def on_resize(self) -> None:
        self.check_size()

    def on_screen_resume(self) -> None:
        self.check_size()

    def check_size(self) -> bool:
        """Show the too-small message when the terminal is under 80×24; True if it fits."""
        width, height = self.app.size
        small = width < MIN_WIDTH or height < MIN_HEIGHT
        self.set_class(small, "-too-small")
        self._guard_focus(small)
        if small:
            for w in self.query("#too-small"):
                w.update(
                    f"terminal too small ({width}×{height}), need {MIN_WIDTH}×{MIN_HEIGHT}\n"
                    "enlarge the window · q quits"
                )
        return not small

    def _guard_focus(self, small: bool) -> None:
        """Take the focus from the (hidden) focused widget while too small; give it back."""
        if small:
            if self.focused is not None:
                if getattr(self, "_blurred", None) is None:
                    self._blurred = self.focused
                self.set_focus(None)
            return
        widget, self._blurred = getattr(self, "_blurred", None), None
        if widget is not None and widget.is_attached and self.focused is None:
            self.set_focus(widget)

    def flush_repaints(self) -> None:
        """Hand the screen now every repaint its widgets asked for during this action, so that
        they all land in one frame.

        Textual delivers a widget's ``refresh()`` to the screen from that widget's own task,
        when it is next idle: after a key press that changed several widgets, the screen's 60
        fps timer could draw a frame with some of them and a second one, a timer period later,
        with the rest (the hint line, a scroll bar). Widgets with nothing pending are left
        alone; on a Textual without the private hook this does nothing."""
        for widget in self.walk_children(with_self=False):
            for w in (widget, getattr(widget, "_vertical_scrollbar", None),
                      getattr(widget, "_horizontal_scrollbar", None)):
                if w is None or not (getattr(w, "_repaint_required", False)
                                     or getattr(w, "_layout_required", False)):
                    continue
                check = getattr(w, "_check_refresh", None)
                if check is not None:
                    check()

    def hint(self, text: str) -> None:
        """Show ``text`` in the hint line above the footer (empty string clears it). The line
        is one row high (``app.tcss``): a new text repaints it without a layout, the same text
        not at all; a text longer than the line wraps onto as many rows as it needs (up to 8),
        never cut. A hint repeats names (a module's, a run's) and messages: it is shown
        :func:`hooks.text.printable`."""
        text = printable(text)
        hints = getattr(self, "_hint_widgets", None)
        if hints is None or any(not w.is_attached for w in hints):
            hints = self._hint_widgets = list(self.query("#hint"))  # a DOM query costs ~1 ms
        for w in hints:
            if getattr(w, "_mdb_text", None) != text:
                w._mdb_text = text
                # a text longer than the line wraps onto more lines (never cut): a layout then
                long = cell_len(text) > (w.content_size.width or self.app.size.width - 2)
                relayout = long or w.has_class("-long")
                w.set_class(long, "-long")
                w.update(text, layout=relayout)
