"""The run store: every training run, its per-step metrics and captured internals, in SQLite.

One database file (by default ``./runs/mdb.sqlite``, see :func:`default_db_path`) holds any
number of runs. One process writes a run (:class:`RunWriter`), any number of processes read it
(:class:`RunStore`), concurrently, without ever blocking each other:

* the database is in WAL mode (``PRAGMA journal_mode=WAL``): readers see the last committed
  snapshot and never wait for the writer, the writer never waits for readers;
* every step is written in one short transaction (its metrics row, its internals and sample if
  any, and the run row's ``last_step`` / ``last_loss`` / ``heartbeat``), so a reader sees a step
  completely or not at all;
* ``synchronous=NORMAL``: a commit does not fsync; a crash of the *process* (``kill -9``) loses
  nothing that was committed, a power cut may lose the last few steps but never corrupts the file
  (SQLite's WAL guarantees);
* every connection sets ``busy_timeout``, so the short moments where two writers overlap (the
  heartbeat thread, a resumed run, a WAL checkpoint) wait instead of failing with
  ``database is locked``.

The writer's liveness is recorded as ``pid``, ``host`` and a ``heartbeat`` timestamp refreshed by
a background thread (:meth:`RunWriter.start_heartbeat`), so a reader can tell a run that is
still being written from one whose writer died without saying so (``kill -9``, a power cut):
see :meth:`RunInfo.writer_state`.

Schema (version :data:`SCHEMA_VERSION`; ``meta`` identifies the file as an mdb run store, and
``PRAGMA application_id`` is :data:`APPLICATION_ID`)::

    meta(key TEXT PRIMARY KEY, value TEXT)
    runs(id, name UNIQUE, kind, config JSON, status, pid, host, started, ended, heartbeat,
         total_steps, last_step, last_loss, paused, reason, fail_step, fail_module,
         checkpoint_step, checkpoint_path, attempt)
    metrics(run_id, step, wall, ce, aux, total, grad_norm, lr, step_time, tokens_per_s,
            steps_per_s, expert_load JSON (L, E))            PRIMARY KEY (run_id, step)
    internals(run_id, step, captured, data JSON, tensors BLOB) PRIMARY KEY (run_id, step)
    samples(run_id, step, prompt, text)                      PRIMARY KEY (run_id, step)

Times are Unix seconds (``time.time()``). SQLite stores a NaN ``REAL`` as ``NULL``: a metric
read back as ``None`` was NaN (or was not measured); infinities round-trip.

This module uses only the standard library; it never imports torch, textual or rich.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "APPLICATION_ID",
    "DEFAULT_DB_ENV",
    "DEFAULT_DB_PATH",
    "DEFAULT_STALE_AFTER",
    "SCHEMA_VERSION",
    "STATUSES",
    "MetricRow",
    "RunExistsError",
    "RunInfo",
    "RunNotFoundError",
    "RunStore",
    "RunStoreError",
    "RunUpdate",
    "RunWriter",
    "SampleRow",
    "WriterBusyError",
    "checkpoint_dir",
    "default_db_path",
    "pid_alive",
    "validate_run_name",
]

#: Version of the schema below; bumped on any incompatible change.
SCHEMA_VERSION = 1
#: ``PRAGMA application_id`` of an mdb run store: the bytes ``b"mdbR"`` as a big-endian int.
APPLICATION_ID = int.from_bytes(b"mdbR", "big")
#: Value of ``meta.format`` in an mdb run store.
FORMAT_NAME = "mdb-runstore"
#: Environment variable overriding the default database path.
DEFAULT_DB_ENV = "MDB_DB"
#: Default database path, relative to the current directory.
DEFAULT_DB_PATH = Path("runs") / "mdb.sqlite"
#: A running run whose heartbeat is older than this many seconds is reported "gone".
DEFAULT_STALE_AFTER = 15.0
#: Run statuses as stored in ``runs.status``.
STATUSES = ("running", "finished", "interrupted", "failed")
#: Busy timeout of every connection, in milliseconds.
BUSY_TIMEOUT_MS = 10_000

_RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    name            TEXT NOT NULL UNIQUE,
    kind            TEXT NOT NULL DEFAULT 'overfit',
    config          TEXT NOT NULL,
    status          TEXT NOT NULL
                    CHECK (status IN ('running', 'finished', 'interrupted', 'failed')),
    pid             INTEGER,
    host            TEXT,
    started         REAL NOT NULL,
    ended           REAL,
    heartbeat       REAL,
    total_steps     INTEGER,
    last_step       INTEGER NOT NULL DEFAULT 0,
    last_loss       REAL,
    paused          INTEGER NOT NULL DEFAULT 0,
    reason          TEXT,
    fail_step       INTEGER,
    fail_module     TEXT,
    checkpoint_step INTEGER,
    checkpoint_path TEXT,
    attempt         INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS metrics (
    run_id       INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step         INTEGER NOT NULL,
    wall         REAL NOT NULL,
    ce           REAL,
    aux          REAL,
    total        REAL,
    grad_norm    REAL,
    lr           REAL,
    step_time    REAL,
    tokens_per_s REAL,
    steps_per_s  REAL,
    expert_load  TEXT,
    PRIMARY KEY (run_id, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS internals (
    run_id   INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step     INTEGER NOT NULL,
    captured REAL NOT NULL,
    data     TEXT NOT NULL,
    tensors  BLOB,
    PRIMARY KEY (run_id, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS samples (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step   INTEGER NOT NULL,
    prompt TEXT NOT NULL,
    text   TEXT NOT NULL,
    PRIMARY KEY (run_id, step)
) WITHOUT ROWID;
"""

