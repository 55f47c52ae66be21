"""What a command asks of its process: a terminal (:func:`require_terminal`), stdout kept
for its own output (:func:`stdout_to_stderr`), and the end of a run's signal handling
(:func:`release_stop_signals`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from tui.errors import MdbError


def is_terminal(stream) -> bool:
    """Whether ``stream`` (``sys.stdin``, ``sys.stdout``, ``sys.stderr``…) is a terminal;
    False when it is None (closed at start: ``mdb step <&-``, ``2>&-``), closed since, or
    not a file."""
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, OSError, ValueError):
        return False


#: Set (to ``1``) in the environment of a command that ``mdb serve`` runs for a browser tab
#: (:mod:`tui.serve.server`): it draws through Textual's web driver, on no terminal.
SERVED_ENV = "MDB_SERVED"


def has_screen() -> bool:
    """Whether a command can open its Textual screen: stdin and stdout are a terminal, or the
    command runs for a browser tab of ``mdb serve`` (:data:`SERVED_ENV`)."""
    if os.environ.get(SERVED_ENV) == "1":
        return True
    return is_terminal(sys.stdin) and is_terminal(sys.stdout)


def require_terminal(command: str, instead: str) -> None:
    """Raise :class:`MdbError` unless stdin and stdout are a terminal (a Textual app needs one;
    without it the app would draw into a pipe and wait for keys that never come). stderr may
    be redirected (``2>FILE``): the app then draws on stdout's terminal (:mod:`tui.driver`).

    Args:
        command: the command, e.g. ``"mdb step"``.
        instead: what to run without a terminal, e.g. ``"mdb summary"``.
    """
    if not has_screen():
        raise MdbError(f"{command} needs a terminal (without one, use {instead})")


@contextlib.contextmanager
def stdout_to_stderr():
    """Send whatever is written to stdout to stderr while the block runs: ``sys.stdout``
    (``print``) and file descriptor 1 itself (``os.write(1, …)``, a C extension's ``printf``,
    a child process), so that stdout carries only what mdb writes there afterwards (the
    table, the JSON document). Both are restored on exit, also when the block raises."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 (closed): only sys.stdout can be redirected
        saved = None
    try:
        if saved is not None:
            os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            _flush_c_stdio()  # what C code buffered for descriptor 1 belongs to stderr too
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 1)
            os.close(saved)


def _flush_c_stdio() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)


def release_stop_signals(control, restore) -> None:
    """End a run's signal handling (``restore`` from
    :func:`hooks.train.trainer.install_stop_signals`): the previous handlers come back, unless a
    signal stopped the run. The process then exits with 128 + n right away, and a signal
    repeated meanwhile is ignored, so that no ``KeyboardInterrupt`` reaches an atexit handler
    (a traceback on stderr)."""
    if control.stop_reason in ("SIGINT", "SIGTERM", "SIGHUP"):
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is not None:
                signal.signal(sig, signal.SIG_IGN)
    else:
        restore()
