"""``mdb export RUN``: every logged metric of a run, one row per step, to stdout.

CSV (the default) has a header ``step,<metric>,…`` with the metrics in the order they were
first logged (a control character in a name written as a visible escape, ``\\x1b``, ``\\n``:
:func:`hooks.text.printable`, so the header stays one line); a metric not logged at a step
is an empty cell, a NaN is ``nan``, infinities are ``inf`` / ``-inf`` — what
``pandas.read_csv`` and spreadsheets read as numbers. JSON lines (``--format jsonl``) give
one object per step, ``{"step": 1, "loss": 2.31, …}``, without the metrics not logged at that
step; NaN and infinities are written ``NaN``, ``Infinity``,
``-Infinity`` (as Python's ``json``, ``pandas.read_json`` and ``jq`` read them). ``mdb
overfit``'s per-expert load is not a scalar and is not exported.

A distributed run (a ``torchrun`` job recorded by ``hooks.run``) has a ``rank`` column after
``step``: one row per rank and step, every rank's own logged values; ``--rank N`` keeps rank
N's rows.

The export streams: SQLite pivots the run's values into one row per step and orders them
(:func:`hooks.runs.table.table_batches`), and the rows are written in batches of 20,000 by
the ``csv`` module, with no Python object per step; memory stays flat whatever the run's
length (a run of a million steps × 5 metrics takes about 2× what the ``sqlite3`` command line
takes to print the same values, which it cuts to 15 digits; ``benchmarks/bench_store.py``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

from hooks.text import printable
from tui.errors import MdbError, print_error

#: Reads the run store only: ``mdb`` does not import torch for it (a capture opened from
#: its screen imports it then).
NEEDS_TORCH = False

HELP = "write every logged metric of a run, per step, to stdout (csv or jsonl)"

#: Rows read from the database at a time (memory stays bounded for long runs).
PAGE = 2000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``mdb export``."""
    parser.add_argument("run", metavar="RUN", help="run name (see `mdb runs`)")
    parser.add_argument("--format", choices=("csv", "jsonl"), default="csv",
                        help="csv (default: header step,<metrics>; empty cell = not logged, "
                             "nan, inf, -inf) or jsonl (one JSON object per step)")
    parser.add_argument("--db", metavar="PATH", default=None,
                        help="run database (default $MDB_DB, else ./runs/mdb.sqlite)")
    parser.add_argument("--rank", metavar="N", type=int, default=None,
                        help="a torchrun job's run: only rank N's rows (default: every rank, "
                             "a rank column after step)")


def csv_cell(value: float | None, logged: bool) -> str:
    """A value as a CSV cell: ``""`` when not logged, ``nan`` for NaN (stored as ``None``),
    ``inf`` / ``-inf``, else the shortest text that reads back as the same float."""
    if not logged:
        return ""
    if value is None or math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(float(value))


def rows(store, run_id: int):
    """The run's :class:`hooks.runs.store.MetricRow` s in step order, read a page at a time
    (one object per step: :func:`write` does not use it)."""
    cursor = None
    while True:
        page = store.metrics(run_id, after_step=-1 if cursor is None else cursor, limit=PAGE)
        if not page:
            return
        yield from page
        cursor = page[-1].step


def _json_value(v) -> str:
    """A value of :func:`hooks.runs.table.table_batches` as JSON text (as ``json.dumps``
    writes it: ``NaN``, ``Infinity``, ``-Infinity``, else the float's repr)."""
    if isinstance(v, str):
        return "NaN"
    if v == math.inf:
        return "Infinity"
    if v == -math.inf:
        return "-Infinity"
    return repr(float(v))


def write(store, info, fmt: str, out, rank: int | None = None) -> int:
    """Write run ``info`` of ``store`` to the text stream ``out``; returns the rows written.

    A distributed run (``info.world_size``) is written one row per step and rank, with a
    ``rank`` column after ``step`` (``rank``: that rank's rows only).

    Raises:
        hooks.runs.store.DamagedRunError: A value is not a number (changed outside mdb).
    """
    from hooks.runs.table import table_batches

    conn = store.connection
    names_ids = conn.execute("SELECT id, name FROM metric_names WHERE run_id = ? ORDER BY id",
                             (info.id,)).fetchall()
    names = [n for _i, n in names_ids]
    ranked = bool(info.world_size)
    keys = ["step", "rank"] if ranked else ["step"]
    lead = len(keys)
    n = 0
    with store._transaction(immediate=False):  # one snapshot of a run still being written
        batches = table_batches(conn, info.id, [i for i, _n in names_ids], ranks=ranked,
                                rank=rank, where=f"{info.name!r} in {store.path}")
        if fmt == "csv":
            w = csv.writer(out, lineterminator="\n")
            # a name is shown as text (a newline would split the header line, an ESC drive
            # the terminal it is read on): escaped; jsonl's json.dumps escapes it already
            w.writerow([*keys, *(printable(name) for name in names)])
            for batch in batches:
                w.writerows(batch)  # None: an empty cell; "nan"; floats as their repr
                n += len(batch)
            return n
        heads = [json.dumps(k) + ": " for k in [*keys, *names]]
        for batch in batches:
            lines = []
            for row in batch:
                parts = [f"{heads[i]}{row[i]}" for i in range(lead)]
                parts += [heads[i] + _json_value(v) for i, v in enumerate(row) if i >= lead
                          and v is not None]
                lines.append("{" + ", ".join(parts) + "}\n")
            out.write("".join(lines))
            n += len(batch)
    return n


def _check_rank(store, info, rank: int) -> None:
    """``--rank N`` names a rank of a distributed run, or one line (:class:`MdbError`)."""
    if not info.world_size:
        raise MdbError(f"--rank {rank}: run {info.name!r} is a single process, not a torchrun "
                       "job (it has no ranks); leave --rank out")
    known = [r.rank for r in store.ranks(info.id)] or list(range(info.world_size))
    if rank not in known:
        raise MdbError(f"--rank {rank}: run {info.name!r} has ranks "
                       f"{', '.join(map(str, known))}")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb export``."""
    from hooks.runs.store import RunStore, RunStoreError, default_db_path

    path = args.db if args.db else default_db_path()
    try:
        with RunStore(path) as store:
            if store.note:
                print_error(store.note, "note")
            info = store.run(args.run)
            if args.rank is not None:
                _check_rank(store, info, args.rank)
            try:
                write(store, info, args.format, sys.stdout, args.rank)
                sys.stdout.flush()
            except BrokenPipeError:
                # the reader stopped early (`mdb export r | head`): not an error
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                return 0
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None
    return 0
