"""The terminal of the live screen hangs up for real (the SSH link or tmux dropping: the kernel
sends SIGHUP when the terminal's master side closes): the viewer ends — it used to hang in
Textual's shutdown, writing to a terminal that no longer exists — and the trainer, a process in
a session of its own, goes on training until ``mdb stop``."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from hooks.store.store import RunStore
from tests.conftest import wait_for
from tests.processes import mdb_argv
from tests.terminal import spawn_in_pty
from tui.cli import main


def _run(db):
    with RunStore(db) as store:
        return store.run("hup")


@pytest.mark.slow
def test_a_hangup_ends_the_viewer_and_training_goes_on(tmp_path):
    db = tmp_path / "runs.sqlite"
    child = spawn_in_pty(mdb_argv() + ["overfit", "--db", str(db), "--run", "hup", "--steps",
                                       "100000"], cwd=tmp_path, timeout=120)
    try:
        child.expect("running")
        os.close(child.child_fd)  # the terminal is gone for good
        with contextlib.suppress(AssertionError):  # before the fix: forever (judged below,
            wait_for(lambda: not child.isalive(), 90, "the viewer to end")  # trainer stopped)
        viewer_alive = child.isalive()
        held = _run(db).last_step
        wait_for(lambda: _run(db).last_step > held + 20, 120, "20 steps more")
        assert _run(db).writer_state() == "running" and _run(db).last_step > held + 20
        assert main(["stop", "hup", "--db", str(db)]) == 0
    finally:
        if child.isalive():
            os.kill(child.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):  # never leave the trainer behind
            run = _run(db)
            if run.writer_state() == "running":
                os.kill(run.pid, signal.SIGKILL)
    assert not viewer_alive, "the viewer still runs 90 s after its terminal hung up"
    run = _run(db)
    assert run.status == "interrupted" and run.reason == "stopped"
    assert run.checkpoint_step == run.last_step > 20
    with RunStore(db) as store:
        assert store.integrity_check() == "ok"
