"""Store commands at scale (issue 25): ``mdb runs``, ``mdb export``, ``mdb watch``,
``mdb compare`` and ``mdb stop`` never import torch; a run of many steps is listed, exported
and watched with exactly the values written, its spike visible in the chart.

The stores are written directly with the store's writer (``RunWriter.log_steps`` in batches);
every expected value comes from :func:`value`, computed again here, never read back through
the code under test."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hooks.store.store import RunStore
from tui.cli import main

ROOT = Path(__file__).resolve().parents[3]
NAMES = ("loss", "acc", "lr", "grad_norm", "tokens_per_s")
#: The spike: the largest value of the run, at a step drawn by the test.
SPIKE = 8765.25


def value(step: int, m: int, spike_step: int) -> float | None:
    """The value of metric ``m`` (index in :data:`NAMES`) at ``step``: ``None`` = not logged
    (``acc`` at steps 1, 4, 7, … only); a NaN at step 7 and +inf at step 11 of ``grad_norm``."""
    if m == 0:
        return SPIKE if step == spike_step else 2.0 + math.sin(step * 1e-3) / (1 + step * 1e-5)
    if m == 1:
        return (step % 997) / 997 if step % 3 == 1 else None
    if m == 2:
        return 1e-3 * (1 + step % 5) / 7
    if m == 3:
        return math.nan if step == 7 else math.inf if step == 11 else math.cos(step) ** 2 / 3
    return 1000.0 + (step * 7919) % 1013 / 10


def write_store(db: Path, steps: int, spike_step: int, batch: int = 20_000) -> None:
    """Run ``big`` of ``steps`` steps × 5 metrics, finished, in ``db``."""
    with RunStore(db, create=True) as store:
        w = store.create_run("big", {"steps": steps}, total_steps=steps, kind="api")
        for lo in range(1, steps + 1, batch):
            rows = []
            for s in range(lo, min(steps, lo + batch - 1) + 1):
                vals = {n: value(s, m, spike_step) for m, n in enumerate(NAMES)}
                rows.append(({"step": s, "wall": 1.7e9 + s * 0.01,
                              "values": {k: v for k, v in vals.items() if v is not None}},
                             None, None))
            w.log_steps(rows)
        w.finish("finished")


def _csv_cell(v: float | None) -> str:
    """The CSV cell of a value, as the README documents it (independent of mdb's writer)."""
    if v is None:
        return ""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return repr(v)


def check_runs_and_export(db: Path, steps: int, spike_step: int, capsys) -> None:
    assert main(["runs", "--json", "--db", str(db)]) == 0
    (rec,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rec["status"] == "finished" and rec["steps"] == steps == rec["last_step"]
    assert rec["metrics"] == list(NAMES)
    last_acc = steps - (steps - 1) % 3
    expected = {n: value(steps, m, spike_step) for m, n in enumerate(NAMES)}
    expected["acc"] = value(last_acc, 1, spike_step)
    assert rec["latest"] == expected
    assert rec["last_loss"] == expected["loss"]

    assert main(["export", "big", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    reader = csv.reader(io.StringIO(out))
    assert next(reader) == ["step", *NAMES]
    n = 0
    for n, row in enumerate(reader, start=1):
        want = [str(n), *(_csv_cell(value(n, m, spike_step)) for m in range(len(NAMES)))]
        if row != want:
            raise AssertionError(f"step {n}: {row} != {want}")
    assert n == steps
    del out

    assert main(["export", "big", "--format", "jsonl", "--db", str(db)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == steps
    for s in (1, 3, 7, 11, spike_step, steps):
        obj = json.loads(lines[s - 1])
        want = {"step": s}
        want.update({n: value(s, m, spike_step) for m, n in enumerate(NAMES)
                     if value(s, m, spike_step) is not None})
        assert list(obj) == list(want)
        for k, v in want.items():
            assert obj[k] == v or (math.isnan(v) and math.isnan(obj[k])), (s, k)


async def check_watch(db: Path, steps: int, spike_step: int) -> None:
    from tests.conftest import drawn, wait_until
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app
    from tui.screens.live_chart import LineChart, chart_rows

    store, run = open_run(str(db), "big")
    app = make_watch_app(store, run)
    try:
        async with app.run_test(size=(120, 36)) as pilot:
            screen = app.live
            # the first read marks the charts to be drawn; they are drawn on the screen's next
            # redraw slot, however long that takes on a loaded machine
            await wait_until(pilot, lambda: screen.polls >= 1, timeout=60)
            await drawn(pilot, screen)
            assert screen.state == "finished" and screen.series.step == steps
            status = str(screen.query_one("#live-status").render())
            assert "finished" in status
            loss = screen.query_one("#live-loss", LineChart)
            drawn = [s for s in loss.series if s.xs]
            assert max(max(s.highs) for s in drawn) == SPIKE  # the spike's own value
            rows = chart_rows(loss.series, loss.size.width, loss.size.height,
                              log=loss.log_scale)
            top = "".join(t for t, _ in rows[1]).split("┤")[0].strip()
            assert top == f"{SPIKE:.0f}"  # the top of the y axis is the spike
    finally:
        store.close()


@pytest.fixture(scope="module")
def store_20k(tmp_path_factory):
    import random

    spike = random.Random(25).randrange(12, 20_000)
    db = tmp_path_factory.mktemp("scale") / "m.sqlite"
    write_store(db, 20_000, spike)
    return db, 20_000, spike


def test_runs_and_export_give_exactly_the_values_written(store_20k, capsys):
    check_runs_and_export(*store_20k, capsys)


async def test_watch_of_a_long_run_shows_it_finished_and_its_spike(store_20k):
    await check_watch(*store_20k)


@pytest.mark.slow
async def test_a_run_of_a_million_steps_is_listed_exported_and_watched_exactly(tmp_path,
                                                                               capsys):
    import random

    steps = 1_000_000
    spike = random.Random(1_000_000).randrange(12, steps)
    db = tmp_path / "m.sqlite"
    write_store(db, steps, spike, batch=50_000)
    check_runs_and_export(db, steps, spike, capsys)
    await check_watch(db, steps, spike)


# -- never import torch ----------------------------------------------------------------------

_WATCH = textwrap.dedent("""
    import asyncio, sys, time
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    async def go():
        store, run = open_run(sys.argv[1], "big")
        app = make_watch_app(store, run)
        async with app.run_test(size=(100, 30)) as pilot:
            deadline = time.monotonic() + 60
            while not app.live.polls and time.monotonic() < deadline:
                await pilot.pause()
            print("polls", app.live.polls, app.live.state)
        store.close()

    asyncio.run(go())
    print("torch imported:", "torch" in sys.modules)
""")


def test_store_commands_never_import_torch(tmp_path, store_20k):
    """A ``torch`` package that raises on import, first on ``PYTHONPATH``: every store command
    works (``mdb stop`` asks and times out: nothing trains)."""
    fake = tmp_path / "notorch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('mdb test: torch was imported')\n")
    db = store_20k[0]
    small = tmp_path / "two.sqlite"
    write_store(small, 50, 5)
    with RunStore(small) as store:  # a second run, left running by this (live) process
        w = store.create_run("live", {}, kind="api")
        w.log_step({"step": 1, "values": {"loss": 1.0}})
        w.heartbeat()
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'notorch'}{os.pathsep}{ROOT}")

    def mdb(*argv: str, code: str | None = None) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", code, *argv] if code else [
            sys.executable, "-c", "import sys; from tui.cli import main; sys.exit(main())", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=120)

    assert "mdb test: torch was imported" in mdb(code="import torch").stderr  # the fake works
    r = mdb("runs", "--db", str(db))
    assert r.returncode == 0 and "big" in r.stdout, r.stderr
    r = mdb("export", "big", "--db", str(db))
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 20_001, r.stderr
    r = mdb("compare", "big", "live", "--table", "--db", str(small))
    assert r.returncode == 0 and "big" in r.stdout and "live" in r.stdout, r.stderr
    r = mdb("stop", "live", "--timeout", "0.5", "--db", str(small))
    assert "asked run live" in r.stderr and "torch" not in r.stderr, r.stderr
    r = mdb(str(db), code=_WATCH)
    assert r.returncode == 0, r.stderr
    assert "polls 1 finished" in r.stdout and "torch imported: False" in r.stdout


# -- a torchrun job's export: a rank column ---------------------------------------------------

def test_export_of_a_distributed_run_has_a_row_per_rank_and_step(tmp_path, capsys):
    db = tmp_path / "d.sqlite"
    want = {}  # (step, rank) -> {name: value}
    with RunStore(db, create=True) as store:
        w = store.create_run("ddp", {}, kind="api", world_size=2)
        w.set_ranks([{"rank": 0}, {"rank": 1}])
        for rank in (0, 1):
            rows = []
            for s in range(1, 6):
                vals = {"loss": 1.0 / (s + rank), "lr": 0.1}
                if rank == 1 and s == 3:
                    vals = {"loss": math.nan}  # lr not logged by rank 1 at step 3
                rows.append({"step": s, "wall": float(s), "values": vals})
                want[(s, rank)] = vals
            w.log_rank_steps(rank, rows)
        w.log_steps([({"step": s, "wall": float(s), "values": want[(s, 0)]}, None, None)
                     for s in range(1, 6)])
        w.finish("finished")

    def cell(v):
        return "" if v is None else "nan" if math.isnan(v) else repr(v)

    assert main(["export", "ddp", "--db", str(db)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step,rank,loss,lr"
    assert lines[1:] == [f"{s},{r},{cell(want[(s, r)].get('loss'))},{cell(want[(s, r)].get('lr'))}"
                         for s in range(1, 6) for r in (0, 1)]
    assert main(["export", "ddp", "--rank", "1", "--format", "jsonl", "--db", str(db)]) == 0
    objs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(o["step"], o["rank"]) for o in objs] == [(s, 1) for s in range(1, 6)]
    assert math.isnan(objs[2]["loss"]) and "lr" not in objs[2] and objs[0]["loss"] == 0.5
    assert main(["export", "ddp", "--rank", "2", "--db", str(db)]) == 2
    assert capsys.readouterr().err == "mdb: error: --rank 2: run 'ddp' has ranks 0, 1\n"
    single = tmp_path / "s.sqlite"
    write_store(single, 3, 2)
    assert main(["export", "big", "--rank", "0", "--db", str(single)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mdb: error: --rank 0: run 'big' is a single process") and \
        err.count("\n") == 1


async def test_watch_fills_in_the_expert_load_of_a_long_run_after_its_first_frame(tmp_path):
    """The first frame of a run of 6,000 steps has the expert load of its last steps; the rest
    is read after it (the share of expert 0 of layer 0 peaks at 0.97 at step 10)."""
    from tests.conftest import wait_until
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    db = tmp_path / "moe.sqlite"
    with RunStore(db, create=True) as store:
        w = store.create_run("moe", {}, kind="api")
        w.log_steps([({"step": s, "wall": float(s), "values": {"loss": 1.0},
                       "expert_load": [[0.97, 0.03] if s == 10 else [0.4, 0.6], [0.5, 0.5]]},
                      None, None) for s in range(1, 6001)])
        w.finish("finished")
    store, run = open_run(str(db), "moe")
    app = make_watch_app(store, run)
    try:
        async with app.run_test(size=(120, 36)) as pilot:
            s = app.live.series
            await wait_until(pilot, lambda: app.live.polls >= 1, timeout=60)
            await wait_until(pilot, lambda: s.experts[0][0].count == 6000, timeout=60)
            xs, _means, lows, highs = s.experts[0][0].ranges()
            assert max(highs) == 0.97 and min(lows) == 0.4 and xs[-1] == 6000
            assert len(s.experts) == 2 and xs[0] <= 64
    finally:
        store.close()


def test_compare_of_a_long_run_reads_its_bucketed_history_with_exact_last_and_best(
        store_20k, tmp_path, capsys):
    import shutil

    src, steps, spike = store_20k
    db = tmp_path / "c.sqlite"
    shutil.copyfile(src, db)
    with RunStore(db) as store:
        w = store.create_run("small", {}, kind="api")
        w.log_steps([({"step": s, "wall": float(s), "values": {"loss": 5.0 - s / 100}}, None,
                      None) for s in range(1, 101)])
        w.finish("finished")
    assert main(["compare", "big", "small", "--json", "--db", str(db)]) == 0
    rows = {r["label"]: r["cells"] for r in json.loads(capsys.readouterr().out)["rows"]}
    losses = [value(s, 0, spike) for s in range(1, steps + 1)]
    assert rows["last loss"] == [f"{losses[-1]:.4f}", "4.0000"]
    assert rows["best loss"] == [f"{min(losses):.4f}", "4.0000"]
    assert rows["step"] == [f"{steps}/{steps}", "100"]


async def test_the_ranks_of_a_long_job_are_read_a_page_at_a_time(tmp_path, monkeypatch):
    from tests.conftest import wait_until
    from tui.live_app import make_watch_app
    from tui.screens import live_ranks

    db = tmp_path / "r.sqlite"
    with RunStore(db, create=True) as store:
        w = store.create_run("ddp", {}, kind="api", world_size=2)
        w.set_ranks([{"rank": 0}, {"rank": 1}])
        for rank in (0, 1):
            w.log_rank_steps(rank, [{"step": s, "wall": float(s), "values": {
                "loss": 10.0 + s + rank}} for s in range(1, 11)])
        w.log_steps([({"step": s, "wall": float(s), "values": {"loss": 10.0 + s}}, None, None)
                     for s in range(1, 11)])
        w.finish("finished")
        page = store.rank_steps(store.run("ddp").id, after_step=2, rank=1, limit=3)
        assert [(r.step, r.rank, r.values) for r in page] == [
            (s, 1, {"loss": 11.0 + s}) for s in (3, 4, 5)]
    monkeypatch.setattr(live_ranks, "RANK_PAGE", 3)
    with RunStore(db) as store:
        app = make_watch_app(store, store.run("ddp"))
        async with app.run_test(size=(80, 24)) as pilot:
            summary = app.live.query_one(live_ranks.RanksSummary)
            await wait_until(pilot, lambda: summary.series.step == 10, timeout=30)
            assert summary.polls >= 4  # 10 steps, 3 a page
            assert "loss 20‥21" in summary.summary().plain
