"""The run database's file format: what identifies it, its tables, and the migrations of
older versions.

Schema (version :data:`SCHEMA_VERSION`; ``meta`` identifies the file as an mdb run store, and
``PRAGMA application_id`` is :data:`APPLICATION_ID`)::

    meta(key TEXT PRIMARY KEY, value TEXT)
    runs(id, name UNIQUE, kind, config JSON, status, pid, host, started, ended, heartbeat,
         total_steps, last_step, last_loss, paused, reason, fail_step, fail_module,
         checkpoint_step, checkpoint_path, attempt, nonfinite JSON, world_size, writer JSON)
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
    latest(run_id, metric, step, value)                     PRIMARY KEY (run_id, metric)
    blocks(run_id, metric, block, first_step, last_step, count, n, total, lo, hi)
                                                  PRIMARY KEY (run_id, metric, block)
    summary(run_id PRIMARY KEY, captures, last_capture)

A step's metrics are any number of named scalars: ``scalars.metric`` is a
``metric_names.id``, numbered per run in the order the names were first logged. SQLite stores
a NaN ``REAL`` as ``NULL``, so a ``scalars`` row with a ``NULL`` value is a NaN, a missing row is
a metric not logged at that step, and infinities round-trip. Times are Unix seconds
(``time.time()``).

``spikes`` holds the loss spikes the writer found as it wrote the steps
(:mod:`hooks.store.spikes`: one row per episode of the run's loss far above its running median).
The table was added without a version change: a writer creates it in a version-2 database that
lacks it, and a reader of such a database sees no spikes.

``runs.writer`` (JSON ``{"pid", "host", "start"}``: the writing process, named by its start
time too, :mod:`hooks.store.liveness`) was added without a version change as well: a writer
adds the column to a database that lacks it; a reader of a row without it judges the writer
by its pid and heartbeat, as before.

**Distributed runs** (a ``torchrun`` job recorded by ``hooks.run``, see
:mod:`hooks.dist.distributed`) keep the run-level tables as a single process would fill them,
from rank 0's own ``log()`` calls (``scalars``, ``metrics``, ``internals``: what rank 0 logged
and captured), and add every rank's view: ``runs.world_size`` (``NULL`` for a single process),
one ``ranks`` row per rank (its host, pid and liveness), every rank's logged scalars per step
in ``rank_scalars`` (``metric`` ids shared with ``metric_names``), its step time, compute time
and expert load in ``rank_steps``, the captures of ranks other than 0 in ``rank_internals``,
and the cross-rank checks' ``findings`` (a parameter that diverged, a gradient that was not
all-reduced, a rank that died or stopped reporting) and ``checks`` (one row per comparison
made, so that "no finding" can be told from "not checked").

``latest``, ``blocks`` and ``summary`` are what the writer keeps so that a reader never scans a
long run (``mdb runs``, the first frame of ``mdb watch``): each metric's latest value, its
aggregates per block of 64 steps, and the number of captured steps
(:mod:`hooks.store.summary`).

Version 1 (mdb before the ``hooks.run`` API) kept a fixed set of metric columns in
``metrics``; version 2 had no rank tables; version 3 had no ``latest``, ``blocks`` and
``summary``. :class:`hooks.store.store.RunStore` migrates such a
database to the current version on open, in one transaction (see :func:`_migrate_v1`,
:func:`_migrate_v2`, :func:`_migrate_v3`).
A database of a newer version is refused with one line.

:data:`BUSY_TIMEOUT_MS` (and ``$MDB_LOCK_WAIT``) is how long a connection to the file waits
for a lock another process holds.

Part of the run store (:mod:`hooks.store.store`, which re-exports its public names). This
module uses only the standard library.
"""

from __future__ import annotations

import json
import sqlite3
import time

from hooks.store.rows import FIXED_METRICS, nonfinite_from_failure
from hooks.store.sqlite_open import lock_wait
from hooks.store.summary import rebuild

