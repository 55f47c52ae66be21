"""``mdb runs``: list the runs of a run database (name, status, steps, last loss, age, metrics).

On a terminal the table is laid out for its width (80 columns and up): one row per run with a
one-word status, and below it, indented, what there is to say about the run — why it ended, where
it failed, that its writer is gone and how to resume it, a non-finite value, a loss spike — cut
to the width (``--json`` has every line in full). Piped, nothing is cut.

A run whose row cannot be read (the database was changed outside mdb) is listed as ``damaged``
with one ``mdb: error:`` line naming the field; the exit status is then 1. A database file that
``PRAGMA quick_check`` finds damaged (``database disk image is malformed``) is listed as far as
it can be read, with one ``mdb: error:`` line saying so (mdb will not write to it), exit 1.

A run of ``mdb overfit`` that was stopped before its first checkpoint (its writer killed while
writing it) cannot be continued, but it can start again: its line says
``restart from step 0: mdb overfit --resume NAME``. A job of ``mdb overfit --nproc N`` (DDP,
``--fsdp``, ``--tp``) keeps no checkpoints and gets no such line: ``--resume`` refuses it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time

from hooks.text import printable
from tui.commands.process import is_terminal
from tui.errors import MdbError, print_error
from tui.screens.live_data import display_name

#: Reads the run store only: ``mdb`` does not import torch for it (a capture opened from
#: its screen imports it then).
NEEDS_TORCH = False

HELP = "list recorded runs (name, status, steps, last loss, metrics, age) of the run database"

#: Exit status when some run of the database could not be read.
EXIT_DAMAGED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``mdb runs``."""
    parser.add_argument("--db", metavar="PATH", default=None,
                        help="run database (default $MDB_DB, else ./runs/mdb.sqlite)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per run (one per line) instead of a table: "
                             "name, status, steps, metrics (names in first-logged order), "
                             "loss_metric and loss, steps_per_s, eta_s, "
                             "nonfinite (step, metric, module, direction[, rank]), spikes, "
                             "damaged, the run row, and for a torchrun job world_size, ranks, "
                             "findings, rank_times, straggler_basis, stragglers and "
                             "parallel (DDP, FSDP2, tensor parallel: how an mdb overfit --nproc "
                             "job split the model)")


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


def run_record(run, store, now: float, probe: bool = False) -> dict:
    """One run as ``mdb runs --json`` prints it.

    Keys: every :class:`hooks.store.store.RunInfo` field but ``config`` (``status`` is the
    stored status; ``damaged`` names what could not be read), plus ``writer_state``
    (``running``/``gone``/… as a reader should show it), ``status_line``, ``steps`` (the last
    step written), ``metrics`` (the names logged, in first-logged order), ``latest`` (each
    metric's latest value by name, ``null`` for NaN), ``nonfinite_line``,
    ``captures`` (how many steps have a stored capture) and ``last_capture`` (the latest such
    step, ``None`` without), ``last_ce``, ``spikes`` (each loss spike the writer recorded:
    step, metric, value, baseline, ratio, peak_step, last_step), ``spike_stories`` (the
    one-line story of each capture taken before its update because it spiked, by step:
    :mod:`hooks.recorder.story`), ``loss_metric`` (the metric
    that is the run's loss, :func:`hooks.store.numbers.loss_metric`) and ``loss`` (its latest
    value), ``steps_per_s`` (end to end, :class:`hooks.store.rates.StepRate`) and ``eta_s``
    (seconds to ``total_steps`` at that pace while the run is running, else ``None``) — the
    numbers ``mdb watch`` and ``mdb compare`` show —, ``world_size`` (``None`` for a single
    process), ``ranks`` (a distributed run's ranks: :class:`hooks.store.store.RankInfo`
    fields), ``parallel`` (how a distributed run split its model, as its stored config says:
    ``DDP``, ``FSDP2``, ``tensor parallel``; ``None`` for one process or when it does not
    say), ``findings`` (its cross-rank checks' findings, :class:`hooks.store.store.Finding`
    fields: ``kind``, ``step``, ``rank``, ``subject`` — the parameter or ``rank N`` — and
    ``line``; also the training-loop doctor's findings of ``run.watch(..., optimizer=,
    scheduler=)``, with ``detail["severity"]`` and ``detail["evidence"]``), for a distributed
    run ``rank_times`` (each rank's median ``step_time`` and ``compute_time`` over its last
    steps), ``straggler_basis`` (``compute``, ``step`` or ``None``) and ``stragglers``
    (``rank``, ``time``, ``median``, slowest first) as ``mdb watch``'s ranks screen names them
    (:mod:`hooks.store.rank_stats`), and ``details`` (the lines the table prints under the run,
    uncut).

    ``probe`` (the file is damaged): the first and last rows of the run's per-step tables are
    read too, so that a run whose rows sit on a damaged page is said ``damaged``.
    """
    import sqlite3

    from hooks.store.store import DatabaseLockedError, RunStoreError
    from hooks.train.overfit_options import parallel_kind

    d = run.to_dict()
    d.pop("config", None)
    # (a loop of one's own records its own config: its "nproc" says nothing of the kind)
    d["parallel"] = parallel_kind(_config(run)) if run.world_size and run.kind == "overfit" \
        else None
    d.update(writer_state=run.writer_state(now), status_line=run.status_line(now),
             steps=run.last_step, nonfinite_line=run.nonfinite_line(), metrics=[], latest={},
             captures=0,
             last_capture=None, last_ce=None, spikes=[], spike_stories={}, ranks=[],
             findings=[],
             loss_metric=None, loss=None, steps_per_s=None, eta_s=None, rank_times=[],
             straggler_basis=None, stragglers=[])
    try:
        summary = store.summary(run.id)  # kept by the writer: no scan of the run's rows
        ce = summary.latest.get("ce")
        ranks = store.ranks(run.id)
        d.update(
            metrics=store.metric_names(run.id),
            captures=summary.captures,
            last_capture=summary.last_capture,
            last_ce=ce[1] if ce is not None and ce[0] == run.last_step else None,
            latest={name: value for name, (_step, value) in summary.latest.items()},
            spikes=[s.to_dict() for s in store.spikes(run.id)],
            spike_stories=_stories(store, run.id),
            ranks=[r.to_dict() for r in ranks],
            findings=[f.to_dict() for f in store.findings(run.id)],
        )
        d.update(_numbers(run, store, d["metrics"], summary.latest, ranks, d["writer_state"]))
        if probe:
            _probe_rows(store, run.id)
    except DatabaseLockedError:
        raise
    except RunStoreError as exc:  # a damaged metric row: the run is listed, said damaged
        d["damaged"] = d["damaged"] or str(exc)
    except sqlite3.DatabaseError as exc:  # a damaged page of the file: the same
        d["damaged"] = d["damaged"] or f"run {run.name!r}: its rows cannot be read ({exc})"
    d["details"] = detail_lines(run, d, now)
    return d


