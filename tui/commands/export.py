"""``mdb export RUN``: every logged metric of a run, one row per step, to stdout.

CSV (the default) has a header ``step,<metric>,…`` with the metrics in the order they were
first logged; a metric not logged at a step is an empty cell, a NaN is ``nan``, infinities are
``inf`` / ``-inf`` — what ``pandas.read_csv`` and spreadsheets read as numbers. JSON lines
(``--format jsonl``) give one object per step, ``{"step": 1, "loss": 2.31, …}``, without the
metrics not logged at that step; NaN and infinities are written ``NaN``, ``Infinity``,
``-Infinity`` (as Python's ``json``, ``pandas.read_json`` and ``jq`` read them). ``mdb
overfit``'s per-expert load is not a scalar and is not exported.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

from tui.errors import MdbError

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
    """The run's :class:`hooks.runs.store.MetricRow` s in step order, read a page at a time."""
    cursor = None
    while True:
        page = store.metrics(run_id, after_step=-1 if cursor is None else cursor, limit=PAGE)
        if not page:
            return
        yield from page
        cursor = page[-1].step


def write(store, info, fmt: str, out) -> int:
    """Write run ``info`` of ``store`` to the text stream ``out``; returns the rows written."""
    names = store.metric_names(info.id)
    n = 0
    if fmt == "csv":
        w = csv.writer(out, lineterminator="\n")
        w.writerow(["step", *names])
        for row in rows(store, info.id):
            v = row.values
            w.writerow([row.step, *(csv_cell(v.get(k), k in v) for k in names)])
            n += 1
    else:
        for row in rows(store, info.id):
            obj: dict = {"step": row.step}
            for k, x in row.values.items():
                obj[k] = math.nan if x is None else x
            out.write(json.dumps(obj) + "\n")
            n += 1
    return n


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb export``."""
    from hooks.runs.store import RunStore, RunStoreError, default_db_path

    path = args.db if args.db else default_db_path()
    try:
        with RunStore(path) as store:
            if store.note:
                print(f"mdb: note: {store.note}", file=sys.stderr)
            info = store.run(args.run)
            try:
                write(store, info, args.format, sys.stdout)
                sys.stdout.flush()
            except BrokenPipeError:
                # the reader stopped early (`mdb export r | head`): not an error
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                return 0
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None
    return 0