#: Version of the schema below; bumped on any incompatible change.
SCHEMA_VERSION = 4
#: ``PRAGMA application_id`` of an mdb run store: the bytes ``b"mdbR"`` as a big-endian int.
APPLICATION_ID = int.from_bytes(b"mdbR", "big")
#: Value of ``meta.format`` in an mdb run store.
FORMAT_NAME = "mdb-runstore"
#: How long a connection waits for a lock another process holds, in milliseconds, unless
#: ``$MDB_LOCK_WAIT`` (seconds) says otherwise (:func:`hooks.store.sqlite_open.lock_wait`).
BUSY_TIMEOUT_MS = 10_000

TABLES = {
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
    world_size      INTEGER,
    writer          TEXT
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
    "latest": """CREATE TABLE latest (
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    metric INTEGER NOT NULL,
    step   INTEGER NOT NULL,
    value  REAL,
    PRIMARY KEY (run_id, metric)
) WITHOUT ROWID""",
    "blocks": """CREATE TABLE blocks (
    run_id     INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    metric     INTEGER NOT NULL,
    block      INTEGER NOT NULL,
    first_step INTEGER NOT NULL,
    last_step  INTEGER NOT NULL,
    count      INTEGER NOT NULL,
    n          INTEGER NOT NULL,
    total      REAL NOT NULL,
    lo         REAL,
    hi         REAL,
    PRIMARY KEY (run_id, metric, block)
) WITHOUT ROWID""",
    "summary": """CREATE TABLE summary (
    run_id       INTEGER PRIMARY KEY REFERENCES runs(id) ON DELETE CASCADE,
    captures     INTEGER NOT NULL DEFAULT 0,
    last_capture INTEGER
)""",
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


def store_lock_wait() -> float:
    """Seconds to wait for a lock another process holds (``$MDB_LOCK_WAIT``, else
    :data:`BUSY_TIMEOUT_MS`)."""
    return lock_wait(BUSY_TIMEOUT_MS / 1000)


# ---------------------------------------------------------------------------------------------
# Schema versions
# ---------------------------------------------------------------------------------------------


def create_schema(conn: sqlite3.Connection) -> None:
    """Create every table of the current schema (:data:`TABLES`) on an empty database and
    record its application id and version."""
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    for sql in TABLES.values():
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
    conn.execute(TABLES["metric_names"])
    conn.execute(TABLES["scalars"])
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
    conn.execute(TABLES["metrics"].replace("CREATE TABLE metrics", "CREATE TABLE metrics_v2"))
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
        nf = nonfinite_from_failure(r[1], r[2], r[3], r[4])
        if nf is not None:
            conn.execute("UPDATE runs SET nonfinite = ? WHERE id = ?", (json.dumps(nf), r[0]))
    conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")


def _migrate_v2(conn: sqlite3.Connection) -> None:
    """Version 2 → 3, inside the caller's write transaction; nothing is lost: ``runs`` gains
    ``world_size`` (``NULL``: every run of version 2 was a single process) and the tables of
    distributed runs are created empty (:data:`_RANK_TABLES`)."""
    conn.execute("ALTER TABLE runs ADD COLUMN world_size INTEGER")
    for name in _RANK_TABLES:
        conn.execute(TABLES[name])
    conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")


#: The tables of what the writer keeps about a run (schema 4, :mod:`hooks.store.summary`).
_SUMMARY_TABLES = ("latest", "blocks", "summary")


def _migrate_v3(conn: sqlite3.Connection) -> None:
    """Version 3 → 4, inside the caller's write transaction; nothing is lost: the tables of
    what the writer keeps (:data:`_SUMMARY_TABLES`) are created and filled from every run's
    rows (:func:`hooks.store.summary.rebuild`), once."""
    for name in _SUMMARY_TABLES:
        conn.execute(TABLES[name])
    for (run_id,) in conn.execute("SELECT id FROM runs").fetchall():
        rebuild(conn, run_id)
    conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")


#: Migrations by the version they start from.
MIGRATIONS = {1: _migrate_v1, 2: _migrate_v2, 3: _migrate_v3}
