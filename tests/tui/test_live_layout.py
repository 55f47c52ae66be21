"""The live screen at 80×24, as a user sees it: 8 MoE layers whose labels stay apart, a status
line that keeps ``|g|`` whole, hints that fit one line, help that wraps whole words and lists
only the keys that act, a watched run whose writer is gone saying how to continue it, and a
forward that never returns (``q q`` and Ctrl-C end the process)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from textual.geometry import Region

from hooks.store.store import FIXED_METRICS, MetricRow, RunStore
from tests.conftest import drawn, wait_for, wait_until
from tests.processes import mdb_argv
from tests.terminal import spawn_in_pty

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "overfit-20261201-111806"  # as long as mdb overfit's default names


def _watched_db(tmp_path: Path, *, layers: int = 8, steps: int = 30, gone: bool = False) -> Path:
    """A run database as ``mdb overfit`` writes it (minillm metrics, expert load of
    ``layers`` MoE layers of 4 experts, a checkpoint of step 20); ``gone``: its writer's pid
    no longer exists."""
    db = tmp_path / "mdb.sqlite"
    config = {"metrics": list(FIXED_METRICS), "loss_metrics": ["ce", "aux", "total"],
              "moe": True, "top_k": 2, "text": "", "workload": "minillm",
              "resolved_model_config": {"num_local_experts": 4, "num_experts_per_tok": 2}}
    with RunStore(db, create=True) as store:
        w = store.create_run(NAME, config, total_steps=5000)
        for i in range(1, steps + 1):
            ce = 2.5 * 0.9 ** i
            load = [[0.1 + 0.05 * ((e + k + i) % 4) for e in range(4)] for k in range(layers)]
            load = [[f / sum(row) for f in row] for row in load]
            w.log_step(MetricRow(step=i, wall=1000.0 + 0.1 * i, ce=ce, aux=0.0394,
                                 total=ce + 0.0394, grad_norm=0.008723 * (1 + 1 / i),
                                 lr=3e-3, step_time=0.05, tokens_per_s=1320.0,
                                 steps_per_s=20.0, expert_load=load))
            if i == 20:
                w.set_checkpoint(20, tmp_path / "mdb-checkpoints" / NAME / "step-00000020")
        if gone:
            store.connection.execute("UPDATE runs SET pid = ?, host = ?",
                                     (_dead_pid(), socket.gethostname()))
        else:
            w.finish("finished")
    return db


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _text(widget) -> str:
    return str(widget.render())


async def test_eight_moe_layers_keep_their_labels_apart_and_page_with_e(tmp_path):
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    store, run = open_run(str(_watched_db(tmp_path)), NAME)
    app = make_watch_app(store, run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.series.rows == 30)
        await drawn(pilot, app.live)
        q = app.screen.query_one
        assert _text(q("#live-experts-head")) == (
            "tokens routed to each expert · MoE layers 0-3 of 8 (1/2) · e: next layers")
        charts = [c for c in app.screen.query(".live-expert") if c.display]
        assert [c.chart_title for c in charts] == ["L0", "L1", "L2", "L3"]
        for left, right in zip(charts, charts[1:], strict=False):
            assert left.region.right < right.region.x  # a blank column between two charts
        for chart in charts:  # each title row fits its chart: "L0  0  1  2  3"
            first = "".join(seg.text for seg in chart.render_line(0))
            assert first.split() == [chart.chart_title, "0", "1", "2", "3"]
            assert len(first.rstrip()) <= chart.region.width
        await pilot.press("e")
        await drawn(pilot, app.live)
        assert "MoE layers 4-7 of 8 (2/2)" in _text(q("#live-experts-head"))
        assert [c.chart_title for c in app.screen.query(".live-expert") if c.display] == [
            "L4", "L5", "L6", "L7"]
        await pilot.press("q")
    store.close()


async def test_a_gone_writer_keeps_g_whole_and_says_how_to_continue(tmp_path):
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    db = _watched_db(tmp_path, layers=4, gone=True)
    store, run = open_run(str(db), NAME)
    app = make_watch_app(store, run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.state == "gone")
        await drawn(pilot, app.live)
        q = app.screen.query_one
        status = _text(q("#live-status"))
        ce = 2.5 * 0.9 ** 30  # the run's loss (total) first, then the losses that fit
        assert status.startswith(f"✗ writer gone  step 30/5000  total {ce + 0.0394:.4f}  "
                                 f"ce {ce:.4f}"), status
        g = f"{0.008723 * (1 + 1 / 30):.3g}"
        assert status.endswith(f"  |g| {g}"), status  # whole, at the end
        assert len(status) <= 78
        note = _text(q("#live-note")).splitlines()
        assert note[0].startswith("✗ writer gone: process ") and "no longer exists" in note[0]
        assert note[0].endswith("· checkpoint @ step 20")
        assert f"continue: mdb overfit --resume {NAME} --db {db}" in " ".join(note[1:])
        await pilot.press("q")
    store.close()


async def test_watch_help_lists_the_viewer_keys_and_wraps_whole_words(tmp_path):
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app
    from tui.screens.live_help import LiveHelpScreen

    store, run = open_run(str(_watched_db(tmp_path, layers=2)), NAME)
    app = make_watch_app(store, run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.polls >= 1)
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, LiveHelpScreen)
                         and app.screen.query_one("#help-text").region.width > 0
                         and app.screen.query_one("#help-text").virtual_size.height > 0)
        await pilot.pause()  # laid out: its lines are rendered at that width
        widget = app.screen.query_one("#help-text")
        width = widget.region.width
        lines = ["".join(seg.text for seg in strip).rstrip()
                 for strip in widget.render_lines(Region(0, 0, width, widget.virtual_size.height))]
        keys = [line.split()[0] for line in lines if line.startswith("  ") and line.strip()]
        assert "s" not in keys  # a viewer cannot single-step another process's training
        assert {"p", "x", "d", "c", "m", "o", "l", "e", "?", "q"} <= set(keys)
        prose = [line for line in lines if line and not line.startswith("  ")]
        assert all(len(line) <= width for line in lines)
        # a paragraph wrapped by the box: no line is one word left over from the line above
        assert not [line for line in prose if len(line.split()) == 1], prose
        await pilot.press("q")
        await pilot.press("q")
    store.close()


@pytest.mark.slow
async def test_every_hint_of_the_training_screen_fits_one_line(tmp_path):
    from tests.models import tiny_session
    from tui.live_app import make_overfit_app
    from tui.screens.live import LiveScreen
    from tui.screens.step import StepScreen

    # far more steps than any machine runs while the keys are pressed: the run ends by ``x``
    session = tiny_session(tmp_path, steps=10**7, name=NAME)
    app = make_overfit_app(session, chart_interval=0.1)
    screen = app.live
    said: list[str] = []
    original = LiveScreen.hint

    def hint(self, text: str) -> None:
        said.append(text)
        original(self, text)

    LiveScreen.hint = hint
    try:
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: screen.series.step >= 2)
            await pilot.press("s")  # not paused: says how
            await pilot.press("p")
            await wait_until(pilot, lambda: screen.state == "paused")
            await pilot.press("s")
            await pilot.press("c")
            await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))
            await pilot.press("q")
            await wait_until(pilot, lambda: app.screen is screen)
            await pilot.press("p", "p")  # resumes, pauses again
            await wait_until(pilot, lambda: screen.state == "paused")
            await pilot.press("m", "o", "l", "e", "x")
            await wait_until(pilot, lambda: screen.ended is not None)
            await drawn(pilot, app.live)
            await pilot.press("p")  # the run has ended
            note = _text(screen.query_one("#live-note"))
            await pilot.press("q")
    finally:
        LiveScreen.hint = original
    assert len(said) >= 10
    assert [h for h in said if len(h) > 78] == []
    assert screen.ended.status == "interrupted"  # a stopped run says how to continue it
    assert f"continue: mdb overfit --resume {NAME} --db" in note


async def test_a_spike_during_training_is_flagged_from_the_writers_record(tmp_path):
    from tests.models import tiny_session
    from tui.live_app import make_overfit_app

    session = tiny_session(tmp_path, steps=45)
    session.trainer.lr_at = lambda step: 1.0 if step == 40 else 1e-2
    app = make_overfit_app(session, chart_interval=0.05, text_interval=0.05)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.ended is not None)
        await drawn(pilot, app.live)
        (spike,) = session.writer.spikes
        assert list(app.live.series.spikes.values()) == [spike]
        flags = {s.name: list(s.flags) for s in app.screen.query_one("#live-loss").series}
        assert flags["total"] == [spike.peak_step] and flags["ce"] == []
        assert f"! loss spike at step {spike.step}: total" in _text(
            app.screen.query_one("#live-note"))
        await pilot.press("q")
    with RunStore(tmp_path / "mdb.sqlite") as store:
        assert store.spikes(store.run("live").id) == [spike]


async def test_enter_opens_the_step_a_spike_was_captured_at_before_its_update(tmp_path):
    from tests.models import tiny_session
    from tui.live_app import make_overfit_app
    from tui.screens.step import StepScreen

    session = tiny_session(tmp_path, steps=45)
    assert session.trainer.capture_every == 0  # no capture but the triggered one
    session.trainer.lr_at = lambda step: 1.0 if step == 40 else 1e-2
    app = make_overfit_app(session, chart_interval=0.05, text_interval=0.05)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.ended is not None)
        await drawn(pilot, app.live)
        (spike,) = session.writer.spikes
        note = _text(app.screen.query_one("#live-note"))
        assert "Enter opens it" in note
        assert "verdict: " in note  # the screen shows the verdict the headless run prints
        assert app.live.ended.verdict[0] == session.verdict().lines()[0]
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))
        trace = app.screen.trace
        assert trace.step == spike.step
        assert trace.meta["trigger"]["reason"] == "loss spike"
        assert trace.meta["spike"]["line"].startswith(f"step {spike.step} (loss spike)")
        assert any(k.startswith("batch/") for k in trace.tensors)
        await pilot.press("q")
        await wait_until(pilot, lambda: app.screen is app.live)
        await pilot.press("q")


# -- a forward that never returns, under the live screen --------------------------------------

SLEEPY = '''
import os
import time
import torch
from torch import nn

CALLS = [0]
AFTER = int(os.environ.get("SLEEP_AFTER", "0"))


class Sleepy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        CALLS[0] += 1
        if CALLS[0] > AFTER:  # says so (a file beside this one), then hangs
            open(os.path.join(os.path.dirname(__file__), "sleeping"), "w").close()
            time.sleep(600)
        return self.fc(x).pow(2).mean()


def build():
    return Sleepy(), torch.randn(2, 4)
'''


def _spawn_live(tmp_path: Path, after: int):
    pexpect = pytest.importorskip("pexpect")
    (tmp_path / "sleepy.py").write_text(SLEEPY)
    db = tmp_path / "mdb.sqlite"
    child = spawn_in_pty(mdb_argv() + ["overfit", "--model", f"{tmp_path}/sleepy.py:build",
                                       "--db", str(db), "--run", "sl"],
                         cwd=tmp_path, SLEEP_AFTER=str(after))
    return pexpect, child, db


@pytest.mark.slow
def test_stopping_from_the_viewer_while_a_step_hangs_leaves_the_trainer_to_finish_it(tmp_path):
    """The live screen is a viewer of a trainer process: q, x asks it to stop; while its step
    hangs, Ctrl-C leaves the viewer at once and says that the run stops after that step."""
    # the probe and 2 steps return (3 calls), the third step's forward sleeps for 10 minutes
    pexpect, child, db = _spawn_live(tmp_path, after=3)
    trainer = None
    try:
        child.expect("running for")  # the rate row says that step 3 takes long
        with RunStore(db) as store:
            trainer = store.run("sl").pid
        child.send("q")
        child.expect("Leave it training, or stop it")
        child.send("x")
        child.expect("waiting for its checkpoint")
        child.sendintr()
        child.expect(pexpect.EOF, timeout=60)
        out = child.before
    finally:
        child.close(force=True)
        trainer = trainer or _trainer_pid(db)
        alive = trainer is not None and _alive(trainer)
        if alive:  # never leave the sleeping trainer behind, also when the test failed
            os.kill(trainer, signal.SIGKILL)
    assert "run sl stops after its current step (it goes on in the background until then: " \
           f"pid {trainer})" in out and "Traceback" not in out
    assert child.exitstatus == 130 and alive  # the viewer left; the trainer was not killed


def _trainer_pid(db: Path) -> int | None:
    try:
        with RunStore(db) as store:
            return store.run("sl").pid
    except Exception:  # no database or no run yet: the trainer had not started its run
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_ctrl_c_while_the_model_is_built_ends_at_once_and_records_nothing(tmp_path):
    pexpect, child, db = _spawn_live(tmp_path, after=0)  # the probe's forward sleeps
    try:
        child.expect("building the model")
        wait_for(lambda: (tmp_path / "sleeping").exists(), 120, "the probe's forward to hang")
        child.sendintr()
        child.expect(pexpect.EOF, timeout=60)
    finally:
        child.close()
    out = child.before
    assert "mdb: error: stopped while building the model; nothing was recorded" in out
    assert "Traceback" not in out and child.exitstatus == 130
    assert not db.exists() and not (tmp_path / "mdb-checkpoints").exists()


async def test_the_viewer_at_40x12_says_too_small_and_shows_nothing_else(tmp_path):
    """The panels the live screen shows for a run's data (MoE load, the sample) are hidden
    with the rest while the terminal is too small, and come back at 80×24."""
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    store, run = open_run(str(_watched_db(tmp_path, layers=2)), NAME)
    app = make_watch_app(store, run)
    async with app.run_test(size=(40, 12)) as pilot:
        await wait_until(pilot, lambda: app.live.polls >= 1)
        await drawn(pilot, app.live)
        screen = app.screen
        visible = [w.id for w in screen.children if w.display and w.id != "too-small"]
        assert screen.has_class("-too-small") and visible == []
        assert "terminal too small (40×12)" in _text(screen.query_one("#too-small"))
        await pilot.resize_terminal(80, 24)
        await wait_until(pilot, lambda: not screen.has_class("-too-small"))
        await drawn(pilot, app.live)
        assert all(screen.query_one(w).display for w in ("#live-experts", "#live-status"))
        await pilot.press("q")
    store.close()
