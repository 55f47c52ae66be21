"""The ranks of a distributed run in ``mdb watch``: the data (bands, furthest rank,
stragglers) against numpy, and the summary line and ranks screen on a run store written by
``RunWriter``'s rank methods."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hooks.sharded.checksums import NOT_COMPARED
from hooks.store.store import RankInfo, RankRow, RunStore
from tests.conftest import wait_until
from tui.screens.live_ranks_data import RankSeries, bar_string


def _row(step, rank, loss, st=None, ct=None, load=None, **more):
    return RankRow(step=step, rank=rank, wall=float(step), step_time=st, compute_time=ct,
                   expert_load=load, values={"loss": loss, "grad_norm": 1.0, **more})


def _info(rank, state="running"):
    return RankInfo(rank, "h", 100 + rank, rank, state, 0, None, None)


def test_the_band_is_min_median_max_over_the_ranks_of_complete_steps():
    rng = np.random.default_rng(0)
    losses = rng.normal(size=(12, 3))
    s = RankSeries(3, capacity=64)
    s.set_ranks([_info(r) for r in range(3)])
    # rank 2's rows arrive a gather later: its steps 7-12 are not there yet
    s.add_all([_row(t + 1, r, float(losses[t, r])) for t in range(12) for r in (0, 1)]
              + [_row(t + 1, 2, float(losses[t, 2])) for t in range(6)])
    assert s.step == 6
    lo, med, hi = s.band("loss")
    assert lo.points()[0] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(lo.points()[1], losses[:6].min(axis=1))
    np.testing.assert_allclose(med.points()[1], np.median(losses[:6], axis=1))
    np.testing.assert_allclose(hi.points()[1], losses[:6].max(axis=1))
    s.add_all([_row(t + 1, 2, float(losses[t, 2])) for t in range(6, 12)])
    assert s.step == 12
    np.testing.assert_allclose(med.points()[1], np.median(losses, axis=1))
    far = s.furthest("loss")
    last = losses[11]
    m = float(np.median(last))
    want = int(np.argmax(np.abs(last - m)))
    assert far[0] == want and far[1] == pytest.approx(last[want])
    assert far[2] == pytest.approx(m) and far[3] == pytest.approx((last[want] - m) / abs(m))


def test_a_dead_rank_is_no_longer_awaited_and_nan_is_left_out_of_the_band():
    s = RankSeries(2)
    s.set_ranks([_info(0), _info(1)])
    s.add_all([_row(1, 0, 1.0), _row(1, 1, math.nan), _row(2, 0, 2.0)])
    assert s.step == 1 and s.nonfinite_ranks("loss") == [1]
    assert [p for p in s.band("loss")[1].points()[1]] == [1.0]
    assert s.furthest("loss") is None  # one finite value
    s.set_ranks([_info(0), _info(1, "dead")])
    assert s.step == 2  # rank 1 died after step 1: step 2 counts with rank 0 alone


def test_two_ranks_are_always_equally_far_from_their_median():
    s = RankSeries(2)
    s.add_all([_row(1, 0, 1.0), _row(1, 1, 3.0)])
    r, v, med, rel = s.furthest("loss")
    assert med == 2.0 and abs(v - med) == 1.0 and s.tied_with("loss", r) == [1 - r]


def test_stragglers_are_named_by_compute_time_when_every_rank_has_it():
    s = RankSeries(4)
    s.set_ranks([_info(r) for r in range(4)])
    rows = []
    for t in range(1, 21):
        for r in range(4):
            # synchronous DDP: the same step time everywhere; rank 2 computes 40 % longer
            rows.append(_row(t, r, 1.0, st=0.10, ct=0.05 * (1.4 if r == 2 else 1.0)))
    s.add_all(rows)
    assert s.straggler_basis() == "compute"
    (rank, x, med), = s.stragglers()
    assert rank == 2 and x == pytest.approx(0.07) and med == pytest.approx(0.05)
    # without compute times the step times are compared, and here nobody stands out
    s2 = RankSeries(2)
    s2.add_all([_row(t, r, 1.0, st=0.1) for t in range(1, 5) for r in (0, 1)])
    assert s2.straggler_basis() == "step" and s2.stragglers() == []


def test_expert_load_per_rank_and_its_bars():
    s = RankSeries(2)
    s.add_all([_row(1, 0, 1.0, load=[[0.5, 0.25, 0.25, 0.0]]),
               _row(1, 1, 1.0, load=[[0.25, 0.25, 0.25, 0.25]])])
    assert s.expert_load() == {0: [[0.5, 0.25, 0.25, 0.0]], 1: [[0.25] * 4]}
    assert bar_string([0.5, 0.25, 0.25, 0.0]) == "█▄▄ "
    assert bar_string([0.25] * 4) == "████"


# ---------------------------------------------------------------------------------------------
# On screen
# ---------------------------------------------------------------------------------------------


def _distributed_db(path):
    with RunStore(path, create=True) as store:
        w = store.create_run("ddp", {"gather_every": 5}, total_steps=10, kind="api")
        w.set_world_size(2)
        w.set_ranks([{"rank": 0, "host": "nodeA", "pid": 4241, "local_rank": 0},
                     {"rank": 1, "host": "nodeB", "pid": 4242, "local_rank": 0}])
        for step in range(1, 11):
            w.log_step({"step": step, "wall": float(step), "loss": 2.0 / step, "grad_norm": 0.5})
            for rank in (0, 1):
                w.log_rank_steps(rank, [{
                    "step": step, "wall": float(step), "step_time": 0.1,
                    "compute_time": 0.05 if rank == 0 else 0.08,
                    "expert_load": [[0.5, 0.5]] if rank == 0 else [[0.9, 0.1]],
                    "values": {"loss": 2.0 / step + 0.1 * rank, "grad_norm": 0.5}}])
        # it was silent for a while and came back (a silent rank is not awaited, nor timed)
        w.set_ranks([{"rank": 1, "state": "running", "reason": None}])
        w.add_findings([{"kind": "rank_silent", "step": 10, "rank": 1, "subject": "rank 1",
                         "line": "rank 1 (pid 4242 on nodeB) stopped reporting: no heartbeat "
                                 "for 16 s, last step 10"}])
        w.add_checks([{"step": 5, "kind": "params", "ranks": 2, "compared": 4,
                       "differing": 0}])


@pytest.mark.asyncio
async def test_watch_of_a_distributed_run_shows_the_ranks_and_k_opens_them(tmp_path):
    from tui.live_app import make_watch_app
    from tui.screens.live_ranks import RanksScreen, RanksSummary

    db = tmp_path / "d.sqlite"
    _distributed_db(db)
    with RunStore(db) as store:
        app = make_watch_app(store, store.run("ddp"))
        async with app.run_test(size=(80, 24)) as pilot:
            summary = app.live.query_one(RanksSummary)
            await wait_until(pilot, lambda: summary.polls >= 1 and summary.series.step == 10)
            assert summary.display
            line = summary.summary().plain
            assert "2 ranks" in line and "@10" in line and "loss 0.2‥0.3" in line
            assert "rank 1 (pid 4242 on nodeB) stopped reporting" in line
            await pilot.press("k")
            await wait_until(pilot, lambda: isinstance(app.screen, RanksScreen))
            screen = app.screen
            await wait_until(pilot, lambda: screen.redraws >= 1)
            table = screen.table_text().plain
            assert "nodeB" in table and "4242" in table and "running" in table
            assert "◀ straggler" in table.splitlines()[2]  # rank 1: 0.08 s vs median 0.065
            assert "straggler(s) by compute time: rank 1 (+23%)" in screen.times_text().plain
            experts = screen.experts_text().plain
            assert "r1" in experts and "e0 90%" in experts
            findings = screen.findings_text().plain
            assert "findings (1)" in findings and "parameters equal at 1 steps" in \
                findings
            await pilot.press("q")
            await wait_until(pilot, lambda: app.screen is app.live)


@pytest.mark.asyncio
async def test_a_single_process_run_has_no_ranks_line(tmp_path):
    from tui.live_app import make_watch_app
    from tui.screens.live_ranks import RanksSummary

    db = tmp_path / "s.sqlite"
    with RunStore(db, create=True) as store:
        w = store.create_run("one", {}, kind="api")
        w.log_step({"step": 1, "loss": 1.0})
    with RunStore(db) as store:
        app = make_watch_app(store, store.run("one"))
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: app.live.polls >= 1)
            assert not app.live.query_one(RanksSummary).display
            await pilot.press("k")
            await pilot.pause()  # the key handled, the app idle again
            assert app.screen is app.live


def _rank_rows(w, steps):
    for step in steps:
        w.log_step({"step": step, "wall": float(step), "loss": 2.0 / step, "grad_norm": 0.5})
        for rank in (0, 1):
            w.log_rank_steps(rank, [{"step": step, "wall": float(step), "step_time": 0.1,
                                     "values": {"loss": 2.0 / step, "grad_norm": 0.5}}])


@pytest.mark.asyncio
async def test_the_ranks_line_never_stays_behind_a_finished_status(tmp_path, monkeypatch):
    """The status line and the ranks line come from two reads of the store: once the screen
    says "✓ finished", the ranks line shows the ranks' final state at once (or says it is
    reading it), not a step of before with a rank still running."""
    from tui.live_app import make_watch_app
    from tui.screens.live_ranks import RanksSummary

    monkeypatch.setattr(RanksSummary, "POLL_INTERVAL", 600.0)  # its own reads: far apart
    db = tmp_path / "d.sqlite"
    with RunStore(db, create=True) as store:
        w = store.create_run("ddp", {"gather_every": 10}, total_steps=30, kind="api")
        w.set_world_size(2)
        w.set_ranks([{"rank": r, "host": "h", "pid": 4241 + r, "local_rank": r}
                     for r in (0, 1)])
        _rank_rows(w, range(1, 21))
        w.set_ranks([{"rank": 0, "state": "finished", "reason": None}])
        with RunStore(db) as reader:
            app = make_watch_app(reader, reader.run("ddp"))
            async with app.run_test(size=(80, 24)) as pilot:
                summary = app.live.query_one(RanksSummary)
                await wait_until(pilot, lambda: summary.polls >= 1
                                 and summary.series.step == 20)
                first = summary.summary().plain.splitlines()[0]
                assert "(1 finished · 1 running)" in first and "@20" in first
                _rank_rows(w, range(21, 31))
                w.set_ranks([{"rank": 1, "state": "finished", "reason": None}])
                w.finish("finished")
                await wait_until(pilot, lambda: app.live.state == "finished")
                # the line follows the screen (every 0.1 s): catching up, or read again
                await wait_until(pilot, lambda: summary.catching_up
                                 or summary.run.status != "running")
                first = summary.summary().plain.splitlines()[0]
                assert "running" not in first and "@20" not in first
                # read again at once, not at its next poll (600 s away)
                await wait_until(pilot, lambda: "@30" in summary.summary().plain, timeout=60)
                first = summary.summary().plain.splitlines()[0]
                assert first.startswith("2 ranks (2 finished) · @30")
                await pilot.press("q")


@pytest.mark.asyncio
async def test_checks_that_compared_nothing_are_shown_as_not_compared(tmp_path):
    """An FSDP2 job's checks: two ranks, but every tensor a shard of one rank (compared 0,
    as the monitor records them): neither "checks ✓" nor "parameters equal", but why not."""
    from tui.live_app import make_watch_app
    from tui.screens.live_ranks import RanksScreen, RanksSummary

    db = tmp_path / "f.sqlite"
    with RunStore(db, create=True) as store:
        w = store.create_run("fsdp", {"gather_every": 5}, total_steps=10, kind="api")
        w.set_world_size(2)
        w.set_ranks([{"rank": r, "host": "h", "pid": 10 + r, "local_rank": r}
                     for r in (0, 1)])
        for step in range(1, 11):
            w.log_step({"step": step, "wall": float(step), "loss": 1.0})
            for rank in (0, 1):
                w.log_rank_steps(rank, [{"step": step, "wall": float(step), "step_time": 0.1,
                                         "compute_time": 0.05, "values": {"loss": 1.0}}])
        w.add_checks([{"step": s, "kind": k, "ranks": 2, "compared": 0, "differing": 0}
                      for s in (5, 10) for k in ("params", "grads")])
    with RunStore(db) as store:
        app = make_watch_app(store, store.run("fsdp"))
        async with app.run_test(size=(160, 24)) as pilot:
            summary = app.live.query_one(RanksSummary)
            await wait_until(pilot, lambda: summary.polls >= 1 and summary.series.step == 10)
            line = summary.summary().plain
            assert "✓" not in line and line.endswith(" · not compared: no replicas"), line
            await pilot.press("k")
            await wait_until(pilot, lambda: isinstance(app.screen, RanksScreen))
            findings = app.screen.findings_text().plain
            assert "equal" not in findings, findings
            assert (f"checks: parameters not compared: {NOT_COMPARED} · gradients not "
                    f"compared: {NOT_COMPARED}") in findings, findings


def test_only_checks_that_compared_tensors_count_as_made():
    s = RankSeries(2)
    s.checks = [{"step": 5, "kind": "params", "compared": 4, "differing": 1, "note": None},
                {"step": 10, "kind": "params", "compared": 4, "differing": 0, "note": None},
                {"step": 5, "kind": "grads", "compared": 0, "differing": 0, "note": "why"}]
    assert s.checks_summary() == {"params": (2, 1)}
    assert s.checks_not_compared() == {"grads": (1, "why")}
