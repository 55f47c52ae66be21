"""Runs that outlive the terminal (issue 20): the trainer in a process of its own, ``mdb stop``,
``--detach``, the viewer's keys, ``hooks.run``'s ``should_stop`` and pause, Ctrl-C in every
screen. Every trainer here is a real process; every request goes through the run database."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hooks.store.control import pending, request
from hooks.store.store import RunStore
from tests.conftest import REPO, TINY_TOML, terminal_signals, wait_until
from tests.conftest import wait_for as _wait
from tests.processes import spawn_mdb
from tests.terminal import spawn_in_pty
from tui.cli import main

pytestmark = pytest.mark.slow  # every test starts a trainer process
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
MDB = [sys.executable, "-m", "tui.cli"]


def _mdb(*args: str, cwd=None) -> subprocess.Popen:
    return spawn_mdb(list(args), cwd=cwd, env=ENV)


def _info(db: Path, name: str):
    try:
        with RunStore(db) as store:
            return store.run(name)
    except Exception:
        return None


def _integrity(db: Path) -> str:
    with sqlite3.connect(db) as conn:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]


@pytest.fixture
def tiny(tmp_path) -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text(TINY_TOML)
    return p


def _headless(tmp_path: Path, tiny: Path, name: str, steps: int = 100000) -> subprocess.Popen:
    return _mdb("overfit", "--headless", "--config", str(tiny), "--steps", str(steps), "--db",
                str(tmp_path / "r.sqlite"), "--run", name, "--checkpoint-every", "0")


# -- mdb stop ----------------------------------------------------------------------------------


def test_mdb_stop_checkpoints_a_headless_run_and_returns_once_it_stopped(tmp_path, tiny,
                                                                         capsys):
    db = tmp_path / "r.sqlite"
    proc = _headless(tmp_path, tiny, "h")
    try:
        _wait(lambda: (i := _info(db, "h")) and i.last_step >= 3, what="3 steps")
        assert main(["stop", "h", "--db", str(db)]) == 0
        info = _info(db, "h")  # stopped when mdb stop returned, not later
        assert (info.status, info.reason) == ("interrupted", "stopped")
        assert info.checkpoint_step == info.last_step >= 3
        out = capsys.readouterr()
        assert out.out.strip() == (
            f"run h interrupted (stopped) at step {info.last_step}; checkpoint @ step "
            f"{info.last_step}; continue with: mdb overfit --resume h --db {db}")
        assert proc.wait(60) == 130  # the trainer ends as a stopped run does
    finally:
        proc.kill()
    assert _integrity(db) == "ok"
    # the run is not running any more: one line, exit 2
    assert main(["stop", "h", "--db", str(db)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mdb: error: run h is not running (interrupted (stopped)): nothing to stop"]


def test_a_paused_run_makes_no_step_until_it_is_resumed(tmp_path, tiny):
    db = tmp_path / "r.sqlite"
    proc = _headless(tmp_path, tiny, "p")
    try:
        info = _wait(lambda: (i := _info(db, "p")) and i.last_step >= 2 and i, what="2 steps")
        request(db, info.id, "pause")
        info = _wait(lambda: (i := _info(db, "p")) and i.paused and i, what="paused")
        held, beat = info.last_step, info.heartbeat
        # the trainer polls every 0.25 s and a step takes milliseconds: 2 s of its heartbeats
        # paused (however long a loaded machine makes them) would have made dozens of steps
        _wait(lambda: _info(db, "p").heartbeat >= beat + 2.0, what="2 s of heartbeats paused")
        assert _info(db, "p").last_step == held and _info(db, "p").writer_state() == "running"
        request(db, info.id, "resume")
        _wait(lambda: _info(db, "p").last_step > held + 5, what="steps after resume")
        assert not _info(db, "p").paused
        assert main(["stop", "p", "--db", str(db)]) == 0
    finally:
        proc.kill()


_LOOP = textwrap.dedent("""
    import sys, torch, hooks
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with hooks.run("loop", db=sys.argv[1], total_steps=10**6) as run:
        run.watch(model, every=50, optimizer=opt)
        for step in range(10**6):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()
            run.log(loss=loss)
            if run.should_stop:
                break
    print("ended", run.status, run.reason, run.step)