def _stories(store, run_id: int) -> dict[int, str]:
    """The stories of the run's triggered captures near its spikes, by step (reads only those
    capture rows; none when the run has no spike)."""
    from hooks.train.verdict import spike_stories

    return spike_stories(store, run_id) if store.spikes(run_id) else {}


def _numbers(run, store, names, latest, ranks, state: str) -> dict:
    """The run's loss, speed, ETA and, for a ``torchrun`` job, its ranks' median times and
    stragglers, as every view computes them (:func:`hooks.store.numbers.stored_numbers`); the
    ETA only while the run is running (the live screen shows "—" once it ended)."""
    from hooks.store.numbers import stored_numbers

    with store.snapshot():
        n = stored_numbers(store.connection, run, names, latest, ranks)
    return {"loss_metric": n.loss_metric, "loss": n.loss, "steps_per_s": n.steps_per_s,
            "eta_s": n.eta_s if state == "running" else None,
            "rank_times": [{"rank": r, "step_time": st, "compute_time": ct}
                           for r, (st, ct) in n.rank_times.items()],
            "straggler_basis": n.straggler_basis,
            "stragglers": [{"rank": r, "time": x, "median": med}
                           for r, x, med in n.stragglers]}


def _probe_rows(store, run_id: int) -> None:
    """Read the first and last rows of the run's per-step tables (raises
    ``sqlite3.DatabaseError`` when they sit on a damaged page)."""
    conn = store.connection
    for table in ("metrics", "scalars", "internals", "samples"):
        for order in ("ASC", "DESC"):
            conn.execute(f"SELECT step FROM {table} WHERE run_id = ? ORDER BY step {order}"
                         " LIMIT 1", (run_id,)).fetchall()


