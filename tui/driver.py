"""Where mdb's Textual apps draw: on the terminal, also when stderr is redirected.

Textual's Linux driver draws on ``sys.__stderr__`` (so that a program's stdout stays free for
its output). mdb opens a screen only when stdin and stdout are a terminal
(:func:`tui.commands.process.require_terminal`, or a command's table fallback), so with
``mdb step 2>FILE`` Textual would draw the whole screen into FILE and leave the terminal blank.
:class:`TerminalDriver` draws on stdout's terminal instead whenever stderr is not one; stderr
stays FILE, for what Python and C code write there: what Python writes to ``sys.stderr`` while
the app runs (Textual captures it) is appended to FILE as it comes (:class:`StderrToFile`), and
Textual's own error report, printed once the app has closed, goes there too.

A ``kill -TERM`` (SIGTERM) while the screen is open closes the app as ``q`` does, so the
terminal is restored (main screen, cursor, echo, no mouse reporting) instead of being left in
the app's modes by the default action (death on the spot); the process then exits with status
143 (128 + 15) — :class:`TerminalOutput`'s ``run``.

Every mdb app mixes in :class:`TerminalOutput`, which picks the driver
(``App.get_driver_class``). ``TEXTUAL_DRIVER`` in the environment still wins, as in Textual.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading

from textual import constants, events
from textual.drivers.linux_driver import LinuxDriver


def _is_terminal(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, OSError, ValueError):  # closed or not a file
        return False


def drawing_stream():
    """The stream a :class:`TerminalDriver` draws on: ``sys.__stderr__`` when it is a terminal
    (Textual's choice), else ``sys.__stdout__`` when that is one, else ``sys.__stderr__``."""
    if not _is_terminal(sys.__stderr__) and _is_terminal(sys.__stdout__):
        return sys.__stdout__
    return sys.__stderr__


class StderrToFile:
    """A target of ``App.begin_capture_print`` (stderr only) that writes what it receives to
    ``file`` at once: what Python code writes to ``sys.stderr`` while a Textual app runs (a
    warning, a worker's traceback), which Textual would otherwise drop.

    Args:
        file: the real stderr (a file or pipe, not the terminal the app draws on).
    """

    def __init__(self, file) -> None:
        self.file = file

    def post_message(self, message) -> bool:
        """Write a :class:`textual.events.Print` to stderr's ``text`` to :attr:`file`."""
        if isinstance(message, events.Print) and message.stderr:
            try:
                self.file.write(message.text)
                self.file.flush()
            except (OSError, ValueError):  # the file was closed or its disk is full
                return False
        return True

    async def _post_message(self, message) -> bool:
        return self.post_message(message)


#: The exit status of a process whose app was closed by SIGTERM: 128 + 15, as a shell reports a
#: command killed by it.
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


class TerminalDriver(LinuxDriver):
    """Textual's Linux driver drawing on :func:`drawing_stream`; when that is stdout (stderr is
    redirected), what Python writes to ``sys.stderr`` during the app goes to stderr's file
    (:class:`StderrToFile`) from the start of application mode to its end.

    From the start of application mode to its end, SIGTERM asks the app to exit with return
    code :data:`SIGTERM_EXIT_CODE` (``App.exit``), handled in the app's event loop
    (``loop.add_signal_handler``), and marks the app ``terminated_by_signal``; a Python handler
    that was in place before is called after that (e.g. one forwarding the signal to a child
    job). The previous disposition is put back exactly when application mode ends. A SIGTERM
    that was ignored (``SIG_IGN``) stays ignored."""

    def __init__(self, app, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self._file = drawing_stream()
        self._stderr_to_file = None
        if self._file is not sys.__stderr__ and sys.__stderr__ is not None:
            self._stderr_to_file = StderrToFile(sys.__stderr__)
        self._sigterm_loop: asyncio.AbstractEventLoop | None = None
        self._sigterm_previous = signal.SIG_DFL

    def start_application_mode(self) -> None:
        if self._stderr_to_file is not None:
            self._app.begin_capture_print(self._stderr_to_file, stdout=False, stderr=True)
        self._catch_sigterm()
        super().start_application_mode()

    def stop_application_mode(self) -> None:
        try:
            super().stop_application_mode()
        finally:
            self._release_sigterm()
            if self._stderr_to_file is not None:
                with contextlib.suppress(KeyError):  # ended already
                    self._app.end_capture_print(self._stderr_to_file)

    def _catch_sigterm(self) -> None:
        """Handle SIGTERM in the running event loop (only the main thread can set handlers)."""
        if self._sigterm_loop is not None:  # resumed after a suspend without a stop: kept
            return
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None or previous == signal.SIG_IGN:  # set outside Python, or ignored
            return
        try:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        except (RuntimeError, ValueError, NotImplementedError):  # no loop, or not allowed here
            return
        self._sigterm_loop = loop
        self._sigterm_previous = previous

    def _release_sigterm(self) -> None:
        """Put back the SIGTERM disposition :meth:`_catch_sigterm` found."""
        loop, self._sigterm_loop = self._sigterm_loop, None
        if loop is None:
            return
        with contextlib.suppress(RuntimeError, ValueError):  # the loop is closed already
            loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._sigterm_previous)

    def _on_sigterm(self) -> None:
        # A command that handles SIGTERM itself (mdb ablate stops its workers, a torchrun job
        # is forwarded the signal, hooks.run marks the run interrupted) keeps doing so: the
        # app only closes, as on q, and the command goes on to its own end. Otherwise the
        # process ends as a killed one would, once the terminal is restored (TerminalOutput).
        previous = self._sigterm_previous
        if not callable(previous):
            self._app.terminated_by_signal = True
        self._app.exit(return_code=SIGTERM_EXIT_CODE)
        if callable(previous):
            with contextlib.suppress(Exception):
                previous(signal.SIGTERM, None)


class TerminalOutput:
    """Mixed into every mdb ``App`` (before ``App``): Textual runs it with
    :class:`TerminalDriver`, unless ``TEXTUAL_DRIVER`` names another driver or the system is
    Windows (Textual's Windows driver then, as without the mixin).

    ``run`` ends the process with status :data:`SIGTERM_EXIT_CODE` (``SystemExit``, after the
    app has closed and restored the terminal) when a SIGTERM closed the app
    (``terminated_by_signal``) and the command had no SIGTERM handler of its own, so that it
    exits as a killed one would (a command with its own handler gets it called, and goes on
    after the app as after q); an app
    still ``loading`` (``mdb step``'s capture) returns instead, for its command to abandon the
    loader thread (``os._exit`` with the app's return code)."""

    #: Set by :class:`TerminalDriver` when a SIGTERM asked the app to exit.
    terminated_by_signal = False

    def run(self, *args, **kwargs):
        """``App.run``; raises ``SystemExit(143)`` once the app has closed if a SIGTERM closed
        it (see the class)."""
        result = super().run(*args, **kwargs)
        if self.terminated_by_signal and not getattr(self, "loading", False):
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(AttributeError, OSError, ValueError):
                    stream.flush()
            raise SystemExit(SIGTERM_EXIT_CODE)
        return result

    def get_driver_class(self):
        """The driver class Textual builds when the app runs (``App.get_driver_class``)."""
        if constants.DRIVER is not None or sys.platform == "win32":  # Textual's own choice
            return super().get_driver_class()
        return TerminalDriver