""")


def test_a_hooks_run_loop_obeys_stop_and_pause(tmp_path, capsys):
    db = tmp_path / "r.sqlite"
    script = tmp_path / "loop.py"
    script.write_text(_LOOP)
    proc = subprocess.Popen([sys.executable, str(script), str(db)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=terminal_signals)
    try:
        info = _wait(lambda: (i := _info(db, "loop")) and i.last_step >= 5 and i, what="steps")
        request(db, info.id, "pause")
        info = _wait(lambda: (i := _info(db, "loop")) and i.paused and i, what="paused")
        held, beat = info.last_step, info.heartbeat
        # log() blocks while paused: no step in a second of the run's heartbeats (hundreds
        # otherwise); its writer beats every second while nothing is logged
        _wait(lambda: _info(db, "loop").heartbeat >= beat + 1.0, what="a heartbeat paused")
        assert _info(db, "loop").last_step == held
        assert main(["stop", "loop", "--db", str(db)]) == 0  # wakes the paused loop too
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    info = _info(db, "loop")
    assert (info.status, info.reason) == ("interrupted", "stopped")
    assert out.strip() == f"ended interrupted stopped {info.last_step}"
    assert "paused from a viewer" in err
    assert capsys.readouterr().out.strip() == f"run loop interrupted (stopped) at step " \
                                              f"{info.last_step}"


# -- --detach ----------------------------------------------------------------------------------


def test_detach_returns_at_once_and_the_run_trains_on(tmp_path, tiny):
    db = tmp_path / "r.sqlite"
    t0 = time.monotonic()
    proc = _mdb("overfit", "--detach", "--config", str(tiny), "--steps", "100000", "--db",
                str(db), "--run", "d")
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 0, err
    info = _info(db, "d")
    try:
        assert info.writer_state() == "running" and info.pid != proc.pid
        assert out.startswith(f"run d is training in the background (pid {info.pid}); follow "
                              f"it: mdb watch d --db {db} · stop it: mdb stop d --db {db}")
        before = info.last_step
        _wait(lambda: _info(db, "d").last_step > before + 10, what="training after --detach")
        # resuming a run that is still running is refused with one line
        again = _mdb("overfit", "--resume", "d", "--db", str(db), "--detach")
        a_out, a_err = again.communicate(timeout=60)
        assert again.returncode == 2 and a_err.strip().splitlines() == [
            f"mdb: error: run d is still running (pid {info.pid}): watch it with `mdb watch d`"
            " or stop it with `mdb stop d` first"]
        assert main(["stop", "d", "--db", str(db)]) == 0
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(info.pid, signal.SIGKILL)
    assert _info(db, "d").status == "interrupted" and _integrity(db) == "ok"
    assert took < 60  # returned with the trainer still running (it would train for hours)


def test_detach_refuses_headless_and_nproc(capsys):
    assert main(["overfit", "--detach", "--headless"]) == 2
    assert "--detach and --headless exclude each other" in capsys.readouterr().err
    assert main(["overfit", "--detach", "--nproc", "2"]) == 2
    assert "--detach does not apply with --nproc" in capsys.readouterr().err


# -- the viewer's keys (Textual Pilot on mdb watch's screen, a real trainer) ----------------


def _footer(app) -> str:
    return " ".join(str(k.render()) for k in app.screen.query("FooterKey"))


async def _viewer(db: Path, name: str):
    from tui.live_app import make_watch_app

    store = RunStore(db)
    return store, make_watch_app(store, store.run(name), poll_interval=0.1)


async def test_p_pauses_and_resumes_x_asks_then_stops(tmp_path, tiny):
    db = tmp_path / "r.sqlite"
    proc = _headless(tmp_path, tiny, "k")
    try:
        _wait(lambda: (i := _info(db, "k")) and i.last_step >= 2, what="2 steps")
        store, app = await _viewer(db, "k")
        screen = app.live
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: screen.state == "running", timeout=60)
            await wait_until(pilot, lambda: "detach" in _footer(app), timeout=60)
            assert "pause" in _footer(app) and "stop" in _footer(app)
            await pilot.press("p")
            await wait_until(pilot, lambda: screen.state == "paused", timeout=60)
            await pilot.press("p")
            await wait_until(pilot, lambda: screen.state == "running", timeout=60)
            await pilot.press("x")  # asks first: n keeps it training
            await pilot.press("n")
            await wait_until(pilot, lambda: app.screen is screen, timeout=60)
            # a second of the trainer's heartbeats after n: its poller (every 0.25 s) would
            # have seen a stop by then
            beat = _info(db, "k").heartbeat
            await wait_until(pilot, lambda: _info(db, "k").heartbeat >= beat + 1.0, timeout=60)
            assert _info(db, "k").writer_state() == "running"
            assert pending(db, _info(db, "k").id) == []  # nothing was asked
            await pilot.press("x", "y")
            await wait_until(pilot, lambda: screen.state == "interrupted", timeout=60)
            # nothing to drive now: p, x, d leave the footer
            await wait_until(pilot, lambda: "detach" not in _footer(app), timeout=60)
            assert "pause" not in _footer(app) and "step view" in _footer(app)
            await pilot.press("q")  # an ended run: q just closes
        store.close()
        assert screen.outcome == "stopped"
        assert (_info(db, "k").status, _info(db, "k").reason) == ("interrupted", "stopped")
    finally:
        proc.kill()


@pytest.mark.parametrize("keys", [("d",), ("q", "enter"), ("ctrl+c",)])
async def test_d_q_and_ctrl_c_detach_and_training_goes_on(tmp_path, tiny, keys):
    db = tmp_path / "r.sqlite"
    proc = _headless(tmp_path, tiny, "v")
    try:
        _wait(lambda: (i := _info(db, "v")) and i.last_step >= 2, what="2 steps")
        store, app = await _viewer(db, "v")
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: app.live.state == "running", timeout=60)
            await pilot.press(*keys)
            await wait_until(pilot, lambda: app.return_code is not None, timeout=60)
            assert app.return_code == 0 and app.live.outcome == "detached"
        store.close()
        held = _info(db, "v").last_step
        _wait(lambda: _info(db, "v").last_step > held + 5, what="training after detaching")
        assert proc.poll() is None
    finally:
        proc.kill()


# -- the live screen in a real terminal --------------------------------------------------------


def test_losing_the_terminal_leaves_training_running(tmp_path, tiny):
    """``mdb overfit`` in a pty; the terminal's process group gets SIGHUP (the SSH link drops):
    the trainer, in a session of its own, goes on; ``mdb watch`` re-attaches and ``mdb stop``
    ends it with a checkpoint and an intact database."""
    pexpect = pytest.importorskip("pexpect")
    db = tmp_path / "r.sqlite"
    child = spawn_in_pty(MDB + ["overfit", "--config", str(tiny), "--steps", "100000", "--db",
                                str(db), "--run", "t"], cwd=tmp_path, timeout=120,
                         OMP_NUM_THREADS="1")
    try:
        child.expect("running")
        os.killpg(child.pid, signal.SIGHUP)
        child.expect(pexpect.EOF, timeout=60)  # the viewer is gone with its terminal
        held = _info(db, "t").last_step
        _wait(lambda: _info(db, "t").last_step > held + 20, what="training after SIGHUP")
        assert _info(db, "t").writer_state() == "running"
        watch = spawn_in_pty(MDB + ["watch", "t", "--db", str(db)], cwd=tmp_path, timeout=60,
                             OMP_NUM_THREADS="1")
        watch.expect("running")
        watch.send("d")
        watch.expect("re-attach: mdb watch t --db")
        watch.expect(pexpect.EOF)
        assert main(["stop", "t", "--db", str(db)]) == 0
    finally:
        child.close(force=True)
        info = _info(db, "t")
        if info is not None and info.writer_state() == "running":
            os.kill(info.pid, signal.SIGKILL)
    info = _info(db, "t")
    assert info.status == "interrupted" and info.checkpoint_step == info.last_step
    assert _integrity(db) == "ok"


def test_ctrl_c_quits_mdb_step_in_a_pty():
    pexpect = pytest.importorskip("pexpect")
    child = spawn_in_pty(MDB + ["step", "--preset", "tiny"], timeout=120, OMP_NUM_THREADS="1")
    try:
        child.expect("forward · call 1/")
        child.sendcontrol("c")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close()
    assert child.exitstatus == 0


_GATED = textwrap.dedent("""
    import os, sys, time, hooks
    db, gate = sys.argv[1], sys.argv[2]
    with hooks.run("gated", db=db, total_steps=10**6) as run:
        while not os.path.exists(gate):  # the run exists, no step written yet
            time.sleep(0.05)
        for step in range(10**6):
            run.log(loss=1.0 / (step + 1))
            time.sleep(0.01)
