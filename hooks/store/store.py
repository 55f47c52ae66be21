"""The run store: every training run, its per-step metrics and captured internals, in SQLite.

One database file (by default ``./runs/mdb.sqlite``, see :func:`default_db_path`) holds any
number of runs. One process writes a run (:class:`RunWriter`), any number of processes read it
(:class:`RunStore`), concurrently, without ever blocking each other:

* the database is in WAL mode (``PRAGMA journal_mode=WAL``): readers see the last committed
  snapshot and never wait for the writer, the writer never waits for readers;
* a batch of steps is written in one short transaction (their metrics rows and scalars, their
  internals and samples if any, and the run row's ``last_step`` / ``last_loss`` /
  ``heartbeat``), so a reader sees a step completely or not at all;
* ``synchronous=NORMAL``: a commit does not fsync; a crash of the *process* (``kill -9``) loses
  nothing that was committed, a power cut may lose the last few steps but never corrupts the file
  (SQLite's WAL guarantees);
* every connection sets ``busy_timeout``, so the short moments where two writers overlap (the
  heartbeat thread, a resumed run, a WAL checkpoint) wait instead of failing; a lock another
  process keeps longer than that (10 s, ``$MDB_LOCK_WAIT``) raises
  :class:`~hooks.store.sqlite_open.DatabaseLockedError`, one line naming the process;
* a database that ``PRAGMA quick_check`` finds damaged is read as far as it can be, never
  written to (:meth:`RunStore.damage`); opening, locks and damage are in
  :mod:`hooks.store.sqlite_open`.

A database on a read-only mount (or a read-only file or directory) is opened read-only: with
``mode=ro`` when its ``-wal``/``-shm`` files exist, as ``immutable=1`` when it has no
write-ahead log to read, and otherwise from a private copy (the write-ahead log of a writer that
did not close cannot be read in place without write access). :attr:`RunStore.read_only` and
:attr:`RunStore.note` say which.

The store is split by what each part does; this module is the public import path and
re-exports every public name of the others:

* :mod:`hooks.store.schema` — the file format: its identity (:data:`SCHEMA_VERSION`,
  :data:`APPLICATION_ID`), the tables and what each column holds, the migrations of older
  versions;
* :mod:`hooks.store.rows` — the rows as Python values (:class:`RunInfo`, :class:`MetricRow`,
  the rank tables' rows, :class:`RunUpdate`), the errors, run names, non-finite findings;
* :mod:`hooks.store.writer` — :class:`RunWriter`: the steps, the heartbeat thread, the
  checkpoint record, the final status, and a distributed run's ranks, findings and checks;
* this module — :class:`RunStore`: opening (through :mod:`hooks.store.sqlite_open`), checking
  and migrating the file, reading runs and polling them, creating and resuming writers.

This module uses only the standard library (and the modules above, which do too); it never
imports torch, textual or rich.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hooks.store.listing import latest_names
from hooks.store.numbers import loss_metric
from hooks.store.rows import (
    DEFAULT_STALE_AFTER,
    FINDING_KINDS,
    FIXED_METRICS,
    RANK_STATES,
    STATUSES,
    DamagedRunError,
    Finding,
    MetricRow,
    RankInfo,
    RankRow,
    RunExistsError,
    RunInfo,
    RunNotFoundError,
    RunUpdate,
    SampleRow,
    WriterBusyError,
    pid_alive,
    read_cell,
    run_from_row,
    shown_value,
    validate_run_name,
)
from hooks.store.rows import nonfinite_sentence as nonfinite_sentence
from hooks.store.schema import (
    APPLICATION_ID,
    MIGRATIONS,
    SCHEMA_VERSION,
    TABLES,
    create_schema,
    store_lock_wait,
)
from hooks.store.schema import FORMAT_NAME as FORMAT_NAME
from hooks.store.spikes import Spike
from hooks.store.sqlite_open import (
    DEFAULT_DB_ENV,
    DamagedDatabaseError,
    DatabaseLockedError,
    RunStoreError,
    Transaction,
    damaged_error,
    find_damage,
    find_damage_quickly,
    is_locked,
    locked_error,
    not_a_store,
    open_copy,
    open_database,
    set_wal,
)
from hooks.store.summary import History, RunSummary, history, read_summary, rebuild
from hooks.store.writer import RunWriter

__all__ = [
    "APPLICATION_ID",
    "DEFAULT_DB_ENV",
    "DEFAULT_DB_PATH",
    "DEFAULT_STALE_AFTER",
    "FINDING_KINDS",
    "FIXED_METRICS",
    "RANK_STATES",
    "SCHEMA_VERSION",
    "STATUSES",
    "Finding",
    "MetricRow",
    "RankInfo",
    "RankRow",
    "RunExistsError",
    "RunInfo",
    "RunNotFoundError",
    "RunStore",
    "RunStoreError",
    "DamagedRunError",
    "DamagedDatabaseError",
    "DatabaseLockedError",
    "RunUpdate",
    "RunWriter",
    "SampleRow",
    "WriterBusyError",
    "checkpoint_dir",
    "checkpoint_folder",
    "default_db_path",
    "loss_metric",
    "pid_alive",
    "validate_run_name",
]

#: Steps of metric rows :meth:`RunStore.history` reads besides the buckets.
RECENT_STEPS = 64

#: Default database path, relative to the current directory.
DEFAULT_DB_PATH = Path("runs") / "mdb.sqlite"


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

    For ``runs/mdb.sqlite`` and run ``r1`` this is ``runs/mdb-checkpoints/r1``. The name is
    checked as on input (:func:`validate_run_name`) whether the user typed it or it was read
    back from a database: a run renamed ``../victim`` outside mdb never becomes a path.

    Raises:
        RunStoreError: ``run_name`` is not a valid run name.
    """
    validate_run_name(run_name)
    db = Path(db_path)
    return db.with_name(f"{db.stem}-checkpoints") / run_name


