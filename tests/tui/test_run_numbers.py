"""One meaning for each number (issue 33): the same run shows the same loss, steps/s and ETA in
``mdb runs --json``, in ``mdb compare``'s table and in the live screen's data, and the same
rank medians and stragglers in ``mdb runs --json`` and ``mdb watch``'s ranks data — each
checked against values worked out here from the logged numbers (``statistics.median``, plain
arithmetic), never by the code under test."""

from __future__ import annotations

import json
import sqlite3
import statistics

import pytest

import hooks
from hooks.store.store import RunStore
from tests.conftest import wait_for
from tui.cli import main
from tui.commands.compare import read_views
from tui.screens.compare_data import compare_rows
from tui.screens.live_data import RunSeries, run_declaration
from tui.screens.live_ranks_data import RankSeries

STEPS, TOTAL = 30, 50

#: What a loop logs at step s, and which of its metrics is "the loss" (hooks.store.numbers):
#: the back-propagated total first, then loss; the cross-entropy when it is all there is.
LOGS = {
    "ce, aux and total": (lambda s: {"ce": 3.0 / s, "aux": 0.05, "total": 3.0 / s + 0.05},
                          "total"),
    "loss only": (lambda s: {"loss": 2.0 / s, "lr": 1e-3}, "loss"),
    "ce only": (lambda s: {"ce": 4.0 / s, "grad_norm": 0.5}, "ce"),
}


