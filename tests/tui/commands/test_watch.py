"""``mdb watch``: follows a run written by a real ``mdb overfit --headless`` subprocess, reports
the writer gone after ``kill -9``, replays a finished run, and rejects bad input in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hooks.store.store import RunStore
from tests.conftest import REPO, TINY_TOML, drawn, wait_for, wait_until
from tests.processes import one_error_line as _one_error_line
from tui.cli import main


def _writer(tmp_path, steps: int, name: str = "w") -> tuple[subprocess.Popen, Path]:
    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY_TOML)
    db = tmp_path / "mdb.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tui.cli", "overfit", "--headless", "--config", str(toml),
         "--steps", str(steps), "--db", str(db), "--run", name, "--every", "0",
         "--sample-every", "10", "--heartbeat", "0.2"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return proc, db


def _wait_for_run(db: Path, name: str, min_step: int = 1, timeout: float = 60.0):
    def reached():
        if not db.exists():
            return None
        try:
            with RunStore(db) as store:
                run = store.run(name)
        except Exception:
            return None
        return run if run.last_step >= min_step else None

    return wait_for(reached, timeout, f"run {name} to reach step {min_step}")


@pytest.mark.slow
async def test_watch_follows_a_real_writer_then_sees_it_finish(tmp_path):
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    # Long enough that the writer is still going while 20 new steps are timed, however fast
    # the machine (300 steps of this model can finish before the watcher has seen 20).
    steps = 1500
    proc, db = _writer(tmp_path, steps=steps)
    try:
        _wait_for_run(db, "w", 1)
        store, run = open_run(str(db), None)  # the latest run by default
        assert run.name == "w"
        app = make_watch_app(store, run)
        screen = app.live
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: screen.series.step >= 5)
            # new steps keep showing while the writer runs (how soon: bench_overfit_ui.py's
            # watch latency; a wall-clock bound here fails on a loaded machine)
            for _ in range(5):
                before = screen.series.step
                await wait_until(pilot, lambda b=before: screen.series.step > b, timeout=60)
            await wait_until(pilot, lambda: screen.state == "finished", timeout=120)
            await drawn(pilot, app.live)
            status = str(app.screen.query_one("#live-status").render())
            assert "finished" in status and f"step {steps}/{steps}" in status
            # the run has ended: the keys that drive training are neither shown nor acted on
            assert str(app.screen.query_one("#title").render()).startswith("mdb watch · run w")
            footer = " ".join(str(k.render()) for k in app.screen.query("FooterKey"))
            assert "pause" not in footer and "stop" not in footer and "step view" in footer
            hint_before = str(app.screen.query_one("#hint").render())
            await pilot.press("p", "x")
            assert str(app.screen.query_one("#hint").render()) == hint_before
            assert screen.state == "finished"
            await pilot.press("q")
        store.close()
    finally:
        proc.wait(timeout=120)
    assert proc.returncode == 0
    with RunStore(db) as ref:  # every step seen exactly once, in order, same values
        rows = ref.metrics(ref.run("w").id)
    assert len(rows) == screen.series.rows == screen.series.ce.count == steps
    assert screen.series.last.ce == rows[-1].ce
    mean_ce = sum(r.ce for r in rows) / len(rows)
    xs, ce = screen.series.ce.points(1)  # one bucket: the mean of every step seen
    assert xs == [steps] and ce[0] == pytest.approx(mean_ce, rel=1e-9)


@pytest.mark.slow
async def test_watch_reports_the_writer_gone_after_kill_9(tmp_path):
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    proc, db = _writer(tmp_path, steps=100000)
    try:
        _wait_for_run(db, "w", 3)
        store, run = open_run(str(db), "w")
        app = make_watch_app(store, run)
        screen = app.live
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: screen.state == "running")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            await wait_until(pilot, lambda: screen.state == "gone", timeout=10)
            await drawn(pilot, app.live)
            status = str(app.screen.query_one("#live-status").render())
            note = str(app.screen.query_one("#live-note").render()).splitlines()
            assert status.startswith("✗ writer gone  step ") and "|g| " in status
            assert note[0].startswith(f"✗ writer gone: process {proc.pid}")
            ckpt = store.run("w").checkpoint_step
            assert ckpt is not None and note[0].endswith(f"· checkpoint @ step {ckpt}")
            assert f"continue: mdb overfit --resume w --db {db}" in " ".join(note[1:])
            await pilot.press("q")
        store.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    with RunStore(db) as ref:
        assert ref.integrity_check() == "ok"
        assert ref.run("w").writer_state() == "gone"


async def test_watch_replays_a_finished_run(tmp_path):
    from hooks.train.overfit import OverfitOptions, OverfitSession
    from minillm import MiniLLMConfig
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    cfg = MiniLLMConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=64)
    with RunStore(tmp_path / "mdb.sqlite", create=True) as store:
        s = OverfitSession.create(store, "done", OverfitOptions(
            text="人工智能正在改变世界。", model_config=cfg.to_dict(), steps=12, every=0,
            sample_every=4))
        s.run()
    store, run = open_run(str(tmp_path / "mdb.sqlite"), "done")
    app = make_watch_app(store, run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.polls >= 1)
        await drawn(pilot, app.live)
        assert app.live.series.rows == 12 and app.live.state == "finished"
        assert app.live.series.sample.step == 12
        assert "✓ finished" in str(app.screen.query_one("#live-status").render())
        await pilot.press("q")
    store.close()


async def test_watch_c_opens_the_latest_stored_capture_in_the_step_view(tmp_path):
    from hooks.train.overfit import OverfitOptions, OverfitSession
    from hooks.train.trainer import load_trace
    from minillm import MiniLLMConfig
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app
    from tui.screens.step import StepScreen

    cfg = MiniLLMConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=64)
    db = tmp_path / "mdb.sqlite"
    with RunStore(db, create=True) as store:
        for name, every in (("cap", 5), ("nocap", 0)):
            OverfitSession.create(store, name, OverfitOptions(
                text="人工智能正在改变世界。", model_config=cfg.to_dict(), steps=12, every=every,
                sample_every=0)).run()
        run_id = store.run("cap").id
        assert store.internals_steps(run_id) == [5, 10]
        expected = load_trace(store, run_id, 10)

    store, run = open_run(str(db), "cap")
    app = make_watch_app(store, run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.polls >= 1)
        await pilot.press("c")
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen), timeout=30)
        trace = app.screen.trace
        assert str(app.screen.query_one("#title").render()).startswith("step 10 · overfit run cap")
        assert trace.step == 10 and len(trace.forward) == len(expected.forward)
        assert [r.module for r in trace.forward] == [r.module for r in expected.forward]
        assert trace.forward[-1].outputs[0].stats == expected.forward[-1].outputs[0].stats
        await pilot.press("q")  # back to the live screen, not out of the app
        await wait_until(pilot, lambda: app.screen is app.live)
        assert "back from the step view" in str(app.screen.query_one("#hint").render())
        # a capture that arrives while help is open does not cover it (c, then ? before the
        # read finished): it opens when help is closed
        await pilot.press("question_mark")
        help_screen = app.screen
        app.live.action_capture()
        hint = app.live.query_one("#hint")
        await wait_until(pilot, lambda: "opens after this" in str(hint.render()), timeout=30)
        assert app.screen is help_screen
        await pilot.press("q")
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))
        await pilot.press("q")
        await wait_until(pilot, lambda: app.screen is app.live)
        await pilot.press("q")
    store.close()

    store, run = open_run(str(db), "nocap")
    app = make_watch_app(store, run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.polls >= 1)
        await pilot.press("c")
        hint = app.screen.query_one("#hint")
        await wait_until(pilot, lambda: "no stored capture" in str(hint.render()), timeout=30)
        assert app.screen is app.live
        await pilot.press("q")
    store.close()


def test_watch_bad_input_one_line_exit_2(tmp_path, capsys):
    assert main(["watch", "--db", str(tmp_path / "missing.sqlite")]) == 2
    assert "no run database" in _one_error_line(capsys)
    other = tmp_path / "other.sqlite"
    import sqlite3

    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x)")
    assert main(["watch", "--db", str(other)]) == 2
    assert "not an mdb run database" in _one_error_line(capsys)
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database at all" * 100)
    assert main(["watch", "--db", str(garbage)]) == 2
    _one_error_line(capsys)
    db = tmp_path / "mdb.sqlite"
    RunStore(db, create=True).close()
    assert main(["watch", "--db", str(db)]) == 2
    assert "no runs" in _one_error_line(capsys)
    assert main(["watch", "nope", "--db", str(db)]) == 2
    assert "no run named 'nope'" in _one_error_line(capsys)
