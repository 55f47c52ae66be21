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
  :class:`~hooks.runs.sqlite_open.DatabaseLockedError`, one line naming the process;
* a database that ``PRAGMA quick_check`` finds damaged is read as far as it can be, never
  written to (:meth:`RunStore.damage`); opening, locks and damage are in
  :mod:`hooks.runs.sqlite_open`.

The writer's liveness is recorded as ``pid``, ``host`` and a ``heartbeat`` timestamp refreshed by
a background thread (:meth:`RunWriter.start_heartbeat`), so a reader can tell a run that is
still being written from one whose writer died without saying so (``kill -9``, a power cut):
see :meth:`RunInfo.writer_state`.

A database on a read-only mount (or a read-only file or directory) is opened read-only: with
``mode=ro`` when its ``-wal``/``-shm`` files exist, as ``immutable=1`` when it has no
write-ahead log to read, and otherwise from a private copy (the write-ahead log of a writer that
did not close cannot be read in place without write access). :attr:`RunStore.read_only` and
:attr:`RunStore.note` say which.

Schema (version :data:`SCHEMA_VERSION`; ``meta`` identifies the file as an mdb run store, and
``PRAGMA application_id`` is :data:`APPLICATION_ID`)::

    meta(key TEXT PRIMARY KEY, value TEXT)
    runs(id, name UNIQUE, kind, config JSON, status, pid, host, started, ended, heartbeat,
         total_steps, last_step, last_loss, paused, reason, fail_step, fail_module,
         checkpoint_step, checkpoint_path, attempt, nonfinite JSON)
    metrics(run_id, step, wall, expert_load JSON (L, E))      PRIMARY KEY (run_id, step)
    metric_names(run_id, id, name)        PRIMARY KEY (run_id, id), UNIQUE (run_id, name)
    scalars(run_id, step, metric, value)  PRIMARY KEY (run_id, step, metric)
    internals(run_id, step, captured, data JSON, tensors BLOB) PRIMARY KEY (run_id, step)
    samples(run_id, step, prompt, text)                      PRIMARY KEY (run_id, step)
    spikes(run_id, step, metric, value, baseline, peak_step, last_step)
                                                     PRIMARY KEY (run_id, step, metric)
    ranks(run_id, rank, host, pid, local_rank, state, last_step, heartbeat, reason)
                                          PRIMARY KEY (run_id, rank)
    rank_steps(run_id, step, rank, wall, step_time, compute_time, expert_load JSON (L, E))
                                          PRIMARY KEY (run_id, step, rank)
    rank_scalars(run_id, step, rank, metric, value) PRIMARY KEY (run_id, step, rank, metric)
    rank_internals(run_id, step, rank, captured, data JSON, tensors BLOB)
                                          PRIMARY KEY (run_id, step, rank)
    findings(run_id, id, kind, step, rank, subject, line, detail JSON, wall)
                                          PRIMARY KEY (run_id, id)
    checks(run_id, step, kind, ranks, compared, differing) PRIMARY KEY (run_id, step, kind)

A step's metrics are any number of named scalars: ``scalars.metric`` is a
``metric_names.id``, numbered per run in the order the names were first logged. SQLite stores
a NaN ``REAL`` as ``NULL``, so a ``scalars`` row with a ``NULL`` value is a NaN, a missing row is
a metric not logged at that step, and infinities round-trip. Times are Unix seconds
(``time.time()``).

``spikes`` holds the loss spikes the writer found as it wrote the steps
(:mod:`hooks.runs.spikes`: one row per episode of the run's loss far above its running median).
The table was added without a version change: a writer creates it in a version-2 database that
lacks it, and a reader of such a database sees no spikes.

A row changed outside mdb (text in a numeric column, a config that is not JSON) is read with
the unreadable fields left empty and :attr:`RunInfo.damaged` saying which; such a run is never
resumed. A metric row that cannot be read raises :class:`DamagedRunError`.

**Distributed runs** (a ``torchrun`` job recorded by ``hooks.run``, see
:mod:`hooks.runs.distributed`) keep the run-level tables as a single process would fill them,
from rank 0's own ``log()`` calls (``scalars``, ``metrics``, ``internals``: what rank 0 logged
and captured), and add every rank's view: ``runs.world_size`` (``NULL`` for a single process),
one ``ranks`` row per rank (its host, pid and liveness), every rank's logged scalars per step
in ``rank_scalars`` (``metric`` ids shared with ``metric_names``), its step time, compute time
and expert load in ``rank_steps``, the captures of ranks other than 0 in ``rank_internals``,
and the cross-rank checks' ``findings`` (a parameter that diverged, a gradient that was not
all-reduced, a rank that died or stopped reporting) and ``checks`` (one row per comparison
made, so that "no finding" can be told from "not checked").

Version 1 (mdb before the ``hooks.run`` API) kept a fixed set of metric columns in
``metrics``; version 2 had no rank tables. :class:`RunStore` migrates such a database to the
current version on open, in one transaction (see :func:`_migrate_v1`, :func:`_migrate_v2`).
A database of a newer version is refused with one line.

This module uses only the standard library (and :mod:`hooks.runs.spikes`, which does too); it
never imports torch, textual or rich.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hooks.runs.listing import latest_names
from hooks.runs.spikes import Spike, SpikeDetector
from hooks.runs.sqlite_open import (
    DEFAULT_DB_ENV,
    DamagedDatabaseError,
    DatabaseLockedError,
    RunStoreError,
    Transaction,
    damaged_error,
    find_damage,
    is_locked,
    lock_wait,
    locked_error,
    not_a_store,
    open_copy,
    open_database,
    set_wal,
)

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
    "default_db_path",
    "loss_metric",
    "pid_alive",
    "validate_run_name",
]

#: Version of the schema below; bumped on any incompatible change.
SCHEMA_VERSION = 3
#: ``PRAGMA application_id`` of an mdb run store: the bytes ``b"mdbR"`` as a big-endian int.
APPLICATION_ID = int.from_bytes(b"mdbR", "big")
#: Value of ``meta.format`` in an mdb run store.
FORMAT_NAME = "mdb-runstore"
#: Default database path, relative to the current directory.
DEFAULT_DB_PATH = Path("runs") / "mdb.sqlite"
#: A running run whose heartbeat is older than this many seconds is reported "gone".
DEFAULT_STALE_AFTER = 15.0
#: How long a connection waits for a lock another process holds, in milliseconds, unless
#: ``$MDB_LOCK_WAIT`` (seconds) says otherwise (:func:`hooks.runs.sqlite_open.lock_wait`).
BUSY_TIMEOUT_MS = 10_000
#: Run statuses as stored in ``runs.status``.
STATUSES = ("running", "finished", "interrupted", "failed")
#: The metrics ``mdb overfit`` logs every step, in the order it logs them; they are also
#: :class:`MetricRow` attributes.
FIXED_METRICS = (
    "ce",
    "aux",
    "total",
    "grad_norm",
    "lr",
    "step_time",
    "tokens_per_s",
    "steps_per_s",
)

_RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,99}$")

