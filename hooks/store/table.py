"""A run's logged scalars as one table, a row per step (per step and rank for a ``torchrun``
job), ordered by SQLite and read in large batches: what ``mdb export`` writes.

A run of few metrics (:data:`SQL_PIVOT_MAX` or fewer) is pivoted by SQLite, one column per
metric, and no Python object per step or per value is made beyond the row tuples SQLite's
module returns. That pivot costs each stored value one comparison per metric, and SQLite
refuses a result of 2,000 columns or more (``too many columns in result set``), so a wider
run is read one value per row, in step and metric order, and pivoted here, a list per step:
its cost grows with the values stored, whatever the number of metrics.

A value is a ``float``, ``None`` when the metric was not logged at that step, or the string
:data:`NAN` for a NaN (stored as ``NULL``). A value that is not a number (the database was
changed outside mdb) stops the read with :class:`hooks.store.rows.DamagedRunError` naming the
metric and the step. This module uses only the standard library.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence

from hooks.store.rows import DamagedRunError

#: How a NaN value appears in the rows of :func:`table_batches`.
NAN = "nan"
#: Rows per batch of :func:`table_batches`.
BATCH = 20_000
#: The most metrics SQLite pivots (one ``max(CASE …)`` column each); a wider run is pivoted
#: in Python. Measured on runs of 20,000 steps (``table_batches`` alone, best of 3, a shared
#: 2-core machine): 5 metrics 0.05 s in SQL vs 0.08 s in Python, 64: 1.7 vs 2.1 s, 100: 4.5 vs
#: 2.2 s, 200: 22 vs 5 s.
SQL_PIVOT_MAX = 64

_CHECKED = ("CASE WHEN typeof(s.value) IN ('real', 'null', 'integer') THEN IFNULL(s.value, "
            f"'{NAN}') ELSE mdb_not_a_number(s.step, s.metric, s.value) END")


class _NotANumber(Exception):
    """Raised inside SQLite by ``mdb_not_a_number`` (a value that is not a number)."""


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _source(run_id: int, ranks: bool, rank: int | None) -> tuple[str, str, str, list]:
    """``(keys, steps, scalars JOIN condition + WHERE, params)`` of the run's rows."""
    if not ranks:
        return ("m.step", "metrics", " ON s.run_id = m.run_id AND s.step = m.step"
                " WHERE m.run_id = ?", [run_id])
    cond, params = " ON s.run_id = m.run_id AND s.step = m.step AND s.rank = m.rank" \
        " WHERE m.run_id = ?", [run_id]
    if rank is not None:
        cond += " AND m.rank = ?"
        params.append(int(rank))
    return "m.step, m.rank", "rank_steps", cond, params


def _sql_pivot(cursor: sqlite3.Cursor, metric_ids: Sequence[int], batch: int,
               keys: str, join: str, params: list) -> Iterator[list[tuple]]:
    """One row per step (and rank) pivoted by SQLite: ``(keys…, v1, …, vk)``."""
    cols = "".join(f", max(CASE s.metric WHEN {int(m)} THEN {_CHECKED} END)" for m in metric_ids)
    cursor.execute(f"SELECT {keys}{cols} {join} GROUP BY {keys} ORDER BY {keys}", params)
    while rows := cursor.fetchmany(batch):
        yield rows


def _python_pivot(cursor: sqlite3.Cursor, metric_ids: Sequence[int], batch: int,
                  keys: str, join: str, params: list) -> Iterator[list[list]]:
    """The same rows as :func:`_sql_pivot` (lists), from one row per stored value."""
    lead = keys.count(",") + 1
    column = {int(m): lead + i for i, m in enumerate(metric_ids)}
    width = lead + len(metric_ids)
    cursor.execute(f"SELECT {keys}, s.metric, {_CHECKED} {join} ORDER BY {keys}, s.metric",
                   params)
    out: list[list] = []
    row: list | None = None
    key: tuple | None = None
    while values := cursor.fetchmany(batch):
        for value in values:
            if value[:lead] != key:
                if len(out) >= batch:
                    yield out
                    out = []
                key = value[:lead]
                row = [*key, *([None] * (width - lead))]
                out.append(row)
            at = column.get(value[lead])  # None: a step without values (LEFT JOIN)
            if at is not None:
                row[at] = value[lead + 1]
    if out:
        yield out


def table_batches(conn: sqlite3.Connection, run_id: int, metric_ids: Sequence[int], *,
                  ranks: bool = False, rank: int | None = None, where: str = "",
                  batch: int = BATCH) -> Iterator[list[tuple]]:
    """The run's scalars, one row per step: ``(step, v1, …, vk)`` for the metrics
    ``metric_ids`` in that order, or with ``ranks`` one per step and rank, ``(step, rank, v1,
    …, vk)``, from every rank's rows (``rank_steps`` / ``rank_scalars``; ``rank`` alone if
    given). In step (then rank) order, ``batch`` rows at a time (a row is a tuple, or a list
    for a run of more than :data:`SQL_PIVOT_MAX` metrics). Any number of metrics.

    Args:
        conn: A connection to the run store; a read transaction around the loop gives one
            snapshot (:meth:`hooks.store.store.RunStore.snapshot`).
        run_id: The run.
        metric_ids: ``metric_names.id`` of the columns, in order.
        ranks: Read every rank's rows (a distributed run) instead of the run's own.
        rank: With ``ranks``: this rank only.
        where: The run as the error names it (``'r' in runs/mdb.sqlite``).
        batch: Rows per list.

    Raises:
        DamagedRunError: A value is not a number (text or a blob written outside mdb).
    """
    found: list[tuple] = []

    def not_a_number(step, metric, value):
        found.append((step, metric, value))
        raise _NotANumber

    conn.create_function("mdb_not_a_number", 3, not_a_number, deterministic=True)
    keys, steps, cond, params = _source(run_id, ranks, rank)
    join = f"FROM {steps} AS m LEFT JOIN {'rank_' if ranks else ''}scalars AS s{cond}"
    pivot = _sql_pivot if len(metric_ids) <= SQL_PIVOT_MAX else _python_pivot
    try:
        yield from pivot(conn.cursor(), metric_ids, batch, keys, join, params)
    except sqlite3.OperationalError:
        if not found:
            raise
        step, metric, value = found[0]
        (name,) = conn.execute("SELECT name FROM metric_names WHERE run_id = ? AND id = ?",
                               (run_id, metric)).fetchone() or (f"metric{metric}",)
        raise DamagedRunError(
            f"run {where} cannot be read: the value of {name} at step {step} is "
            f"{_shown(value)}, not a number; the database was changed outside mdb") from None
