"""The database deleted under a running run (issue 32, item 5): the writer checks the file's
device and inode at each commit and checkpoint; a trainer stops with one line on stderr (its
log, for a detached one) naming the checkpoint it keeps, a ``hooks.run`` loop gets a warning
and ``run.should_stop``. Before, the trainer trained on into the unlinked file and said
"finished"."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

import hooks
from hooks.store.store import RunStore
from hooks.store.writer import DatabaseGoneError
from tests.conftest import TINY_TOML
from tests.conftest import wait_for as _wait
from tests.processes import run_mdb, run_row

pytestmark = pytest.mark.usefixtures("one_thread")


def _rm_db(db: Path) -> None:
    """``rm d.sqlite*``: the database and its -wal and -shm files (the checkpoints are in
    ``d-checkpoints/``)."""
    for p in db.parent.glob(db.name + "*"):
        if p.is_file():
            p.unlink()


def test_a_writer_refuses_to_commit_into_a_deleted_or_replaced_file(tmp_path):
    db = tmp_path / "d.sqlite"
    store = RunStore(db, create=True)
    w = store.create_run("r", {})
    w.log_step({"step": 1, "loss": 1.0})
    _rm_db(db)
    with pytest.raises(DatabaseGoneError, match=re.escape(f"{db} was deleted while run r")):
        w.log_step({"step": 2, "loss": 0.5})
    with pytest.raises(DatabaseGoneError):
        w.set_checkpoint(1, tmp_path / "ckpt")
    with pytest.raises(DatabaseGoneError):
        w.heartbeat()
    RunStore(db, create=True).close()  # another database now at the path
    with pytest.raises(DatabaseGoneError, match="was replaced by another file"):
        w.log_step({"step": 2, "loss": 0.5})
    store.close()


def test_a_hooks_run_loop_is_told_and_asked_to_stop(tmp_path, capsys):
    db = tmp_path / "d.sqlite"
    with hooks.run("loop", db=db, total_steps=100_000) as run:
        for _ in range(3):
            run.log(loss=1.0)
        _wait(lambda: (r := run_row(db, "loop")) is not None and r.last_step == 3, 10,
              "three steps committed")
        _rm_db(db)
        deadline = time.monotonic() + 30
        while not run.should_stop:  # the loop goes on as a user's loop would, checking it
            assert time.monotonic() < deadline, "run.should_stop never became true"
            run.log(loss=0.5)
            time.sleep(0.005)
        stopped_at = run.step
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "was deleted" in ln]
    assert len(lines) == 1, err
    assert lines == [
        "mdb: warning: recording of run loop stopped after step 3: DatabaseGoneError: the run "
        f"database {db} was deleted while run loop was being written: nothing more can be "
        "recorded; run.should_stop is now True"]
    assert "final status could not be written" not in err
    assert run.error.startswith("recording of run loop stopped after step 3: ")
    assert 3 < stopped_at < 100_000 and not db.exists()  # nothing recreated the file


@pytest.mark.slow
def test_a_detached_trainer_stops_when_its_database_is_deleted(tmp_path):
    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY_TOML)
    db = tmp_path / "d.sqlite"
    started = run_mdb(["overfit", "--detach", "--config", str(toml), "--steps", "100000",
                       "--db", str(db), "--run", "gone", "--checkpoint-every", "10",
                       "--every", "0", "--sample-every", "0", "--heartbeat", "0.2"],
                      cwd=tmp_path, timeout=120)
    assert started.returncode == 0, started.stderr
    info = run_row(db, "gone")
    pid = info.pid
    _wait(lambda: (r := run_row(db, "gone")) and (r.checkpoint_step or 0) >= 10, 180,
          "a checkpoint of step 10 or later")
    ckpt = run_row(db, "gone")
    _rm_db(db)
    try:
        _wait(lambda: not _alive(pid), 120, "the trainer to stop")
    finally:
        if _alive(pid):
            os.kill(pid, 9)
    log = (tmp_path / "d-checkpoints" / "gone" / "trainer.log").read_text()
    last = [ln for ln in log.splitlines() if ln.strip()][-1]
    m = re.fullmatch(
        rf"mdb: error: the run database {re.escape(str(db))} was deleted while run gone was "
        r"being written: nothing more can be recorded; training stopped at step (\d+); its "
        r"checkpoint of step (\d+) is kept in (.+)", last)
    assert m, log
    assert int(m.group(2)) >= ckpt.checkpoint_step
    assert Path(m.group(3)) == tmp_path / "d-checkpoints" / "gone" / f"step-{int(m.group(2)):08d}"
    assert (Path(m.group(3)) / "checkpoint.json").is_file()  # kept, whole
    assert int(m.group(2)) <= int(m.group(1)) < 100_000 and not db.exists()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"
