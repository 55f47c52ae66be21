"""What the process does to a :class:`hooks.recorder.run.Run`: signals, and ``os.fork()``.

* SIGINT, SIGTERM and SIGHUP mark the run ``interrupted`` (see :mod:`hooks.recorder.run`): the
  handlers installed here note the signal and call the one that was there before. They are
  installed before the run is created: a signal that comes while the run is being opened (its
  row may already be in the store, its writer not started yet) is held until the run is open
  and then acts as it would have (:meth:`RunProcess._opened`), so a run never stays
  ``running`` because its process was stopped while it started (a ``torchrun`` job stopped
  while its ranks start). If opening fails, the held signal goes to the handlers that were
  there before.
* A process forked after ``hooks.run`` was opened (``os.fork()``, a ``multiprocessing``
  worker started by fork) inherits the run but not its writer thread, and SQLite connections
  must not cross a fork: the child's :meth:`~hooks.recorder.run.Run.log` calls are not recorded.
  The first one says so on the child's stderr, once per run; the parent's run is untouched
  (the child never writes the database, its exit does not finish the run).

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import weakref
from typing import Any

__all__ = ["RunProcess"]

_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
#: The runs this process records (their writer thread is in this process).
_OPEN: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for run in list(_OPEN):
        run._forked()
    _OPEN.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class RunProcess:
    """Signals and fork for :class:`hooks.recorder.run.Run` (a mixin: it uses the run's
    ``_prev_handlers``, ``_done``, ``_finishing``, ``_signal``, ``_thread``, ``_poller``,
    ``finish``, ``_say`` and ``_title``)."""

    _forked_from: int | None = None  # in a forked child: the parent's pid
    _said_forked = False
    _opening = False  # the run is being opened: a signal is held (_pending) until it is open
    _pending: int | None = None  # the first signal that came while the run was being opened

    def _track_fork(self) -> None:
        """Called by the process that records the run (its writer thread is here)."""
        _OPEN.add(self)

    def _forked(self) -> None:
        """In the child of a fork: nothing of the parent's writer is here; never write."""
        self._forked_from = os.getppid()
        self._thread = None  # log() no longer queues anything: the child's steps are dropped
        self._poller = None

    def _dropped_in_child(self) -> None:
        """A forked child's log(): say once that it is not recorded."""
        if self._forked_from is None or self._said_forked:
            return
        self._said_forked = True
        self._say(f"warning: {self._title}: run.log() in a forked child process (pid "
                  f"{os.getpid()}, forked from {self._forked_from}) is not recorded: only the "
                  "process that opened hooks.run writes the run (log from the parent, or open "
                  "a hooks.run of the child's own)")

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in _SIGNALS:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            prev = signal.getsignal(sig)
            if prev is signal.SIG_IGN:
                continue  # ignored (nohup): stays ignored
            try:
                signal.signal(sig, self._on_signal)
            except (ValueError, OSError):
                continue
            self._prev_handlers[sig] = prev

    def _restore_signals(self) -> None:
        for sig, prev in self._prev_handlers.items():
            with contextlib.suppress(ValueError, TypeError, OSError):
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)

    def _opened(self) -> None:
        """The run is open (its writer, poller and link started): a signal held while it was
        being opened acts now."""
        self._opening = False  # first: a signal from here on acts at once, none is lost
        held, self._pending = self._pending, None
        if held is not None:
            self._on_signal(held, None)

    def _open_failed(self) -> None:
        """Opening the run raised: the handlers that were there before are back, and a signal
        held meanwhile goes to them."""
        self._restore_signals()
        self._opening = False
        held, self._pending = self._pending, None
        if held is not None:
            signal.raise_signal(held)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Runs in the main thread between two bytecodes of the loop: it takes no lock the
        # loop may hold (log() only appends to a deque).
        if self._opening:  # the run is not open yet: finish() cannot save it; see _opened
            if self._pending is None:
                self._pending = signum
            return
        prev = self._prev_handlers.get(signum)
        if not self._done:
            if self._finishing:
                return  # the final commit is under way: a second Ctrl-C must not abandon it
            if self._signal is None:
                self._signal = signal.Signals(signum).name
        # (a finished run's handler still reached through a later run's chain passes it on)
        if callable(prev):
            prev(signum, frame)
            return
        # the default action (terminate): save the run, then terminate by the same signal
        if not self._done:
            self.finish("interrupted", reason=signal.Signals(signum).name)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