""")


def test_two_viewers_from_before_the_first_step_until_the_writer_is_killed(tmp_path):
    """Two ``mdb watch`` in real terminals, started while the run has no step yet: both follow
    its steps, and both say ``writer gone`` with its last step after ``kill -9``."""
    pexpect = pytest.importorskip("pexpect")
    db, gate = tmp_path / "r.sqlite", tmp_path / "gate"
    script = tmp_path / "gated.py"
    script.write_text(_GATED)
    loop = subprocess.Popen([sys.executable, str(script), str(db), str(gate)], env=ENV,
                            stderr=subprocess.DEVNULL, preexec_fn=terminal_signals)
    viewers = []
    try:
        _wait(lambda: _info(db, "gated"), what="the run")
        for _ in range(2):
            v = spawn_in_pty(MDB + ["watch", "gated", "--db", str(db)], timeout=60,
                             OMP_NUM_THREADS="1")
            v.expect("step 0")
            viewers.append(v)
        gate.touch()
        for v in viewers:
            v.expect(r"step [1-9]\d*")
        _wait(lambda: _info(db, "gated").last_step >= 20, what="20 steps")
        loop.kill()
        loop.wait()
        last = _info(db, "gated").last_step
        for v in viewers:
            v.expect("writer gone", timeout=60)
            v.expect(f"step {last}")
            v.send("q")  # a run that is not training: q closes at once
            v.expect(pexpect.EOF)
    finally:
        loop.kill()
        for v in viewers:
            v.close(force=True)
    assert [v.exitstatus for v in viewers] == [0, 0]


# -- found in review ---------------------------------------------------------------------------


def test_an_abbreviated_detach_is_not_passed_to_the_trainer():
    import argparse

    from tui.commands.overfit_detach import trainer_argv

    for flag in ("--detach", "--detac", "--det"):
        args = argparse.Namespace(_argv=["overfit", flag, "--steps", "5", "--db", "x"],
                                  resume=None)
        argv = trainer_argv(args, "r", Path("/tmp/r.sqlite"))
        assert argv[3:] == ["overfit", "--steps", "5", "--db", "x", "--headless", "--db",
                            "/tmp/r.sqlite", "--run", "r"], flag


def test_detach_of_a_run_that_ends_at_once_says_how_it_ended(tmp_path, tiny):
    db = tmp_path / "r.sqlite"
    proc = _mdb("overfit", "--detach", "--config", str(tiny), "--steps", "2", "--db", str(db),
                "--run", "s", "--sample-every", "0")
    out, err = proc.communicate(timeout=120)
    info = _info(db, "s")
    assert info.status == "finished" and proc.returncode == 0, err
    assert out.startswith("run s finished at step 2") or out.startswith("run s is training")
    assert "before its run started" not in err


def test_a_stop_left_from_an_earlier_attempt_is_not_obeyed(tmp_path):
    """A request written before the trainer started (for the attempt before a resume) is
    marked done unread."""
    from hooks.store.control import ControlPoller, pending
    from hooks.store.store import RunStore

    db = tmp_path / "r.sqlite"
    with RunStore(db, create=True) as store:
        run_id = store.create_run("a", config={}).run_id
    request(db, run_id, "stop")
    got = []
    poller = ControlPoller(db, run_id, got.append, interval=0.05, since=time.time() + 1)
    poller.start()
    _wait(lambda: not pending(db, run_id), what="the stale request marked done")
    request(db, run_id, "pause")  # one of this attempt's would be obeyed... after `since`
    poller.since = time.time() - 1
    _wait(lambda: got, what="the new request")
    poller.close()
    assert got == ["pause"]


def test_a_torchrun_job_has_no_detach_pause_or_stop_keys_and_mdb_stop_refuses_it(tmp_path,
                                                                                 capsys):
    from types import SimpleNamespace

    db = tmp_path / "r.sqlite"
    with RunStore(db, create=True) as store:
        store.create_run("j", config={}, world_size=2)  # written by this (live) process
        assert main(["stop", "j", "--db", str(db)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"mdb: error: run j is a torchrun job of 2 ranks: mdb stop reaches one process; stop "
        f"the job with Ctrl-C in its terminal or kill -TERM {os.getpid()}"]

    from tui.screens.live_controls import ViewerControls

    v = ViewerControls()
    v.watch, v.state = True, "running"
    v.run = SimpleNamespace(world_size=2)
    assert not v.viewing_live_run()
    v.run = SimpleNamespace(world_size=None)
    assert v.viewing_live_run()