_METRIC_COLUMNS = (
    "step",
    "wall",
    "ce",
    "aux",
    "total",
    "grad_norm",
    "lr",
    "step_time",
    "tokens_per_s",
    "steps_per_s",
    "expert_load",
)


class RunStoreError(Exception):
    """The database is missing, unreadable, not an mdb run store, or was used wrongly.

    The message is one line meant for the user (the CLI prints it as ``mdb: error: ...``).
    """


class RunNotFoundError(RunStoreError):
    """No run with the requested name (or id) exists in the database."""


class RunExistsError(RunStoreError):
    """A new run was requested under a name that is already taken."""


class WriterBusyError(RunStoreError):
    """A run cannot be resumed because its writer is still alive."""


def default_db_path(environ: Mapping[str, str] | None = None) -> Path:
    """Return the database path to use when none is given.

    Args:
        environ: Environment to read (defaults to ``os.environ``).

    Returns:
        ``$MDB_DB`` when set and non-empty, else ``./runs/mdb.sqlite`` (relative to the current
        directory).
    """
    env = os.environ if environ is None else environ
    value = env.get(DEFAULT_DB_ENV, "").strip()
    return Path(value) if value else DEFAULT_DB_PATH


def checkpoint_dir(db_path: str | os.PathLike[str], run_name: str) -> Path:
    """Directory holding a run's checkpoint files, beside the database.

    For ``runs/mdb.sqlite`` and run ``r1`` this is ``runs/mdb-checkpoints/r1``.
    """
    db = Path(db_path)
    return db.with_name(f"{db.stem}-checkpoints") / run_name


def validate_run_name(name: str) -> str:
    """Return ``name`` if it is a valid run name, else raise :class:`RunStoreError`.

    A run name is 1-100 characters from ``A-Z a-z 0-9 . _ -`` starting with a letter or digit
    (it names a checkpoint directory, so no slashes or spaces).
    """
    if not isinstance(name, str) or not _RUN_NAME_RE.match(name):
        raise RunStoreError(
            f"invalid run name {name!r}: use 1-100 characters from A-Z a-z 0-9 . _ - "
            "starting with a letter or digit"
        )
    return name


def pid_alive(pid: int | None) -> bool:
    """Whether a process with this id exists on this machine (signal 0 probe).

    A zombie (exited, not yet reaped by its parent) still counts as alive; a process owned by
    another user counts as alive (``EPERM``).
    """
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _finite_or_none(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) else x


