"""SIGHUP (the SSH link or tmux dropping) under the live screen: the run is checkpointed and
marked interrupted, and the process ends (it used to hang in Textual's shutdown, writing to the
terminal that no longer exists)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hooks.runs.store import RunStore
from tests.conftest import REPO
from tests.test_cli_step import _mdb_argv


@pytest.mark.slow
def test_sighup_under_the_live_screen_checkpoints_and_exits(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    db = tmp_path / "runs.sqlite"
    argv = _mdb_argv() + ["overfit", "--db", str(db), "--run", "hup", "--steps", "5000"]
    env = dict(os.environ, TERM="xterm", PYTHONPATH=str(REPO))
    child = pexpect.spawn(argv[0], argv[1:], env=env, cwd=str(tmp_path), dimensions=(24, 80),
                          encoding="utf-8", timeout=120)
    try:
        deadline = time.monotonic() + 120
        steps = 0
        while steps < 5 and time.monotonic() < deadline:  # the live screen is training
            child.expect([pexpect.TIMEOUT, pexpect.EOF], timeout=0.5)
            if db.exists():
                with RunStore(db) as store:
                    run = store.latest_run()
                    steps = run.last_step if run else 0
        assert steps >= 5, "the run did not start"
        # Hang up for real: closing the terminal's master side makes the kernel send SIGHUP,
        # and the terminal is gone for good (as when an SSH link or tmux server dies).
        os.close(child.child_fd)
        deadline = time.monotonic() + 90
        while child.isalive() and time.monotonic() < deadline:  # before the fix: forever
            time.sleep(0.2)
        alive = child.isalive()
    finally:
        if child.isalive():
            os.kill(child.pid, signal.SIGKILL)
    assert not alive, "mdb overfit still running 90 s after its terminal hung up"
    assert child.exitstatus == 128 + signal.SIGHUP
    with RunStore(db) as store:
        run = store.run("hup")
        assert run.status == "interrupted" and run.reason == "SIGHUP"
        assert run.checkpoint_step == run.last_step >= 5
        assert store.integrity_check() == "ok"
