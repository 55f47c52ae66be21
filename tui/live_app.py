"""``LiveApp``: the Textual app of ``mdb overfit`` (live screen) and ``mdb watch``.

Both commands show :class:`tui.screens.live.LiveScreen`; the app adds the CSS of the step view
(``c`` pushes :class:`tui.screens.step.StepScreen` on top of the live screen). ``mdb overfit``
trains in a process of its own and shows :func:`make_watch_app`'s viewer of it
(:mod:`tui.commands.overfit_detach`); :func:`make_overfit_app` trains in this process, for the
API, the tests and the benchmark.

The factories :func:`make_overfit_app` and :func:`make_watch_app` are shared by the CLI, the
tests and the benchmark.
"""

from __future__ import annotations

from textual.app import App

from tui import messages
from tui.driver import TerminalOutput
from tui.keys import KeysInOrder
from tui.screens.base import CTRL_C_QUITS


class LiveApp(KeysInOrder, TerminalOutput, App[int]):
    """An app whose only screen (until ``c``) is one :class:`tui.screens.live.LiveScreen`. Keys
    typed in one burst act in order, each on the view on screen when it is handled
    (:class:`tui.keys.KeysInOrder`).

    Args:
        screen: The live screen to show.
    """

    CSS_PATH = ["app.tcss", "screens/live.tcss", "screens/live_ranks.tcss",
                "screens/live_findings.tcss"]
    TITLE = "mdb"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [CTRL_C_QUITS]

    def __init__(self, screen) -> None:
        super().__init__()
        self.live = screen

    def on_mount(self) -> None:
        self.push_screen(self.live)

    def on_jump_to_module(self, message: messages.JumpToModule) -> None:
        """A view on top of the step view asked to open a module: hand it to the step view."""
        from tui.screens.step import StepScreen

        for screen in reversed(self.screen_stack):
            if isinstance(screen, StepScreen):
                screen.on_jump_to_module(message)
                return


def make_overfit_app(session, **kwargs) -> LiveApp:
    """The live app training ``session`` (an :class:`hooks.train.overfit.OverfitSession`).

    Keyword arguments go to :class:`tui.screens.live.LiveScreen` (``heartbeat``,
    ``chart_interval``, ...).
    """
    from tui.screens.live_train import TrainScreen

    return LiveApp(TrainScreen(session, **kwargs))


def make_watch_app(store, run, **kwargs) -> LiveApp:
    """The read-only app following ``run`` (a :class:`hooks.store.store.RunInfo`) in ``store``."""
    from tui.screens.live_watch import WatchScreen

    return LiveApp(WatchScreen(store, run, **kwargs))
