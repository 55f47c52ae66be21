"""The run store under the faults of issue 19, each with real processes and real files: a
SIGKILL inside a run's first checkpoint, 8 processes creating one new database at once, a
second process holding the lock (an open ``BEGIN EXCLUSIVE``, a connection in
``locking_mode=EXCLUSIVE``), ``nohup`` (SIGHUP ignored), a database with a corrupt page, and
``hooks.run``'s refusals (``db=""``, bad names and configs, a bad ``expert_load``)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hooks
from hooks.store.sqlite_open import DamagedDatabaseError, DatabaseLockedError
from hooks.store.store import RunStore, RunStoreError
from tests.conftest import REPO, TINY_TOML, terminal_signals, wait_for
from tui.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

#: A tiny overfit run's options, without --db and --run.
_TINY_ARGS = ["--headless", "--steps", "5", "--every", "0", "--sample-every", "0"]


@pytest.fixture
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_TOML)
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    env.pop("MDB_DB", None)
    env.pop("MDB_LOCK_WAIT", None)
    return env


def _spawn_overfit(args, cwd: Path, log: Path, env: dict[str, str], preexec=terminal_signals):
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "tui.cli", "overfit", *args], cwd=cwd,
                                env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=preexec)


def _inside_checkpoint(fifo: Path, proc: subprocess.Popen, log: Path, timeout=120.0) -> int:
    """Wait until ``proc`` holds its first checkpoint at the hold point (it opened ``fifo``
    for reading: ``MDB_TEST_HOLD_CHECKPOINT``); the write end, to release it."""
    opened: list[int] = []

    def write_end() -> bool:
        try:
            opened.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            return True
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: nobody reads it yet
                raise
        assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()}"
        return False

    wait_for(write_end, timeout, f"the trainer to reach its checkpoint: {log}")
    return opened[0]


def _run(db: Path, name: str):
    with RunStore(db) as store:
        return store.run(name)


def _totals(db: Path, name: str) -> list[float]:
    with RunStore(db) as store:
        run = store.run(name)
        return [m.total for m in store.metrics(run.id)]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("mdb: error:")]


# ---------------------------------------------------------------------------------------------
# 1. SIGKILL inside the first (step-0) checkpoint
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_killed_inside_its_first_checkpoint_restarts_from_step_0(tmp_path, tiny, capfd):
    """Before: the row stayed ``running`` without a checkpoint, ``--resume`` said "no
    checkpoint to resume from" and a fresh start "already exists"."""
    db, fifo, log = tmp_path / "f.sqlite", tmp_path / "hold", tmp_path / "f0.log"
    os.mkfifo(fifo)
    args = [*_TINY_ARGS, "--config", str(tiny), "--db", str(db)]
    proc = _spawn_overfit([*args, "--run", "f0"], tmp_path, log,
                          _env(MDB_TEST_HOLD_CHECKPOINT=str(fifo)))
    release = _inside_checkpoint(fifo, proc, log)
    try:
        proc.kill()
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        os.close(release)
    run = _run(db, "f0")
    assert (run.status, run.checkpoint_step, run.last_step, run.pid) == ("running", None, 0,
                                                                       proc.pid)
    # killed with the checkpoint's files written, not yet renamed into place
    assert (tmp_path / "f-checkpoints" / "f0" / "step-00000000.tmp" / "checkpoint.json").exists()

    assert main(["runs", "--db", str(db)]) == 0
    table = capfd.readouterr().out
    assert f"gone: process {proc.pid} on " in table and "no longer exists · no checkpoint" in table
    assert f"└ restart from step 0: mdb overfit --resume f0 --db {db}" in table

    assert main(["overfit", *args, "--run", "f0"]) == 2  # the name stays taken
    assert "a run named 'f0' already exists" in capfd.readouterr().err
    assert main(["overfit", "--headless", "--resume", "f0", "--db", str(db)]) == 0
    err = capfd.readouterr().err
    assert "mdb: run f0 has no checkpoint" in err and "starts again from step 0" in err
    run = _run(db, "f0")
    assert (run.status, run.last_step, run.attempt, run.checkpoint_step) == ("finished", 5, 2, 5)
    assert sorted(p.name for p in (tmp_path / "f-checkpoints" / "f0").iterdir()) == [
        "step-00000005"]
    # the same run as one never killed, to the bit
    assert main(["overfit", *args, "--run", "ref"]) == 0
    assert _totals(db, "f0") == _totals(db, "ref")
    assert len(_totals(db, "f0")) == 5


