"""``MdbApp``: the Textual app behind ``mdb step``, and the factories the CLI and tests share.

Two ways in:

* :func:`make_step_app` — a trace already in memory (tests, ``mdb step --trace``, embedding);
* :func:`make_loading_app` — a function that produces the trace (``mdb step``): the app paints a
  loading screen at once and runs the function in a thread worker (importing torch, building the
  model and capturing the step take most of the start-up time). If it raises
  :class:`tui.errors.MdbError`, the app exits with code 2 and keeps the message in
  :attr:`MdbApp.error` for the CLI to print after the terminal is restored.

Importing this module does not import torch; screens import ``hooks`` lazily.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from textual.app import App

from tui import messages
from tui.driver import TerminalOutput
from tui.errors import MdbError
from tui.keys import KeysInOrder
from tui.screens.base import CTRL_C_QUITS


class MdbApp(KeysInOrder, TerminalOutput, App[int]):
    """The step-through debugger. Keys typed in one burst act in order, each on the view on
    screen when it is handled (:class:`tui.keys.KeysInOrder`).

    Args:
        trace: a :class:`hooks.Trace` to open, or None when ``loader`` provides it.
        loader: called in a thread worker to produce the trace (when ``trace`` is None).
        loading_text: what the loading screen says while ``loader`` runs.
        doctor_results: ``hooks.doctor.model`` results for the ``d`` view, or None.
        doctor_runner: runs the checks on demand for the ``d`` view (``mdb step`` passes one
            bound to its model), or None.
        exit_after_paint: exit as soon as the step view is painted (start-up benchmark).
            Defaults to the environment variable ``MDB_EXIT_AFTER_PAINT=1``. With
            ``MDB_PAINT_LOG=FILE`` the app also appends ``loading <time>`` and ``step <time>``
            (Unix seconds) to FILE when those screens are first painted.
    """

    CSS_PATH = "app.tcss"
    TITLE = "mdb"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [CTRL_C_QUITS]

    def __init__(self, trace=None, *, loader: Callable[[], object] | None = None,
                 loading_text: str = "capturing one forward and backward pass…",
                 doctor_results=None, doctor_runner=None,
                 exit_after_paint: bool | None = None) -> None:
        super().__init__()
        self.doctor_runner = doctor_runner
        if trace is None and loader is None:
            raise ValueError("MdbApp needs a trace or a loader")
        self.trace = trace
        self.loader = loader
        self.loading_text = loading_text
        self.doctor_results = doctor_results
        if exit_after_paint is None:
            exit_after_paint = os.environ.get("MDB_EXIT_AFTER_PAINT") == "1"
        self.exit_after_paint = exit_after_paint
        self.error: str | None = None
        #: turn Python's cyclic garbage collector back on once the step view is first painted
        #: (``mdb step`` turns it off for its start-up; see :meth:`step_painted`)
        self.gc_after_paint = False
        #: True while the loader runs in its thread (it cannot be interrupted: a user's forward
        #: may sleep or spin; the CLI does not wait for it after the app quits)
        self.loading = False
        self._paint_log = os.environ.get("MDB_PAINT_LOG")

    def log_paint(self, label: str) -> None:
        """Append ``label <unix time>`` to ``$MDB_PAINT_LOG`` when set (start-up benchmark)."""
        if self._paint_log:
            import time

            with open(self._paint_log, "a", encoding="utf-8") as f:
                f.write(f"{label} {time.time():.6f}\n")

    def step_painted(self) -> None:
        """Called once the step view is painted: logs it (:meth:`log_paint`) and, the first
        time, when :attr:`gc_after_paint` is set, collects the start-up's garbage, moves the
        survivors (model, trace, widgets: they live as long as the app) out of the collector's
        reach (``gc.freeze``, so that a later full collection does not stall a key press by
        walking them) and turns the collector back on."""
        self.log_paint("step")
        if self.gc_after_paint:
            import gc

            self.gc_after_paint = False
            gc.collect()
            gc.freeze()
            gc.enable()

    def on_mount(self) -> None:
        if self.trace is not None:
            self._open(self.trace)
            return
        from tui.screens.loading import LoadingScreen

        self.push_screen(LoadingScreen(self.loading_text))
        self.call_after_refresh(self._load)

    def _open(self, trace) -> None:
        from tui.screens.step import StepScreen

        self.trace = trace
        screen = StepScreen(trace, doctor_results=self.doctor_results,
                            doctor_runner=self.doctor_runner)
        if len(self.screen_stack) > 1:
            self.switch_screen(screen)
        else:
            self.push_screen(screen)

    def _load(self) -> None:
        """Run the loader in a daemon thread (not a Textual worker: the app waits for its
        workers when it quits, and a user's forward may sleep or spin for minutes; the CLI
        leaves without waiting for it). ``post_message`` is thread-safe."""
        import threading

        self.loading = True
        threading.Thread(target=self._run_loader, name="mdb-capture", daemon=True).start()

    def _run_loader(self) -> None:
        try:
            trace = self.loader()
        except MdbError as exc:
            self.post_message(messages.LoadFailed(str(exc), exc.exit_code))
        except Exception as exc:  # the user's model may raise anything: one line, no traceback
            self.post_message(messages.LoadFailed(f"{type(exc).__name__}: {exc}", 1))
        else:
            self.post_message(messages.TraceReady(trace))
        finally:
            self.loading = False

    def on_trace_ready(self, message: messages.TraceReady) -> None:
        self._open(message.trace)

    def on_load_failed(self, message: messages.LoadFailed) -> None:
        self.error = message.error
        self.exit(return_code=message.exit_code)

    def on_jump_to_module(self, message: messages.JumpToModule) -> None:
        """A screen (e.g. the doctor) asked to open a module: hand it to the step screen."""
        from tui.screens.step import StepScreen

        for screen in reversed(self.screen_stack):
            if isinstance(screen, StepScreen):
                screen.on_jump_to_module(message)
                return


def make_step_app(trace, *, doctor_results=None, exit_after_paint: bool | None = None) -> MdbApp:
    """The app for a trace in memory (shared by ``mdb step --trace``, tests and benchmarks)."""
    return MdbApp(trace, doctor_results=doctor_results, exit_after_paint=exit_after_paint)


def make_loading_app(loader: Callable[[], object], *, loading_text: str | None = None,
                     doctor_results=None, doctor_runner=None) -> MdbApp:
    """The app that paints a loading screen and runs ``loader()`` in a worker for the trace."""
    kwargs = {"loading_text": loading_text} if loading_text else {}
    return MdbApp(loader=loader, doctor_results=doctor_results, doctor_runner=doctor_runner,
                  **kwargs)


class DiffApp(KeysInOrder, TerminalOutput, App[int]):
    """``mdb diff A B``: the changed tensors, and each call of A beside B. Keys typed in one
    burst act in order (:class:`tui.keys.KeysInOrder`), also in ``mdb diff --dtype``'s
    subclass."""

    CSS_PATH = "app.tcss"
    TITLE = "mdb diff"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [CTRL_C_QUITS]

    def __init__(self, a, b, diff, name_a: str, name_b: str) -> None:
        super().__init__()
        self.args = (a, b, diff, name_a, name_b)

    def on_mount(self) -> None:
        from tui.screens.diff import DiffScreen

        self.push_screen(DiffScreen(*self.args))


def make_diff_app(a, b, diff, name_a: str, name_b: str) -> DiffApp:
    """The app of ``mdb diff`` for two traces and their :class:`hooks.trace.diff.TraceDiff`."""
    return DiffApp(a, b, diff, name_a, name_b)