@dataclass(frozen=True)
class RunInfo:
    """One row of ``runs``: a run's identity, configuration and writer status.

    Attributes:
        id: Integer primary key, stable for the life of the database.
        name: Unique run name.
        kind: What wrote it (``"overfit"``).
        config: The run's configuration (model config and training options), as a dict.
        status: Stored status: ``running``, ``finished``, ``interrupted`` or ``failed``.
            ``running`` only says the writer has not said otherwise; see :meth:`writer_state`.
        pid: Process id of the (last) writer.
        host: Host name of the (last) writer.
        started: When the run was created (Unix seconds).
        ended: When the writer set a final status, else ``None``.
        heartbeat: Last sign of life of the writer (Unix seconds).
        total_steps: Number of steps the run was asked to do.
        last_step: Last step written (0 before the first).
        last_loss: Total loss of ``last_step`` (``None`` before the first, or NaN).
        paused: Whether the writer is paused (live screen).
        reason: Why the run ended (``"finished"``, ``"SIGTERM"``, ``"non-finite loss"`` ...).
        fail_step: Step at which a non-finite value appeared (failed runs).
        fail_module: Qualified name of the module whose output was first non-finite, or
            ``None`` when it could not be located.
        checkpoint_step: Step of the last checkpoint, ``None`` if none was written.
        checkpoint_path: Directory of the last checkpoint, relative to the database's directory.
        attempt: 1 for a fresh run, incremented by every resume.
    """

    id: int
    name: str
    kind: str
    config: dict[str, Any]
    status: str
    pid: int | None
    host: str | None
    started: float
    ended: float | None
    heartbeat: float | None
    total_steps: int | None
    last_step: int
    last_loss: float | None
    paused: bool
    reason: str | None
    fail_step: int | None
    fail_module: str | None
    checkpoint_step: int | None
    checkpoint_path: str | None
    attempt: int

    def writer_state(
        self, now: float | None = None, stale_after: float = DEFAULT_STALE_AFTER
    ) -> str:
        """The run's status as a reader should show it.

        Args:
            now: Current Unix time (defaults to ``time.time()``).
            stale_after: Seconds without heartbeat after which a running writer counts as gone.

        Returns:
            ``finished``, ``interrupted`` or ``failed`` as stored; for a ``running`` run,
            ``running`` while the writer looks alive, else ``gone`` — its pid does not exist
            (checked only when the writer ran on this host) or its heartbeat is older than
            ``stale_after`` seconds.
        """
        if self.status != "running":
            return self.status
        return "running" if self.writer_alive(now, stale_after) else "gone"

    def writer_alive(
        self, now: float | None = None, stale_after: float = DEFAULT_STALE_AFTER
    ) -> bool:
        """Whether the writer of a ``running`` run still looks alive (see :meth:`writer_state`)."""
        if self.status != "running":
            return False
        now = time.time() if now is None else now
        if self.host == socket.gethostname() and not pid_alive(self.pid):
            return False
        beat = self.heartbeat if self.heartbeat is not None else self.started
        return now - beat <= stale_after

    def gone_reason(
        self, now: float | None = None, stale_after: float = DEFAULT_STALE_AFTER
    ) -> str:
        """One line saying why the writer counts as gone, or ``""`` if it does not."""
        if self.writer_state(now, stale_after) != "gone":
            return ""
        now = time.time() if now is None else now
        if self.host == socket.gethostname() and not pid_alive(self.pid):
            return f"writer gone: process {self.pid} on {self.host} no longer exists"
        beat = self.heartbeat if self.heartbeat is not None else self.started
        return (
            f"writer gone: no heartbeat from pid {self.pid} on {self.host} for "
            f"{now - beat:.0f} s"
        )

    def status_line(self, now: float | None = None) -> str:
        """The status as ``mdb runs`` and the live screen show it: ``running``, ``paused``,
        ``finished``, ``interrupted (SIGTERM)``, ``failed @ step 7 in model.layers.1.mlp``,
        ``gone: ...``."""
        state = self.writer_state(now)
        if state == "running":
            return "paused" if self.paused else "running"
        if state == "gone":
            return "gone: " + self.gone_reason(now).removeprefix("writer gone: ")
        if state == "interrupted":
            return f"interrupted ({self.reason})" if self.reason else "interrupted"
        if state == "failed":
            where = f" in {self.fail_module}" if self.fail_module else ""
            step = f" @ step {self.fail_step}" if self.fail_step is not None else ""
            return f"failed{step}{where}" if (step or where) else f"failed ({self.reason})"
        return state

    def to_dict(self) -> dict[str, Any]:
        """The run as a JSON-serialisable dict."""
        return asdict(self)


