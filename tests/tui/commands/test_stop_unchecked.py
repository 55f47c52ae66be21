"""``mdb stop`` of a ``hooks.run`` loop that never reads ``run.should_stop`` (issue 32, item 6):
after a bounded wait it says that the loop does not check for stop requests and how to make it
(exit 1), instead of waiting for the loop's end without a word; a loop that runs to its end is
``finished``, not ``interrupted (stopped)``. Real processes; every wait has a deadline."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hooks.store.control import pending
from tests.conftest import wait_for as _wait
from tests.processes import mdb_env, run_mdb, run_row, spawn_mdb

pytestmark = pytest.mark.slow  # every test starts a loop process

#: A loop that logs a step every 10 ms and never reads run.should_stop; it ends when the gate
#: file exists.
LOOP = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import hooks
    db, name, gate = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    with hooks.run(name, db=db) as run:
        while not gate.exists():
            run.log(loss=1.0 / (run.step + 1))
            time.sleep(0.01)
    print(run.status, run.reason, flush=True)
""")


def _loop(tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path, Path]:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    db, gate = tmp_path / "l.sqlite", tmp_path / f"{name}.gate"
    proc = subprocess.Popen([sys.executable, str(script), str(db), name, str(gate)],
                            env=mdb_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _wait(lambda: (r := run_row(db, name)) is not None and r.last_step >= 5, 60,
          "the loop to log five steps")
    return proc, db, gate


def test_stop_of_a_loop_that_never_reads_should_stop_says_so_after_the_wait(tmp_path):
    proc, db, gate = _loop(tmp_path, "deaf")
    try:
        t0 = time.monotonic()
        res = run_mdb(["stop", "deaf", "--db", str(db), "--wait", "2", "--timeout", "40"],
                      timeout=60)
        took = time.monotonic() - t0
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 1, res.stderr
        assert lines[0] == f"mdb: asked run deaf (pid {proc.pid}) to stop after its step; " \
                           "waiting for its checkpoint…"
        assert len(lines) == 2 and lines[1].startswith("mdb: error: run deaf logged "), lines
        assert ("without reading run.should_stop" in lines[1]
                and "its loop does not check for stop requests; make it stop with "
                    "`if run.should_stop: break` after run.log(...) in the loop" in lines[1])
        assert 2 <= took < 30  # the bounded wait, not the loop's end nor --timeout
        assert run_row(db, "deaf").status == "running" and proc.poll() is None
    finally:
        gate.touch()  # the loop ends by itself
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.split() == ["finished", "None"]
    info = run_row(db, "deaf")
    assert (info.status, info.reason, info.status_line()) == ("finished", None, "finished")
    assert pending(db, info.id) == []  # received (and left as asked), none waiting


def test_stop_of_a_loop_that_ends_on_its_own_meanwhile_says_finished(tmp_path):
    proc, db, gate = _loop(tmp_path, "ends")
    stopper = spawn_mdb(["stop", "ends", "--db", str(db), "--wait", "60", "--timeout", "60"],
                        env=mdb_env())
    try:
        _wait(lambda: (r := run_row(db, "ends")) is not None and pending(db, r.id) == []
              and _requested(db), 30, "the request to be received")
        gate.touch()
        out, err = stopper.communicate(timeout=60)
    finally:
        gate.touch()
        proc.communicate(timeout=60)
    assert stopper.returncode == 0, err
    step = run_row(db, "ends").last_step
    assert out.strip() == (f"run ends finished at step {step}: its loop ran to its end "
                           "without reading the stop request")


def _requested(db: Path) -> bool:
    import sqlite3

    with sqlite3.connect(db) as conn:
        try:
            return conn.execute("SELECT count(*) FROM control").fetchone()[0] == 1
        except sqlite3.OperationalError:
            return False