_TABLES = {
    "meta": """CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
)""",
    "runs": """CREATE TABLE runs (
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
    attempt         INTEGER NOT NULL DEFAULT 1,
    nonfinite       TEXT,
    world_size      INTEGER
)""",
    "metrics": """CREATE TABLE metrics (
    run_id      INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step        INTEGER NOT NULL,
    wall        REAL NOT NULL,
    expert_load TEXT,
    PRIMARY KEY (run_id, step)
) WITHOUT ROWID""",
    "metric_names": """CREATE TABLE metric_names (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    id     INTEGER NOT NULL,
    name   TEXT NOT NULL,
    PRIMARY KEY (run_id, id),
    UNIQUE (run_id, name)
) WITHOUT ROWID""",
    "scalars": """CREATE TABLE scalars (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step   INTEGER NOT NULL,
    metric INTEGER NOT NULL,
    value  REAL,
    PRIMARY KEY (run_id, step, metric)
) WITHOUT ROWID""",
    "internals": """CREATE TABLE internals (
    run_id   INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step     INTEGER NOT NULL,
    captured REAL NOT NULL,
    data     TEXT NOT NULL,
    tensors  BLOB,
    PRIMARY KEY (run_id, step)
) WITHOUT ROWID""",
    "samples": """CREATE TABLE samples (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step   INTEGER NOT NULL,
    prompt TEXT NOT NULL,
    text   TEXT NOT NULL,
    PRIMARY KEY (run_id, step)
) WITHOUT ROWID""",
    "spikes": """CREATE TABLE spikes (
    run_id    INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step      INTEGER NOT NULL,
    metric    TEXT NOT NULL,
    value     REAL NOT NULL,
    baseline  REAL NOT NULL,
    peak_step INTEGER NOT NULL,
    last_step INTEGER NOT NULL,
    PRIMARY KEY (run_id, step, metric)
) WITHOUT ROWID""",
    "ranks": """CREATE TABLE ranks (
    run_id     INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    rank       INTEGER NOT NULL,
    host       TEXT,
    pid        INTEGER,
    local_rank INTEGER,
    state      TEXT NOT NULL,
    last_step  INTEGER NOT NULL DEFAULT 0,
    heartbeat  REAL,
    reason     TEXT,
    PRIMARY KEY (run_id, rank)
) WITHOUT ROWID""",
    "rank_steps": """CREATE TABLE rank_steps (
    run_id       INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step         INTEGER NOT NULL,
    rank         INTEGER NOT NULL,
    wall         REAL NOT NULL,
    step_time    REAL,
    compute_time REAL,
    expert_load  TEXT,
    PRIMARY KEY (run_id, step, rank)
) WITHOUT ROWID""",
    "rank_scalars": """CREATE TABLE rank_scalars (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step   INTEGER NOT NULL,
    rank   INTEGER NOT NULL,
    metric INTEGER NOT NULL,
    value  REAL,
    PRIMARY KEY (run_id, step, rank, metric)
) WITHOUT ROWID""",
    "rank_internals": """CREATE TABLE rank_internals (
    run_id   INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step     INTEGER NOT NULL,
    rank     INTEGER NOT NULL,
    captured REAL NOT NULL,
    data     TEXT NOT NULL,
    tensors  BLOB,
    PRIMARY KEY (run_id, step, rank)
) WITHOUT ROWID""",
    "findings": """CREATE TABLE findings (
    run_id  INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    id      INTEGER NOT NULL,
    kind    TEXT NOT NULL,
    step    INTEGER,
    rank    INTEGER,
    subject TEXT NOT NULL,
    line    TEXT NOT NULL,
    detail  TEXT,
    wall    REAL NOT NULL,
    PRIMARY KEY (run_id, id)
) WITHOUT ROWID""",
    "checks": """CREATE TABLE checks (
    run_id    INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step      INTEGER NOT NULL,
    kind      TEXT NOT NULL,
    ranks     INTEGER NOT NULL,
    compared  INTEGER NOT NULL,
    differing INTEGER NOT NULL,
    PRIMARY KEY (run_id, step, kind)
) WITHOUT ROWID""",
}

#: The tables a distributed run adds (schema 3).
_RANK_TABLES = ("ranks", "rank_steps", "rank_scalars", "rank_internals", "findings", "checks")


class RunNotFoundError(RunStoreError):
    """No run with the requested name (or id) exists in the database."""


class RunExistsError(RunStoreError):
    """A new run was requested under a name that is already taken."""


class DamagedRunError(RunStoreError):
    """A row of a run holds what mdb never writes there (text in a numeric column, JSON that
    does not parse): the database was changed outside mdb. The message names the run, the
    column and the value."""


class WriterBusyError(RunStoreError):
    """A run cannot be resumed because its writer is still alive."""


