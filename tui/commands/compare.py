"""``mdb compare RUN [RUN ...]``: 2–8 runs of the run store on one screen, live.

Their losses overlaid on shared axes (a colour and a marker per run), and a table of the config
fields in which they differ with, per run, parameters, attention parameters per layer, KV-cache
bytes per token, the last and best loss, held-out ``ce@N``, steps/s and status
(:mod:`tui.screens.compare`). Runs still being written keep coming in (the screen reads the
store like ``mdb watch``). Without a terminal, or with ``--table``, the table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from hooks.text import printable
from tui.commands.process import has_screen
from tui.errors import MdbError

#: Reads the run store only: ``mdb`` does not import torch for it (a capture opened from
#: its screen imports it then).
NEEDS_TORCH = False

HELP = ("2-8 runs of the run store side by side, live: losses overlaid, and a table of what "
        "differs (params, attention params/layer, KV bytes/token, CE, steps/s, status)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``mdb compare``."""
    parser.add_argument("runs", metavar="RUN", nargs="+",
                        help="2 to 8 run names (see `mdb runs`)")
    parser.add_argument("--db", metavar="PATH", default=None,
                        help="run database (default $MDB_DB, else ./runs/mdb.sqlite)")
    parser.add_argument("--table", action="store_true",
                        help="print the table even in a terminal")
    parser.add_argument("--json", action="store_true",
                        help="print the table as JSON (one object: runs, rows)")
    parser.add_argument("--poll", metavar="SECONDS", type=float, default=0.3,
                        help=argparse.SUPPRESS)


def check_names(names: Sequence[str], *, low: int = 2) -> list[str]:
    """The run names, checked: ``low`` to 8 of them, none twice.

    Raises:
        MdbError: too few, too many, or a name given twice.
    """
    from tui.screens.compare_data import MAX_RUNS

    names = list(names)
    if not (low <= len(names) <= MAX_RUNS):
        raise MdbError(f"give {low} to {MAX_RUNS} runs to compare, got {len(names)}")
    for n in names:
        if names.count(n) > 1:
            raise MdbError(f"run {n!r} is given twice")
    return names


def open_store(db: str | None):
    """The run store, read-only (a missing or foreign file: :class:`MdbError`)."""
    from hooks.store.store import RunStore, RunStoreError, default_db_path

    try:
        return RunStore(db if db else default_db_path())
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None


def read_views(store, names: Sequence[str],
               status: Callable[[str], str | None] | None = None) -> list:
    """A :class:`tui.screens.compare_data.RunView` per name with everything the store holds
    (a name not in the store gets an empty view; ``status`` may say why)."""
    from tui.screens.compare_data import RunView
    from tui.screens.live_data import first_read

    by_name = {r.name: r for r in store.runs()}
    views = []
    for i, name in enumerate(names):
        view = RunView(name, i)
        run = by_name.get(name)
        if run is not None:
            view.add_update(*first_read(store, run.id, 0))  # a long run: bucketed history
        view.external = status(name) if status is not None else None
        views.append(view)
    return views


def table_document(views: Sequence) -> dict:
    """The table as JSON: ``runs`` (name, label, marker, arch numbers or why) and ``rows``
    (label, kind, one cell per run)."""
    from tui.screens.compare_data import compare_rows, short_labels

    labels = short_labels([v.name for v in views])
    return {
        "runs": [{"name": v.name, "label": label, "marker": v.marker,
                  "arch": v.arch.to_dict() if v.arch is not None else None,
                  "arch_why": v.arch_why if v.arch is None else "",
                  "status": v.status()}
                 for v, label in zip(views, labels, strict=True)],
        "rows": [{"label": r.label, "kind": r.kind, "cells": r.cells}
                 for r in compare_rows(views)],
    }


def print_table(views: Sequence, db, file=None) -> None:
    """Print the compare table (the screen's) with Rich: wide when piped, no colour."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from tui.screens.compare_data import compare_rows, short_labels, why_lines

    file = file or sys.stdout
    tty = file.isatty() if hasattr(file, "isatty") else False
    width = None
    if not tty:
        cols = os.environ.get("COLUMNS", "")
        width = int(cols) if cols.isdigit() and int(cols) > 0 else 200
    console = Console(file=file, width=width, no_color=not tty or None, highlight=False)
    labels = short_labels([v.name for v in views])
    table = Table(title=Text(printable(f"{len(views)} runs in {db}")), title_justify="left",
                  show_edge=False, pad_edge=False)
    table.add_column("", no_wrap=True)
    for v, label in zip(views, labels, strict=True):
        table.add_column(Text(f"{v.marker} {label}"), justify="right",  # never markup
                         style=v.style if tty else "")
    for r in compare_rows(views):
        table.add_row(*(Text(c) for c in (r.label, *r.cells)))  # never markup
    console.print(table)
    if labels != [printable(v.name) for v in views]:
        console.print("runs: " + " · ".join(f"{v.marker} {label} = {printable(v.name)}"
                                            for v, label in zip(views, labels, strict=True)),
                      markup=False)
    for line in why_lines(views, labels):
        console.print(printable(line), markup=False)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb compare``."""
    if not (args.poll > 0):
        raise MdbError(f"--poll must be a positive number of seconds, got {args.poll}")
    names = check_names(args.runs)
    store = open_store(args.db)
    try:
        known = {r.name for r in store.runs()}
        for n in names:
            if n not in known:
                store.run(n)  # raises with the names the store has
        if args.json or args.table or not has_screen():
            views = read_views(store, names)
            if args.json:
                print(json.dumps(table_document(views), allow_nan=False, default=str))
            else:
                print_table(views, store.path)
            return 0
    except Exception as exc:
        from hooks.store.store import RunStoreError

        if isinstance(exc, RunStoreError):
            raise MdbError(str(exc)) from None
        raise
    finally:
        store.close()
    from tui.screens.compare import CompareApp, CompareScreen

    CompareApp(CompareScreen(store.path, names, poll_interval=args.poll)).run()
    return 0