# ---------------------------------------------------------------------------------------------
# 2. Writers creating one new database at once
# ---------------------------------------------------------------------------------------------

#: Imports hooks once, then per repeat forks N writers that wait on one pipe and all call
#: hooks.run on the same new database when it closes; prints each repeat's exit codes.
_CREATORS = r"""
import json, os, sys, traceback
import hooks
root, n, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
codes = []
for k in range(repeats):
    db = os.path.join(root, f"r{k}.sqlite")
    r, w = os.pipe()
    pids = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:
            os.close(w)
            os.read(r, 1)  # the start: all at once
            try:
                with hooks.run(f"w{i}", db=db) as run:
                    for step in range(3):
                        run.log(loss=float(step))
                code = 0
            except BaseException as exc:
                sys.stderr.write(f"r{k} w{i}: " + traceback.format_exception_only(
                    type(exc), exc)[-1])
                code = 1
            sys.stderr.flush()
            os._exit(code)
        pids.append(pid)
    os.close(r)
    os.close(w)
    codes.append([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])
print(json.dumps(codes))
"""


@pytest.mark.slow
def test_8_processes_creating_one_new_database_at_once_all_record(tmp_path):
    """Before: 16 of 40 writers failed, in 3 of 5 repeats, with ``table meta already
    exists``."""
    repeats, n = 5, 8
    out = subprocess.run([sys.executable, "-c", _CREATORS, str(tmp_path), str(n), str(repeats)],
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    codes = json.loads(out.stdout)
    failures = [line for line in out.stderr.splitlines() if not line.startswith("mdb: ")]
    assert codes == [[0] * n] * repeats, failures
    assert "Traceback" not in out.stderr
    for k in range(repeats):
        with RunStore(tmp_path / f"r{k}.sqlite") as store:
            runs = {r.name: r for r in store.runs()}
            assert store.damage() is None
        assert sorted(runs) == [f"w{i}" for i in range(n)]
        assert {(r.status, r.last_step) for r in runs.values()} == {("finished", 3)}


# ---------------------------------------------------------------------------------------------
# 3. A database locked by another process
# ---------------------------------------------------------------------------------------------

_HOLDER = r"""
import os, sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
if sys.argv[2] == "locking_mode":
    c.execute("PRAGMA locking_mode = EXCLUSIVE")
    c.execute("SELECT count(*) FROM runs").fetchone()  # takes the file's lock, keeps it
else:
    c.execute("BEGIN EXCLUSIVE")
print(os.getpid(), flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _held(db: Path, how: str):
    """Another process holding ``db``'s lock (``BEGIN EXCLUSIVE`` or ``locking_mode``) until
    the block ends; yields its pid."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(db), how], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.isdigit(), f"the holder did not take the lock (exit {proc.wait()})"
        yield int(line)
    finally:
        proc.stdin.close()
        proc.wait(30)


def _recorded(tmp_path: Path, tiny: Path) -> Path:
    db = tmp_path / "l.sqlite"
    assert main(["overfit", *_TINY_ARGS, "--config", str(tiny), "--db", str(db),
                 "--run", "a"]) == 0
    return db


def _locked_line(pid: int, waited: str, db: Path) -> str:
    return (f"mdb: error: the run database is locked by another process (pid {pid}); mdb waited "
            f"{waited} s for {db} (set MDB_LOCK_WAIT=SECONDS to wait longer)")


def test_a_write_transaction_held_elsewhere_is_one_line_after_the_stated_wait(
        tmp_path, tiny, capsys, monkeypatch):
    """Before: a traceback ending ``sqlite3.OperationalError: database is locked``, from
    ``mdb overfit`` and ``--resume`` alike."""
    db = _recorded(tmp_path, tiny)
    capsys.readouterr()
    monkeypatch.setenv("MDB_LOCK_WAIT", "1")
    with _held(db, "transaction") as pid:
        for argv in (["overfit", *_TINY_ARGS, "--config", str(tiny), "--db", str(db),
                      "--run", "b"],
                     ["overfit", "--headless", "--resume", "a", "--steps", "8", "--db", str(db)]):
            t0 = time.monotonic()
            assert main(argv) == 2
            waited = time.monotonic() - t0
            err = capsys.readouterr().err
            assert _error_lines(err) == [_locked_line(pid, "1.0", db)], err
            assert "Traceback" not in err and waited >= 1.0
        with pytest.raises(DatabaseLockedError) as info:
            hooks.run("c", db=db)
        assert info.value.pids == [pid] and 1.0 <= info.value.waited < 10
        assert main(["runs", "--db", str(db)]) == 0  # readers do not wait for a writer
        assert "a  " in capsys.readouterr().out
    run = _run(db, "a")
    with RunStore(db) as store:  # nothing was written by the refused writers, nothing lost
        assert [r.name for r in store.runs()] == ["a"]
    assert (run.status, run.last_step, run.attempt) == ("finished", 5, 1)


def test_locking_mode_exclusive_elsewhere_is_said_locked_not_not_a_database(
        tmp_path, tiny, capsys, monkeypatch):
    """Before: ``l.sqlite is not an mdb run database (database is locked)``."""
    db = _recorded(tmp_path, tiny)
    capsys.readouterr()
    monkeypatch.setenv("MDB_LOCK_WAIT", "0.5")
    with _held(db, "locking_mode") as pid:
        for argv in (["runs", "--db", str(db)],
                     ["overfit", *_TINY_ARGS, "--config", str(tiny), "--db", str(db),
                      "--run", "b"]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert _error_lines(err) == [_locked_line(pid, "0.5", db)], err
            assert "not an mdb run database" not in err
    assert main(["runs", "--db", str(db)]) == 0  # and once it is released, all is there


@pytest.mark.slow
def test_the_stated_bound_without_mdb_lock_wait_is_10_s(tmp_path, tiny, capsys, monkeypatch):
    db = _recorded(tmp_path, tiny)
    capsys.readouterr()
    monkeypatch.delenv("MDB_LOCK_WAIT", raising=False)
    with _held(db, "locking_mode") as pid:
        t0 = time.monotonic()
        assert main(["runs", "--db", str(db)]) == 2
        waited = time.monotonic() - t0
    assert _error_lines(capsys.readouterr().err) == [_locked_line(pid, "10", db)]
    assert 10.0 <= waited < 20.0


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "1e9"])
def test_a_bad_mdb_lock_wait_is_one_line(tmp_path, tiny, capsys, monkeypatch, value):
    db = _recorded(tmp_path, tiny)
    capsys.readouterr()
    monkeypatch.setenv("MDB_LOCK_WAIT", value)
    assert main(["runs", "--db", str(db)]) == 2
    assert _error_lines(capsys.readouterr().err) == [
        f"mdb: error: MDB_LOCK_WAIT={value!r}: expected the seconds to wait for a locked run "
        "database, 0 to 86400"]


