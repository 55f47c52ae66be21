"""A run's logged scalars as one table, a row per step (per step and rank for a ``torchrun``
job), pivoted and ordered by SQLite and read in large batches: what ``mdb export`` writes.

No Python object per step or per value is made beyond the row tuples SQLite's module returns:
a value is a ``float``, ``None`` when the metric was not logged at that step, or the string
:data:`NAN` for a NaN (stored as ``NULL``). A value that is not a number (the database was
changed outside mdb) stops the read with :class:`hooks.runs.rows.DamagedRunError` naming the
metric and the step. This module uses only the standard library.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence

from hooks.runs.rows import DamagedRunError, _shown

#: How a NaN value appears in the rows of :func:`table_batches`.
NAN = "nan"
#: Rows per batch of :func:`table_batches`.
BATCH = 20_000

_CHECKED = ("CASE WHEN typeof(s.value) IN ('real', 'null', 'integer') THEN IFNULL(s.value, "
            f"'{NAN}') ELSE mdb_not_a_number(s.step, s.metric, s.value) END")


class _NotANumber(Exception):
    """Raised inside SQLite by ``mdb_not_a_number`` (a value that is not a number)."""


def table_batches(conn: sqlite3.Connection, run_id: int, metric_ids: Sequence[int], *,
                  ranks: bool = False, rank: int | None = None, where: str = "",
                  batch: int = BATCH) -> Iterator[list[tuple]]:
    """The run's scalars, one tuple per step: ``(step, v1, …, vk)`` for the metrics
    ``metric_ids`` in that order, or with ``ranks`` one per step and rank, ``(step, rank, v1,
    …, vk)``, from every rank's rows (``rank_steps`` / ``rank_scalars``; ``rank`` alone if
    given). In step (then rank) order, ``batch`` rows at a time.

    Args:
        conn: A connection to the run store; a read transaction around the loop gives one
            snapshot.
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
    cols = ", ".join(f"max(CASE s.metric WHEN {int(m)} THEN {_CHECKED} END)" for m in metric_ids)
    cols = ", " + cols if cols else ""
    if ranks:
        cond, params = "m.run_id = ?", [run_id]
        if rank is not None:
            cond += " AND m.rank = ?"
            params.append(int(rank))
        sql = (f"SELECT m.step, m.rank{cols} FROM rank_steps AS m LEFT JOIN rank_scalars AS s"
               " ON s.run_id = m.run_id AND s.step = m.step AND s.rank = m.rank"
               f" WHERE {cond} GROUP BY m.step, m.rank ORDER BY m.step, m.rank")
    else:
        params = [run_id]
        sql = (f"SELECT m.step{cols} FROM metrics AS m LEFT JOIN scalars AS s"
               " ON s.run_id = m.run_id AND s.step = m.step WHERE m.run_id = ?"
               " GROUP BY m.step ORDER BY m.step")
    try:
        cursor = conn.execute(sql, params)
        while rows := cursor.fetchmany(batch):
            yield rows
    except sqlite3.OperationalError:
        if not found:
            raise
        step, metric, value = found[0]
        (name,) = conn.execute("SELECT name FROM metric_names WHERE run_id = ? AND id = ?",
                               (run_id, metric)).fetchone() or (f"metric{metric}",)
        raise DamagedRunError(
            f"run {where} cannot be read: the value of {name} at step {step} is "
            f"{_shown(value)}, not a number; the database was changed outside mdb") from None