def _lock_wait() -> float:
    """Seconds to wait for a lock another process holds (``$MDB_LOCK_WAIT``, else
    :data:`BUSY_TIMEOUT_MS`)."""
    return lock_wait(BUSY_TIMEOUT_MS / 1000)


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

    A run name is 1-100 characters from ``A-Z a-z 0-9 . _ - = +`` starting with a letter or
    digit (it names a checkpoint directory, so no slashes or spaces; ``=`` and ``+`` let
    ``mdb ablate`` name a run after its variant, ``abl-attention=mha+ffn=dense``).
    """
    if not isinstance(name, str) or not _RUN_NAME_RE.match(name):
        shown = repr(name)
        if len(shown) > 120:  # a name of 10,000 characters is not repeated in full
            n = len(name) if isinstance(name, str) else len(shown)
            shown = f"{shown[:110]}… ({n:,} characters)"
        raise RunStoreError(
            f"invalid run name {shown}: use 1-100 characters from A-Z a-z 0-9 . _ - = + "
            "starting with a letter or digit"
        )
    return name


def pid_alive(pid: int | None) -> bool:
    """Whether a process with this id exists on this machine (signal 0 probe).

    A zombie (exited, not yet reaped by its parent) still counts as alive; a process owned by
    another user counts as alive (``EPERM``).
    """
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, OverflowError):
        return False
    return True


def loss_metric(names: Iterable[str]) -> str | None:
    """The metric that stands for "the loss" among ``names``: ``total`` (``mdb overfit``'s
    back-propagated loss), else ``loss``, else the first name containing ``loss``; ``None``
    when none does. It feeds :attr:`RunInfo.last_loss`."""
    names = list(names)
    for key in ("total", "loss"):
        if key in names:
            return key
    return next((n for n in names if "loss" in n), None)


def _nan_to_none(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def _nonfinite_from_failure(
    status: str, reason: str | None, fail_step: int | None, fail_module: str | None
) -> dict[str, Any] | None:
    """The :attr:`RunInfo.nonfinite` finding of a run that :class:`hooks.runs.trainer.Trainer`
    stopped as failed: its reason starts ``non-finite loss`` (the loss, ``total``) or
    ``non-finite gradient`` (``grad_norm``) and names where it started, ``first in MODULE
    (DIRECTION)`` (:meth:`hooks.runs.trainer.NonFiniteInfo.describe`)."""
    if status != "failed" or fail_step is None or not reason:
        return None
    metric = {"non-finite loss": "total", "non-finite gradient": "grad_norm"}.get(
        " ".join(reason.split()[:2]))
    if metric is None:
        return None
    m = re.search(r"first in .*? \((forward|backward|parameter|gradient)\)", reason)
    # a reason written before the origin named its direction: the locator of the time looked
    # forward for a non-finite loss and backward for a non-finite gradient
    legacy = "forward" if metric == "total" else "backward"
    return {"step": fail_step, "metric": metric, "module": fail_module,
            "direction": m.group(1) if m else legacy}


def nonfinite_sentence(nf: Mapping[str, Any]) -> str:
    """A non-finite finding (:attr:`RunInfo.nonfinite`) as one sentence, what, when and where:
    ``non-finite loss at step 131, first in blocks.1.mlp.0 (parameter): its weight holds 1 NaN
    of 4096 values``; ``non-finite loss at step 7 (module not located: …)``."""
    what = f"non-finite {nf.get('metric') or 'value'} at step {nf.get('step')}"
    if nf.get("rank") is not None:
        what += f" on rank {nf['rank']}"
    module, detail = nf.get("module"), nf.get("detail")
    if module is None:
        return f"{what} (module not located" + (f": {detail})" if detail else ")")
    text = f"{what}, first in {module or 'the root module'}"
    if nf.get("direction"):
        text += f" ({nf['direction']})"
    if detail:
        text += f": {detail}"
    return text + (f"; {nf['note']}" if nf.get("note") else "")


_NONFINITE_KEYS = ("step", "metric", "module", "direction", "detail", "note")
#: Where a non-finite value started (:attr:`hooks.runs.origin.Origin.direction`).
_DIRECTIONS = (None, "forward", "backward", "parameter", "gradient")


def _nonfinite_from_json(text: str | None) -> dict[str, Any] | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(d, dict) or not isinstance(d.get("step"), int):
        return None
    out = {k: d.get(k) for k in _NONFINITE_KEYS}
    for key in ("metric", "module", "detail", "note"):
        if not isinstance(out[key], (str, type(None))):
            out[key] = str(out[key])
        if isinstance(out[key], str) and len(out[key]) > 500:
            out[key] = out[key][:500] + "…"
    for key in ("detail", "note"):
        if out[key] is None:
            del out[key]
    if out["direction"] not in _DIRECTIONS:
        out["direction"] = None
    if isinstance(d.get("rank"), int):  # a distributed run: the rank that logged it
        out["rank"] = d["rank"]
    return out


@dataclass(frozen=True)
class RunInfo:
    """One row of ``runs``: a run's identity, configuration and writer status.

    Attributes:
        id: Integer primary key, stable for the life of the database.
        name: Unique run name.
        kind: What wrote it: ``"overfit"`` (``mdb overfit``) or ``"api"`` (``hooks.run``).
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
        last_loss: The loss (see :func:`loss_metric`) of the last step that logged it (``None``
            before the first, or NaN).
        paused: Whether the writer is paused (live screen).
        reason: Why the run ended (``"finished"``, ``"SIGTERM"``, ``"non-finite loss"`` ...).
        fail_step: Step at which a non-finite value appeared (failed runs).
        fail_module: Qualified name of the module whose output was first non-finite, or
            ``None`` when it could not be located.
        checkpoint_step: Step of the last checkpoint, ``None`` if none was written.
        checkpoint_path: Directory of the last checkpoint, relative to the database's directory.
        attempt: 1 for a fresh run, incremented by every resume.
        nonfinite: ``None``, or where a logged value first turned NaN/Inf:
            ``{"step": int, "metric": str | None, "module": str | None,
            "direction": "forward" | "backward" | None}`` — the step, the metric, and the
            first module whose output (forward) or output gradient (backward) was non-finite
            in a capture of that step or the next (``None``: not located, e.g. no capture).
            ``module`` is ``""`` for the model's own (root) forward.
        damaged: ``None``, or one line naming the fields of the row that could not be read
            (text in a numeric column, a config that is not a JSON object...): they hold
            their empty value here (``None``, 0, ``{}``). A damaged run is listed, never
            resumed.
            ``module`` is ``""`` for the model's own (root) forward. In a distributed run it
            also has ``"rank"``: the rank that logged the first non-finite value (the
            earliest step; within a step, the metric logged first), located in that rank's
            capture.
        world_size: The number of ranks of a distributed run (``torchrun``), ``None`` for a
            single process.
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
    nonfinite: dict[str, Any] | None = field(default=None, hash=False)
    world_size: int | None = None
    damaged: str | None = field(default=None, hash=False)

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
        ``gone: ...``; ``damaged`` for a row that could not be read (see :attr:`damaged`)."""
        if self.damaged:
            return "damaged"
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

    def nonfinite_line(self) -> str:
        """The non-finite finding in words, ``""`` without one (:func:`nonfinite_sentence`)."""
        return nonfinite_sentence(self.nonfinite) if self.nonfinite else ""

    def to_dict(self) -> dict[str, Any]:
        """The run as a JSON-serialisable dict."""
        return asdict(self)


@dataclass(frozen=True)
class MetricRow:
    """One training step's metrics: any number of named scalars (a row of ``metrics`` and its
    ``scalars``).

    Attributes:
        step: Step number (1-based for ``mdb overfit``; ``hooks.run`` counts from 1 too).
        wall: When the step was logged (Unix seconds).
        ce: Cross-entropy of the step's forward pass, in nats per token (``None`` = NaN or not
            logged). This and the next attributes are ``values[name]`` for the
            :data:`FIXED_METRICS` that ``mdb overfit`` logs.
        aux: Auxiliary (load-balancing) loss as added to the total (0 for dense models).
        total: ``ce + aux``, the loss that was back-propagated.
        grad_norm: Global L2 norm of all gradients before clipping.
        lr: Learning rate used for the update.
        step_time: Wall time of the step (forward, backward, update), seconds.
        tokens_per_s: Tokens trained on per second in this step.
        steps_per_s: ``1 / step_time``.
        expert_load: Per MoE layer, per expert, fraction of the routed slots (N*k) it received,
            shape (L_moe, E); rows sum to 1. ``None`` for dense models.
        values: Every scalar logged at this step, by name, in first-logged order: a float
            (infinities included) or ``None`` for NaN. A metric not logged at this step is
            absent. Built from the fixed attributes above when not given (a NaN attribute
            becomes ``None``, a ``None`` attribute stays absent).
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
    values: dict[str, float | None] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        values = dict(self.values)
        for name in FIXED_METRICS:
            attr = getattr(self, name)
            if attr is not None and name not in values:
                values[name] = _nan_to_none(float(attr))
            elif attr is None and name in values:
                object.__setattr__(self, name, values[name])
        object.__setattr__(self, "values", values)

    def to_dict(self) -> dict[str, Any]:
        """The row as a JSON-serialisable dict."""
        return asdict(self)


@dataclass(frozen=True)
class SampleRow:
    """A greedy continuation generated during training (a row of ``samples``)."""

    step: int
    prompt: str
    text: str


#: States of a rank of a distributed run (``ranks.state``): reporting; ended as it said; its
#: process no longer exists; no heartbeat for longer than the stale limit; never joined.
RANK_STATES = ("running", "finished", "interrupted", "failed", "dead", "silent", "absent")
#: Kinds of finding of a distributed run (``findings.kind``).
FINDING_KINDS = (
    "param_divergence",  # a parameter's checksum differs across ranks after an optimizer step
    "grad_not_reduced",  # a gradient differs across ranks after backward (not all-reduced)
    "rank_dead",  # a rank's process no longer exists
    "rank_silent",  # a rank stopped reporting (hung, stopped, or dead on another host)
    "rank_failed",  # a rank ended with an exception of its own
    "rank_absent",  # a rank never called hooks.run
    "gather_failed",  # the gathering of per-rank values stopped (one line why)
)