# ---------------------------------------------------------------------------------------------
# 4. nohup: SIGHUP ignored stays ignored
# ---------------------------------------------------------------------------------------------


def _nohup() -> None:
    """``preexec_fn``: the stop signals at their defaults, SIGHUP ignored, as ``nohup``
    leaves it."""
    terminal_signals()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


@pytest.mark.slow
def test_nohup_overfit_keeps_sighup_ignored_and_finishes(tmp_path, tiny):
    """Before: exit 129, interrupted. The same SIGHUP, at the same point, stops a run started
    from a terminal (exit 129): the signal arrives, and only the disposition differs."""
    db = tmp_path / "n.sqlite"
    procs = {}
    for name, preexec in (("nohup", _nohup), ("terminal", terminal_signals)):
        fifo, log = tmp_path / f"{name}.fifo", tmp_path / f"{name}.log"
        os.mkfifo(fifo)
        args = [*_TINY_ARGS, "--config", str(tiny), "--db", str(db), "--run", name]
        proc = _spawn_overfit(args, tmp_path, log, _env(MDB_TEST_HOLD_CHECKPOINT=str(fifo)),
                              preexec)
        procs[name] = (proc, fifo, log)
    for proc, fifo, log in procs.values():
        release = _inside_checkpoint(fifo, proc, log)  # held in its step-0 checkpoint
        proc.send_signal(signal.SIGHUP)
        os.write(release, b"x")
        os.close(release)
    codes = {name: proc.wait(120) for name, (proc, _, _) in procs.items()}
    logs = {name: log.read_text() for name, (_, _, log) in procs.items()}
    assert codes == {"nohup": 0, "terminal": 129}, logs
    nohup, terminal = _run(db, "nohup"), _run(db, "terminal")
    assert (nohup.status, nohup.last_step, nohup.reason) == ("finished", 5, "finished")
    assert (terminal.status, terminal.reason) == ("interrupted", "SIGHUP")
    assert "Traceback" not in logs["nohup"] + logs["terminal"]


