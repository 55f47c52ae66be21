"""``kill -TERM`` of ``mdb overfit``'s live viewer, in a real pseudo-terminal: the viewer closes
as on ``q`` → detach, prints the same "detached" line (the trainer, a process of a session of its
own, runs on) and exits with status 143 (128 + SIGTERM, as any mdb screen closed by SIGTERM).
The trainer keeps training, no stop was asked of it, and ``mdb stop`` ends it afterwards."""

from __future__ import annotations

import contextlib
import os
import re
import signal

import pytest

from hooks.store.control import pending
from hooks.store.store import RunStore
from tests.conftest import TINY_TOML
from tests.conftest import wait_for as _wait
from tests.processes import mdb_argv
from tests.terminal import spawn_in_pty
from tui.cli import main
from tui.commands.stop import ended_line


def _info(db, name: str):
    try:
        with RunStore(db) as store:
            return store.run(name)
    except Exception:
        return None


def _printed_after_the_screen(text: str) -> str:
    """What was written after the alternate screen was left, escape sequences removed, lines
    joined (the pty wraps at 80 columns)."""
    rest = text.rsplit("\x1b[?1049l", 1)[-1]
    rest = re.sub(r"\x1b\[[0-9;?<>=$]*[A-Za-z]", "", rest)
    return "".join(line.strip("\r") for line in rest.splitlines())


def _viewer(tmp_path):
    """``mdb overfit`` (live viewer, trainer in a process of its own) of run ``t`` in a pty."""
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    return spawn_in_pty(mdb_argv() + ["overfit", "--config", str(tmp_path / "tiny.toml"),
                                      "--steps", "100000", "--db", str(tmp_path / "r.sqlite"),
                                      "--run", "t", "--checkpoint-every", "0"],
                        cwd=tmp_path, rows=24, cols=200, timeout=120, OMP_NUM_THREADS="1")


@pytest.mark.slow
def test_sigterm_detaches_with_the_q_line_and_the_run_trains_on(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    db = tmp_path / "r.sqlite"
    child = _viewer(tmp_path)
    try:
        child.expect("running")
        _wait(lambda: (i := _info(db, "t")) is not None and i.last_step >= 2, what="2 steps")
        trainer = _info(db, "t").pid
        os.kill(child.pid, signal.SIGTERM)
        child.expect(pexpect.EOF, timeout=60)
        printed = _printed_after_the_screen(child.before)
        child.close()
        assert child.signalstatus is None and child.exitstatus == 128 + signal.SIGTERM
        # the line q → detach prints (tui.commands.stop.detached_line), with the trainer's pid
        assert (f"mdb: detached; run t goes on training (pid {trainer}) · re-attach: mdb watch t "
                f"--db {db} · stop it: mdb stop t --db {db}") in printed, printed
        held = _info(db, "t").last_step
        _wait(lambda: _info(db, "t").last_step > held + 5, what="training after SIGTERM")
        info = _info(db, "t")
        assert (info.status, info.writer_state(), info.pid) == ("running", "running", trainer)
        assert pending(db, info.id) == []  # no stop (nor pause) was asked of it
        assert main(["stop", "t", "--db", str(db)]) == 0
    finally:
        child.close(force=True)
        with contextlib.suppress(Exception):  # never leave the trainer behind
            info = _info(db, "t")
            if info.writer_state() == "running":
                os.kill(info.pid, signal.SIGKILL)
    info = _info(db, "t")
    assert (info.status, info.reason) == ("interrupted", "stopped")


@pytest.mark.slow
def test_sigterm_after_a_stop_was_asked_says_so_without_waiting(tmp_path):
    """``x y`` (stop the run after its step), then SIGTERM before the run has stopped: the
    viewer says the run stops after its current step and exits 143 at once; the stop asked
    is carried out by the trainer (interrupted, reason "stopped", with a checkpoint)."""
    pexpect = pytest.importorskip("pexpect")
    db = tmp_path / "r.sqlite"
    child = _viewer(tmp_path)
    try:
        child.expect("running")
        _wait(lambda: (i := _info(db, "t")) is not None and i.last_step >= 2, what="2 steps")
        trainer = _info(db, "t").pid
        child.send("x")
        child.expect("stop run t after its current step")
        child.send("y")
        child.expect("asked the run to stop")
        os.kill(child.pid, signal.SIGTERM)
        child.expect(pexpect.EOF, timeout=60)
        printed = _printed_after_the_screen(child.before)
        child.close()
        assert child.signalstatus is None and child.exitstatus == 128 + signal.SIGTERM
        assert "detached" not in printed
        _wait(lambda: _info(db, "t").writer_state() != "running", what="the run stopped")
        # the trainer polls for requests every few tenths of a second: almost always still
        # running at the SIGTERM; else the viewer saw the run end and says so, as q would
        stopping = (f"mdb: run t stops after its current step (it goes on in the background "
                    f"until then: pid {trainer})")
        assert stopping in printed or ended_line(_info(db, "t"), str(db)) in printed, printed
    finally:
        child.close(force=True)
        with contextlib.suppress(Exception):
            info = _info(db, "t")
            if info.writer_state() == "running":
                os.kill(info.pid, signal.SIGKILL)
    info = _info(db, "t")
    assert (info.status, info.reason) == ("interrupted", "stopped")
    assert info.checkpoint_step == info.last_step
