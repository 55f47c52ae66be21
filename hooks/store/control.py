"""Requests to a running run, through the run store: stop, pause, resume.

``mdb stop``, the ``p``/``x`` keys of ``mdb watch`` and of the live screen, from any terminal on
the machine, write a row into the ``control`` table of the run's database; the process that
trains the run reads that table (:class:`ControlPoller`, a thread that polls every
:data:`POLL_INTERVAL` seconds with a connection of its own) and acts on each request once,
marking it done. No port, no socket: it works for viewers that come and go, and for a run
started live, detached or headless (``mdb overfit``) or by a user's own loop (``hooks.run``).

Table (created on first use, so databases written before it keep working)::

    control(id INTEGER PRIMARY KEY, run_id INTEGER, command TEXT, requested REAL, done REAL,
            seen REAL)

``done``: when the training process received the request. ``seen`` (added to a table that
lacks it): when it acted on it — ``mdb overfit``'s trainer at once; a ``hooks.run`` loop when
it read ``run.should_stop`` after the stop arrived (:func:`progress`). ``mdb stop`` tells by it a
loop that never checks ``run.should_stop`` from one that is busy in a long step.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hooks.store.sqlite_open import decode_text
from hooks.text import printable

__all__ = ["COMMANDS", "POLL_INTERVAL", "ControlPoller", "RunControls", "pending", "progress",
           "request"]

#: What a request may ask.
COMMANDS = ("stop", "pause", "resume")
#: Seconds between two reads of the ``control`` table by the training process.
POLL_INTERVAL = 0.25
_BUSY_MS = 10_000
_SCHEMA = ("CREATE TABLE IF NOT EXISTS control (id INTEGER PRIMARY KEY, run_id INTEGER NOT "
           "NULL, command TEXT NOT NULL, requested REAL NOT NULL, done REAL, seen REAL)")


def _ensure_table(conn: sqlite3.Connection) -> None:
    """The ``control`` table, with its ``seen`` column (added to a table made before it)."""
    conn.execute(_SCHEMA)
    if "seen" not in {r[1] for r in conn.execute("PRAGMA table_info(control)")}:
        with contextlib.suppress(sqlite3.OperationalError):  # another process added it
            conn.execute("ALTER TABLE control ADD COLUMN seen REAL")


def _connect(path: str | Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=_BUSY_MS / 1000, isolation_level=None,
                           check_same_thread=False)
    conn.text_factory = decode_text  # a command written elsewhere may hold any bytes
    conn.execute(f"PRAGMA busy_timeout = {_BUSY_MS}")
    return conn


def request(path: str | Path, run_id: int, command: str) -> int:
    """Ask run ``run_id`` of the database at ``path`` to ``command``.

    Args:
        path: The run database.
        run_id: :attr:`hooks.store.store.RunInfo.id`.
        command: One of :data:`COMMANDS`.

    Returns:
        The request's id.

    Raises:
        ValueError: An unknown command.
        sqlite3.Error: The database cannot be written (read-only, locked past the busy
            timeout).
    """
    if command not in COMMANDS:
        raise ValueError(f"unknown control command {command!r}: one of {', '.join(COMMANDS)}")
    conn = _connect(path)
    try:
        _ensure_table(conn)
        cur = conn.execute("INSERT INTO control (run_id, command, requested) VALUES (?, ?, ?)",
                           (int(run_id), command, time.time()))
        return int(cur.lastrowid)
    finally:
        conn.close()


def pending(path: str | Path, run_id: int) -> list[str]:
    """The requests to run ``run_id`` not yet acted on, oldest first (``[]`` when the database
    has no ``control`` table)."""
    conn = _connect(path)
    try:
        return [row[0] for row in conn.execute(
            "SELECT command FROM control WHERE run_id = ? AND done IS NULL ORDER BY id",
            (int(run_id),))]
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []
        raise
    finally:
        conn.close()


def progress(path: str | Path, request_id: int) -> str:
    """How far request ``request_id`` got: ``"pending"`` (not received yet), ``"received"``
    (the training process has it: ``done``) or ``"seen"`` (it acted on it, see the ``seen``
    column above; never for a table without the column, made by an older mdb)."""
    conn = _connect(path)
    try:
        row = conn.execute("SELECT done, seen FROM control WHERE id = ?",
                           (int(request_id),)).fetchone()
    except sqlite3.OperationalError as exc:
        if "no such" not in str(exc):
            raise
        row = conn.execute("SELECT done, NULL FROM control WHERE id = ?",
                           (int(request_id),)).fetchone()
    finally:
        conn.close()
    if row is None or row[0] is None:
        return "pending"
    return "seen" if row[1] is not None else "received"


class ControlPoller:
    """The training side: a daemon thread that reads run ``run_id``'s requests every
    ``interval`` seconds and hands each to ``on_request`` once (in the poller's thread), then
    marks it done. Requests written before the poller started are acted on too (a stop sent
    while the model was being built).

    Args:
        path: The run database.
        run_id: The run being trained.
        on_request: Called with ``"stop"``, ``"pause"`` or ``"resume"``.
        interval: Seconds between reads.
        since: Requests written before this Unix time are marked done unread: they were for
            an earlier attempt of the run (a ``stop`` that arrived as it ended must not stop
            its resume).
        acknowledged: For a ``stop`` handed to a loop that decides itself when to stop
            (``hooks.run``): whether it has acted on it (read ``run.should_stop``); the
            request is marked ``seen`` once it returns true. ``None``: at once.
    """

    def __init__(self, path: str | Path, run_id: int, on_request: Callable[[str], None],
                 interval: float = POLL_INTERVAL, since: float | None = None,
                 acknowledged: Callable[[], bool] | None = None) -> None:
        self.path, self.run_id = Path(path), int(run_id)
        self.since = since
        self.acknowledged = acknowledged
        self._unseen: list[int] = []  # stop requests handed over, not yet acted on
        self.on_request = on_request
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"mdb-control-{run_id}",
                                        daemon=True)

    def start(self) -> ControlPoller:
        """Start polling; returns self."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop polling (waits for the thread, at most one interval and one read)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.interval + 15)

    def _main(self) -> None:
        conn = None
        while not self._stop.is_set():
            try:
                conn = conn or _connect(self.path)
                self._poll(conn)
            except sqlite3.Error:  # locked for longer than the busy timeout: next time
                with contextlib.suppress(Exception):
                    conn.close()
                conn = None
            self._stop.wait(self.interval)
        if conn is not None:
            with contextlib.suppress(Exception):  # a stop the loop read at its last step
                if self._unseen and self.acknowledged is not None and self.acknowledged():
                    self._mark_seen(conn, self._unseen)
                conn.close()

    def _poll(self, conn: sqlite3.Connection) -> None:
        if self._unseen and self.acknowledged is not None and self.acknowledged():
            self._mark_seen(conn, self._unseen)
            self._unseen = []
        try:
            rows = conn.execute(
                "SELECT id, command, requested FROM control WHERE run_id = ? AND done IS NULL "
                "ORDER BY id", (self.run_id,)).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return
            raise
        for rid, command, requested in rows:
            conn.execute("UPDATE control SET done = ? WHERE id = ?", (time.time(), rid))
            stale = self.since is not None and requested < self.since
            if command in COMMANDS and not stale:
                with contextlib.suppress(Exception):  # the trainer's side must not die
                    self.on_request(command)
                if command == "stop" and self.acknowledged is not None:
                    self._unseen.append(rid)
                elif command == "stop":
                    self._mark_seen(conn, [rid])

    @staticmethod
    def _mark_seen(conn: sqlite3.Connection, ids: list[int]) -> None:
        with contextlib.suppress(sqlite3.OperationalError):  # a table of an older mdb
            if "seen" not in {r[1] for r in conn.execute("PRAGMA table_info(control)")}:
                conn.execute("ALTER TABLE control ADD COLUMN seen REAL")
            conn.executemany("UPDATE control SET seen = ? WHERE id = ?",
                             [(time.time(), i) for i in ids])


class RunControls:
    """What :class:`hooks.recorder.run.Run` does with a request: ``stop`` sets
    :attr:`should_stop`; ``pause`` makes ``log()`` wait until ``resume`` (or ``stop``).

    Uses the run's ``_stop_asked`` and ``_stop_seen`` (bools), ``_resumed`` (a set
    ``threading.Event``),
    ``_enqueue``, ``_wake``, ``_closed``, ``_dead``, ``name``, ``rank`` and ``step``.
    """

    def _say(self, line: str) -> None:
        print(f"mdb: {printable(line)}", file=sys.stderr, flush=True)  # names, exceptions

    @property
    def _title(self) -> str:
        """``run NAME``; on a rank other than 0 before rank 0 has told the run's name,
        ``rank R's run``."""
        return f"run {self.name}" if self.name is not None else f"rank {self.rank}'s run"

    @property
    def should_stop(self) -> bool:
        """Whether ``mdb stop`` (or ``x`` in ``mdb watch``) asked this run to stop: end your
        loop (``if run.should_stop: break``) and the run is marked ``interrupted (stopped)``;
        ``mdb stop`` returns once it is. (Reading it after a stop tells ``mdb stop`` that the
        loop checks it; a loop that never reads it runs to its end and is ``finished``.)
        Also true once the run's database was deleted (nothing more is recorded)."""
        if self._stop_asked:
            self._stop_seen = True
        return self._stop_asked

    @property
    def paused(self) -> bool:
        """Whether ``p`` in ``mdb watch`` paused this run: :meth:`log` then waits until it is
        resumed (or asked to stop) before it returns."""
        return not self._resumed.is_set()

    def _on_request(self, command: str) -> None:
        """The control poller's thread: a request from ``mdb stop`` or a viewer."""
        if command == "stop":
            self._stop_asked = True
            self._resumed.set()  # a paused loop wakes to see it
        elif command == "pause" and self._resumed.is_set() and not self._stop_asked:
            self._resumed.clear()  # the loop marks the run paused when it starts to wait
        elif command == "resume" and not self._resumed.is_set():
            self._resumed.set()

    def _wait_while_paused(self) -> None:
        # recorded after this step's row (the writer keeps the queue's order): a viewer that
        # reads "paused" has every step the loop made
        self._enqueue(("paused", True))
        self._wake.set()
        self._say(f"run {self.name}: paused from a viewer after step {self.step} (p resumes, "
                  f"mdb stop {self.name} stops)")
        while not self._resumed.wait(0.5):
            if self._closed or self._dead:
                break
        self._enqueue(("paused", False))
        if not self._stop_asked:
            self._say(f"run {self.name}: resumed")

