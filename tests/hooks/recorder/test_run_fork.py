"""``run.log`` in a process forked after ``hooks.run`` was opened (issue 32, item 7): it is not
recorded (the writer thread and the SQLite connection stay in the parent), and the child says so
once on its stderr instead of dropping the steps silently; the parent's run is untouched."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from tests.processes import mdb_env

SCRIPT = textwrap.dedent("""
    import os, sys
    import hooks
    with hooks.run("fork", db=sys.argv[1]) as run:
        run.log(loss=1.0)
        pid = os.fork()
        if pid == 0:  # the child: three steps, then a normal exit (atexit, the with block)
            for v in (2.0, 3.0, 5.0):
                run.log(loss=v)
            print("child", run.step, flush=True)
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        run.log(loss=4.0)
    print("parent", run.status, run.step, flush=True)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_forked_childs_log_says_once_that_it_is_not_recorded(tmp_path):
    db = tmp_path / "f.sqlite"
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(db)], env=mdb_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:3] == ["child 4", "child exit 0", "parent finished 2"]
    warned = [ln for ln in res.stderr.splitlines() if "forked child" in ln]
    assert len(warned) == 1, res.stderr
    assert warned[0].startswith("mdb: warning: run fork: run.log() in a forked child process "
                                "(pid ")
    assert warned[0].endswith(f"forked from {_pid_of(db)}) is not recorded: only the process "
                              "that opened hooks.run writes the run (log from the parent, or "
                              "open a hooks.run of the child's own)")
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT s.step, s.value FROM scalars s JOIN metric_names n ON "
                            "n.run_id = s.run_id AND n.id = s.metric WHERE n.name = 'loss' "
                            "ORDER BY s.step").fetchall()
        status = conn.execute("SELECT status, last_step FROM runs").fetchone()
    assert rows == [(1, 1.0), (2, 4.0)]  # the parent's steps, none of the child's
    assert status == ("finished", 2)


def _pid_of(db) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT pid FROM runs").fetchone()[0]
