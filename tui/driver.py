"""Where mdb's Textual apps draw: on the terminal, also when stderr is redirected.

Textual's Linux driver draws on ``sys.__stderr__`` (so that a program's stdout stays free for
its output). mdb opens a screen only when stdin and stdout are a terminal
(:func:`tui.commands.process.require_terminal`, or a command's table fallback), so with
``mdb step 2>FILE`` Textual would draw the whole screen into FILE and leave the terminal blank.
:class:`TerminalDriver` draws on stdout's terminal instead whenever stderr is not one; stderr
stays FILE, for what Python and C code write there: what Python writes to ``sys.stderr`` while
the app runs (Textual captures it) is appended to FILE as it comes (:class:`StderrToFile`), and
Textual's own error report, printed once the app has closed, goes there too.

Every mdb app mixes in :class:`TerminalOutput`, which picks the driver
(``App.get_driver_class``). ``TEXTUAL_DRIVER`` in the environment still wins, as in Textual.
"""

from __future__ import annotations

import contextlib
import sys

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


class TerminalDriver(LinuxDriver):
    """Textual's Linux driver drawing on :func:`drawing_stream`; when that is stdout (stderr is
    redirected), what Python writes to ``sys.stderr`` during the app goes to stderr's file
    (:class:`StderrToFile`) from the start of application mode to its end."""

    def __init__(self, app, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self._file = drawing_stream()
        self._stderr_to_file = None
        if self._file is not sys.__stderr__ and sys.__stderr__ is not None:
            self._stderr_to_file = StderrToFile(sys.__stderr__)

    def start_application_mode(self) -> None:
        if self._stderr_to_file is not None:
            self._app.begin_capture_print(self._stderr_to_file, stdout=False, stderr=True)
        super().start_application_mode()

    def stop_application_mode(self) -> None:
        try:
            super().stop_application_mode()
        finally:
            if self._stderr_to_file is not None:
                with contextlib.suppress(KeyError):  # ended already
                    self._app.end_capture_print(self._stderr_to_file)


class TerminalOutput:
    """Mixed into every mdb ``App`` (before ``App``): Textual runs it with
    :class:`TerminalDriver`, unless ``TEXTUAL_DRIVER`` names another driver or the system is
    Windows (Textual's Windows driver then, as without the mixin)."""

    def get_driver_class(self):
        """The driver class Textual builds when the app runs (``App.get_driver_class``)."""
        if constants.DRIVER is not None or sys.platform == "win32":  # Textual's own choice
            return super().get_driver_class()
        return TerminalDriver