@dataclass(frozen=True)
class RankInfo:
    """One rank of a distributed run (a row of ``ranks``).

    Attributes:
        rank: Its global rank (``RANK``), 0 … world_size − 1.
        host: Host name of its process.
        pid: Process id on that host.
        local_rank: ``LOCAL_RANK`` (its index on its host), if known.
        state: One of :data:`RANK_STATES`.
        last_step: The last step it logged that reached rank 0 (0 before the first).
        heartbeat: When rank 0 last heard from it (rank 0's clock, Unix seconds).
        reason: Why it ended, died or stopped reporting (one line), else ``None``.
    """

    rank: int
    host: str | None
    pid: int | None
    local_rank: int | None
    state: str
    last_step: int
    heartbeat: float | None
    reason: str | None

    def describe(self) -> str:
        """``rank 1 (pid 4242 on vm)``."""
        where = []
        if self.pid is not None:
            where.append(f"pid {self.pid}")
        if self.host:
            where.append(f"on {self.host}")
        return f"rank {self.rank}" + (f" ({' '.join(where)})" if where else "")

    def to_dict(self) -> dict[str, Any]:
        """The rank as a JSON-serialisable dict."""
        return asdict(self)


@dataclass(frozen=True)
class RankRow:
    """One step of one rank of a distributed run (a row of ``rank_steps`` and its
    ``rank_scalars``).

    Attributes:
        step: The step.
        rank: The rank that logged it.
        wall: When that rank logged it (that rank's clock, Unix seconds).
        step_time: Seconds since the rank's previous step was logged (``None`` for its first).
        compute_time: Seconds from the rank's previous ``log()`` until its backward produced the
            gradient of the watched model's first parameter — the rank's own work, before it
            waits for the others in the gradient all-reduce (``None``: not measured, no
            ``run.watch``).
        expert_load: Per MoE layer, per expert, the share of routed slots (L_moe, E) the rank
            logged, or ``None``.
        values: Every scalar the rank logged at this step, by name (``None`` = NaN).
    """

    step: int
    rank: int
    wall: float
    step_time: float | None = None
    compute_time: float | None = None
    expert_load: list[list[float]] | None = None
    values: dict[str, float | None] = field(default_factory=dict, hash=False)

    def to_dict(self) -> dict[str, Any]:
        """The row as a JSON-serialisable dict."""
        return asdict(self)


