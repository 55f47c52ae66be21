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

The export streams: SQLite orders the run's values and pivots them into one row per step
(:func:`hooks.store.table.table_batches`; a run of more than 64 metrics is pivoted in Python,
any number of metrics), and the rows are written in batches of 20,000 by the ``csv`` module,
read in one snapshot of the run (:meth:`hooks.store.store.RunStore.snapshot`); memory stays
flat whatever the run's length (a run of a million steps × 5 metrics takes about 2× what the
``sqlite3`` command line takes to print the same values, which it cuts to 15 digits;
``benchmarks/bench_store.py``). Nothing is written when the first rows cannot be read.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
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


def rows(store, run_id: int):
    """The run's :class:`hooks.store.store.MetricRow` s in step order, read a page at a time
    (one object per step: :func:`write` does not use it)."""
    cursor = None
    while True:
        page = store.metrics(run_id, after_step=-1 if cursor is None else cursor, limit=PAGE)
        if not page:
            return
        yield from page
        cursor = page[-1].step


def _json_value(v) -> str:
    """A value of :func:`hooks.store.table.table_batches` as JSON text (as ``json.dumps``
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
        hooks.store.store.DamagedRunError: A value is not a number (changed outside mdb).
    """
    from hooks.store.table import table_batches

    conn = store.connection
    ranked = bool(info.world_size)
    keys = ["step", "rank"] if ranked else ["step"]
    n = 0
    with store.snapshot():  # the names and values of a run still being written, as one
        names_ids = conn.execute("SELECT id, name FROM metric_names WHERE run_id = ? "
                                 "ORDER BY id", (info.id,)).fetchall()
        names = [name for _i, name in names_ids]
        batches = table_batches(conn, info.id, [i for i, _n in names_ids], ranks=ranked,
                                rank=rank, where=f"{info.name!r} in {store.path}")
        first = next(batches, [])  # read before the header: a failed read writes nothing
        if fmt == "csv":
            w = csv.writer(out, lineterminator="\n")
            # a name is shown as text (a newline would split the header line, an ESC drive
            # the terminal it is read on): escaped; jsonl's json.dumps escapes it already
            w.writerow([*keys, *(printable(name) for name in names)])
            for batch in itertools.chain([first], batches):
                w.writerows(batch)  # None: an empty cell; "nan"; floats as their repr
                n += len(batch)
            return n
        heads = [json.dumps(k) + ": " for k in [*keys, *names]]
        for batch in itertools.chain([first], batches):
            out.write(_json_lines(batch, heads, len(keys)))
            n += len(batch)
    return n


def _json_lines(batch, heads: list[str], lead: int) -> str:
    """Rows of :func:`hooks.store.table.table_batches` as JSON lines: the keys, then the
    metrics logged at that step (``heads``: each column's ``"name": ``)."""
    lines = []
    for row in batch:
        parts = [f"{heads[i]}{row[i]}" for i in range(lead)]
        parts += [heads[i] + _json_value(v) for i, v in enumerate(row) if i >= lead
                  and v is not None]
        lines.append("{" + ", ".join(parts) + "}\n")
    return "".join(lines)


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
    from hooks.store.store import RunStore, RunStoreError, default_db_path

    path = args.db if args.db else default_db_path()
    try:
        with RunStore(path) as store:
            if store.note:
                print_error(store.note, "note")
            info = store.run(args.run)
            if args.rank is not None:
                _check_rank(store, info, args.rank)
            # a write error (a full disk) is one line, a reader that stopped early (`mdb
            # export r | head`) ends it quietly: tui.cli.main (tui.output)
            write(store, info, args.format, sys.stdout, args.rank)
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None
    return 0
