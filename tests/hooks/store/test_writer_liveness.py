"""Two live writers on one run (issue 32, item 4): a writer is its process (pid, start time,
host). A writer stopped with SIGSTOP for longer than the heartbeat timeout still lives: a resume
is refused while it does; after SIGCONT it trains to its end alone, and the per-64-step summary
counts every step once. A writer whose run was taken over stops writing it."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hooks.store.liveness import process_lives, process_start
from hooks.store.store import RunStore, WriterBusyError
from hooks.store.summary import BLOCK_BITS
from hooks.store.writer import RunTakenOverError
from tests.conftest import TINY_TOML
from tests.conftest import wait_for as _wait
from tests.processes import mdb_env, run_mdb, run_row

LINUX = os.path.isdir("/proc/self")


def _proc_state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (read here, as the reference)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None


def _writer_child(db: Path, name: str) -> subprocess.Popen:
    """A process that creates run ``name`` (status running, heartbeat now), says ``ready`` and
    sleeps: a writer whose heartbeat then grows old."""
    code = textwrap.dedent(f"""
        import sys, time
        from hooks.store.store import RunStore
        store = RunStore({str(db)!r}, create=True)
        w = store.create_run({name!r}, {{}})
        w.log_step({{"step": 1, "loss": 1.0}})
        w.set_checkpoint(1, {str(db.parent / "ckpt")!r})
        print("ready", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=mdb_env())
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _age_heartbeat(db: Path, name: str, seconds: float = 100.0, timeout: float = 5.0) -> None:
    """What a writer silent for ``seconds`` looks like (no need to wait 15 s)."""
    conn = sqlite3.connect(db, timeout=timeout)
    try:
        with conn:
            conn.execute("UPDATE runs SET heartbeat = ? WHERE name = ?",
                         (time.time() - seconds, name))
    finally:
        conn.close()


def _stop_outside_a_write(pid: int, db: Path, name: str) -> None:
    """SIGSTOP the trainer ``pid`` at a moment it holds no write lock on ``db`` (a process
    stopped inside its write transaction would keep every other writer out), then age its
    heartbeat (:func:`_age_heartbeat`). Stopped inside one: let it go on, and stop it again."""

    def stopped_and_aged() -> bool:
        os.kill(pid, signal.SIGSTOP)
        _wait(lambda: _proc_state(pid) == "T", 10, "the trainer to be stopped")
        try:
            _age_heartbeat(db, name, timeout=0.0)
            return True
        except sqlite3.OperationalError as exc:  # "database is locked": inside its write
            if "locked" not in str(exc):
                raise
            os.kill(pid, signal.SIGCONT)
            _wait(lambda: _proc_state(pid) != "T", 10, "the trainer to go on")
            return False

    _wait(stopped_and_aged, 120, "the trainer stopped outside a write")


@pytest.mark.skipif(not LINUX, reason="process start times are read from /proc")
def test_a_stopped_process_lives_a_zombie_or_another_start_does_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = process_start(child.pid)
        # the reference: field 22 of /proc/<pid>/stat, counted from the line's start
        fields = Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()
        assert start == int(fields[19])
        assert process_lives(child.pid, start)
        assert not process_lives(child.pid, start + 1)  # the pid, reused by another process
        os.kill(child.pid, signal.SIGSTOP)
        _wait(lambda: _proc_state(child.pid) == "T", 10, "the child to be stopped")
        assert process_lives(child.pid, start)
        os.kill(child.pid, signal.SIGKILL)  # not reaped: a zombie
        _wait(lambda: _proc_state(child.pid) == "Z", 10, "the child to be a zombie")
        assert not process_lives(child.pid, start)
    finally:
        child.kill()
        child.wait()
    assert not process_lives(child.pid, start)


@pytest.mark.skipif(not LINUX, reason="process start times are read from /proc")
def test_a_stopped_writer_past_the_heartbeat_timeout_is_running_and_not_resumed(tmp_path):
    db = tmp_path / "w.sqlite"
    child = _writer_child(db, "w")
    try:
        os.kill(child.pid, signal.SIGSTOP)
        _wait(lambda: _proc_state(child.pid) == "T", 10, "the writer to be stopped")
        _age_heartbeat(db, "w")
        with RunStore(db) as store:
            info = store.run("w")
            assert info.pid == child.pid and info.writer["pid"] == child.pid
            assert info.writer_state() == "running"
            with pytest.raises(WriterBusyError, match=f"pid {child.pid}"):
                store.resume_run("w")
            assert store.run("w").attempt == 1  # nothing was taken over
        os.kill(child.pid, signal.SIGKILL)
        _wait(lambda: _proc_state(child.pid) == "Z", 10, "the writer to be a zombie")
        with RunStore(db) as store:  # exited (not reaped yet): gone at once
            info = store.run("w")
            assert info.writer_state() == "gone"
            assert info.gone_reason() == (f"writer gone: process {child.pid} on "
                                          f"{socket.gethostname()} no longer exists")
            store.resume_run("w").finish("finished")
    finally:
        child.kill()
        child.wait()


def test_a_writer_of_another_host_is_judged_by_its_heartbeat_and_says_so(tmp_path):
    db = tmp_path / "h.sqlite"
    with RunStore(db, create=True) as store:
        store.create_run("h", {})
        store.connection.execute("UPDATE runs SET host = 'far-away', heartbeat = ?",
                                 (time.time() - 20,))
        info = store.run("h")
        assert info.writer_state() == "gone"
        assert info.gone_reason().startswith("writer gone: no heartbeat from pid ")
        assert "on far-away for 20 s (another host: its process cannot be asked" \
            in info.gone_reason()


