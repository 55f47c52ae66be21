"""``mdb runs``: list the runs of a run database (name, status, steps, last loss, metrics, age)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from tui.errors import MdbError

HELP = "list recorded runs (name, status, steps, last loss, metrics, age) of the run database"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``mdb runs``."""
    parser.add_argument("--db", metavar="PATH", default=None,
                        help="run database (default $MDB_DB, else ./runs/mdb.sqlite)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per run (one per line) instead of a table: "
                             "name, status, steps, metrics (names in first-logged order), "
                             "nonfinite (step, metric, module, direction[, rank]), the run "
                             "row, and for a torchrun job world_size, ranks and findings")


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


def run_record(run, store, now: float) -> dict:
    """One run as ``mdb runs --json`` prints it.

    Keys: every :class:`hooks.runs.store.RunInfo` field but ``config`` (``status`` is the
    stored status), plus ``writer_state`` (``running``/``gone``/… as a reader should show it),
    ``status_line``, ``steps`` (the last step written), ``metrics`` (the names logged, in
    first-logged order), ``nonfinite_line``, ``captures`` (how many steps have a stored
    capture) and ``last_capture`` (the latest such step, ``None`` without), ``last_ce``;
    ``world_size`` (``None`` for a single process), ``ranks`` (a distributed run's ranks:
    :class:`hooks.runs.store.RankInfo` fields) and ``findings`` (its cross-rank checks' findings,
    :class:`hooks.runs.store.Finding` fields: ``kind``, ``step``, ``rank``, ``subject`` — the
    parameter or ``rank N`` — and ``line``; empty for a single process).
    """
    d = run.to_dict()
    d.pop("config", None)
    captured = store.internals_steps(run.id)
    last = store.last_metrics(run.id)
    d.update(
        writer_state=run.writer_state(now),
        status_line=run.status_line(now),
        steps=run.last_step,
        metrics=store.metric_names(run.id),
        nonfinite_line=run.nonfinite_line(),
        captures=len(captured),
        last_capture=captured[-1] if captured else None,
        last_ce=last.ce if last is not None else None,
        ranks=[r.to_dict() for r in store.ranks(run.id)],
        findings=[f.to_dict() for f in store.findings(run.id)],
    )
    return d


def _short(names: list[str], width: int = 28) -> str:
    text = ""
    for i, name in enumerate(names):
        piece = name if not text else f"{text}, {name}"
        if len(piece) > width:
            return f"{text} +{len(names) - i}" if text else name[: width - 1] + "…"
        text = piece
    return text or "—"


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb runs``."""
    from hooks.runs.store import RunStore, RunStoreError, default_db_path, loss_metric

    path = args.db if args.db else default_db_path()
    now = time.time()
    try:
        with RunStore(path) as store:
            if store.note:
                print(f"mdb: note: {store.note}", file=sys.stderr)
            runs = store.runs()
            records = [run_record(r, store, now) for r in runs]
            last = {r.id: store.last_metrics(r.id) for r in runs}
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None
    if args.json:
        for d in records:
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
    table.add_column("metrics")
    table.add_column("age", justify="right")
    table.add_column("updated", justify="right")
    colors = {"running": "green", "paused": "yellow", "finished": "cyan",
              "interrupted": "yellow", "failed": "red", "gone": "red"}
    notes = []
    for r, d in zip(runs, records, strict=True):
        status = r.status_line(now)
        color = colors.get(status.split(" ")[0].split(":")[0], "")
        cell = f"[{color}]{status}[/]" if color else status
        nf = r.nonfinite
        if nf and not (r.status == "failed" and r.fail_step == nf["step"]):
            cell += f" · [red]non-finite @ {nf['step']}[/]"
            notes.append(f"{r.name}: {r.nonfinite_line()}")
        if r.world_size:
            cell += f" · {r.world_size} ranks"
        if d["findings"]:
            cell += f" · [red]{len(d['findings'])} finding(s)[/]"
            notes += [f"{r.name}: {f['line']}" for f in d["findings"]]
        steps = f"{r.last_step}/{r.total_steps}" if r.total_steps else str(r.last_step)
        m = last[r.id]
        if m is None:
            loss = "—"
        elif r.last_loss is None:
            loss = "nan" if loss_metric(d["metrics"]) is not None else "—"
        else:
            loss = f"{r.last_loss:.4f}"
        updated = r.heartbeat if r.heartbeat is not None else r.started
        table.add_row(
            r.name,
            cell,
            steps,
            loss,
            _short(d["metrics"]),
            format_age(now - r.started),
            format_age(now - updated) + " ago",
        )
    console.print(table)
    for line in notes:
        console.print(line, markup=False)
    return 0
