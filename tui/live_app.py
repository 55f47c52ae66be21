"""``LiveApp``: the Textual app of ``mdb overfit`` (live screen) and ``mdb watch``.

Both commands show :class:`tui.screens.live.LiveScreen`; the app adds the CSS of the step view
(``c`` pushes :class:`tui.screens.step.StepScreen` on top of the live screen) and, for
``mdb overfit``, :func:`run_live`: signal handling, waiting for the training thread, and the
closing line printed once the terminal is restored.

The factories :func:`make_overfit_app` and :func:`make_watch_app` are shared by the CLI, the
tests and the benchmark.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from textual.app import App

from tui import messages
from tui.run_end import end_of_run


class LiveApp(App[int]):
    """An app whose only screen (until ``c``) is one :class:`tui.screens.live.LiveScreen`.

    Args:
        screen: The live screen to show.
    """

    CSS_PATH = ["app.tcss", "screens/live.tcss", "screens/live_ranks.tcss"]
    TITLE = "mdb"
    ENABLE_COMMAND_PALETTE = False

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
    """The live app training ``session`` (an :class:`hooks.runs.overfit.OverfitSession`).

    Keyword arguments go to :class:`tui.screens.live.LiveScreen` (``heartbeat``,
    ``chart_interval``, ...).
    """
    from tui.screens.live import LiveScreen

    return LiveApp(LiveScreen.training(session, **kwargs))


def make_watch_app(store, run, **kwargs) -> LiveApp:
    """The read-only app following ``run`` (a :class:`hooks.runs.store.RunInfo`) in ``store``."""
    from tui.screens.live import LiveScreen

    return LiveApp(LiveScreen.watching(store, run, **kwargs))


def run_live(session, args=None) -> int:
    """Train ``session`` under the live screen; return the exit status of ``mdb overfit``.

    SIGINT, SIGTERM and SIGHUP (the SSH connection dropping) stop the run after the current step
    with a checkpoint, as in a headless run, and close the screen. After the screen closes
    (``q``), the run is stopped if it is still training, the training thread is waited for
    (it finishes its step, checkpoints and marks the run), and one line says how the run ended.

    Returns:
        0 finished, or stopped from the screen; 1 failed (non-finite value) or crashed;
        128 + n when stopped by signal n.
    """
    from hooks.runs.trainer import install_stop_signals

    heartbeat = getattr(args, "heartbeat", 1.0) if args is not None else 1.0
    app = make_overfit_app(session, heartbeat=heartbeat)
    screen = app.live

    def on_signal(name: str) -> None:
        if name == "SIGHUP":  # the terminal is gone (SSH dropped, tmux killed)
            threading.Thread(target=_exit_after_hangup, args=(screen, session),
                             name="mdb-hangup", daemon=True).start()

    restore = install_stop_signals(session.control, on_signal=on_signal)
    try:
        app.run()
        session.control.stop("quit")
        if not screen.training_done.wait(1.0):
            print("mdb: finishing the current step and writing a checkpoint…", file=sys.stderr)
            screen.training_done.wait()
    finally:
        restore()
        session.store.close()
    name = session.name
    result = session.result
    if screen.error is not None or result is None:
        print(f"mdb: error: run {name}: {screen.error or 'training did not finish'}",
              file=sys.stderr)
        return 1
    db = getattr(args, "db", None) if args is not None else None
    line, is_error, code = end_of_run(session, result, screen.series.last, db)
    print(f"mdb: error: {line}" if is_error else line, file=sys.stderr if is_error else sys.stdout)
    # stopped from the screen (x, q) is a normal end here, unlike a headless run's 130
    return code if is_error else exit_code(result)


def _exit_after_hangup(screen, session, timeout: float = 300.0) -> None:
    """After SIGHUP: let the training thread finish its step, checkpoint and mark the run
    interrupted, then end the process at once (exit 129).

    Textual's shutdown writes terminal-restoring sequences to the terminal, which no longer
    exists after a hangup: it blocks there forever while the input thread spins on the dead
    tty. Nothing is left to restore, and the run store has committed every step, so the
    process leaves without it.
    """
    screen.training_done.wait(timeout)
    with contextlib.suppress(Exception):
        session.store.close()
    os._exit(128 + signal.SIGHUP)


def exit_code(result) -> int:
    """Exit status of a live run from its :class:`hooks.runs.trainer.TrainResult` (see run_live)."""
    from hooks.runs.trainer import signal_exit_code

    if result.status == "failed":
        return 1
    if result.status == "interrupted":
        return signal_exit_code(result.reason) or 0
    return 0