def _inside(path: str, parent: str) -> bool:
    return path == parent or os.path.commonpath([path, parent]) == parent


def checkpoint_folder(db_path: str | os.PathLike[str], run_name: str,
                      path: str | os.PathLike[str] | None = None) -> Path:
    """A run's checkpoint folder, checked before anything there is read, written or deleted.

    The run's directory (:func:`checkpoint_dir`) must resolve, symbolic links followed, inside
    ``<db stem>-checkpoints/`` (itself resolved: that folder may be a link to another disk),
    and ``path`` (a checkpoint folder as the database records it, relative to the database's
    directory or absolute) inside the run's directory. A database, trace or checkpoint from
    elsewhere is data: what it names is never trusted to be where mdb would have put it.

    Args:
        db_path: The run database.
        run_name: The run (checked as on input).
        path: A checkpoint folder of the run; ``None``: the run's directory itself.

    Returns:
        ``path`` (relative ones joined to the database's directory), or the run's directory,
        as given, not resolved.

    Raises:
        RunStoreError: An invalid run name, a run directory that is a link leading out of
            ``<db stem>-checkpoints/``, or ``path`` outside the run's directory: one line.
    """
    run_dir = checkpoint_dir(db_path, run_name)
    root = os.path.realpath(run_dir.parent)
    real_dir = os.path.realpath(run_dir)
    if real_dir == root or not _inside(real_dir, root):
        raise RunStoreError(f"the checkpoint directory of run {run_name!r}, {run_dir}, leads "
                            f"out of {run_dir.parent} (to {real_dir}): refused, nothing there "
                            "is read, written or deleted")
    if path is None:
        return run_dir
    folder = Path(path)
    if not folder.is_absolute():
        folder = Path(db_path).parent / folder
    real = os.path.realpath(folder)
    if not _inside(real, real_dir):
        raise RunStoreError(f"run {run_name!r} records its checkpoint at {str(path)!r}, which "
                            f"is not inside {run_dir} (the database was changed outside mdb, "
                            "or moved): refused, nothing there is read or deleted")
    return folder