def _runs_json(db, capsys) -> dict[str, dict]:
    assert main(["runs", "--json", "--db", str(db)]) in (0, 1)
    return {d["name"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}


def _walls(db, name) -> list[float]:
    with sqlite3.connect(db) as conn:
        return [w for (w,) in conn.execute(
            "SELECT wall FROM metrics WHERE run_id = (SELECT id FROM runs WHERE name = ?)"
            " ORDER BY step", (name,))]


@pytest.mark.parametrize("case", list(LOGS))
def test_the_loss_speed_and_eta_of_a_run_are_the_same_in_every_view(tmp_path, capsys, case):
    values, loss_name = LOGS[case]
    db = tmp_path / "mdb.sqlite"
    with hooks.run("r", db=db, total_steps=TOTAL) as run:
        for s in range(1, STEPS + 1):
            run.log(**values(s))
        with RunStore(db) as store:
            wait_for(lambda: store.run("r").last_step == STEPS, what="the steps written")
        record = _runs_json(db, capsys)["r"]  # while the run is running: it has an ETA
        # by hand: the median spacing of the last 21 steps' walls, and the steps left
        walls = _walls(db, "r")[-21:]
        spp = statistics.median(b - a for a, b in zip(walls, walls[1:], strict=False))
        loss = values(STEPS)[loss_name]
        steps_per_s, eta = 1.0 / spp, (TOTAL - STEPS) * spp

        with RunStore(db) as store:
            info = store.run("r")
            declared = run_declaration(info)
            live = RunSeries(info.total_steps, names=declared["names"],
                             loss_names=declared["loss_names"])
            for row in store.poll(info.id, 0).metrics:
                live.add(row)
            views = read_views(store, ["r"])
        assert info.last_loss == pytest.approx(loss)  # what the writer keeps as the loss
        rows = {r.label: r.cells for r in compare_rows(views)}
        assert views[0].loss_name == loss_name
        assert rows[f"last {loss_name}"] == [f"{loss:.4f}"]
        assert rows["steps/s"] == [f"{steps_per_s:.1f}"]
        assert live.loss_name == loss_name
        assert live.value(live.loss_name) == pytest.approx(loss)
        assert live.steps_per_s() == pytest.approx(steps_per_s)
        assert live.eta() == pytest.approx(eta)

        assert record["loss_metric"] == loss_name
        assert record["loss"] == pytest.approx(loss)
        assert record["steps_per_s"] == pytest.approx(steps_per_s)
        assert record["eta_s"] == pytest.approx(eta)
    assert _runs_json(db, capsys)["r"]["eta_s"] is None  # ended: no ETA, as the live screen


def test_the_table_of_mdb_runs_shows_the_same_loss(tmp_path, capsys):
    db = tmp_path / "mdb.sqlite"
    with hooks.run("only-ce", db=db) as run:
        for s in range(1, 6):
            run.log(ce=4.0 / s)
    assert main(["runs", "--db", str(db)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("only-ce"))
    assert f"{4.0 / 5:.4f}" in line.split()


def test_mdb_compare_shows_the_cross_entropy_beside_a_moe_runs_total(tmp_path):
    db = tmp_path / "mdb.sqlite"
    with RunStore(db, create=True) as store:
        for name, aux in (("a", 0.05), ("b", 0.2)):
            w = store.create_run(name, {}, total_steps=3, kind="api")
            for s in (1, 2, 3):
                w.log_step({"step": s, "wall": 100.0 + s, "ce": 1.0 / s, "aux": aux,
                            "total": 1.0 / s + aux})
            w.finish("finished")
        rows = {r.label: r.cells for r in compare_rows(read_views(store, ["a", "b"]))}
    assert rows["last total"] == [f"{1 / 3 + 0.05:.4f}", f"{1 / 3 + 0.2:.4f}"]
    assert rows["best total"] == rows["last total"]
    assert rows["last ce"] == [f"{1 / 3:.4f}"] * 2
    assert rows["steps/s"] == ["1.0", "1.0"]  # walls one second apart


# ---------------------------------------------------------------------------------------------
# The ranks of a torchrun job
# ---------------------------------------------------------------------------------------------

WORLD = 5
RANK_STEPS = 26  # more than the 20 steps each rank's medians are taken over


def _compute(step: int, rank: int) -> float | None:
    """Rank 3 computes ~40 % longer; rank 4 is measured but dies; rank 1 is slow only in its
    first steps (outside the window of the last 20)."""
    base = 0.05 + 0.001 * ((7 * step + 3 * rank) % 5)
    if rank == 3:
        base *= 1.4
    if rank == 1 and step <= RANK_STEPS - 20:
        base *= 3.0
    return base


def _distributed_db(path, compute=True):
    with RunStore(path, create=True) as store:
        w = store.create_run("ddp", {}, total_steps=100, kind="api")
        w.set_world_size(WORLD)
        w.set_ranks([{"rank": r, "host": "h", "pid": 4000 + r, "local_rank": r}
                     for r in range(WORLD)])
        for step in range(1, RANK_STEPS + 1):
            w.log_step({"step": step, "wall": float(step), "ce": 1.0 / step,
                        "total": 1.0 / step + 0.01})
            for rank in range(WORLD):
                w.log_rank_steps(rank, [{
                    "step": step, "wall": float(step), "step_time": 0.1 + 0.001 * rank,
                    "compute_time": _compute(step, rank) if compute or rank else None,
                    "values": {"ce": 1.0 / step, "total": 1.0 / step + 0.01}}])
        w.set_ranks([{"rank": 4, "state": "dead", "reason": "process gone"}])


def _expected(compute: bool):
    """Per rank, the median of its last 20 times (by hand), and the stragglers among the
    ranks still reporting (0-3) on the basis every one of them has."""
    window = range(RANK_STEPS - 19, RANK_STEPS + 1)
    step_t = {r: statistics.median(0.1 + 0.001 * r for _ in window) for r in range(WORLD)}
    comp = {r: statistics.median(_compute(t, r) for t in window) for r in range(WORLD)
            if compute or r}
    basis = "compute" if compute else "step"
    chosen = comp if compute else step_t
    med = statistics.median(chosen[r] for r in range(4))
    slow = sorted(((r, chosen[r], med) for r in range(4) if chosen[r] > 1.1 * med),
                  key=lambda s: -s[1])
    return step_t, comp, basis, slow


@pytest.mark.parametrize("compute", [True, False], ids=["compute times", "rank 0 unmeasured"])
def test_rank_medians_and_stragglers_are_the_same_in_mdb_runs_and_mdb_watch(
        tmp_path, capsys, compute):
    db = tmp_path / "d.sqlite"
    _distributed_db(db, compute)
    step_t, comp, basis, slow = _expected(compute)
    assert slow == ([(3, comp[3], pytest.approx(statistics.median(comp[r] for r in range(4))))]
                    if compute else [])  # the case is what it says: rank 3 alone straggles

    record = _runs_json(db, capsys)["ddp"]
    assert record["loss_metric"] == "total"
    assert {t["rank"]: (t["step_time"], t["compute_time"]) for t in record["rank_times"]} == {
        r: (pytest.approx(step_t[r]), pytest.approx(comp[r]) if r in comp else None)
        for r in range(WORLD)}
    assert record["straggler_basis"] == basis
    assert [(s["rank"], s["time"], s["median"]) for s in record["stragglers"]] == [
        (r, pytest.approx(x), pytest.approx(m)) for r, x, m in slow]

    with RunStore(db) as store:
        info = store.run("ddp")
        ranks = RankSeries(info.world_size)
        ranks.set_ranks(store.ranks(info.id))
        ranks.add_all(store.rank_steps(info.id))
    assert ranks.loss_name() == "total"
    assert ranks.times() == {t["rank"]: (t["step_time"], t["compute_time"])
                             for t in record["rank_times"]}
    assert ranks.straggler_basis() == basis
    assert ranks.stragglers() == [(s["rank"], s["time"], s["median"])
                                  for s in record["stragglers"]]
    if compute:
        assert main(["runs", "--db", str(db)]) == 0
        pct = comp[3] / statistics.median(comp[r] for r in range(4)) - 1
        assert f"straggler rank 3 (+{pct * 100:.0f}% compute time)" in capsys.readouterr().out


def test_the_headless_line_of_an_nproc_job_shows_the_runs_speed(tmp_path, capsys):
    """``mdb overfit --nproc N`` without a terminal: the same steps/s as every view (the median
    spacing of the steps' walls), not rank 0's own ``steps_per_s`` of one step."""
    from types import SimpleNamespace

    from tui.commands.overfit_ddp import _headless

    walls = [100.0, 100.5, 101.0, 101.25]  # spacings 0.5, 0.5, 0.25: median 0.5 s
    db = tmp_path / "mdb.sqlite"
    with RunStore(db, create=True) as store:
        w = store.create_run("job", {}, total_steps=4)
        for s, wall in enumerate(walls, 1):
            w.log_step({"step": s, "wall": wall, "ce": 1.0, "aux": 0.0, "grad_norm": 1.0,
                        "step_time": 0.02, "steps_per_s": 50.0})
        w.finish("finished")
    with RunStore(db) as store:
        _headless(store, store.run("job"), SimpleNamespace(alive=lambda: False, log="log"), 2)
    last = capsys.readouterr().out.splitlines()[-1]
    spacings = [b - a for a, b in zip(walls, walls[1:], strict=False)]
    assert last.startswith("step 4/4") and last.endswith(
        f"  {1 / statistics.median(spacings):.1f} steps/s"), last
