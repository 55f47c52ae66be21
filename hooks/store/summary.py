"""What the writer keeps about a run besides its rows, so that readers never scan a long run:
the latest value of each metric, per-block aggregates of each metric, and how many steps have
a capture.

Tables (schema 4, :mod:`hooks.store.schema`)::

    latest(run_id, metric, step, value)                     PRIMARY KEY (run_id, metric)
    blocks(run_id, metric, block, first_step, last_step, count, n, total, lo, hi)
                                                            PRIMARY KEY (run_id, metric, block)
    summary(run_id PRIMARY KEY, captures, last_capture)

* ``latest``: each metric's value at the last step it was logged (``NULL`` value: NaN);
* ``blocks``: for each metric and each block of :data:`BLOCK` consecutive steps (``block =
  step >> BLOCK_BITS``), the first and last step logged in it, ``count`` values logged, ``n``
  of them finite, their sum ``total`` and their ``lo`` / ``hi`` (min/max of the finite ones,
  ``NULL`` when ``n`` is 0). A chart of a run of a million steps is read from about 16,000 rows
  per metric instead of a million, bucketed by SQLite (:func:`history`), with every spike kept
  (min/max per bucket, never every n-th point);
* ``summary``: how many steps have a stored capture (``internals``) and the last of them.

The writer (:class:`hooks.store.writer.RunWriter`) updates them in the transaction that writes
the steps (:func:`record_scalars`, :func:`record_captures`); a resume that deletes rows
(:meth:`hooks.store.store.RunStore.resume_run`) and the migration of an older database rebuild
them from the rows (:func:`rebuild`). This module uses only the standard library.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass, field

#: log2 of the steps per block of ``blocks``.
BLOCK_BITS = 6
#: Steps per block of ``blocks``.
BLOCK = 1 << BLOCK_BITS

_MAX = 1.7976931348623157e308
#: SQL: ``value`` when finite, else ``NULL``.
_FINITE = f"CASE WHEN value BETWEEN -{_MAX!r} AND {_MAX!r} THEN value END"

#: SQL: the ``blocks`` rows of one run's scalars with ``lo <= step <= hi`` (parameters: run_id,
#: lo, hi), recomputed from ``scalars``.
_BLOCKS_FROM_SCALARS = (
    "INSERT OR REPLACE INTO blocks (run_id, metric, block, first_step, last_step, count, n,"
    " total, lo, hi) SELECT run_id, metric, step >> " + str(BLOCK_BITS) + ", min(step),"
    f" max(step), count(*), count({_FINITE}), total({_FINITE}), min({_FINITE}),"
    f" max({_FINITE}) FROM scalars WHERE run_id = ? AND step BETWEEN ? AND ?"
    " GROUP BY metric, step >> " + str(BLOCK_BITS)
)


#: SQL: add the ``blocks`` of one run's scalars with ``lo <= step <= hi`` (parameters: run_id,
#: lo, hi) to those stored — for steps that were not stored before.
_ADD_BLOCKS = (
    _BLOCKS_FROM_SCALARS.replace("INSERT OR REPLACE INTO", "INSERT INTO")
    + " ON CONFLICT (run_id, metric, block) DO UPDATE SET"
    " first_step = min(first_step, excluded.first_step),"
    " last_step = max(last_step, excluded.last_step),"
    " count = count + excluded.count, n = n + excluded.n, total = total + excluded.total,"
    " lo = min(coalesce(lo, excluded.lo), coalesce(excluded.lo, lo)),"
    " hi = max(coalesce(hi, excluded.hi), coalesce(excluded.hi, hi))"
)
#: SQL: each metric's value at its last step with ``lo <= step <= hi`` (parameters: run_id,
#: lo, hi) becomes its ``latest`` unless that is later already (SQLite gives the bare column
#: ``value`` of the row of ``max(step)``).
_SET_LATEST = (
    "INSERT INTO latest (run_id, metric, step, value) SELECT run_id, metric, max(step), value"
    " FROM scalars WHERE run_id = ? AND step BETWEEN ? AND ? GROUP BY metric"
    " ON CONFLICT (run_id, metric) DO UPDATE SET step = excluded.step, value = excluded.value"
    " WHERE excluded.step >= latest.step"
)


def record_scalars(conn: sqlite3.Connection, run_id: int, lo: int, hi: int,
                   relogged: bool) -> None:
    """Update ``blocks`` and ``latest`` for the scalars just written with ``lo <= step <=
    hi``, inside the writer's transaction, by SQLite (no Python work per value).

    Args:
        conn: The writer's connection, in its write transaction.
        run_id: The run.
        lo: The first step written.
        hi: The last step written.
        relogged: Some of these steps may have been written before (a step logged again
            replaces a value): their blocks are recomputed from ``scalars`` instead of added
            to. Without it, every row with ``lo <= step <= hi`` must be new.
    """
    if relogged:
        conn.execute(_BLOCKS_FROM_SCALARS, (run_id, (lo >> BLOCK_BITS) << BLOCK_BITS,
                                            ((hi >> BLOCK_BITS) << BLOCK_BITS) + BLOCK - 1))
    else:
        conn.execute(_ADD_BLOCKS, (run_id, lo, hi))
    conn.execute(_SET_LATEST, (run_id, lo, hi))


def record_captures(conn: sqlite3.Connection, run_id: int, steps: Iterable[int],
                    new: int) -> None:
    """Count ``new`` captured steps more in ``summary`` and move ``last_capture`` to the
    largest of ``steps`` (inside the writer's transaction)."""
    steps = list(steps)
    if not steps:
        return
    conn.execute(
        "INSERT INTO summary (run_id, captures, last_capture) VALUES (?, ?, ?)"
        " ON CONFLICT (run_id) DO UPDATE SET captures = captures + excluded.captures,"
        " last_capture = max(coalesce(last_capture, excluded.last_capture),"
        " excluded.last_capture)", (run_id, int(new), max(steps)),
    )


def rebuild(conn: sqlite3.Connection, run_id: int, after_step: int | None = None) -> None:
    """Recompute a run's ``blocks``, ``latest`` and ``summary`` from its rows: all of them
    (``after_step=None``: an older database being migrated), or the blocks from the one that
    holds ``after_step`` on (a resume deleted the rows after it). Inside the caller's write
    transaction."""
    first = -(1 << 62) if after_step is None else (after_step >> BLOCK_BITS) << BLOCK_BITS
    conn.execute("DELETE FROM blocks WHERE run_id = ? AND block >= ?",
                 (run_id, first >> BLOCK_BITS))
    conn.execute(_BLOCKS_FROM_SCALARS, (run_id, first, 1 << 62))
    conn.execute("DELETE FROM latest WHERE run_id = ?", (run_id,))
    conn.execute(
        "INSERT INTO latest (run_id, metric, step, value) SELECT s.run_id, s.metric, s.step,"
        " s.value FROM scalars AS s JOIN blocks AS b ON b.run_id = s.run_id"
        " AND b.metric = s.metric AND s.step = b.last_step WHERE b.run_id = ?"
        " AND b.block = (SELECT max(block) FROM blocks WHERE run_id = b.run_id"
        " AND metric = b.metric)", (run_id,),
    )
    conn.execute("DELETE FROM summary WHERE run_id = ?", (run_id,))
    conn.execute(
        "INSERT INTO summary (run_id, captures, last_capture) SELECT ?, count(*), max(step)"
        " FROM internals WHERE run_id = ?", (run_id, run_id),
    )


@dataclass
class RunSummary:
    """What :func:`read_summary` gives of one run.

    Attributes:
        captures: Steps with a stored capture.
        last_capture: The last of them (``None`` without).
        latest: Each metric's latest value by name, in first-logged order: ``(step, value)``,
            ``value`` ``None`` for NaN.
    """

    captures: int = 0
    last_capture: int | None = None
    latest: dict[str, tuple[int, float | None]] = field(default_factory=dict)


def read_summary(conn: sqlite3.Connection, run_id: int) -> RunSummary:
    """The run's :class:`RunSummary`, read from ``summary``, ``latest`` and ``metric_names``
    (a few rows whatever the run's length)."""
    row = conn.execute("SELECT captures, last_capture FROM summary WHERE run_id = ?",
                       (run_id,)).fetchone()
    latest = {
        r[0]: (int(r[1]), None if r[2] is None else float(r[2]))
        for r in conn.execute(
            "SELECT n.name, l.step, l.value FROM latest AS l JOIN metric_names AS n"
            " ON n.run_id = l.run_id AND n.id = l.metric WHERE l.run_id = ? ORDER BY n.id",
            (run_id,))
    }
    if row is None:
        return RunSummary(latest=latest)
    return RunSummary(int(row[0] or 0), row[1], latest)


@dataclass
class Buckets:
    """One metric's history, bucketed by step range: per bucket (in step order) the step of
    its last value, how many values it holds (``count``; ``n`` of them finite), their sum, min
    and max (``None`` without a finite value).

    A chart draws each bucket as its min-max range, so a spike inside a bucket of a thousand
    steps is as tall as it was.
    """

    steps: list[int] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    n: list[int] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    lo: list[float | None] = field(default_factory=list)
    hi: list[float | None] = field(default_factory=list)


@dataclass
class History:
    """A run's metrics bucketed by step range (:func:`history`).

    Attributes:
        metrics: Each metric's :class:`Buckets` by name, in first-logged order.
        width: Steps per bucket.
        first: The first step of the run (``None``: no step yet).
        last: The last step read.
        latest: Each metric's latest ``(step, value)`` by name, when the reader adds them
            (:meth:`hooks.store.store.RunStore.history`).
    """

    metrics: dict[str, Buckets]
    width: int = 1
    first: int | None = None
    last: int | None = None
    latest: dict[str, tuple[int, float | None]] = field(default_factory=dict)


def history(conn: sqlite3.Connection, run_id: int, buckets: int) -> History:
    """Every metric of the run bucketed into at most ``buckets`` step ranges of equal width,
    by SQLite: from ``blocks`` (:data:`BLOCK` steps each; a bucket is a whole number of
    blocks) for a long run, from ``scalars`` when a bucket would be narrower than a block.

    Args:
        conn: A connection (call inside a read transaction for one snapshot).
        run_id: The run.
        buckets: At most this many buckets per metric (≥ 1).

    Returns:
        The :class:`History`.
    """
    ends = [conn.execute(f"SELECT step FROM metrics WHERE run_id = ? ORDER BY step {order}"
                         " LIMIT 1", (run_id,)).fetchone() for order in ("ASC", "DESC")]
    lo_hi = (ends[0][0] if ends[0] else None, ends[1][0] if ends[1] else None)
    names = dict(conn.execute("SELECT id, name FROM metric_names WHERE run_id = ? ORDER BY id",
                              (run_id,)).fetchall())
    out = {name: Buckets() for name in names.values()}
    if lo_hi[0] is None:
        return History(out)
    first, last = int(lo_hi[0]), int(lo_hi[1])
    buckets = max(1, int(buckets))
    width = -(-(last - first + 1) // buckets)
    if width >= BLOCK:
        base = first >> BLOCK_BITS  # buckets of whole blocks start at first's block
        per_bucket = -(-(last - (base << BLOCK_BITS) + 1) // buckets)  # steps, rounded up
        k = -(-per_bucket // BLOCK)  # whole blocks a bucket
        width = k * BLOCK
        rows = conn.execute(
            "SELECT metric, max(last_step), sum(count), sum(n), total(total), min(lo), max(hi)"
            " FROM blocks WHERE run_id = ? GROUP BY metric, (block - ?) / ?"
            " ORDER BY metric, max(last_step)", (run_id, base, k),
        )
    else:
        rows = conn.execute(
            f"SELECT metric, max(step), count(*), count({_FINITE}), total({_FINITE}),"
            f" min({_FINITE}), max({_FINITE}) FROM scalars WHERE run_id = ?"
            " GROUP BY metric, (step - ?) / ? ORDER BY metric, max(step)",
            (run_id, first, width),
        )
    for mid, step, count, n, total, lo, hi in rows:
        name = names.get(mid)
        if name is None:
            continue
        b = out[name]
        b.steps.append(int(step))
        b.count.append(int(count))
        b.n.append(int(n))
        b.total.append(float(total))
        b.lo.append(None if lo is None else float(lo))
        b.hi.append(None if hi is None else float(hi))
    return History(out, width, first, last)