class RunStore:
    """A connection to an mdb run database: reads runs, creates and resumes writers.

    Reading never blocks a writer and never sees a half-written step. Open one ``RunStore`` per
    thread (the connection is not shared between threads by design, although SQLite would
    allow it).

    Args:
        path: The database file. Defaults to :func:`default_db_path`.
        create: Create the file (and its directory) and the schema if missing — for writers.
            Readers leave it ``False``: a missing file raises :class:`RunStoreError`.

    Attributes:
        path: The database file.
        read_only: The database could not be written (a read-only mount, file or directory):
            this store reads it and refuses to write.
        note: One line for the user about how a read-only database is read, else ``None``.

    Raises:
        RunStoreError: The file is missing (``create=False``), unreadable, not an SQLite
            database, an SQLite database of something else, of a newer schema version, or
            read-only (``create=True``).

    Example::

        with RunStore("runs/mdb.sqlite") as store:
            run = store.latest_run()
            rows = store.metrics(run.id, after_step=0)
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, create: bool = False):
        self.path = Path(path) if path is not None else default_db_path()
        wait = store_lock_wait()
        opened = open_database(self.path, create=create, wait=wait)
        self._conn: sqlite3.Connection | None = opened.conn
        self.read_only = opened.read_only
        self.note = opened.note
        self._copy_dir = opened.copy_dir
        self._names: dict[int, dict[int, str]] = {}
        self._sound = False  # quick_check passed (checked before the first write)
        t0 = time.monotonic()
        try:
            self._check_or_init(create)
        except sqlite3.Error as exc:
            self.close()
            if isinstance(exc, RunStoreError):  # DatabaseLockedError
                raise
            if is_locked(exc):
                raise locked_error(self.path, time.monotonic() - t0, wait) from exc
            raise RunStoreError(f"cannot use the run database {self.path}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (idempotent); a private copy of a read-only database is
        deleted."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._copy_dir is not None:
            shutil.rmtree(self._copy_dir, ignore_errors=True)
            self._copy_dir = None

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

    def _header(self) -> tuple[int, set[str]]:
        """``PRAGMA application_id`` and the names of the tables, read in one transaction (a
        process creating the schema meanwhile is seen before or after, never half-way)."""
        conn = self.connection
        try:
            with self._transaction(immediate=False):
                app_id = conn.execute("PRAGMA application_id").fetchone()[0]
                tables = {
                    r[0]
                    for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                }
        except sqlite3.DatabaseError as exc:
            if is_locked(exc):
                raise
            raise not_a_store(self.path, exc) from exc
        return app_id, tables

    def _check_or_init(self, create: bool) -> None:
        app_id, tables = self._header()
        if not tables and app_id == 0:
            if not create:
                raise RunStoreError(f"{self.path} is an empty database with no runs in it")
            if self._init_schema():
                return
            app_id, tables = self._header()  # another process created it meanwhile
        version = self._version(app_id, tables)
        if version > SCHEMA_VERSION:
            raise RunStoreError(
                f"{self.path} was written by a newer mdb (schema {version}, this mdb reads "
                f"up to {SCHEMA_VERSION}): upgrade mdb to read it"
            )
        if version < SCHEMA_VERSION:
            self._migrate(version)
        if "spikes" not in tables and not self.read_only:
            # added within version 2: a writer adds it to a database that lacks it
            self.connection.execute(TABLES["spikes"].replace("CREATE TABLE",
                                                              "CREATE TABLE IF NOT EXISTS"))

    def _version(self, app_id: int, tables: set[str]) -> int:
        if app_id != APPLICATION_ID or "meta" not in tables:
            raise RunStoreError(
                f"{self.path} is an SQLite database of something else, not an mdb run database"
            )
        meta = dict(self.connection.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("format") != FORMAT_NAME:
            raise RunStoreError(
                f"{self.path} is an SQLite database of something else, not an mdb run database"
            )
        try:
            return int(meta.get("schema_version", "0"))
        except ValueError:
            raise RunStoreError(
                f"{self.path} has an unreadable schema version {meta.get('schema_version')!r}"
            ) from None

    def _migrate(self, version: int) -> None:
        """Bring an older database up to :data:`SCHEMA_VERSION` in one write transaction (a
        read-only database is migrated in a private copy)."""
        if version not in MIGRATIONS:
            raise RunStoreError(
                f"{self.path} has schema version {version}, which this mdb cannot read"
            )
        if self.read_only and self._copy_dir is None:
            self.connection.close()
            opened = open_copy(self.path, (self.note or f"{self.path} is read-only") +
                                f"; its schema {version} is upgraded in a private copy",
                               store_lock_wait())
            self._conn, self.note, self._copy_dir = opened.conn, opened.note, opened.copy_dir
        conn = self.connection
        with self._transaction():
            # another process may have migrated it meanwhile: read the version again, locked
            (current,) = conn.execute(
                "SELECT value FROM meta WHERE key = 'schema_version'"
            ).fetchone()
            v = int(current)
            while v < SCHEMA_VERSION:
                MIGRATIONS[v](conn)
                v += 1

    def _init_schema(self) -> bool:
        """Create the schema of a new database, in one write transaction that first looks
        again whether another process created it meanwhile (writers creating one database
        at once): whether this process created it."""
        conn = self.connection
        mode = set_wal(conn, self.path, store_lock_wait())
        if mode.lower() != "wal":
            raise RunStoreError(f"cannot put {self.path} in WAL mode (got {mode!r})")
        with self._transaction():
            if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                return False
            create_schema(conn)
        return True

    def _transaction(self, immediate: bool = True) -> Transaction:
        """A transaction (:class:`hooks.store.sqlite_open.Transaction`): ``BEGIN IMMEDIATE``
        for writes, ``BEGIN`` for a consistent multi-statement read; a write lock another
        process holds past the lock wait raises :class:`DatabaseLockedError`."""
        return Transaction(self.connection, self.path, immediate)

    def transaction(self) -> Transaction:
        """``with store.transaction() as conn:`` one write transaction (``BEGIN IMMEDIATE``) on
        :attr:`connection`: committed when the block ends normally, rolled back otherwise.

        Raises:
            DatabaseLockedError: Another process held the write lock past the lock wait.
        """
        return self._transaction()

    def snapshot(self) -> Transaction:
        """``with store.snapshot():`` one read transaction: every read inside the block sees
        the database as it was at its first read (a run still being written included), and
        no writer waits on it (WAL). Reads on :attr:`connection` inside it are consistent
        with each other, e.g. a run's metric names and its values.

        Raises:
            DatabaseLockedError: The database is locked past the lock wait (a writer
                changing its journal mode; ordinary writes never block a read).
            RunStoreError: The store is closed.
        """
        return self._transaction(immediate=False)

    def _require_writable(self) -> None:
        if self.read_only:
            raise RunStoreError(
                f"cannot write to {self.path}: it is read-only (`mdb runs` and `mdb watch` "
                "can still read it)"
            )
        if not self._sound:  # never write to a damaged file: checked once per store
            problem = find_damage(self.connection)
            if problem is not None:
                raise damaged_error(self.path, problem)
            self._sound = True

    def damage(self, thorough: bool = True) -> str | None:
        """How the database file is damaged, from ``PRAGMA quick_check``
        (:func:`hooks.store.sqlite_open.find_damage`): ``None`` for a sound one. A store
        refuses to create or resume a run in a damaged one (:class:`DamagedDatabaseError`).
        ``thorough=False``: a large file's tables of per-step rows are only walked
        (:func:`hooks.store.sqlite_open.find_damage_quickly`), for a listing."""
        if thorough:
            return find_damage(self.connection)
        try:
            size = self.path.stat().st_size
        except OSError:
            size = 0
        return find_damage_quickly(self.connection, size)

    # -- reading ---------------------------------------------------------------------------

    def runs(self) -> list[RunInfo]:
        """All runs, oldest first."""
        rows = self.connection.execute("SELECT * FROM runs ORDER BY started, id").fetchall()
        return [run_from_row(r) for r in rows]

    def run(self, name_or_id: str | int) -> RunInfo:
        """One run by name (``str``) or id (``int``).

        Raises:
            RunNotFoundError: No such run; the message names the latest 5 runs (… for more).
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
            known = latest_names([r.name for r in self.runs()])  # the latest 5 of N, …
            raise RunNotFoundError(f"no run named {name_or_id!r} in {self.path} ({known})")
        return run_from_row(row)

    def latest_run(self) -> RunInfo | None:
        """The most recently started run, or ``None`` if there is none."""
        row = self.connection.execute(
            "SELECT * FROM runs ORDER BY started DESC, id DESC LIMIT 1"
        ).fetchone()
        return run_from_row(row) if row is not None else None

    def metric_names(self, run_id: int) -> list[str]:
        """Names of every scalar the run has logged, in the order each was first logged."""
        return list(self._metric_names(run_id, refresh=True).values())

    def _metric_names(self, run_id: int, refresh: bool = False) -> dict[int, str]:
        names = self._names.get(run_id)
        if names is None or refresh:
            rows = self.connection.execute(
                "SELECT id, name FROM metric_names WHERE run_id = ? ORDER BY id", (run_id,)
            )
            names = {r[0]: r[1] for r in rows}
            self._names[run_id] = names
        return names

    def metrics(
        self, run_id: int, after_step: int = 0, limit: int | None = None
    ) -> list[MetricRow]:
        """Metric rows of a run with ``step > after_step``, in step order, each with every
        scalar logged at that step (:attr:`MetricRow.values`).

        Call it repeatedly with the last step seen to read each step exactly once.

        Args:
            run_id: :attr:`RunInfo.id`.
            after_step: Return only steps after this one (0 = from the start).
            limit: At most this many rows (``None`` = all).
        """
        with self._transaction(immediate=False):
            return self._metrics(run_id, after_step, limit)

    def _metrics(self, run_id: int, after_step: int, limit: int | None) -> list[MetricRow]:
        conn = self.connection
        sql = "SELECT step, wall, expert_load FROM metrics WHERE run_id = ? AND step > ? " \
              "ORDER BY step"
        params: tuple[Any, ...] = (run_id, after_step)
        if limit is not None:
            sql += " LIMIT ?"
            params += (int(limit),)
        rows = conn.execute(sql, params).fetchall()
        if not rows:
            return []
        for step, wall, _load in rows:
            if not read_cell("int", step)[0]:
                raise self._damaged(run_id, f"metrics.step holds {shown_value(step)}, "
                                    "not an integer")
            if not read_cell("real", wall)[0]:
                raise self._damaged(run_id, f"metrics.wall of step {step} holds "
                                    f"{shown_value(wall)}, not a number")
        values: dict[int, dict[str, float | None]] = {r[0]: {} for r in rows}
        names = self._metric_names(run_id)
        scalars = conn.execute(
            "SELECT step, metric, value FROM scalars WHERE run_id = ? AND step > ? AND step <= ?"
            " ORDER BY step, metric",
            (run_id, after_step, rows[-1][0]),
        ).fetchall()
        for step, metric, value in scalars:
            name = names.get(metric)
            if name is None:
                names = self._metric_names(run_id, refresh=True)
                name = names.get(metric, f"metric{metric}")
            if value is not None and not read_cell("real", value)[0]:
                raise self._damaged(run_id, f"the value of {name} at step {step} is "
                                    f"{shown_value(value)}, not a number")
            bucket = values.get(step)
            if bucket is not None:
                bucket[name] = None if value is None else float(value)
        out = []
        for step, wall, load in rows:
            out.append(MetricRow(step=step, wall=float(wall),
                                 expert_load=self._expert_load(run_id, step, load),
                                 values=values[step]))
        return out

    def _expert_load(self, run_id: int, step: int, text: Any) -> list[list[float]] | None:
        """``metrics.expert_load`` of one step: (L_moe, E) fractions, or ``None``."""
        if text is None:
            return None
        try:
            load = json.loads(text) if isinstance(text, str) else None
        except (json.JSONDecodeError, RecursionError):
            load = None
        if not (isinstance(load, list) and all(
                isinstance(layer, list) and all(read_cell("real", f)[0] for f in layer)
                for layer in load)):
            raise self._damaged(run_id, f"metrics.expert_load of step {step} holds "
                                f"{shown_value(text)}, not a list of per-layer lists of fractions")
        return [[float(f) for f in layer] for layer in load] or None

    def _damaged(self, run_id: int, what: str) -> DamagedRunError:
        row = self.connection.execute("SELECT name FROM runs WHERE id = ?", (run_id,)).fetchone()
        name = row[0] if row is not None else run_id
        return DamagedRunError(f"run {name!r} in {self.path} cannot be read: {what}; the "
                               "database was changed outside mdb")

    def spikes(self, run_id: int, after_step: int = 0) -> list[Spike]:
        """The loss spikes the writer recorded (:mod:`hooks.store.spikes`), in step order:
        those whose episode lasted past ``after_step`` (0 = all). A database without the
        ``spikes`` table (written before it existed) has none."""
        try:
            rows = self.connection.execute(
                "SELECT step, metric, value, baseline, peak_step, last_step FROM spikes"
                " WHERE run_id = ? AND last_step > ? ORDER BY step", (run_id, after_step),
            ).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return []
            raise
        out = []
        for step, metric, value, baseline, peak, last in rows:
            if not (all(read_cell("int", v)[0] for v in (step, peak, last))
                    and all(read_cell("real", v)[0] for v in (value, baseline))
                    and isinstance(metric, str)):
                raise self._damaged(run_id, f"the spike row of step {shown_value(step)} holds "
                                    "values that are not numbers")
            out.append(Spike(int(step), metric, float(value), float(baseline), int(peak),
                             int(last)))
        return out

    def summary(self, run_id: int) -> RunSummary:
        """What the writer keeps about the run (:class:`hooks.store.summary.RunSummary`): the
        number of captured steps, the last of them, each metric's latest value. Reads a few
        rows, whatever the run's length."""
        with self._transaction(immediate=False):
            return read_summary(self.connection, run_id)

    def history(self, run_id: int, buckets: int) -> tuple[RunUpdate, History]:
        """The run as a first frame shows it: its row and everything :meth:`poll` gives
        *except* the metric rows, and every metric bucketed into at most ``buckets`` step
        ranges with min/max/mean per bucket (:func:`hooks.store.summary.history`, bucketed by
        SQLite from the per-block aggregates the writer keeps), read in one snapshot: the
        metric rows of its last :data:`RECENT_STEPS` steps only (for the step rate and the
        latest row), the latest sample only, no capture steps; the latest value of each metric
        in :attr:`hooks.store.summary.History.latest`. Poll after
        :attr:`hooks.store.summary.History.last` for the new steps."""
        with self._transaction(immediate=False):
            row = self.connection.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None:
                raise RunNotFoundError(f"run id {run_id} no longer exists in {self.path}")
            hist = history(self.connection, run_id, buckets)
            last = hist.last or 0
            hist.latest = read_summary(self.connection, run_id).latest
            sample = self.connection.execute(
                "SELECT step FROM samples WHERE run_id = ? ORDER BY step DESC LIMIT 1", (run_id,)
            ).fetchone()
            recent = self._metrics(run_id, max(last - RECENT_STEPS, 0), None) if last else []
            update = RunUpdate(run_from_row(row), recent,
                               self.samples(run_id, sample[0] - 1) if sample else [], [], False,
                               self.spikes(run_id, 0))
        return update, hist

    def last_metrics(self, run_id: int) -> MetricRow | None:
        """The metric row of the run's last written step, or ``None`` before the first."""
        with self._transaction(immediate=False):
            row = self.connection.execute(
                "SELECT step FROM metrics WHERE run_id = ? ORDER BY step DESC LIMIT 1", (run_id,)
            ).fetchone()
            if row is None:
                return None
            rows = self._metrics(run_id, row[0] - 1, 1)
        return rows[0] if rows else None

    def samples(self, run_id: int, after_step: int = 0) -> list[SampleRow]:
        """Greedy continuations recorded during the run with ``step > after_step``."""
        rows = self.connection.execute(
            "SELECT step, prompt, text FROM samples WHERE run_id = ? AND step > ? ORDER BY step",
            (run_id, after_step),
        )
        return [SampleRow(r["step"], str(r["prompt"]), str(r["text"])) for r in rows
                if read_cell("int", r["step"])[0]]

    def internals_steps(self, run_id: int, after_step: int = 0) -> list[int]:
        """Steps of a run that have captured internals, in order."""
        rows = self.connection.execute(
            "SELECT step FROM internals WHERE run_id = ? AND step > ? ORDER BY step",
            (run_id, after_step),
        )
        return [r[0] for r in rows if read_cell("int", r[0])[0]]

    def internals(self, run_id: int, step: int) -> dict[str, Any] | None:
        """The internals captured at ``step`` (a JSON dict, see the training loop), or ``None``.

        For a step captured by :class:`hooks.train.trainer.Trainer` or by ``Run.watch`` this is
        ``hooks.Trace.to_dict()``; :func:`hooks.train.trainer.load_trace` rebuilds the
        :class:`hooks.Trace` with its tensors.

        Raises:
            DamagedRunError: The stored text is not a JSON object (the database was changed
                outside mdb): one line.
        """
        row = self.connection.execute(
            "SELECT data FROM internals WHERE run_id = ? AND step = ?", (run_id, step)
        ).fetchone()
        return self._capture(run_id, "internals", step, row[0]) if row is not None else None

    def _capture(self, run_id: int, table: str, step: int, text: Any) -> dict[str, Any]:
        """A stored capture's JSON, parsed: a damaged one (cut, not JSON, an integer of
        thousands of digits, not an object) is a :class:`DamagedRunError`."""
        why = "not a JSON object"
        try:
            data = json.loads(text) if isinstance(text, (str, bytes)) else None
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, int digits, nesting
            data, why = None, f"which does not parse as JSON ({str(exc)[:120]})"
        if not isinstance(data, dict):
            raise self._damaged(run_id, f"the capture of step {step} ({table}.data) holds "
                                f"{shown_value(text)}, {why}")
        return data

    def _blob(self, run_id: int, table: str, step: int, value: Any) -> bytes | None:
        if value is None:
            return None
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise self._damaged(run_id, f"the tensors of step {step} ({table}.tensors) hold "
                                f"{shown_value(value)}, not safetensors bytes")
        return bytes(value)

    def internals_tensors(self, run_id: int, step: int) -> bytes | None:
        """The tensors captured with ``step``'s internals (safetensors bytes), or ``None``.

        Raises:
            DamagedRunError: Not bytes (the database was changed outside mdb).
        """
        row = self.connection.execute(
            "SELECT tensors FROM internals WHERE run_id = ? AND step = ?", (run_id, step)
        ).fetchone()
        return self._blob(run_id, "internals", step, row[0]) if row is not None else None

    # -- distributed runs ------------------------------------------------------------------

    def ranks(self, run_id: int) -> list[RankInfo]:
        """The ranks of a distributed run, by rank (empty for a single process)."""
        rows = self.connection.execute(
            "SELECT rank, host, pid, local_rank, state, last_step, heartbeat, reason FROM ranks"
            " WHERE run_id = ? ORDER BY rank", (run_id,),
        ).fetchall()
        return [RankInfo(*tuple(r)) for r in rows]

    def rank_steps(self, run_id: int, after_step: int = 0,
                   rank: int | None = None, limit: int | None = None) -> list[RankRow]:
        """Every rank's steps with ``step > after_step`` (of ``rank`` alone if given), in
        (step, rank) order, each with every scalar that rank logged (:class:`RankRow`); at
        most ``limit`` rows (``None``: all; a reader of a long run reads it a page at a
        time)."""
        with self._transaction(immediate=False):
            conn = self.connection
            where, params = "run_id = ? AND step > ?", [run_id, after_step]
            if rank is not None:
                where += " AND rank = ?"
                params.append(int(rank))
            page = f" LIMIT {int(limit)}" if limit is not None else ""
            rows = conn.execute(
                f"SELECT step, rank, wall, step_time, compute_time, expert_load FROM rank_steps"
                f" WHERE {where} ORDER BY step, rank{page}", params,
            ).fetchall()
            if not rows:
                return []
            if limit is not None:  # the scalars of the rows read, not of later steps
                where += " AND step <= ?"
                params.append(rows[-1][0])
            values: dict[tuple[int, int], dict[str, float | None]] = {
                (r[0], r[1]): {} for r in rows}
            names = self._metric_names(run_id)
            for step, rk, metric, value in conn.execute(
                f"SELECT step, rank, metric, value FROM rank_scalars WHERE {where}"
                " ORDER BY step, rank, metric", params,
            ):
                name = names.get(metric)
                if name is None:
                    names = self._metric_names(run_id, refresh=True)
                    name = names.get(metric, f"metric{metric}")
                bucket = values.get((step, rk))
                if bucket is not None:
                    bucket[name] = value
        return [RankRow(step=r[0], rank=r[1], wall=r[2], step_time=r[3], compute_time=r[4],
                        expert_load=json.loads(r[5]) if r[5] else None,
                        values=values[(r[0], r[1])]) for r in rows]

    def rank_internals_steps(self, run_id: int) -> list[tuple[int, int]]:
        """``(step, rank)`` of every capture of a rank other than 0 (rank 0's are
        :meth:`internals_steps`), in order."""
        rows = self.connection.execute(
            "SELECT step, rank FROM rank_internals WHERE run_id = ? ORDER BY step, rank",
            (run_id,),
        )
        return [(r[0], r[1]) for r in rows]

    def rank_internals(self, run_id: int, step: int, rank: int) -> dict[str, Any] | None:
        """The capture of ``step`` on ``rank`` (``hooks.Trace.to_dict()``; rank 0:
        :meth:`internals`), or ``None``."""
        if rank == 0:
            return self.internals(run_id, step)
        row = self.connection.execute(
            "SELECT data FROM rank_internals WHERE run_id = ? AND step = ? AND rank = ?",
            (run_id, step, rank),
        ).fetchone()
        return self._capture(run_id, "rank_internals", step, row[0]) if row is not None \
            else None

    def rank_internals_tensors(self, run_id: int, step: int, rank: int) -> bytes | None:
        """The tensors of :meth:`rank_internals` (safetensors bytes), or ``None``."""
        if rank == 0:
            return self.internals_tensors(run_id, step)
        row = self.connection.execute(
            "SELECT tensors FROM rank_internals WHERE run_id = ? AND step = ? AND rank = ?",
            (run_id, step, rank),
        ).fetchone()
        return self._blob(run_id, "rank_internals", step, row[0]) if row is not None else None

    def findings(self, run_id: int, after_id: int = 0) -> list[Finding]:
        """The findings of a distributed run's cross-rank checks with ``id > after_id``, in the
        order found (empty for a single process)."""
        rows = self.connection.execute(
            "SELECT id, kind, step, rank, subject, line, detail, wall FROM findings"
            " WHERE run_id = ? AND id > ? ORDER BY id", (run_id, after_id),
        ).fetchall()
        out = []
        for r in rows:
            try:
                detail = json.loads(r[6]) if r[6] else {}
            except json.JSONDecodeError:
                detail = {}
            out.append(Finding(r[0], r[1], r[2], r[3], r[4], r[5],
                               detail if isinstance(detail, dict) else {}, r[7]))
        return out

    def checks(self, run_id: int) -> list[dict[str, Any]]:
        """The cross-rank comparisons made, in step order: ``{"step", "kind"`` (``params``:
        after the optimizer step, ``grads``: after backward), ``"ranks"`` compared,
        ``"compared"`` tensors (those two ranks or more hold), ``"differing"`` ones,
        ``"note"``: ``None``, or why nothing was compared (``compared`` 0: every tensor a
        shard of one rank, :data:`hooks.sharded.checksums.NOT_COMPARED`) ``}``."""
        from hooks.sharded.checksums import NOT_COMPARED

        rows = self.connection.execute(
            "SELECT step, kind, ranks, compared, differing FROM checks WHERE run_id = ?"
            " ORDER BY step, kind", (run_id,),
        ).fetchall()
        keys = ("step", "kind", "ranks", "compared", "differing")
        return [{**dict(zip(keys, tuple(r), strict=True)),
                 "note": None if r[3] else NOT_COMPARED} for r in rows]

    def poll(self, run_id: int, after_step: int = 0) -> RunUpdate:
        """Everything new about a run since ``after_step``, read in one consistent snapshot.

        This is the call a watcher makes every few hundred milliseconds.
        """
        with self._transaction(immediate=False):
            row = self.connection.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None:
                raise RunNotFoundError(f"run id {run_id} no longer exists in {self.path}")
            run = run_from_row(row)
            restarted = run.last_step < after_step
            cursor = (run.checkpoint_step or 0) if restarted else after_step
            metrics = self._metrics(run_id, cursor, None)
            samples = self.samples(run_id, cursor)
            steps = self.internals_steps(run_id, cursor)
            spikes = self.spikes(run_id, cursor)
        return RunUpdate(run, metrics, samples, steps, restarted, spikes)

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
        world_size: int | None = None,
    ) -> RunWriter:
        """Create a run in status ``running`` owned by this process and return its writer.

        Args:
            name: Unique run name (see :func:`validate_run_name`).
            config: JSON-serialisable configuration (other values are stored as ``str``).
            total_steps: The step target, if known.
            kind: ``"overfit"`` (``mdb overfit``) or ``"api"`` (``hooks.run``).
            world_size: The number of ranks of a distributed job (``None``: one process).

        Raises:
            RunStoreError: Invalid name, or the database is read-only.
            RunExistsError: A run of that name exists.
        """
        validate_run_name(name)
        self._require_writable()
        now = time.time()
        try:
            with self._transaction() as conn:
                cur = conn.execute(
                    "INSERT INTO runs (name, kind, config, status, pid, host, started, heartbeat,"
                    " total_steps, world_size) VALUES (?, ?, ?, 'running', ?, ?, ?, ?, ?, ?)",
                    (
                        name,
                        kind,
                        json.dumps(dict(config), sort_keys=True, default=str),
                        os.getpid(),
                        socket.gethostname(),
                        now,
                        now,
                        total_steps,
                        world_size,
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
        restart: bool = False,
    ) -> RunWriter:
        """Take over an ended run (or one whose writer is gone) from its last checkpoint, or
        with ``restart`` one that has no checkpoint from step 0.

        In one write transaction (``BEGIN IMMEDIATE``: the write lock is taken before the run
        row is read, so of two processes resuming at once the second sees the first as a live
        writer): the writer's liveness is checked, rows after ``checkpoint_step`` (written
        after the last checkpoint by a writer that died) are deleted, ``last_step`` is set back
        to ``checkpoint_step``, the status becomes ``running`` with this process's pid and
        host, ``attempt`` is incremented and the failure fields are cleared.

        Args:
            name: The run to resume.
            total_steps: New step target (``None`` keeps the stored one).
            stale_after: Heartbeat age after which a ``running`` writer counts as gone.
            restart: A run without a checkpoint (its writer killed before its first one
                was written) starts again from step 0: every row it recorded is deleted.

        Raises:
            RunNotFoundError: No such run.
            WriterBusyError: Its writer is still alive.
            RunStoreError: It has no checkpoint (without ``restart``), it already finished
                all its steps, or the database is read-only or damaged.
        """
        self._require_writable()
        with self._transaction() as conn:
            run = self.run(name)
            if run.damaged:
                raise DamagedRunError(f"cannot resume: {run.damaged}")
            if run.writer_state(stale_after=stale_after) == "running":
                raise WriterBusyError(
                    f"run {name!r} is still being written by pid {run.pid} on {run.host}"
                )
            if run.checkpoint_step is None and not restart:
                raise RunStoreError(f"run {name!r} has no checkpoint to resume from")
            target = total_steps if total_steps is not None else run.total_steps
            ckpt = run.checkpoint_step if run.checkpoint_step is not None else -1
            if target is not None and ckpt >= target:
                raise RunStoreError(
                    f"run {name!r} already reached step {run.checkpoint_step} of {target} "
                    "(pass a larger --steps to continue it)"
                )
            last_loss = self._rewind(conn, run.id, ckpt)
            nonfinite = run.nonfinite if run.nonfinite and run.nonfinite["step"] <= ckpt else None
            now = time.time()
            conn.execute(
                "UPDATE runs SET status = 'running', pid = ?, host = ?, heartbeat = ?,"
                " ended = NULL, reason = NULL, fail_step = NULL, fail_module = NULL, paused = 0,"
                " last_step = ?, last_loss = ?, total_steps = ?, attempt = attempt + 1,"
                " nonfinite = ? WHERE id = ?",
                (
                    os.getpid(),
                    socket.gethostname(),
                    now,
                    max(ckpt, 0),
                    last_loss,
                    target,
                    json.dumps(nonfinite) if nonfinite else None,
                    run.id,
                ),
            )
        return RunWriter(self, run.id, name)


    def _rewind(self, conn: sqlite3.Connection, run_id: int, step: int) -> float | None:
        """Delete the run's rows after ``step`` (inside the caller's write transaction); the
        loss of the last step left, ``None`` when there is none."""
        for table in ("metrics", "scalars", "internals", "samples", "spikes", "rank_steps",
                      "rank_scalars", "rank_internals"):
            conn.execute(f"DELETE FROM {table} WHERE run_id = ? AND step > ?", (run_id, step))
        rebuild(conn, run_id, max(step, 0))  # what the writer keeps, from the rows left
        names = self._metric_names(run_id, refresh=True)
        key = loss_metric(names.values())
        if key is None:
            return None
        ids = [i for i, n in names.items() if n == key]
        row = conn.execute(
            "SELECT value FROM scalars WHERE run_id = ? AND metric = ? AND step <= ?"
            " ORDER BY step DESC LIMIT 1",
            (run_id, ids[0], step),
        ).fetchone()
        return row[0] if row is not None else None