@dataclass(frozen=True)
class MetricRow:
    """One training step's metrics (a row of ``metrics``).

    Attributes:
        step: 1-based step number.
        wall: When the step was written (Unix seconds).
        ce: Cross-entropy of the step's forward pass, in nats per token (``None`` = NaN).
        aux: Auxiliary (load-balancing) loss as added to the total (0 for dense models).
        total: ``ce + aux``, the loss that was back-propagated.
        grad_norm: Global L2 norm of all gradients before clipping.
        lr: Learning rate used for the update.
        step_time: Wall time of the step (forward, backward, update), seconds.
        tokens_per_s: Tokens trained on per second in this step.
        steps_per_s: ``1 / step_time``.
        expert_load: Per MoE layer, per expert, fraction of the routed slots (N*k) it received,
            shape (L_moe, E); rows sum to 1. ``None`` for dense models.
    """

    step: int
    wall: float
    ce: float | None = None
    aux: float | None = None
    total: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    step_time: float | None = None
    tokens_per_s: float | None = None
    steps_per_s: float | None = None
    expert_load: list[list[float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The row as a JSON-serialisable dict."""
        return asdict(self)


@dataclass(frozen=True)
class SampleRow:
    """A greedy continuation generated during training (a row of ``samples``)."""

    step: int
    prompt: str
    text: str


@dataclass(frozen=True)
class RunUpdate:
    """Everything new about a run since a reader's cursor, read in one snapshot.

    Attributes:
        run: The run row at the time of the snapshot.
        metrics: Steps with ``step > after_step``, in step order.
        samples: Samples with ``step > after_step``, in step order.
        internals_steps: Steps with captured internals and ``step > after_step``.
        restarted: True when the run was resumed from an earlier checkpoint than the reader's
            cursor (``run.last_step < after_step``): the reader should drop what it has after
            ``run.checkpoint_step`` and read again from there.
    """

    run: RunInfo
    metrics: list[MetricRow] = field(default_factory=list)
    samples: list[SampleRow] = field(default_factory=list)
    internals_steps: list[int] = field(default_factory=list)
    restarted: bool = False

    @property
    def last_step(self) -> int:
        """The cursor to pass as ``after_step`` next time."""
        return self.metrics[-1].step if self.metrics else self.run.last_step


def _run_from_row(row: sqlite3.Row) -> RunInfo:
    try:
        config = json.loads(row["config"]) if row["config"] else {}
    except json.JSONDecodeError:
        config = {}
    return RunInfo(
        id=row["id"],
        name=row["name"],
        kind=row["kind"],
        config=config,
        status=row["status"],
        pid=row["pid"],
        host=row["host"],
        started=row["started"],
        ended=row["ended"],
        heartbeat=row["heartbeat"],
        total_steps=row["total_steps"],
        last_step=row["last_step"],
        last_loss=row["last_loss"],
        paused=bool(row["paused"]),
        reason=row["reason"],
        fail_step=row["fail_step"],
        fail_module=row["fail_module"],
        checkpoint_step=row["checkpoint_step"],
        checkpoint_path=row["checkpoint_path"],
        attempt=row["attempt"],
    )


def _metric_from_row(row: sqlite3.Row) -> MetricRow:
    load = row["expert_load"]
    return MetricRow(
        step=row["step"],
        wall=row["wall"],
        ce=row["ce"],
        aux=row["aux"],
        total=row["total"],
        grad_norm=row["grad_norm"],
        lr=row["lr"],
        step_time=row["step_time"],
        tokens_per_s=row["tokens_per_s"],
        steps_per_s=row["steps_per_s"],
        expert_load=json.loads(load) if load else None,
    )


def _connect(path: Path, *, create: bool) -> sqlite3.Connection:
    """Open ``path`` in autocommit mode with the store's pragmas; never creates unless asked."""
    if create:
        if path.is_dir():
            raise RunStoreError(f"{path} is a directory, not a run database")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunStoreError(
                f"cannot create the run database {path}: {exc.strerror or exc}"
            ) from exc
        uri = f"file:{_uri_path(path)}?mode=rwc"
    else:
        if not path.exists():
            raise RunStoreError(
                f"no run database at {path} (start a run with `mdb overfit`, or pass --db / "
                f"set {DEFAULT_DB_ENV})"
            )
        if path.is_dir():
            raise RunStoreError(f"{path} is a directory, not a run database")
        if not os.access(path, os.R_OK):
            raise RunStoreError(f"cannot read the run database {path}: permission denied")
        mode = "rw" if os.access(path, os.W_OK) else "ro"
        uri = f"file:{_uri_path(path)}?mode={mode}"
    try:
        conn = sqlite3.connect(
            uri,
            uri=True,
            timeout=BUSY_TIMEOUT_MS / 1000,
            isolation_level=None,
            check_same_thread=False,
        )
    except sqlite3.Error as exc:
        raise RunStoreError(f"cannot open the run database {path}: {exc}") from exc
    conn.row_factory = sqlite3.Row
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA foreign_keys = ON")
        # WAL + NORMAL: a commit appends to the WAL without fsync (fsync at checkpoints only).
        conn.execute("PRAGMA synchronous = NORMAL")
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise RunStoreError(f"{path} is not an mdb run database ({exc})") from exc
    return conn


def _uri_path(path: Path) -> str:
    # Percent-encode the characters that are special in an SQLite URI.
    s = str(path.resolve())
    return s.replace("%", "%25").replace("?", "%3f").replace("#", "%23")


class RunStore:
    """A connection to an mdb run database: reads runs, creates and resumes writers.

    Reading never blocks a writer and never sees a half-written step. Open one ``RunStore`` per
    thread (the connection is not shared between threads by design, although SQLite would
    allow it).

    Args:
        path: The database file. Defaults to :func:`default_db_path`.
        create: Create the file (and its directory) and the schema if missing — for writers.
            Readers leave it ``False``: a missing file raises :class:`RunStoreError`.

    Raises:
        RunStoreError: The file is missing (``create=False``), unreadable, not an SQLite
            database, an SQLite database of something else, or of a newer schema version.

    Example::

        with RunStore("runs/mdb.sqlite") as store:
            run = store.latest_run()
            rows = store.metrics(run.id, after_step=0)
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, create: bool = False):
        self.path = Path(path) if path is not None else default_db_path()
        self._conn = _connect(self.path, create=create)
        try:
            self._check_or_init(create)
        except sqlite3.Error as exc:
            self._conn.close()
            raise RunStoreError(f"cannot use the run database {self.path}: {exc}") from exc
        except BaseException:
            self._conn.close()
            raise

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (idempotent)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None  # type: ignore[assignment]

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def connection(self) -> sqlite3.Connection:
        """The underlying autocommit connection (for diagnostics and tests)."""
        if self._conn is None:
            raise RunStoreError(f"the run database {self.path} is closed")
        return self._conn

    def _check_or_init(self, create: bool) -> None:
        conn = self.connection
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            tables = {
                r[0]
                for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
        except sqlite3.DatabaseError as exc:
            raise RunStoreError(f"{self.path} is not an mdb run database ({exc})") from exc
        if not tables and app_id == 0:
            if not create:
                raise RunStoreError(f"{self.path} is an empty database with no runs in it")
            self._init_schema()
            return
        if app_id != APPLICATION_ID or "meta" not in tables:
            raise RunStoreError(
                f"{self.path} is an SQLite database of something else, not an mdb run database"
            )
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("format") != FORMAT_NAME:
            raise RunStoreError(
                f"{self.path} is an SQLite database of something else, not an mdb run database"
            )
        version = int(meta.get("schema_version", "0"))
        if version > SCHEMA_VERSION:
            raise RunStoreError(
                f"{self.path} was written by a newer mdb (schema {version}, this mdb reads "
                f"up to {SCHEMA_VERSION})"
            )
        if version < SCHEMA_VERSION:
            raise RunStoreError(
                f"{self.path} has an old schema version {version}; start a new database"
            )

    def _init_schema(self) -> None:
        conn = self.connection
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise RunStoreError(f"cannot put {self.path} in WAL mode (got {mode!r})")
        with self._transaction():
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.executemany(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                [
                    ("format", FORMAT_NAME),
                    ("schema_version", str(SCHEMA_VERSION)),
                    ("created", str(time.time())),
                ],
            )

    class _Txn:
        def __init__(self, conn: sqlite3.Connection, immediate: bool):
            self.conn = conn
            self.immediate = immediate

        def __enter__(self) -> sqlite3.Connection:
            self.conn.execute("BEGIN IMMEDIATE" if self.immediate else "BEGIN")
            return self.conn

        def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
            if exc_type is None:
                self.conn.execute("COMMIT")
            else:
                try:
                    self.conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass

    def _transaction(self, immediate: bool = True) -> RunStore._Txn:
        """A transaction: ``BEGIN IMMEDIATE`` for writes (takes the write lock up front, so
        the busy timeout applies at BEGIN rather than failing at COMMIT), ``BEGIN`` for a
        consistent multi-statement read."""
        return RunStore._Txn(self.connection, immediate)

    # -- reading ---------------------------------------------------------------------------

    def runs(self) -> list[RunInfo]:
        """All runs, oldest first."""
        rows = self.connection.execute("SELECT * FROM runs ORDER BY started, id").fetchall()
        return [_run_from_row(r) for r in rows]

    def run(self, name_or_id: str | int) -> RunInfo:
        """One run by name (``str``) or id (``int``).

        Raises:
            RunNotFoundError: No such run; the message lists up to five existing names.
        """
        if isinstance(name_or_id, int):
            row = self.connection.execute(
                "SELECT * FROM runs WHERE id = ?", (name_or_id,)
            ).fetchone()
        else:
            row = self.connection.execute(
                "SELECT * FROM runs WHERE name = ?", (name_or_id,)
            ).fetchone()
        if row is None:
            names = [r.name for r in self.runs()][-5:]
            known = f" (runs: {', '.join(names)})" if names else " (the database has no runs)"
            raise RunNotFoundError(f"no run named {name_or_id!r} in {self.path}{known}")
        return _run_from_row(row)

    def latest_run(self) -> RunInfo | None:
        """The most recently started run, or ``None`` if there is none."""
        row = self.connection.execute(
            "SELECT * FROM runs ORDER BY started DESC, id DESC LIMIT 1"
        ).fetchone()
        return _run_from_row(row) if row is not None else None

    def metrics(
        self, run_id: int, after_step: int = 0, limit: int | None = None
    ) -> list[MetricRow]:
        """Metric rows of a run with ``step > after_step``, in step order.

        Call it repeatedly with the last step seen to read each step exactly once.

        Args:
            run_id: :attr:`RunInfo.id`.
            after_step: Return only steps after this one (0 = from the start).
            limit: At most this many rows (``None`` = all).
        """
        sql = "SELECT * FROM metrics WHERE run_id = ? AND step > ? ORDER BY step"
        params: tuple[Any, ...] = (run_id, after_step)
        if limit is not None:
            sql += " LIMIT ?"
            params += (int(limit),)
        return [_metric_from_row(r) for r in self.connection.execute(sql, params)]

    def last_metrics(self, run_id: int) -> MetricRow | None:
        """The metric row of the run's last written step, or ``None`` before the first."""
        row = self.connection.execute(
            "SELECT * FROM metrics WHERE run_id = ? ORDER BY step DESC LIMIT 1", (run_id,)
        ).fetchone()
        return _metric_from_row(row) if row is not None else None

    def samples(self, run_id: int, after_step: int = 0) -> list[SampleRow]:
        """Greedy continuations recorded during the run with ``step > after_step``."""
        rows = self.connection.execute(
            "SELECT step, prompt, text FROM samples WHERE run_id = ? AND step > ? ORDER BY step",
            (run_id, after_step),
        )
        return [SampleRow(r["step"], r["prompt"], r["text"]) for r in rows]

    def internals_steps(self, run_id: int, after_step: int = 0) -> list[int]:
        """Steps of a run that have captured internals, in order."""
        rows = self.connection.execute(
            "SELECT step FROM internals WHERE run_id = ? AND step > ? ORDER BY step",
            (run_id, after_step),
        )
        return [r[0] for r in rows]

    def internals(self, run_id: int, step: int) -> dict[str, Any] | None:
        """The internals captured at ``step`` (a JSON dict, see the training loop), or ``None``.

        For a step captured by :class:`hooks.runs.trainer.Trainer` this is
        ``hooks.Trace.to_dict()``; :func:`hooks.runs.trainer.load_trace` rebuilds the
        :class:`hooks.Trace` with its tensors.
        """
        row = self.connection.execute(
            "SELECT data FROM internals WHERE run_id = ? AND step = ?", (run_id, step)
        ).fetchone()
        return json.loads(row[0]) if row is not None else None

    def internals_tensors(self, run_id: int, step: int) -> bytes | None:
        """The tensors captured with ``step``'s internals (safetensors bytes), or ``None``."""
        row = self.connection.execute(
            "SELECT tensors FROM internals WHERE run_id = ? AND step = ?", (run_id, step)
        ).fetchone()
        return bytes(row[0]) if row is not None and row[0] is not None else None

    def poll(self, run_id: int, after_step: int = 0) -> RunUpdate:
        """Everything new about a run since ``after_step``, read in one consistent snapshot.

        This is the call a watcher makes every few hundred milliseconds.
        """
        with self._transaction(immediate=False):
            row = self.connection.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None:
                raise RunNotFoundError(f"run id {run_id} no longer exists in {self.path}")
            run = _run_from_row(row)
            restarted = run.last_step < after_step
            cursor = (run.checkpoint_step or 0) if restarted else after_step
            metrics = self.metrics(run_id, cursor)
            samples = self.samples(run_id, cursor)
            steps = self.internals_steps(run_id, cursor)
        return RunUpdate(run, metrics, samples, steps, restarted)

    def integrity_check(self) -> str:
        """Result of ``PRAGMA integrity_check``: ``"ok"`` for a sound database."""
        rows = self.connection.execute("PRAGMA integrity_check").fetchall()
        return "\n".join(str(r[0]) for r in rows)

    # -- writing ---------------------------------------------------------------------------

    def create_run(
        self,
        name: str,
        config: Mapping[str, Any],
        *,
        total_steps: int | None = None,
        kind: str = "overfit",
    ) -> RunWriter:
        """Create a run in status ``running`` owned by this process and return its writer.

        Raises:
            RunStoreError: Invalid name.
            RunExistsError: A run of that name exists.
        """
        validate_run_name(name)
        now = time.time()
        try:
            with self._transaction() as conn:
                cur = conn.execute(
                    "INSERT INTO runs (name, kind, config, status, pid, host, started, heartbeat,"
                    " total_steps) VALUES (?, ?, ?, 'running', ?, ?, ?, ?, ?)",
                    (
                        name,
                        kind,
                        json.dumps(dict(config), sort_keys=True, default=str),
                        os.getpid(),
                        socket.gethostname(),
                        now,
                        now,
                        total_steps,
                    ),
                )
                run_id = int(cur.lastrowid)
        except sqlite3.IntegrityError as exc:
            raise RunExistsError(
                f"a run named {name!r} already exists in {self.path} (choose another --run, "
                "or --resume it)"
            ) from exc
        return RunWriter(self, run_id, name)

    def resume_run(
        self,
        name: str,
        *,
        total_steps: int | None = None,
        stale_after: float = DEFAULT_STALE_AFTER,
    ) -> RunWriter:
        """Take over an ended run (or one whose writer is gone) from its last checkpoint.

        In one transaction: rows after ``checkpoint_step`` (written after the last checkpoint
        by a writer that died) are deleted, ``last_step`` is set back to ``checkpoint_step``,
        the status becomes ``running`` with this process's pid and host, ``attempt`` is
        incremented and the failure fields are cleared.

        Args:
            name: The run to resume.
            total_steps: New step target (``None`` keeps the stored one).
            stale_after: Heartbeat age after which a ``running`` writer counts as gone.

        Raises:
            RunNotFoundError: No such run.
            WriterBusyError: Its writer is still alive.
            RunStoreError: It has no checkpoint, or it already finished all its steps.
        """
        run = self.run(name)
        if run.writer_state(stale_after=stale_after) == "running":
            raise WriterBusyError(
                f"run {name!r} is still being written by pid {run.pid} on {run.host}"
            )
        if run.checkpoint_step is None:
            raise RunStoreError(f"run {name!r} has no checkpoint to resume from")
        target = total_steps if total_steps is not None else run.total_steps
        if target is not None and run.checkpoint_step >= target:
            raise RunStoreError(
                f"run {name!r} already reached step {run.checkpoint_step} of {target} "
                "(pass a larger --steps to continue it)"
            )
        ckpt = run.checkpoint_step
        with self._transaction() as conn:
            for table in ("metrics", "internals", "samples"):
                conn.execute(f"DELETE FROM {table} WHERE run_id = ? AND step > ?", (run.id, ckpt))
            last = conn.execute(
                "SELECT total FROM metrics WHERE run_id = ? AND step = ?", (run.id, ckpt)
            ).fetchone()
            now = time.time()
            conn.execute(
                "UPDATE runs SET status = 'running', pid = ?, host = ?, heartbeat = ?,"
                " ended = NULL, reason = NULL, fail_step = NULL, fail_module = NULL, paused = 0,"
                " last_step = ?, last_loss = ?, total_steps = ?, attempt = attempt + 1"
                " WHERE id = ?",
                (
                    os.getpid(),
                    socket.gethostname(),
                    now,
                    ckpt,
                    last[0] if last is not None else None,
                    target,
                    run.id,
                ),
            )
        return RunWriter(self, run.id, name)


class RunWriter:
    """Writes one run: its steps, heartbeat, checkpoint record and final status.

    Obtain it from :meth:`RunStore.create_run` or :meth:`RunStore.resume_run`. Use it from one
    thread (the training thread); the heartbeat thread started by :meth:`start_heartbeat` uses
    its own connection.
    """

    def __init__(self, store: RunStore, run_id: int, name: str):
        self.store = store
        self.run_id = run_id
        self.name = name
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._closed = False

    @property
    def info(self) -> RunInfo:
        """The run's current row."""
        return self.store.run(self.run_id)

    def log_step(
        self,
        metrics: MetricRow | Mapping[str, Any],
        *,
        internals: Mapping[str, Any] | None = None,
        sample: tuple[str, str] | None = None,
        tensors: bytes | None = None,
    ) -> None:
        """Write one step atomically: metrics row, optional internals and sample, run row.

        Args:
            metrics: A :class:`MetricRow` or a mapping with its field names (``step`` required;
                ``wall`` defaults to now).
            internals: JSON-serialisable captured statistics of this step.
            sample: ``(prompt, continuation)`` generated at this step.
            tensors: Opaque bytes stored with the internals (safetensors of the capture's
                tensors); ignored without ``internals``.
        """
        self.log_steps([(metrics, internals, sample, tensors)])

    def log_steps(
        self,
        steps: Iterable[tuple[Any, ...]],
    ) -> None:
        """Write several steps in one transaction.

        Args:
            steps: Tuples ``(metrics, internals, sample[, tensors])`` as the arguments of
                :meth:`log_step`.
        """
        rows = []
        extras_i = []
        extras_s = []
        now = time.time()
        for item in steps:
            metrics, internals, sample = item[:3]
            tensors = item[3] if len(item) > 3 else None
            m = metrics.to_dict() if isinstance(metrics, MetricRow) else dict(metrics)
            m.setdefault("wall", now)
            load = m.get("expert_load")
            m["expert_load"] = json.dumps(load) if load is not None else None
            for key in ("ce", "aux", "total", "grad_norm", "lr"):
                m[key] = _finite_or_none(m.get(key))
            rows.append(tuple(m.get(c) for c in _METRIC_COLUMNS))
            step = int(m["step"])
            if internals is not None:
                data = json.dumps(internals, default=_jsonable)
                blob = sqlite3.Binary(tensors) if tensors is not None else None
                extras_i.append((self.run_id, step, now, data, blob))
            if sample is not None:
                extras_s.append((self.run_id, step, sample[0], sample[1]))
        if not rows:
            return
        last_step = rows[-1][0]
        last_loss = rows[-1][_METRIC_COLUMNS.index("total")]
        cols = ", ".join(("run_id",) + _METRIC_COLUMNS)
        marks = ", ".join("?" * (len(_METRIC_COLUMNS) + 1))
        with self.store._transaction() as conn:
            conn.executemany(
                f"INSERT OR REPLACE INTO metrics ({cols}) VALUES ({marks})",
                [(self.run_id, *r) for r in rows],
            )
            if extras_i:
                conn.executemany(
                    "INSERT OR REPLACE INTO internals (run_id, step, captured, data, tensors)"
                    " VALUES (?, ?, ?, ?, ?)",
                    extras_i,
                )
            if extras_s:
                conn.executemany(
                    "INSERT OR REPLACE INTO samples (run_id, step, prompt, text)"
                    " VALUES (?, ?, ?, ?)",
                    extras_s,
                )
            conn.execute(
                "UPDATE runs SET last_step = ?, last_loss = ?, heartbeat = ? WHERE id = ?",
                (last_step, last_loss, now, self.run_id),
            )

    def heartbeat(self) -> None:
        """Refresh the run's heartbeat timestamp."""
        with self.store._transaction() as conn:
            conn.execute(
                "UPDATE runs SET heartbeat = ? WHERE id = ?", (time.time(), self.run_id)
            )

    def set_paused(self, paused: bool) -> None:
        """Record whether training is paused (watchers show it)."""
        with self.store._transaction() as conn:
            conn.execute(
                "UPDATE runs SET paused = ?, heartbeat = ? WHERE id = ?",
                (int(paused), time.time(), self.run_id),
            )

    def set_checkpoint(self, step: int, path: str | os.PathLike[str]) -> None:
        """Record that a complete checkpoint of ``step`` now exists at ``path``.

        ``path`` is stored relative to the database's directory when it lies under it.
        """
        p = Path(path).resolve()
        base = self.store.path.resolve().parent
        try:
            rel = str(p.relative_to(base))
        except ValueError:
            rel = str(p)
        with self.store._transaction() as conn:
            conn.execute(
                "UPDATE runs SET checkpoint_step = ?, checkpoint_path = ?, heartbeat = ?"
                " WHERE id = ?",
                (int(step), rel, time.time(), self.run_id),
            )

    def update_config(self, config: Mapping[str, Any]) -> None:
        """Replace the run's stored configuration."""
        with self.store._transaction() as conn:
            conn.execute(
                "UPDATE runs SET config = ? WHERE id = ?",
                (json.dumps(dict(config), sort_keys=True, default=str), self.run_id),
            )

    def finish(
        self,
        status: str,
        *,
        reason: str | None = None,
        fail_step: int | None = None,
        fail_module: str | None = None,
    ) -> None:
        """Set the final status and stop the heartbeat.

        Args:
            status: ``finished``, ``interrupted`` or ``failed``.
            reason: Free text shown by readers (``"SIGTERM"``, ``"non-finite loss"`` ...).
            fail_step: For ``failed``: the step where a non-finite value appeared.
            fail_module: For ``failed``: the module whose output was first non-finite.

        Raises:
            ValueError: Unknown status.
        """
        if status not in STATUSES or status == "running":
            raise ValueError(f"final status must be finished/interrupted/failed, not {status!r}")
        self.stop_heartbeat()
        now = time.time()
        with self.store._transaction() as conn:
            conn.execute(
                "UPDATE runs SET status = ?, ended = ?, heartbeat = ?, reason = ?, fail_step = ?,"
                " fail_module = ?, paused = 0 WHERE id = ?",
                (status, now, now, reason, fail_step, fail_module, self.run_id),
            )
        self._closed = True

    # -- heartbeat thread ------------------------------------------------------------------

    def start_heartbeat(self, interval: float = 1.0) -> None:
        """Refresh the heartbeat every ``interval`` seconds from a daemon thread.

        The thread opens its own connection; it keeps beating while the training thread is
        busy in a long step or paused. :meth:`finish` and :meth:`stop_heartbeat` stop it.
        """
        if self._hb_thread is not None:
            return
        self._hb_stop.clear()
        path = self.store.path
        run_id = self.run_id

        def beat() -> None:
            conn = _connect(path, create=False)
            try:
                while not self._hb_stop.wait(interval):
                    try:
                        conn.execute("BEGIN IMMEDIATE")
                        conn.execute(
                            "UPDATE runs SET heartbeat = ? WHERE id = ? AND status = 'running'",
                            (time.time(), run_id),
                        )
                        conn.execute("COMMIT")
                    except sqlite3.Error:
                        try:
                            conn.execute("ROLLBACK")
                        except sqlite3.Error:
                            pass
            finally:
                conn.close()

        self._hb_thread = threading.Thread(target=beat, name=f"mdb-heartbeat-{run_id}", daemon=True)
        self._hb_thread.start()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat thread (idempotent)."""
        if self._hb_thread is None:
            return
        self._hb_stop.set()
        self._hb_thread.join(timeout=5)
        self._hb_thread = None


def _jsonable(obj: Any) -> Any:
    """``json.dumps`` fallback: tensors and numpy scalars/arrays to lists, the rest to str."""
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, Sequence) and not isinstance(obj, str):
        return list(obj)
    return str(obj)
