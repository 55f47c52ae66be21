"""``LoadingScreen``: shown while a worker captures the step (or loads a trace file)."""

from __future__ import annotations

from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import LoadingIndicator, Static


class LoadingScreen(Screen):
    """A line saying what runs, and a loading indicator; ``q`` quits."""

    BINDINGS = [Binding("q", "app.quit", "quit", id="loading.quit")]

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def compose(self):
        yield Static(self.what, id="loading-text", markup=False)
        yield LoadingIndicator(id="loading-indicator")

    def on_mount(self) -> None:
        if hasattr(self.app, "log_paint"):
            self.call_after_refresh(self.app.log_paint, "loading")