@dataclass(frozen=True)
class Finding:
    """A check that exists only with several ranks found something (a row of ``findings``).

    Attributes:
        id: 1, 2, … in the order found.
        kind: One of :data:`FINDING_KINDS`.
        step: The step it concerns (``None``: not tied to a step).
        rank: The rank it names (``None``: it names a parameter of several ranks).
        subject: The parameter's qualified name, or ``rank N``.
        line: One line for the user, naming the parameter or the rank (with its host and pid).
        detail: The evidence (checksums by rank, heartbeat ages …).
        wall: When rank 0 found it (Unix seconds).
    """

    id: int
    kind: str
    step: int | None
    rank: int | None
    subject: str
    line: str
    detail: dict[str, Any] = field(default_factory=dict, hash=False)
    wall: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The finding as a JSON-serialisable dict."""
        return asdict(self)


@dataclass(frozen=True)
class RunUpdate:
    """Everything new about a run since a reader's cursor, read in one snapshot.

    Attributes:
        run: The run row at the time of the snapshot.
        metrics: Steps with ``step > after_step``, in step order.
        samples: Samples with ``step > after_step``, in step order.
        internals_steps: Steps with captured internals and ``step > after_step``.
        spikes: Loss spikes whose episode lasted past ``after_step`` (new ones, and ones whose
            peak or end moved), in step order (:meth:`RunStore.spikes`).
        restarted: True when the run was resumed from an earlier checkpoint than the reader's
            cursor (``run.last_step < after_step``): the reader should drop what it has after
            ``run.checkpoint_step`` and read again from there.
    """

    run: RunInfo
    metrics: list[MetricRow] = field(default_factory=list)
    samples: list[SampleRow] = field(default_factory=list)
    internals_steps: list[int] = field(default_factory=list)
    restarted: bool = False
    spikes: list[Spike] = field(default_factory=list)

    @property
    def last_step(self) -> int:
        """The cursor to pass as ``after_step`` next time."""
        return self.metrics[-1].step if self.metrics else self.run.last_step


#: The columns of ``runs`` as :func:`_run_from_row` reads them: (kind, may be NULL).
_RUN_COLUMNS: dict[str, tuple[str, bool]] = {
    "id": ("int", False), "name": ("text", False), "kind": ("text", False),
    "status": ("status", False), "pid": ("int", True), "host": ("text", True),
    "started": ("real", False), "ended": ("real", True), "heartbeat": ("real", True),
    "total_steps": ("int", True), "last_step": ("int", False), "last_loss": ("real", True),
    "paused": ("int", False), "reason": ("text", True), "fail_step": ("int", True),
    "fail_module": ("text", True), "checkpoint_step": ("int", True),
    "checkpoint_path": ("text", True), "attempt": ("int", False),
}
_EMPTY = {"int": 0, "real": 0.0, "text": "", "status": "failed"}
_KIND_WORDS = {"int": "an integer", "real": "a number", "text": "text",
               "status": "one of " + "/".join(STATUSES)}


def _cell(kind: str, value: Any) -> tuple[bool, Any]:
    """``(readable, value)`` of one stored value of a column of this kind."""
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return False, None
    if kind == "real":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, None
    if kind == "status":
        return value in STATUSES, value
    return isinstance(value, str), value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _run_from_row(row: sqlite3.Row) -> RunInfo:
    """A :class:`RunInfo` from a ``runs`` row; what cannot be read is left empty and named in
    :attr:`RunInfo.damaged` (a row changed outside mdb never raises here)."""
    problems: list[str] = []
    fields: dict[str, Any] = {}
    for name, (kind, nullable) in _RUN_COLUMNS.items():
        value = row[name]
        if value is None and nullable:
            fields[name] = None
            continue
        ok, got = _cell(kind, value) if value is not None else (False, None)
        if not ok:
            problems.append(f"runs.{name} holds {_shown(value)}, not {_KIND_WORDS[kind]}")
            got = None if nullable else _EMPTY[kind]
        fields[name] = got
    config: Any = {}
    text = row["config"]
    try:
        config = json.loads(text) if isinstance(text, str) and text else {}
    except (json.JSONDecodeError, RecursionError):
        config = None
    if not isinstance(config, dict):
        problems.append(f"runs.config holds {_shown(text)}, not a JSON object")
        config = {}
    damaged = None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        damaged = (f"run {fields['name'] or fields['id']!r} cannot be read: {problems[0]}{more}; "
                   "the database was changed outside mdb")
    return RunInfo(
        config=config,
        paused=bool(fields.pop("paused")),
        nonfinite=_nonfinite_from_json(row["nonfinite"]),
        world_size=row["world_size"] if "world_size" in row.keys() else None,
        damaged=damaged,
        **fields,
    )


# ---------------------------------------------------------------------------------------------
# Schema versions
# ---------------------------------------------------------------------------------------------


def _create_schema(conn: sqlite3.Connection) -> None:
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    for sql in _TABLES.values():
        conn.execute(sql)
    conn.executemany(
        "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
        [
            ("format", FORMAT_NAME),
            ("schema_version", str(SCHEMA_VERSION)),
            ("created", str(time.time())),
        ],
    )


#: Version 1's metric columns that a writer always filled (``NULL`` there was a NaN), and those
#: that were ``NULL`` when not measured.
_V1_NAN_WHEN_NULL = ("ce", "aux", "total", "grad_norm", "lr")
_V1_ABSENT_WHEN_NULL = ("step_time", "tokens_per_s", "steps_per_s")


def _migrate_v1(conn: sqlite3.Connection) -> None:
    """Version 1 → 2, inside the caller's write transaction; nothing is lost.

    Version 1's ``metrics`` table had one column per metric (:data:`FIXED_METRICS`). For each
    run, each column becomes a metric name (in that order) if any of the run's rows has a
    value in it; its values become ``scalars`` rows. In version 1 ``NULL`` meant NaN or "not
    measured": in ``ce``/``aux``/``total``/``grad_norm``/``lr`` of a run that logged the
    column it becomes a NaN (what version 1 showed), in ``step_time``/``tokens_per_s``/
    ``steps_per_s`` (``None`` when a step's time was not measurable) the value is absent.
    ``runs`` gains ``nonfinite``, filled for runs the trainer stopped on a non-finite value.
    """
    conn.execute("ALTER TABLE runs ADD COLUMN nonfinite TEXT")
    conn.execute(_TABLES["metric_names"])
    conn.execute(_TABLES["scalars"])
    run_ids = [r[0] for r in conn.execute("SELECT DISTINCT run_id FROM metrics")]
    for run_id in run_ids:
        next_id = 1
        for name in FIXED_METRICS:
            (has,) = conn.execute(
                f"SELECT EXISTS (SELECT 1 FROM metrics WHERE run_id = ? AND {name} IS NOT NULL)",
                (run_id,),
            ).fetchone()
            if not has:
                continue
            conn.execute(
                "INSERT INTO metric_names (run_id, id, name) VALUES (?, ?, ?)",
                (run_id, next_id, name),
            )
            where = "" if name in _V1_NAN_WHEN_NULL else f" AND {name} IS NOT NULL"
            conn.execute(
                f"INSERT INTO scalars (run_id, step, metric, value) SELECT run_id, step, ?, "
                f"{name} FROM metrics WHERE run_id = ?{where}",
                (next_id, run_id),
            )
            next_id += 1
    conn.execute(_TABLES["metrics"].replace("CREATE TABLE metrics", "CREATE TABLE metrics_v2"))
    conn.execute(
        "INSERT INTO metrics_v2 (run_id, step, wall, expert_load) "
        "SELECT run_id, step, wall, expert_load FROM metrics"
    )
    conn.execute("DROP TABLE metrics")
    conn.execute("ALTER TABLE metrics_v2 RENAME TO metrics")
    rows = conn.execute(
        "SELECT id, status, reason, fail_step, fail_module FROM runs WHERE status = 'failed'"
    ).fetchall()
    for r in rows:
        nf = _nonfinite_from_failure(r[1], r[2], r[3], r[4])
        if nf is not None:
            conn.execute("UPDATE runs SET nonfinite = ? WHERE id = ?", (json.dumps(nf), r[0]))
    conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")


def _migrate_v2(conn: sqlite3.Connection) -> None:
    """Version 2 → 3, inside the caller's write transaction; nothing is lost: ``runs`` gains
    ``world_size`` (``NULL``: every run of version 2 was a single process) and the tables of
    distributed runs are created empty (:data:`_RANK_TABLES`)."""
    conn.execute("ALTER TABLE runs ADD COLUMN world_size INTEGER")
    for name in _RANK_TABLES:
        conn.execute(_TABLES[name])
    conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")


#: Migrations by the version they start from.
_MIGRATIONS = {1: _migrate_v1, 2: _migrate_v2}


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
        opened = open_database(self.path, create=create, wait=_lock_wait())
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
                raise locked_error(self.path, time.monotonic() - t0) from exc
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
            self.connection.execute(_TABLES["spikes"].replace("CREATE TABLE",
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
        if version not in _MIGRATIONS:
            raise RunStoreError(
                f"{self.path} has schema version {version}, which this mdb cannot read"
            )
        if self.read_only and self._copy_dir is None:
            self.connection.close()
            opened = open_copy(self.path, (self.note or f"{self.path} is read-only") +
                                f"; its schema {version} is upgraded in a private copy",
                               _lock_wait())
            self._conn, self.note, self._copy_dir = opened.conn, opened.note, opened.copy_dir
        conn = self.connection
        with self._transaction():
            # another process may have migrated it meanwhile: read the version again, locked
            (current,) = conn.execute(
                "SELECT value FROM meta WHERE key = 'schema_version'"
            ).fetchone()
            v = int(current)
            while v < SCHEMA_VERSION:
                _MIGRATIONS[v](conn)
                v += 1

    def _init_schema(self) -> bool:
        """Create the schema of a new database, in one write transaction that first looks
        again whether another process created it meanwhile (writers creating one database
        at once): whether this process created it."""
        conn = self.connection
        mode = set_wal(conn, self.path, _lock_wait())
        if mode.lower() != "wal":
            raise RunStoreError(f"cannot put {self.path} in WAL mode (got {mode!r})")
        with self._transaction():
            if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                return False
            _create_schema(conn)
        return True

    def _transaction(self, immediate: bool = True) -> Transaction:
        """A transaction (:class:`hooks.runs.sqlite_open.Transaction`): ``BEGIN IMMEDIATE``
        for writes, ``BEGIN`` for a consistent multi-statement read; a write lock another
        process holds past the lock wait raises :class:`DatabaseLockedError`."""
        return Transaction(self.connection, self.path, immediate)

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

    def damage(self) -> str | None:
        """How the database file is damaged, from ``PRAGMA quick_check``
        (:func:`hooks.runs.sqlite_open.find_damage`): ``None`` for a sound one. A store
        refuses to create or resume a run in a damaged one (:class:`DamagedDatabaseError`)."""
        return find_damage(self.connection)

    # -- reading ---------------------------------------------------------------------------

    def runs(self) -> list[RunInfo]:
        """All runs, oldest first."""
        rows = self.connection.execute("SELECT * FROM runs ORDER BY started, id").fetchall()
        return [_run_from_row(r) for r in rows]

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
        return _run_from_row(row)

    def latest_run(self) -> RunInfo | None:
        """The most recently started run, or ``None`` if there is none."""
        row = self.connection.execute(
            "SELECT * FROM runs ORDER BY started DESC, id DESC LIMIT 1"
        ).fetchone()
        return _run_from_row(row) if row is not None else None

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
            if not _cell("int", step)[0]:
                raise self._damaged(run_id, f"metrics.step holds {_shown(step)}, not an integer")
            if not _cell("real", wall)[0]:
                raise self._damaged(run_id, f"metrics.wall of step {step} holds {_shown(wall)}, "
                                    "not a number")
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
            if value is not None and not _cell("real", value)[0]:
                raise self._damaged(run_id, f"the value of {name} at step {step} is "
                                    f"{_shown(value)}, not a number")
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
                isinstance(layer, list) and all(_cell("real", f)[0] for f in layer)
                for layer in load)):
            raise self._damaged(run_id, f"metrics.expert_load of step {step} holds "
                                f"{_shown(text)}, not a list of per-layer lists of fractions")
        return [[float(f) for f in layer] for layer in load] or None

    def _damaged(self, run_id: int, what: str) -> DamagedRunError:
        row = self.connection.execute("SELECT name FROM runs WHERE id = ?", (run_id,)).fetchone()
        name = row[0] if row is not None else run_id
        return DamagedRunError(f"run {name!r} in {self.path} cannot be read: {what}; the "
                               "database was changed outside mdb")

    def spikes(self, run_id: int, after_step: int = 0) -> list[Spike]:
        """The loss spikes the writer recorded (:mod:`hooks.runs.spikes`), in step order:
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
            if not (all(_cell("int", v)[0] for v in (step, peak, last))
                    and all(_cell("real", v)[0] for v in (value, baseline))
                    and isinstance(metric, str)):
                raise self._damaged(run_id, f"the spike row of step {_shown(step)} holds values "
                                    "that are not numbers")
            out.append(Spike(int(step), metric, float(value), float(baseline), int(peak),
                             int(last)))
        return out

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
                if _cell("int", r["step"])[0]]

    def internals_steps(self, run_id: int, after_step: int = 0) -> list[int]:
        """Steps of a run that have captured internals, in order."""
        rows = self.connection.execute(
            "SELECT step FROM internals WHERE run_id = ? AND step > ? ORDER BY step",
            (run_id, after_step),
        )
        return [r[0] for r in rows if _cell("int", r[0])[0]]

    def internals(self, run_id: int, step: int) -> dict[str, Any] | None:
        """The internals captured at ``step`` (a JSON dict, see the training loop), or ``None``.

        For a step captured by :class:`hooks.runs.trainer.Trainer` or by ``Run.watch`` this is
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

    # -- distributed runs ------------------------------------------------------------------

    def ranks(self, run_id: int) -> list[RankInfo]:
        """The ranks of a distributed run, by rank (empty for a single process)."""
        rows = self.connection.execute(
            "SELECT rank, host, pid, local_rank, state, last_step, heartbeat, reason FROM ranks"
            " WHERE run_id = ? ORDER BY rank", (run_id,),
        ).fetchall()
        return [RankInfo(*tuple(r)) for r in rows]

    def rank_steps(self, run_id: int, after_step: int = 0,
                   rank: int | None = None) -> list[RankRow]:
        """Every rank's steps with ``step > after_step`` (of ``rank`` alone if given), in
        (step, rank) order, each with every scalar that rank logged (:class:`RankRow`)."""
        with self._transaction(immediate=False):
            conn = self.connection
            where, params = "run_id = ? AND step > ?", [run_id, after_step]
            if rank is not None:
                where += " AND rank = ?"
                params.append(int(rank))
            rows = conn.execute(
                f"SELECT step, rank, wall, step_time, compute_time, expert_load FROM rank_steps"
                f" WHERE {where} ORDER BY step, rank", params,
            ).fetchall()
            if not rows:
                return []
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
        return json.loads(row[0]) if row is not None else None

    def rank_internals_tensors(self, run_id: int, step: int, rank: int) -> bytes | None:
        """The tensors of :meth:`rank_internals` (safetensors bytes), or ``None``."""
        if rank == 0:
            return self.internals_tensors(run_id, step)
        row = self.connection.execute(
            "SELECT tensors FROM rank_internals WHERE run_id = ? AND step = ? AND rank = ?",
            (run_id, step, rank),
        ).fetchone()
        return bytes(row[0]) if row is not None and row[0] is not None else None

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
        ``"compared"`` tensors, ``"differing"`` ones ``}``."""
        rows = self.connection.execute(
            "SELECT step, kind, ranks, compared, differing FROM checks WHERE run_id = ?"
            " ORDER BY step, kind", (run_id,),
        ).fetchall()
        return [dict(zip(("step", "kind", "ranks", "compared", "differing"), tuple(r),
                         strict=True)) for r in rows]

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