# ---------------------------------------------------------------------------------------------
# 15. A malformed database
# ---------------------------------------------------------------------------------------------


def _corrupt_table_page(db: Path, table: str) -> None:
    """Overwrite the b-tree header of ``table``'s root page with 0xFF bytes, as a bad disk
    block would (the write-ahead log checkpointed into the file first)."""
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?",
                           (table,)).fetchone()
    conn.close()
    with open(db, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\xff" * 16)


def _integrity(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        return "\n".join(r[0] for r in conn.execute("PRAGMA integrity_check").fetchall())
    except sqlite3.DatabaseError as exc:
        return str(exc)
    finally:
        conn.close()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_database_with_a_corrupt_page_is_said_damaged_and_never_written(tmp_path, tiny,
                                                                         capsys):
    """A page ``mdb runs`` never reads (the samples): before, it listed the runs with exit 0
    and ``mdb overfit`` wrote a new run into the file."""
    db = tmp_path / "m.sqlite"
    assert main(["overfit", "--headless", "--steps", "4", "--every", "0", "--sample-every", "1",
                 "--config", str(tiny), "--db", str(db), "--run", "a"]) == 0
    _corrupt_table_page(db, "samples")
    assert _integrity(db) == "database disk image is malformed"  # SQLite's own verdict
    before = _sha(db)
    capsys.readouterr()

    assert main(["runs", "--db", str(db)]) == 1
    out, err = capsys.readouterr()
    assert "a " in out and "4/4" in out  # what can be read is listed
    (line,) = _error_lines(err)
    assert line.startswith(f"mdb: error: {db} is damaged (PRAGMA quick_check: ")
    assert "mdb reads what it can and will not write to it" in line
    assert f"sqlite3 {db} .recover" in line
    for argv in (["overfit", *_TINY_ARGS, "--config", str(tiny), "--db", str(db), "--run", "b"],
                 ["overfit", "--headless", "--resume", "a", "--steps", "8", "--db", str(db)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert [x.split(" (PRAGMA")[0] for x in _error_lines(err)] == [
            f"mdb: error: {db} is damaged"], err
    with pytest.raises(DamagedDatabaseError, match="is damaged"):
        hooks.run("c", db=db)
    assert _sha(db) == before  # not a byte written


def test_a_corrupt_page_that_mdb_runs_reads_is_a_damaged_run_not_a_traceback(tmp_path, tiny,
                                                                             capsys):
    """Before: a traceback ending ``sqlite3.DatabaseError: database disk image is
    malformed``."""
    db = tmp_path / "m.sqlite"
    assert main(["overfit", *_TINY_ARGS, "--config", str(tiny), "--db", str(db),
                 "--run", "a"]) == 0
    _corrupt_table_page(db, "scalars")
    capsys.readouterr()
    assert main(["runs", "--db", str(db)]) == 1
    out, err = capsys.readouterr()
    assert "a     damaged" in out
    assert "└ run 'a': its rows cannot be read (database disk image is malformed)" in out
    assert len(_error_lines(err)) == 1 and f"{db} is damaged" in err
    assert main(["runs", "--json", "--db", str(db)]) == 1
    (rec,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rec["name"] == "a" and "malformed" in rec["damaged"]


# ---------------------------------------------------------------------------------------------
# 16. hooks.run: db="", refused names and configs, expert_load
# ---------------------------------------------------------------------------------------------


def test_db_empty_string_is_the_default_database_as_in_the_cli(tmp_path, monkeypatch, capsys):
    """Before: ``RunStoreError: . is a directory, not a run database``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MDB_DB", str(tmp_path / "env.sqlite"))
    with hooks.run("e", db="") as run:
        run.log(loss=1.0)
    assert run.db == tmp_path / "env.sqlite"
    monkeypatch.delenv("MDB_DB")
    with hooks.run("d", db="") as run:
        run.log(loss=2.0)
    assert run.db == Path("runs") / "mdb.sqlite"
    capsys.readouterr()
    assert main(["runs", "--db", ""]) == 0  # the CLI's --db "" reads the same one
    out = capsys.readouterr().out
    assert "runs in runs/mdb.sqlite" in out and "d " in out
    assert _run(tmp_path / "env.sqlite", "e").last_step == 1


def _self_referencing() -> dict:
    config: dict = {"lr": 3e-3}
    config["self"] = config
    return config


@pytest.mark.parametrize("name, config, error, words", [
    ("../../etc/x", None, RunStoreError, "invalid run name '../../etc/x'"),
    ("a" * 10_000, None, RunStoreError, "(10,000 characters)"),
    ("ok", _self_referencing(), ValueError,
     "hooks.run(config=...) cannot be stored as JSON: Circular reference detected"),
    ("ok", {("a", "b"): 1}, TypeError, "hooks.run(config=...) cannot be stored as JSON"),
])
def test_a_refused_name_or_config_creates_no_database(tmp_path, name, config, error, words):
    """Before: an empty 84 KB database (and its directory) was left behind; the circular
    config said only "Circular reference detected"."""
    db = tmp_path / "sub" / "x.sqlite"
    with pytest.raises(error) as info:
        hooks.run(name, db=db, config=config)
    assert words in str(info.value) and len(str(info.value)) < 300
    assert not (tmp_path / "sub").exists()


def test_expert_load_errors_name_the_argument_and_a_ragged_table_is_refused(tmp_path):
    """Before: ``could not convert string to float: 'a'``, and ``[[0.5, 0.5], [1.0]]``
    was stored."""
    db = tmp_path / "x.sqlite"
    with hooks.run("moe", db=db) as run:
        bad = [("abc", TypeError, "run.log(expert_load=...): expected per MoE layer, per "
                                  "expert, the share of routed slots (a 2-D tensor or nested "
                                  "lists of numbers), got str"),
               (["ab", "cd"], TypeError, "got a row that is str"),
               ([["0.5", "0.5"]], TypeError, "got a share that is str"),
               ([[0.5, 0.5], [1.0]], ValueError, "its layers have [2, 1] experts"),
               ([[]], ValueError, "its layers have [0] experts"),
               ([], ValueError, "no MoE layer in it")]
        for value, error, words in bad:
            with pytest.raises(error) as info:
                run.log(expert_load=value, loss=1.0)
            assert words in str(info.value), value
        run.log(expert_load=[[0.75, 0.25], [0.5, 0.5]], loss=1.0)
    with RunStore(db) as store:
        (row,) = store.metrics(store.run("moe").id)
    assert (row.step, row.expert_load) == (1, [[0.75, 0.25], [0.5, 0.5]])
