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
from tui.screens.base import CTRL_C_QUITS


class LiveApp(App[int]):
    """An app whose only screen (until ``c``) is one :class:`tui.screens.live.LiveScreen`.

    Args:
        screen: The live screen to show.
    """

    CSS_PATH = ["app.tcss", "screens/live.tcss", "screens/live_ranks.tcss"]
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


#: Seconds the process waits for the step in progress after ``q q`` before leaving it behind.
QUIT_GRACE_S = 2.0


def run_live(session, args=None) -> int:
    """Train ``session`` under the live screen; return the exit status of ``mdb overfit``.

    SIGINT, SIGTERM and SIGHUP (the SSH connection dropping) stop the run after the current step
    with a checkpoint, as in a headless run, and close the screen. After the screen closes
    (``q``), the run is stopped if it is still training, the training thread is waited for
    (it finishes its step, checkpoints and marks the run), and one line says how the run ended.

    A step that does not finish (a user's forward that sleeps or hangs) is left behind when the
    user asked twice — ``q`` again on the screen (or Ctrl-C twice there), or Ctrl-C once the
    screen has closed: the run is marked interrupted in the store, one line says that it
    resumes from its last checkpoint, and the process ends at once (exit 130) — the training
    thread is a daemon and cannot be stopped, and waiting for it would keep the process alive.

    Returns:
        0 finished, or stopped from the screen; 1 failed (non-finite value) or crashed;
        128 + n when stopped by signal n. (130 after leaving a step behind, through
        ``os._exit``.)
    """
    from hooks.runs.trainer import install_stop_signals

    heartbeat = getattr(args, "heartbeat", 1.0) if args is not None else 1.0
    app = make_overfit_app(session, heartbeat=heartbeat)
    screen = app.live
    closed = threading.Event()  # the screen has closed
    give_up = threading.Event()  # a signal after it closed: stop waiting for the step

    def on_signal(name: str) -> None:
        if name == "SIGHUP":  # the terminal is gone (SSH dropped, tmux killed)
            threading.Thread(target=_exit_after_hangup, args=(screen, session),
                             name="mdb-hangup", daemon=True).start()
        elif closed.is_set():
            give_up.set()

    restore = install_stop_signals(session.control, on_signal=on_signal)
    try:
        app.run()
        closed.set()
        session.control.stop("quit")
        if screen.quit_now:
            if not screen.training_done.wait(QUIT_GRACE_S):
                _leave_step_behind(session, getattr(args, "db", None))
        elif not screen.training_done.wait(1.0):
            print("mdb: finishing the current step and writing a checkpoint… (Ctrl-C: quit at "
                  "once, the run resumes from its last checkpoint)", file=sys.stderr)
            while not screen.training_done.wait(0.2):
                if give_up.is_set():
                    _leave_step_behind(session, getattr(args, "db", None))
    finally:
        restore()
        if screen.training_done.is_set():
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


def _leave_step_behind(session, db: str | None, code: int = 130) -> None:
    """End the process while the training thread is still inside a step: mark the run
    interrupted (on a connection of this thread: the trainer's may be mid-transaction), say
    where it resumes, and ``os._exit``."""
    from hooks.runs.store import RunStore, RunWriter

    step = session.recorded_step + 1
    saved = session.last_checkpoint_step
    reason = f"quit during step {step}, which did not finish"
    try:
        with RunStore(session.store.path) as store:
            RunWriter(store, session.writer.run_id, session.name).finish(
                "interrupted", reason=reason)
        marked = "interrupted"
    except Exception as exc:  # the database is unreachable: the run will read as gone
        marked = f"not marked ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
    resume = (f"; continue from step {saved}: mdb overfit --resume {session.name}"
              + (f" --db {db}" if db else "")) if saved is not None else ""
    with contextlib.suppress(OSError, ValueError):  # no terminal after a hangup
        print(f"run {session.name} {marked}: step {step} did not finish and was left behind"
              f"{resume}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _exit_after_hangup(screen, session, timeout: float = 300.0) -> None:
    """After SIGHUP: let the training thread finish its step, checkpoint and mark the run
    interrupted, then end the process at once (exit 129); a step that does not finish within
    ``timeout`` is left behind (the run marked interrupted, resumable from its last
    checkpoint).

    Textual's shutdown writes terminal-restoring sequences to the terminal, which no longer
    exists after a hangup: it blocks there forever while the input thread spins on the dead
    tty. Nothing is left to restore, and the run store has committed every step, so the
    process leaves without it.
    """
    if not screen.training_done.wait(timeout):
        _leave_step_behind(session, None, 128 + signal.SIGHUP)
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