def _metric_mapping(metrics: MetricRow | Mapping[str, Any]) -> tuple[int, Any, Any, dict]:
    """``(step, wall, expert_load, values)`` of a :class:`MetricRow` or a mapping of its field
    names; other keys of a mapping are scalars too (a ``None`` value: not logged)."""
    if isinstance(metrics, MetricRow):
        return metrics.step, metrics.wall, metrics.expert_load, metrics.values
    m = dict(metrics)
    step = int(m.pop("step"))
    wall = m.pop("wall", None)
    load = m.pop("expert_load", None)
    values: dict[str, Any] = {}
    for name, v in dict(m.pop("values", None) or {}).items():
        values[name] = v
    for name, v in m.items():
        if v is not None and name not in values:
            values[name] = v
    return step, wall, load, values


class RunWriter:
    """Writes one run: its steps, heartbeat, checkpoint record and final status.

    Obtain it from :meth:`RunStore.create_run` or :meth:`RunStore.resume_run`. Use it from one
    thread (the training thread, or ``hooks.run``'s writer thread); the heartbeat thread
    started by :meth:`start_heartbeat` uses its own connection.

    As it writes the steps it watches the run's loss (:func:`loss_metric`) for spikes
    (:class:`hooks.runs.spikes.SpikeDetector`, seeded from the steps already stored when the
    run was resumed) and records each episode in ``spikes`` in the same transaction.

    Attributes:
        spikes: The spikes this writer recorded, in step order, each in its latest state (its
            peak and last step move while the episode lasts).
    """

    def __init__(self, store: RunStore, run_id: int, name: str):
        self.store = store
        self.run_id = run_id
        self.name = name
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._closed = False
        self._ids: dict[str, int] | None = None
        self._detector: SpikeDetector | None = None
        self._detected_step: int | None = None  # the last step the detector was given
        self.spikes: list[Spike] = []

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
        """Write one step atomically: metrics row and scalars, optional internals and sample,
        run row.

        Args:
            metrics: A :class:`MetricRow` or a mapping with its field names (``step`` required;
                ``wall`` defaults to now; ``values`` and any other key are scalars by name; a
                ``None`` value is not logged, a NaN is).
            internals: JSON-serialisable captured statistics of this step.
            sample: ``(prompt, continuation)`` generated at this step.
            tensors: Opaque bytes stored with the internals (safetensors of the capture's
                tensors); ignored without ``internals``.
        """
        self.log_steps([(metrics, internals, sample, tensors)])

    def _metric_ids(self, conn: sqlite3.Connection) -> dict[str, int]:
        if self._ids is None:
            rows = conn.execute(
                "SELECT id, name FROM metric_names WHERE run_id = ?", (self.run_id,)
            )
            self._ids = {r[1]: r[0] for r in rows}
        return self._ids

    def log_steps(
        self,
        steps: Iterable[tuple[Any, ...]],
    ) -> None:
        """Write several steps in one transaction.

        A step logged again merges into the stored one: its scalars are added (a name logged
        twice keeps the later value) and ``wall`` is updated.

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
            step, wall, load, values = _metric_mapping(metrics)
            rows.append((step, now if wall is None else float(wall),
                         json.dumps(load) if load is not None else None, values))
            if internals is not None:
                data = json.dumps(internals, default=_jsonable)
                blob = sqlite3.Binary(tensors) if tensors is not None else None
                extras_i.append((self.run_id, step, now, data, blob))
            if sample is not None:
                extras_s.append((self.run_id, step, sample[0], sample[1]))
        if not rows:
            return
        found: list[Spike] = []
        try:
            with self.store._transaction() as conn:
                self._write(conn, rows, extras_i, extras_s, now, found)
        except BaseException:
            self._ids = None  # names added in the rolled-back transaction are not stored
            self._detector = None  # nor its steps: seeded again from the database
            raise
        for spike in found:
            if self.spikes and self.spikes[-1].step == spike.step:
                self.spikes[-1] = spike
            else:
                self.spikes.append(spike)

    def _spike_detector(self, conn: sqlite3.Connection, key: str) -> SpikeDetector:
        """The detector of ``key``, seeded from what the database holds of it (a resume)."""
        det = self._detector
        if det is not None and det.metric == key:
            return det
        det = self._detector = SpikeDetector(key)
        self._detected_step = None
        mid = (self._ids or {}).get(key)
        if mid is not None:
            sql = ("SELECT step, value FROM scalars WHERE run_id = ? AND metric = ?"
                   " ORDER BY step {} LIMIT ?")
            first = conn.execute(sql.format("ASC"), (self.run_id, mid, det.min_history))
            last = conn.execute(sql.format("DESC"),
                                (self.run_id, mid, det.window)).fetchall()[::-1]
            det.seed([v for _s, v in first], [v for _s, v in last])
            if last:
                self._detected_step = last[-1][0]
        return det

    def _detect(self, conn: sqlite3.Connection, key: str | None, rows, found: list) -> None:
        if key is None:
            return
        det = self._spike_detector(conn, key)
        upserts = []
        for step, _w, _l, values in sorted(rows, key=lambda r: r[0]):
            if key not in values or (self._detected_step is not None
                                     and step <= self._detected_step):
                continue  # a step logged again (hooks.run adds to it) is seen once
            self._detected_step = step
            v = values[key]
            spike = det.observe(step, None if v is None else float(v))
            if spike is not None:
                found.append(spike)
                upserts.append((self.run_id, spike.step, spike.metric, spike.value,
                                spike.baseline, spike.peak_step, spike.last_step))
        if upserts:
            conn.executemany(
                "INSERT INTO spikes (run_id, step, metric, value, baseline, peak_step,"
                " last_step) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, step, metric)"
                " DO UPDATE SET value = excluded.value, peak_step = excluded.peak_step,"
                " last_step = excluded.last_step", upserts)

    def _metric_id(self, conn: sqlite3.Connection, ids: dict[str, int], name: str) -> int:
        mid = ids.get(name)
        if mid is None:
            mid = len(ids) + 1
            conn.execute(
                "INSERT INTO metric_names (run_id, id, name) VALUES (?, ?, ?)",
                (self.run_id, mid, str(name)),
            )
            ids[name] = mid
        return mid

    def _write(self, conn, rows, extras_i, extras_s, now, found) -> None:
        ids = self._metric_ids(conn)
        self._detect(conn, loss_metric([*ids, *(n for r in rows for n in r[3])]), rows, found)
        scalars = []
        for step, _wall, _load, values in rows:
            for name, v in values.items():
                mid = self._metric_id(conn, ids, name)
                scalars.append((self.run_id, step, mid, None if v is None else float(v)))
        conn.executemany(
            "INSERT INTO metrics (run_id, step, wall, expert_load) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (run_id, step) DO UPDATE SET wall = excluded.wall,"
            " expert_load = COALESCE(excluded.expert_load, expert_load)",
            [(self.run_id, s, w, load) for s, w, load, _ in rows],
        )
        conn.executemany(
            "INSERT OR REPLACE INTO scalars (run_id, step, metric, value) VALUES (?, ?, ?, ?)",
            scalars,
        )
        if extras_i:
            conn.executemany(
                "INSERT OR REPLACE INTO internals (run_id, step, captured, data, tensors)"
                " VALUES (?, ?, ?, ?, ?)",
                extras_i,
            )
        if extras_s:
            conn.executemany(
                "INSERT OR REPLACE INTO samples (run_id, step, prompt, text) VALUES (?, ?, ?, ?)",
                extras_s,
            )
        last_step = max(r[0] for r in rows)
        loss = None
        key = loss_metric(ids)  # the run's loss metric, from every name it logged so far
        for _step, _w, _l, values in rows:
            if key is not None and key in values:
                v = values[key]
                loss = (None if v is None else float(v),)
        if loss is None:
            conn.execute(
                "UPDATE runs SET last_step = MAX(last_step, ?), heartbeat = ? WHERE id = ?",
                (last_step, now, self.run_id),
            )
        else:
            conn.execute(
                "UPDATE runs SET last_step = MAX(last_step, ?), last_loss = ?, heartbeat = ?"
                " WHERE id = ?",
                (last_step, loss[0], now, self.run_id),
            )

    # -- distributed runs ------------------------------------------------------------------

    def set_world_size(self, world_size: int) -> None:
        """Record that this run is a distributed job of ``world_size`` ranks."""
        with self.store._transaction() as conn:
            conn.execute("UPDATE runs SET world_size = ? WHERE id = ?",
                         (int(world_size), self.run_id))

    def set_ranks(self, ranks: Iterable[Mapping[str, Any]]) -> None:
        """Insert or update rows of ``ranks``, in one transaction.

        Args:
            ranks: Mappings with ``rank`` and any of ``host``, ``pid``, ``local_rank``,
                ``state`` (:data:`RANK_STATES`), ``last_step``, ``heartbeat``, ``reason``; a
                key left out keeps the stored value (``last_step`` only grows).

        Raises:
            ValueError: An unknown state.
        """
        rows = []
        for r in ranks:
            state = r.get("state")
            if state is not None and state not in RANK_STATES:
                raise ValueError(f"unknown rank state {state!r}")
            rows.append((self.run_id, int(r["rank"]), r.get("host"), r.get("pid"),
                         r.get("local_rank"), state or "running", int(r.get("last_step") or 0),
                         r.get("heartbeat"), r.get("reason"), "reason" in r))
        if not rows:
            return
        with self.store._transaction() as conn:
            for (run_id, rank, host, pid, local, state, step, beat, reason, has_reason) in rows:
                conn.execute(
                    "INSERT INTO ranks (run_id, rank, host, pid, local_rank, state, last_step,"
                    " heartbeat, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (run_id, rank) DO UPDATE SET"
                    " host = COALESCE(excluded.host, host), pid = COALESCE(excluded.pid, pid),"
                    " local_rank = COALESCE(excluded.local_rank, local_rank),"
                    " state = excluded.state, last_step = MAX(last_step, excluded.last_step),"
                    " heartbeat = COALESCE(excluded.heartbeat, heartbeat),"
                    " reason = CASE WHEN ? THEN excluded.reason ELSE reason END",
                    (run_id, rank, host, pid, local, state, step, beat, reason, int(has_reason)),
                )

    def log_rank_steps(
        self,
        rank: int,
        rows: Iterable[Mapping[str, Any]],
        internals: Iterable[tuple[int, Mapping[str, Any], bytes | None]] = (),
    ) -> None:
        """Write steps of one rank of a distributed run in one transaction (a step written again
        merges, as in :meth:`log_steps`).

        Args:
            rank: The rank.
            rows: Mappings with the fields of :class:`RankRow` (``step`` and ``wall``
                required; ``values``: scalars by name, ``None`` or NaN = NaN).
            internals: ``(step, trace dict, safetensors bytes or None)`` of the rank's
                captures (for rank 0 use :meth:`log_steps`: its captures are the run's).
        """
        rank = int(rank)
        prepared = []
        for r in rows:
            load = r.get("expert_load")
            prepared.append((int(r["step"]), float(r["wall"]), r.get("step_time"),
                             r.get("compute_time"),
                             json.dumps(load) if load is not None else None,
                             dict(r.get("values") or {})))
        extras = [(self.run_id, int(step), rank, time.time(),
                   json.dumps(data, default=_jsonable),
                   sqlite3.Binary(blob) if blob is not None else None)
                  for step, data, blob in internals]
        if not prepared and not extras:
            return
        try:
            with self.store._transaction() as conn:
                ids = self._metric_ids(conn)
                conn.executemany(
                    "INSERT INTO rank_steps (run_id, step, rank, wall, step_time, compute_time,"
                    " expert_load) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, step, rank)"
                    " DO UPDATE SET wall = excluded.wall,"
                    " step_time = COALESCE(excluded.step_time, step_time),"
                    " compute_time = COALESCE(excluded.compute_time, compute_time),"
                    " expert_load = COALESCE(excluded.expert_load, expert_load)",
                    [(self.run_id, st, rank, w, t, c, load)
                     for st, w, t, c, load, _ in prepared],
                )
                scalars = []
                for st, _w, _t, _c, _l, values in prepared:
                    for name, v in values.items():
                        mid = self._metric_id(conn, ids, name)
                        x = None if v is None or (isinstance(v, float) and math.isnan(v)) \
                            else float(v)
                        scalars.append((self.run_id, st, rank, mid, x))
                conn.executemany(
                    "INSERT OR REPLACE INTO rank_scalars (run_id, step, rank, metric, value)"
                    " VALUES (?, ?, ?, ?, ?)", scalars,
                )
                if extras:
                    conn.executemany(
                        "INSERT OR REPLACE INTO rank_internals (run_id, step, rank, captured,"
                        " data, tensors) VALUES (?, ?, ?, ?, ?, ?)", extras,
                    )
                if prepared:
                    conn.execute(
                        "UPDATE ranks SET last_step = MAX(last_step, ?) WHERE run_id = ?"
                        " AND rank = ?", (max(p[0] for p in prepared), self.run_id, rank),
                    )
        except BaseException:
            self._ids = None
            raise

    def add_findings(self, findings: Iterable[Mapping[str, Any]]) -> None:
        """Append findings (:class:`Finding` fields but ``id`` and ``wall``, which are
        assigned), in one transaction.

        Raises:
            ValueError: An unknown kind, or no ``subject`` / ``line``.
        """
        rows = []
        for f in findings:
            if f.get("kind") not in FINDING_KINDS:
                raise ValueError(f"unknown finding kind {f.get('kind')!r}")
            if not f.get("subject") or not f.get("line"):
                raise ValueError("a finding needs a subject and a line")
            rows.append(f)
        if not rows:
            return
        now = time.time()
        with self.store._transaction() as conn:
            (last,) = conn.execute("SELECT COALESCE(MAX(id), 0) FROM findings WHERE run_id = ?",
                                   (self.run_id,)).fetchone()
            conn.executemany(
                "INSERT INTO findings (run_id, id, kind, step, rank, subject, line, detail, wall)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(self.run_id, last + i, f["kind"], f.get("step"), f.get("rank"),
                  str(f["subject"]), str(f["line"])[:1000],
                  json.dumps(f.get("detail") or {}, default=_jsonable), now)
                 for i, f in enumerate(rows, start=1)],
            )

    def add_checks(self, checks: Iterable[Mapping[str, Any]]) -> None:
        """Record cross-rank comparisons (see :meth:`RunStore.checks`), in one transaction."""
        rows = [(self.run_id, int(c["step"]), str(c["kind"]), int(c["ranks"]),
                 int(c["compared"]), int(c["differing"])) for c in checks]
        if not rows:
            return
        with self.store._transaction() as conn:
            conn.executemany(
                "INSERT OR REPLACE INTO checks (run_id, step, kind, ranks, compared, differing)"
                " VALUES (?, ?, ?, ?, ?, ?)", rows,
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

    def set_nonfinite(self, nonfinite: Mapping[str, Any] | None) -> None:
        """Record where a logged value first turned NaN/Inf (:attr:`RunInfo.nonfinite`).

        Args:
            nonfinite: ``{"step": int, "metric": str | None, "module": str | None,
                "direction": "forward" | "backward" | "parameter" | "gradient" | None}``, and
                optionally ``"detail"`` and ``"note"`` (strings, see
                :class:`hooks.runs.origin.Origin`), or ``None`` to clear it.

        Raises:
            ValueError: No integer ``step``, or an unknown ``direction``.
        """
        text = None
        if nonfinite is not None:
            nf = {k: nonfinite.get(k) for k in _NONFINITE_KEYS}
            if nonfinite.get("rank") is not None:
                nf["rank"] = int(nonfinite["rank"])
            if not isinstance(nf["step"], int):
                raise ValueError(f"nonfinite needs an integer step, got {nf['step']!r}")
            for key in ("detail", "note"):
                if nf[key] is None:
                    del nf[key]
            if nf["direction"] not in _DIRECTIONS:
                raise ValueError(f"direction must be one of {_DIRECTIONS}, not "
                                 f"{nf['direction']!r}")
            text = json.dumps(nf)
        with self.store._transaction() as conn:
            conn.execute("UPDATE runs SET nonfinite = ? WHERE id = ?", (text, self.run_id))

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

        A ``failed`` status whose reason is the trainer's ``non-finite loss ...`` or
        ``non-finite gradient ...`` also records :attr:`RunInfo.nonfinite` (unless one is
        recorded already).

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
        nf = _nonfinite_from_failure(status, reason, fail_step, fail_module)
        with self.store._transaction() as conn:
            conn.execute(
                "UPDATE runs SET status = ?, ended = ?, heartbeat = ?, reason = ?, fail_step = ?,"
                " fail_module = ?, paused = 0, nonfinite = COALESCE(nonfinite, ?) WHERE id = ?",
                (status, now, now, reason, fail_step, fail_module,
                 json.dumps(nf) if nf else None, self.run_id),
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
            try:
                conn = open_database(path, create=False, wait=_lock_wait()).conn
            except (RunStoreError, sqlite3.Error):  # locked, or gone: the writer's own writes say
                return
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
