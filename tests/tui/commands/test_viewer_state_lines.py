"""What a viewer says follows the run's real state (issue 32, item 12): detaching from a paused
run says it stays paused and how to resume it (it said "goes on training"), and a viewer that
asked the run to pause no longer says so once another viewer (``mdb stop``) stopped it.

The run is a real ``hooks.run`` loop in a process of its own; every request goes through the
run database; the states are read back from it with a store of the test's own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hooks.store.store import RunStore
from tests.conftest import REPO, terminal_signals, wait_until
from tests.conftest import wait_for as _wait
from tui.cli import main

pytestmark = pytest.mark.slow  # a training process
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")

_LOOP = textwrap.dedent("""
    import sys, torch, hooks
    from torch import nn
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with hooks.run("loop", db=sys.argv[1], total_steps=10**6) as run:
        for step in range(10**6):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()
            run.log(loss=loss)
            if run.should_stop:
                break
""")


def _info(db, name="loop"):
    try:
        with RunStore(db) as store:
            return store.run(name)
    except Exception:
        return None


@pytest.fixture
def loop(tmp_path):
    db = tmp_path / "r.sqlite"
    script = tmp_path / "loop.py"
    script.write_text(_LOOP)
    proc = subprocess.Popen([sys.executable, str(script), str(db)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=terminal_signals)
    try:
        _wait(lambda: (i := _info(db)) is not None and i.last_step >= 3, what="3 steps")
        yield db
    finally:
        proc.kill()
        proc.wait(timeout=60)


def _hint(app) -> str:
    return str(app.live.query_one("#hint").render())


async def test_detaching_from_a_paused_run_says_it_stays_paused(loop, capsys):
    from tui.commands.watch import after_viewer
    from tui.live_app import make_watch_app

    with RunStore(loop) as store:
        app = make_watch_app(store, store.run("loop"), poll_interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: app.live.state == "running", timeout=60)
            await pilot.press("p")
            await wait_until(pilot, lambda: app.live.state == "paused", timeout=60)
            await pilot.press("d")
            await wait_until(pilot, lambda: app.live.outcome == "detached", timeout=60)
        assert after_viewer(app.live, store, str(loop)) == 0
    info = _info(loop)
    assert info.paused and info.writer_state() == "running"  # what the line says, stored
    assert capsys.readouterr().out == (
        f"mdb: detached; run loop stays paused (pid {info.pid}) · resume it: mdb watch loop "
        f"--db {loop}, then p · stop it: mdb stop loop --db {loop}\n")


async def test_a_pause_asked_then_a_stop_from_elsewhere_shows_the_run_stopped(loop, capsys):
    from tui.live_app import make_watch_app

    with RunStore(loop) as store:
        app = make_watch_app(store, store.run("loop"), poll_interval=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: app.live.state == "running", timeout=60)
            await pilot.press("p")  # the hint: "asked the run to pause", then the state
            await wait_until(pilot, lambda: app.live.state == "paused", timeout=60)
            assert _hint(app) == "the run is paused · p resumes"
            assert main(["stop", "loop", "--db", str(loop)]) == 0  # another viewer's stop
            await wait_until(pilot, lambda: app.live.state == "interrupted", timeout=60)
            await wait_until(pilot, lambda: "asked the run" not in _hint(app), timeout=10)
            info = _info(loop)
            assert (info.status, info.reason) == ("interrupted", "stopped")
            assert _hint(app) == "the run has ended: interrupted (stopped) · q closes"
            await pilot.press("q")
