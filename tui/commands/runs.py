"""``mdb runs``: list the runs of a run database (name, status, steps, last loss, age)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from tui.errors import MdbError

HELP = "list recorded runs (name, status, steps, last loss, age) of the run database"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``mdb runs``."""
    parser.add_argument("--db", metavar="PATH", default=None,
                        help="run database (default $MDB_DB, else ./runs/mdb.sqlite)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per run instead of a table")


def format_age(seconds: float) -> str:
    """A short human duration: ``42s``, ``7m``, ``3h12m``, ``5d3h``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600}h"


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb runs``."""
    from hooks.runs.store import RunStore, RunStoreError, default_db_path

    path = args.db if args.db else default_db_path()
    try:
        with RunStore(path) as store:
            runs = store.runs()
            last = {r.id: store.last_metrics(r.id) for r in runs}
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None
    now = time.time()
    if args.json:
        for r in runs:
            d = r.to_dict()
            d.pop("config", None)
            d["writer_state"] = r.writer_state(now)
            d["last_ce"] = last[r.id].ce if last[r.id] is not None else None
            print(json.dumps(d, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.table import Table

    # Piped output (scripts, logs) gets wide rows rather than cells wrapped at 80 columns.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    if not runs:
        console.print(f"no runs in {path}")
        return 0
    table = Table(title=f"runs in {path}", title_justify="left")
    table.add_column("name", no_wrap=True)
    table.add_column("status")
    table.add_column("steps", justify="right", no_wrap=True)
    table.add_column("last loss", justify="right")
    table.add_column("ce", justify="right")
    table.add_column("age", justify="right")
    table.add_column("updated", justify="right")
    colors = {"running": "green", "paused": "yellow", "finished": "cyan",
              "interrupted": "yellow", "failed": "red", "gone": "red"}
    for r in runs:
        status = r.status_line(now)
        color = colors.get(status.split(" ")[0].split(":")[0], "")
        steps = f"{r.last_step}/{r.total_steps}" if r.total_steps else str(r.last_step)
        m = last[r.id]
        loss = "—" if m is None else ("nan" if m.total is None else f"{m.total:.4f}")
        ce = "—" if m is None else ("nan" if m.ce is None else f"{m.ce:.4f}")
        updated = r.heartbeat if r.heartbeat is not None else r.started
        table.add_row(
            r.name,
            f"[{color}]{status}[/]" if color else status,
            steps,
            loss,
            ce,
            format_age(now - r.started),
            format_age(now - updated) + " ago",
        )
    console.print(table)
    return 0