def _blocks(conn: sqlite3.Connection) -> dict:
    return {(m, b): (c, n, round(t, 9)) for m, b, c, n, t in conn.execute(
        "SELECT metric, block, count, n, total FROM blocks ORDER BY metric, block")}


def _recount(conn: sqlite3.Connection) -> dict:
    """The reference: count and sum every stored value per metric and block, in Python."""
    out: dict = {}
    for m, step, v in conn.execute("SELECT metric, step, value FROM scalars"):
        c, n, t = out.get((m, step >> BLOCK_BITS), (0, 0, 0.0))
        out[(m, step >> BLOCK_BITS)] = (c + 1, n + (v is not None), t + (v or 0.0))
    return {k: (c, n, round(t, 9)) for k, (c, n, t) in out.items()}


def test_two_writers_of_one_run_keep_the_summary_exact(tmp_path):
    """Writer a wrote steps 1-100; writer b (another connection, as a second trainer has)
    writes 101-200; a then writes 101-200 again (its own copy of those steps): each step is
    counted once in the 64-step blocks (a counted steps 101-200 twice: it took them for new)."""
    db = tmp_path / "two.sqlite"
    with RunStore(db, create=True) as sa, RunStore(db) as sb:
        a = sa.create_run("r", {})
        a.log_steps([({"step": s, "loss": 1.0 / s}, None, None) for s in range(1, 101)])
        b = type(a)(sb, a.run_id, "r")
        b.log_steps([({"step": s, "loss": 2.0 / s}, None, None) for s in range(101, 201)])
        a.log_steps([({"step": s, "loss": 3.0 / s}, None, None) for s in range(101, 201)])
        conn = sa.connection
        assert _blocks(conn) == _recount(conn)
        assert sum(c for c, _n, _t in _blocks(conn).values()) == 200
        (loss,) = conn.execute("SELECT total FROM blocks WHERE block = 3").fetchone()
        assert loss == pytest.approx(sum(3.0 / s for s in range(192, 201)))


def test_a_writer_whose_run_was_resumed_elsewhere_writes_nothing_more(tmp_path):
    db = tmp_path / "t.sqlite"
    with RunStore(db, create=True) as store:
        w = store.create_run("t", {})
        w.log_step({"step": 1, "loss": 1.0})
        # another process resumed it (the row names that process now)
        store.connection.execute(
            "UPDATE runs SET pid = 4242, host = 'elsewhere', heartbeat = 5")
        with pytest.raises(RunTakenOverError, match="now written by pid 4242 on elsewhere"):
            w.log_step({"step": 2, "loss": 0.5})
        with pytest.raises(RunTakenOverError):
            w.finish("finished")
        info = store.run("t")
        assert (info.status, info.last_step, info.heartbeat) == ("running", 1, 5.0)
        assert tuple(store.connection.execute("SELECT count(*) FROM metrics").fetchone()) == (1,)


def test_a_database_without_the_writer_column_gains_it_and_stays_readable(tmp_path):
    db = tmp_path / "old.sqlite"
    with RunStore(db, create=True) as store:
        store.create_run("o", {})
        store.connection.execute("ALTER TABLE runs DROP COLUMN writer")
    with RunStore(db) as store:  # read as an older mdb wrote it: pid and heartbeat decide
        info = store.run("o")
        assert info.writer is None and info.writer_state() == "running"
        store.connection.execute("UPDATE runs SET status = 'finished'")
        w = store.resume_run("o", restart=True)
        assert json.loads(store.connection.execute("SELECT writer FROM runs").fetchone()[0])[
            "pid"] == os.getpid()
        w.finish("finished")


# -- the real thing: a detached trainer stopped with SIGSTOP -----------------------------------

@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="process start times are read from /proc")
def test_a_sigstopped_trainer_is_not_resumed_beside_and_finishes_alone(tmp_path):
    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY_TOML)
    db = tmp_path / "s.sqlite"
    started = run_mdb(["overfit", "--detach", "--config", str(toml), "--steps", "150", "--db",
                       str(db), "--run", "s", "--checkpoint-every", "20", "--every", "0",
                       "--sample-every", "0", "--heartbeat", "0.2"], cwd=tmp_path, timeout=120)
    assert started.returncode == 0, started.stderr
    with RunStore(db) as store:
        pid = store.run("s").pid
    try:
        _wait(lambda: (r := run_row(db, "s")) and r.checkpoint_step not in (None, 0), 180,
              "a periodic checkpoint")
        _stop_outside_a_write(pid, db, "s")  # stalled past the 15 s of the heartbeat rule
        with RunStore(db) as store:
            assert store.run("s").writer_state() == "running"
        again = run_mdb(["overfit", "--resume", "s", "--db", str(db), "--detach"], cwd=tmp_path,
                        timeout=120)
        assert again.returncode == 2, again.stderr
        assert again.stderr.strip().splitlines() == [
            f"mdb: error: run s is still running (pid {pid}): watch it with `mdb watch s` or "
            "stop it with `mdb stop s` first"]
        os.kill(pid, signal.SIGCONT)
        _wait(lambda: (r := run_row(db, "s")) and r.status != "running", 240,
              "the trainer to finish")
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    with RunStore(db) as store:
        info = store.run("s")
        assert (info.status, info.last_step, info.attempt, info.pid) == ("finished", 150, 1, pid)
        conn = store.connection
        assert _blocks(conn) == _recount(conn)
        (steps,) = conn.execute("SELECT count(*) FROM metrics").fetchone()
        assert steps == 150
        counts = {c for (m, _b), (c, _n, _t) in _blocks(conn).items() if m == 1}
        assert sorted(counts) == [23, 63, 64]  # steps 1-63, 64-127, 128-150
