"""``MdbFooter``: Textual's ``Footer``, composed again only when the keys it shows change."""

from __future__ import annotations

from textual.widgets import Footer


def shown_keys(screen) -> tuple:
    """``(key, description, enabled, tooltip)`` of each binding ``screen``'s footer shows."""
    return tuple((binding.key, binding.description, enabled, tooltip)
                 for (_, binding, enabled, tooltip) in screen.active_bindings.values()
                 if binding.show)


class MdbFooter(Footer):
    """The footer of the step view and of the views on top of it.

    Textual's footer removes and mounts all its keys again whenever the screen's bindings
    may have changed: each time its screen comes back, and again when the focus moves, a
    layout pass and a frame each (about half of the time from ``s``/``r`` to the last frame
    of the step or router view). This one does so only when the keys it would show differ
    from those on show."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._mdb_shown: tuple | None = None

    def bindings_changed(self, screen) -> None:
        if screen.app.app_focus and self.is_attached and screen is self.screen:
            shown = shown_keys(screen)
            if shown == self._mdb_shown:
                return
            self._mdb_shown = shown
        super().bindings_changed(screen)
