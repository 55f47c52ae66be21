"""Loss spikes: the rule on synthetic series (against a direct recomputation of the running
median), the store's record (written with the steps, seeded on resume, shown by ``mdb runs``,
``--json`` and ``mdb watch``), for ``mdb overfit`` and ``hooks.run`` runs, and a real run whose
learning rate is made to jump."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

import hooks
from hooks.store.spikes import FACTOR, MIN_HISTORY, MIN_RISE, WINDOW, Spike, SpikeDetector
from hooks.store.store import MetricRow, RunStore
from tests.conftest import drawn, wait_until
from tui.cli import main
from tui.screens.live_chart import FLAG, Series, chart_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def _episodes(values, **kw):
    """Feed ``values`` (steps 1..n); the final state of each episode, by first step."""
    det = SpikeDetector("loss", **kw)
    out: dict[int, Spike] = {}
    for step, v in enumerate(values, 1):
        sp = det.observe(step, v)
        if sp is not None:
            out[sp.step] = sp
    return list(out.values())


def _reference(values):
    """The rule written out directly: steps whose value exceeds FACTOR × the median of the
    WINDOW finite values before it (with at least MIN_HISTORY of them) and rises above it by
    more than MIN_RISE × the median of the first MIN_HISTORY values."""
    finite = [(i + 1, v) for i, v in enumerate(values) if v is not None and math.isfinite(v)]
    hits = []
    for k, (step, v) in enumerate(finite):
        before = [x for _, x in finite[max(0, k - WINDOW):k]]
        if k < MIN_HISTORY or len(before) < MIN_HISTORY:
            continue
        initial = statistics.median([x for _, x in finite[:MIN_HISTORY]])
        base = statistics.median(before)
        if v > FACTOR * base and v - base > MIN_RISE * initial:
            hits.append(step)
    return hits


def test_a_jump_of_several_times_the_median_is_one_episode_with_its_peak():
    rng = random.Random(0)
    values = [2.5 * math.exp(-i / 15) + 0.04 + 0.002 * rng.random() for i in range(200)]
    values[120:124] = [0.4, 1.3, 3.3, 1.9]  # the shape of the 2,000-step run's step 687
    (sp,) = _episodes(values)
    assert (sp.step, sp.peak_step, sp.last_step) == (121, 123, 124)
    assert sp.value == 3.3
    assert sp.baseline == pytest.approx(statistics.median(values[70:120]))
    assert sp.ratio == pytest.approx(3.3 / sp.baseline)
    assert "loss spike at step 121: loss 3.3 at step 123" in sp.describe()
    assert "(4 steps)" in sp.describe()
    # every spiking step is one the rule written out directly flags, and no other
    assert _reference(values) == list(range(121, 125))


def test_noise_of_a_converged_loss_and_a_smooth_decay_flag_nothing():
    rng = random.Random(1)
    # a converged CE of ~1e-4 that doubles and halves: many times its median, but tiny
    converged = [2.5] * 5 + [1e-4 * (1 + 5 * rng.random()) for _ in range(300)]
    assert _episodes(converged) == [] and _reference(converged) == []
    decay = [3.0 * 0.97 ** i for i in range(300)]
    assert _episodes(decay) == [] and _reference(decay) == []


@pytest.mark.parametrize("seed", range(5))
def test_random_series_agree_with_the_rule_written_out(seed):
    rng = random.Random(seed)
    values = []
    for i in range(400):
        v = 1.0 / (1 + i / 50) + 0.05 * rng.random()
        if rng.random() < 0.03:
            v *= rng.choice([2, 5, 20])
        if rng.random() < 0.01:
            v = rng.choice([float("nan"), float("inf"), None])
        values.append(v)
    spiking = set()
    for sp in _episodes(values):
        spiking.update(range(sp.step, sp.last_step + 1))
    flagged = set(_reference(values))
    # each episode spans consecutive flagged steps (non-finite values in between are skipped)
    assert flagged <= spiking
    assert all(values[s - 1] is None or not math.isfinite(values[s - 1]) or s in flagged
               for s in spiking)


def test_nothing_before_enough_history_and_non_finite_values_are_skipped():
    values = [1.0] * (MIN_HISTORY - 1) + [100.0]
    assert _episodes(values) == []
    det = SpikeDetector("loss")
    for step in range(1, 30):
        det.observe(step, 1.0)
    assert det.observe(30, float("nan")) is None and det.observe(31, None) is None
    assert det.observe(32, float("inf")) is None
    assert det.observe(33, 50.0).step == 33
    with pytest.raises(ValueError):
        SpikeDetector("loss", factor=1.0)


# -- recorded by the run store's writer ------------------------------------------------------

def _loss_rows(values, start: int = 1):
    return [MetricRow(step=start + i, wall=1000.0 + i, values={"loss": v, "lr": 0.1})
            for i, v in enumerate(values)]


def test_the_writer_records_the_episode_with_the_steps_and_a_resume_is_seeded(tmp_path):
    db = tmp_path / "mdb.sqlite"
    values = [1.0 + 0.01 * (i % 3) for i in range(60)]
    values[40:43] = [9.0, 12.0, 5.0]
    with RunStore(db, create=True) as store:
        w = store.create_run("r", {}, total_steps=100)
        for row in _loss_rows(values[:41]):  # one step at a time, as mdb overfit writes them
            w.log_step(row)
        w.log_steps([(row, None, None) for row in _loss_rows(values[41:50], start=42)])
        w.set_checkpoint(50, tmp_path / "ck")
        w.finish("interrupted", reason="SIGTERM")
        (sp,) = store.spikes(w.run_id)
        assert (sp.step, sp.peak_step, sp.last_step, sp.value) == (41, 42, 43, 12.0)
        assert sp.metric == "loss" and sp.baseline == pytest.approx(1.01)
        assert w.spikes == [sp]
        assert store.poll(w.run_id, 0).spikes == [sp]
        assert store.poll(w.run_id, 43).spikes == []  # nothing new after its end
        # resumed: the detector starts from the stored steps, so a jump right away is seen
        w2 = store.resume_run("r")
        w2.log_step(MetricRow(step=51, wall=2000.0, values={"loss": 30.0}))
        spikes = store.spikes(w2.run_id)
        assert [s.step for s in spikes] == [41, 51]
        assert spikes[1].baseline == pytest.approx(statistics.median(values[:50]))


def test_resume_from_before_a_spike_forgets_it(tmp_path):
    db = tmp_path / "mdb.sqlite"
    values = [1.0] * 40 + [10.0] + [1.0] * 5
    with RunStore(db, create=True) as store:
        w = store.create_run("r", {}, total_steps=100)
        w.set_checkpoint(30, tmp_path / "ck")
        w.log_steps([(row, None, None) for row in _loss_rows(values)])
        w.finish("interrupted", reason="SIGTERM")
        assert [s.step for s in store.spikes(w.run_id)] == [41]
        store.resume_run("r")  # back to step 30: the steps after it, and their spike, go
        assert store.spikes(w.run_id) == []


def test_a_database_without_the_spikes_table_reads_none_and_a_writer_adds_it(tmp_path,
                                                                            monkeypatch):
    db = tmp_path / "mdb.sqlite"
    with RunStore(db, create=True) as store:
        w = store.create_run("r", {})
        w.log_steps([(row, None, None) for row in _loss_rows([1.0] * 30)])
        w.finish("finished")
        store.connection.execute("DROP TABLE spikes")  # as written before the table existed
    import hooks.store.sqlite_open as sqlite_open

    with monkeypatch.context() as m:  # a read-only file (root ignores chmod): not added
        m.setattr(sqlite_open, "_is_writable", lambda path: False)
        with RunStore(db) as store:
            assert store.read_only and store.spikes(store.run("r").id) == []
    with RunStore(db) as store:  # writable: added
        tables = {r[0] for r in store.connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "spikes" in tables


def test_hooks_run_spikes_are_recorded_and_listed(tmp_path, capsys):
    db = tmp_path / "mdb.sqlite"
    with hooks.run("api", db=db, total_steps=60) as run:
        for i in range(60):
            run.log(loss=8.0 if i == 45 else 1.0 + 0.001 * i, acc=0.5)
    capsys.readouterr()
    assert main(["runs", "--json", "--db", str(db)]) == 0
    (rec,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (sp,) = rec["spikes"]
    assert (sp["step"], sp["metric"], sp["value"], sp["last_step"]) == (46, "loss", 8.0, 46)
    assert sp["ratio"] == pytest.approx(8.0 / sp["baseline"])
    assert any("loss spike at step 46" in line for line in rec["details"])
    assert main(["runs", "--db", str(db)]) == 0
    assert "└ loss spike at step 46: loss 8" in capsys.readouterr().out


# -- a real run whose learning rate jumps for one step ---------------------------------------

@pytest.fixture(scope="module")
def lr_jump_run(tmp_path_factory):
    """A tiny minillm overfit run of 60 steps whose step 40 takes lr = 1 (else 3e-3)."""
    import tomllib

    from hooks.train.overfit import OverfitOptions, OverfitSession
    from minillm import MiniLLMConfig
    from tests.conftest import TINY_TOML

    tmp = tmp_path_factory.mktemp("spike")
    db = tmp / "mdb.sqlite"
    opts = OverfitOptions(text="人工智能正在改变世界。" * 3,
                          model_config=MiniLLMConfig(**tomllib.loads(TINY_TOML)).to_dict(),
                          steps=60, lr=3e-3, every=0, sample_every=0)
    session = OverfitSession.create(RunStore(db, create=True), "jump", opts)
    session.trainer.lr_at = lambda step: 1.0 if step == 40 else 3e-3
    result = session.run()
    session.store.close()
    assert result.status == "finished"
    return db


def test_an_lr_jump_gives_one_recorded_spike_after_the_jumped_update(lr_jump_run):
    with RunStore(lr_jump_run) as store:
        run = store.run("jump")
        rows = store.metrics(run.id)
        (sp,) = store.spikes(run.id)
    total = [r.values["total"] for r in rows]
    # the jumped update is step 40's: step 41 is the first loss it raised
    assert sp.step == 41 and sp.metric == "total"
    assert sp.value == max(total[40:]) and total[sp.peak_step - 1] == sp.value
    assert sp.baseline == pytest.approx(statistics.median(total[:40][-WINDOW:]))
    assert _reference(total)[0] == 41


def test_mdb_runs_and_watch_show_the_recorded_spike(lr_jump_run, capsys):
    assert main(["runs", "--json", "--db", str(lr_jump_run)]) == 0
    (rec,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["step"] for s in rec["spikes"]] == [41]


async def test_watch_flags_the_spike_on_the_loss_chart_and_says_it(lr_jump_run):
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    store, run = open_run(str(lr_jump_run), "jump")
    app = make_watch_app(store, run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.polls >= 1 and app.live.series.spikes)
        await drawn(pilot, app.live)
        chart = app.screen.query_one("#live-loss")
        flagged = {s.name: list(s.flags) for s in chart.series}
        peak = app.live.series.spikes[41].peak_step
        assert flagged == {"total": [peak], "aux": [], "ce": []}
        rows = chart_rows(chart.series, 44, 11, title=chart.chart_title, log=True)
        text = ["".join(t for t, _ in row) for row in rows]
        assert "! spike" in text[0] and sum(line.count(FLAG) for line in text[1:]) == 1
        note = str(app.screen.query_one("#live-note").render())
        assert "! loss spike at step 41: total" in note
        await pilot.press("q")
    store.close()


def test_the_flag_sits_at_the_top_of_the_line_in_the_peak_column():
    xs = list(range(1, 41))
    ys = [1.0] * 40
    ys[29] = 10.0
    rows = chart_rows([Series("loss", xs, ys, flags=[30])], 40, 10, x_axis=False)
    plot = ["".join(t for t, _ in row) for row in rows[1:]]
    (r,) = [i for i, line in enumerate(plot) if FLAG in line]
    assert r == 0  # the peak is the top of the plot
    gutter = plot[r].index("┤") + 1
    pw = 40 - gutter  # the plot's columns, 2 dots each
    assert plot[r].index(FLAG) - gutter == round((30 - 1) * (2 * pw - 1) / (40 - 1)) // 2
    assert all(FLAG not in line for line in plot[1:])
    # no flags: no legend entry
    assert "spike" not in "".join(t for t, _ in chart_rows([Series("loss", xs, ys)], 40, 10)[0])


def test_headless_run_prints_the_spike_once_it_is_over(tmp_path, capsys):
    import argparse

    import tomllib

    from hooks.train.overfit import OverfitOptions, OverfitSession
    from minillm import MiniLLMConfig
    from tests.conftest import TINY_TOML
    from tui.commands.overfit import run_headless

    opts = OverfitOptions(text="人工智能正在改变世界。" * 3,
                          model_config=MiniLLMConfig(**tomllib.loads(TINY_TOML)).to_dict(),
                          steps=45, lr=3e-3, every=0, sample_every=0)
    db = tmp_path / "mdb.sqlite"
    session = OverfitSession.create(RunStore(db, create=True), "h", opts)
    session.trainer.lr_at = lambda step: 1.0 if step == 40 else 3e-3
    args = argparse.Namespace(db=str(db), heartbeat=1.0)
    assert run_headless(session, args) == 0
    out = capsys.readouterr().out.splitlines()
    said = [line for line in out if line.startswith("loss spike at step 41")]
    assert len(said) == 1, out
    with RunStore(db) as store:
        (sp,) = store.spikes(store.run("h").id)
    assert said[0] == sp.describe()