def detail_lines(run, record: dict, now: float, db: str | None = None) -> list[str]:
    """What the table says under a run, one line each (none when there is nothing to say): why
    it ended or where it failed, a gone writer, a non-finite value, the largest loss spike, and
    the command that continues an interrupted run or one whose writer is gone (``continue:
    ...``), or restarts one that has no checkpoint to continue from (``restart from step 0:
    ...``) — never for a job of ``mdb overfit --nproc``, which cannot be resumed; a
    distributed run's line says its ranks, when its config records it how it split the model,
    and its stragglers as ``mdb watch`` names them (``2 ranks · FSDP2 · straggler rank 1 (+23%
    compute time)``)."""
    from hooks.store.spikes import Spike
    from hooks.train.verdict import story_for

    if record.get("damaged"):
        return [record["damaged"]]
    lines = []
    state = record["writer_state"]
    if state == "gone":
        lines.append(run.gone_reason(now).removeprefix("writer "))
    elif state == "interrupted":
        lines.append(run.status_line(now))
    stopped = run.kind == "overfit" and state in ("gone", "interrupted")
    resumable = stopped and run.checkpoint_step is not None
    nproc = _nproc_job(run)  # no checkpoints, and --resume does not apply
    if stopped:
        lines[-1] += (f" · checkpoint @ step {run.checkpoint_step}" if resumable
                      else " · no checkpoints (an --nproc job cannot be resumed)" if nproc
                      else " · no checkpoint")
    elif state == "failed":
        line = run.status_line(now)
        if run.reason and run.reason.startswith("non-finite"):
            line = f"failed: {run.reason}"  # one sentence: what, where, when
        elif run.reason and not line.endswith(f"({run.reason})"):
            line += f": {run.reason}"
        lines.append(line)
    nf = run.nonfinite
    if nf and not (run.status == "failed" and run.fail_step == nf["step"]):
        lines.append(run.nonfinite_line())
    spikes = [Spike(**{k: v for k, v in s.items() if k != "ratio"})
              for s in record.get("spikes", [])]
    if spikes:
        top = max(spikes, key=lambda s: s.ratio)
        more = f" (the largest of {len(spikes)})" if len(spikes) > 1 else ""
        lines.append(top.describe() + more)
        told = story_for(top, {int(k): v for k, v in record.get("spike_stories", {}).items()})
        if told is not None:
            lines.append(f"{told[1]} · open it: mdb step --run {run.name}@{told[0]}"
                         + (f" --db {db}" if db else ""))
    if run.world_size:
        found = record.get("findings", [])
        kind = record.get("parallel")
        basis = record.get("straggler_basis")
        slow = "".join(f" · straggler rank {s['rank']} (+{(s['time'] / s['median'] - 1):.0%}"
                       f" {basis} time)" for s in record.get("stragglers", []))
        lines.append(f"{run.world_size} ranks" + (f" · {kind}" if kind else "") + slow
                     + (f" · {len(found)} finding(s)" if found else ""))
        lines += [f["line"] for f in found]
    elif record.get("findings"):  # the training-loop doctor's, of a single process
        found = record["findings"]
        lines.append(f"{len(found)} loop finding(s) (mdb doctor --run {run.name})")
        lines += [f["line"] for f in found]
    if stopped and not nproc:
        how = "continue" if resumable else "restart from step 0"
        lines.append(f"{how}: mdb overfit --resume {run.name}" + (f" --db {db}" if db else ""))
    return lines


def _config(run) -> dict:
    config = getattr(run, "config", None)
    return config if isinstance(config, dict) else {}


def _nproc_job(run) -> bool:
    """Whether ``run`` was a job of ``mdb overfit --nproc`` (DDP, FSDP2, tensor parallel)."""
    from hooks.train.overfit_options import is_nproc_run

    return is_nproc_run(run.kind, run.world_size, _config(run))


def _short(names: list[str], width: int = 28) -> str:
    """As many names as fit in ``width`` columns, then ``+N`` for the rest."""
    if not names:
        return "—"
    shown = [display_name(n) for n in names]
    for k in range(len(shown), 0, -1):
        rest = len(shown) - k
        text = ", ".join(shown[:k]) + (f" +{rest}" if rest else "")
        if len(text) <= width:
            return text
    return _cut(shown[0], width - 3) + f" +{len(shown) - 1}" if len(shown) > 1 else _cut(
        shown[0], width)


def _cut(text: str, width: int | None) -> str:
    if width is None or len(text) <= width:
        return text
    return text[: max(1, width - 1)] + "…"


#: The widest a run name is shown in the table, also piped: a longer one is cut in the middle
#: (``--json`` keeps it whole). Names mdb makes are at most 100 characters; this one may come
#: from a database written elsewhere.
NAME_CELL = 60

#: Status words and their colours.
_COLORS = {"running": "green", "paused": "yellow", "finished": "cyan", "interrupted": "yellow",
           "failed": "red", "gone": "red", "damaged": "red"}


