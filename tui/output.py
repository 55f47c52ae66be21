"""Standard output of the ``mdb`` commands, guarded: what cannot be written is said in one line
(``mdb: error: cannot write output: No space left on device``, exit code 2) and a reader that
closed its end of a pipe (``mdb runs --json | head -c 20``) ends the command quietly (exit
code 0: the reader had what it wanted; no traceback, no ``Exception ignored`` at exit).

:func:`guarded_stdout` puts a :class:`GuardedStdout` in ``sys.stdout`` for the command's run
(``print``, the ``csv`` and ``json`` modules, rich's consoles all write through it). It does
not change what a write raises, so code that handles its own write errors (the headless
trainer's output) keeps doing so: it marks the ``OSError`` (:func:`is_output_error`) for
``tui.cli.main`` to tell apart from the errors of other files.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator

#: The attribute :class:`GuardedStdout` sets on an ``OSError`` raised by a write to stdout.
MARK = "mdb_stdout"


def _marked(exc: OSError) -> OSError:
    setattr(exc, MARK, True)
    return exc


def is_output_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an ``OSError`` raised by a write to (or flush of) the guarded stdout."""
    return isinstance(exc, OSError) and getattr(exc, MARK, False)


def closed_stdout_error() -> OSError:
    """The error a write to a standard output closed at start (``mdb … >&-``) raises."""
    return _marked(OSError(errno.EBADF, f"{os.strerror(errno.EBADF)} (standard output is "
                                        "closed)"))


class GuardedStdout:
    """A text stream around ``stream`` (``None``: stdout was closed when the process started,
    every write raises ``OSError(EBADF)``) whose write and flush errors are marked
    (:func:`is_output_error`); anything else is ``stream``'s own.

    Attributes:
        error: The last error a write or flush raised, else ``None`` (rich's consoles turn a
            ``BrokenPipeError`` into ``SystemExit(1)``: this tells ``tui.cli.main`` why).
    """

    def __init__(self, stream) -> None:
        self.stream = stream
        self.error: OSError | None = None

    def _failed(self, exc: OSError) -> OSError:
        self.error = _marked(exc)
        return exc

    def write(self, text: str) -> int:
        if self.stream is None:
            raise self._failed(closed_stdout_error())
        try:
            return self.stream.write(text)
        except OSError as exc:
            self._failed(exc)
            raise

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.stream is None:
            return
        try:
            self.stream.flush()
        except OSError as exc:
            self._failed(exc)
            raise

    def isatty(self) -> bool:
        return False if self.stream is None else self.stream.isatty()

    def fileno(self) -> int:
        if self.stream is None:
            raise closed_stdout_error()
        return self.stream.fileno()

    def __getattr__(self, name: str):
        if self.stream is None:
            raise AttributeError(name)
        return getattr(self.stream, name)


@contextlib.contextmanager
def guarded_stdout() -> Iterator[GuardedStdout]:
    """``sys.stdout`` is a :class:`GuardedStdout` while the block runs (the stream it was
    is put back after, as a command may have replaced it meanwhile)."""
    before = sys.stdout
    guard = GuardedStdout(before)
    sys.stdout = guard
    try:
        yield guard
    finally:
        if sys.stdout is guard:
            sys.stdout = before


def silence(stream) -> None:
    """Point ``stream``'s file descriptor at ``/dev/null`` (nothing if it has none), so that
    what is still buffered for it, flushed at exit, goes nowhere instead of failing again
    (Python's own recipe for a closed pipe)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