def table_lines(runs, records: list[dict], now: float, width: int | None,
                db: str | None = None) -> list:
    """The table as Rich ``Text`` lines, laid out for ``width`` columns (``None``: nothing cut).

    Columns: name (cut in the middle past :data:`NAME_CELL` cells), status (one word), steps,
    last loss, age, updated, and the metrics when they fit; under a run, indented, its
    :func:`detail_lines`, each cut to the width.
    """
    from rich.text import Text

    from tui.widgets.fmt import middle

    rows = []
    for r, d in zip(runs, records, strict=True):
        status = "damaged" if d.get("damaged") else d["writer_state"]
        if status == "running" and r.paused:
            status = "paused"
        steps = f"{r.last_step}/{r.total_steps}" if r.total_steps else str(r.last_step)
        if d["steps"] == 0 or d["loss_metric"] is None:
            loss = "—"
        else:  # the run's loss as every view shows it (hooks.store.numbers)
            loss = "nan" if d["loss"] is None else f"{d['loss']:.4f}"
        updated = r.heartbeat if r.heartbeat is not None else r.started
        if d.get("damaged"):  # its times may be what could not be read
            age = ago = "?"
        else:
            age, ago = format_age(now - r.started), format_age(now - updated) + " ago"
        rows.append([middle(display_name(r.name), NAME_CELL), status, steps, loss, age, ago])
    heads = ["name", "status", "steps", "last loss", "age", "updated"]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    if width is not None:  # a very long name gives way first
        over = sum(widths) + 2 * len(widths) - width
        if over > 0:
            widths[0] = max(8, widths[0] - over)
    right = {2, 3, 4, 5}
    used = sum(widths) + 2 * len(widths)
    metrics_w = (width - used - 1) if width is not None else 60
    show_metrics = metrics_w >= 12
    lines = []
    head = Text("  ".join(h.rjust(w) if i in right else h.ljust(w)
                          for i, (h, w) in enumerate(zip(heads, widths, strict=True))),
                style="bold")
    if show_metrics:
        head.append("  metrics", style="bold")
    lines.append(head)
    for row, r, d in zip(rows, runs, records, strict=True):
        line = Text()
        for i, (cell, w) in enumerate(zip(row, widths, strict=True)):
            cell = _cut(cell, w)
            text = cell.rjust(w) if i in right else cell.ljust(w)
            line.append(text, style=_COLORS.get(cell, "") if i == 1 else "")
            line.append("  ")
        if show_metrics:
            line.append(_short(d["metrics"], metrics_w))
        line.rstrip()
        lines.append(line)
        for detail in detail_lines(r, d, now, db):
            # a command to copy is never cut
            command = detail.startswith(("continue: ", "restart from step 0: "))
            room = None if width is None or command else width - 4
            lines.append(Text("  └ " + _cut(printable(detail), room), style="dim"))
    return lines


def _read_all(path, now: float) -> tuple[list, list[dict], str | None]:
    """The runs of the database, their records, and how the file is damaged (``None``: it is
    sound); one line (:class:`MdbError`) when not even the list of runs can be read."""
    import sqlite3

    from hooks.store.sqlite_open import damaged_error
    from hooks.store.store import RunStore, RunStoreError

    try:
        with RunStore(path) as store:
            if store.note:
                print_error(store.note, "note")
            problem = store.damage(thorough=False)  # a large file: not a second of checks
            try:
                runs = store.runs()
            except sqlite3.DatabaseError as exc:
                if problem is None:
                    raise
                raise MdbError(f"{damaged_error(store.path, problem)}; not even its list of "
                               f"runs can be read ({exc})") from None
            records = [run_record(r, store, now, problem is not None) for r in runs]
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None
    return runs, records, problem


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb runs``."""
    from hooks.store.sqlite_open import damaged_error
    from hooks.store.store import default_db_path

    path = args.db if args.db else default_db_path()
    now = time.time()
    runs, records, problem = _read_all(path, now)
    damaged = [d["damaged"] for d in records if d.get("damaged")]
    if problem is not None:  # one line for the file, not one per run it made unreadable
        damaged = [str(damaged_error(path, problem))] + [
            line for line in damaged if "its rows cannot be read" not in line]
    if args.json:
        for d in records:
            print(json.dumps(d, sort_keys=True))
    else:
        from rich.console import Console

        tty = is_terminal(sys.stdout)
        width = shutil.get_terminal_size((80, 24)).columns if tty else None
        # Piped output (scripts, logs) is never cut.
        console = Console(highlight=False, width=width if tty else 100_000, soft_wrap=not tty)
        if not runs:
            console.print(f"no runs in {printable(str(path))}", markup=False, highlight=False)
        else:
            console.print(f"runs in {printable(str(path))}", markup=False, highlight=False)
            for line in table_lines(runs, records, now, width, args.db):
                console.print(line, overflow="ellipsis" if tty else "ignore", no_wrap=True)
    for line in damaged:
        print_error(line)
    return EXIT_DAMAGED if damaged else 0
