"""The SQLite run store: schema, incremental reads, writer status, resume, bad databases."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hooks.store.store import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    MetricRow,
    RunExistsError,
    RunNotFoundError,
    RunStore,
    RunStoreError,
    WriterBusyError,
    checkpoint_dir,
    default_db_path,
    validate_run_name,
)
from tests.conftest import wait_for
from tui.cli import main


@pytest.fixture
def db(tmp_path):
    return tmp_path / "runs" / "mdb.sqlite"


def _metric(step, loss):
    return {
        "step": step,
        "ce": loss,
        "aux": 0.01,
        "total": loss + 0.01,
        "grad_norm": 2.0 * step,
        "lr": 3e-3,
        "step_time": 0.01,
        "tokens_per_s": 6400.0,
        "steps_per_s": 100.0,
        "expert_load": [[0.25, 0.25, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]],
    }


def test_create_write_and_read_back(db):
    with RunStore(db, create=True) as store:
        w = store.create_run("r1", {"hidden_size": 16, "lr": 3e-3}, total_steps=10)
        for s in range(1, 6):
            w.log_step(_metric(s, 1.0 / s), sample=("人工", f"text{s}") if s % 2 else None)
        w.log_step({"step": 6, "ce": 0.1}, internals={"forward": [{"module": "m", "mean": 1.5}]})

    with RunStore(db) as reader:
        (run,) = reader.runs()
        assert run.name == "r1" and run.status == "running" and run.last_step == 6
        assert run.config == {"hidden_size": 16, "lr": 3e-3}
        assert run.pid == os.getpid() and run.total_steps == 10
        rows = reader.metrics(run.id)
        assert [r.step for r in rows] == [1, 2, 3, 4, 5, 6]
        assert rows[2].ce == pytest.approx(1.0 / 3) and rows[2].total == pytest.approx(1 / 3 + 0.01)
        assert rows[2].grad_norm == 6.0 and rows[2].expert_load[1] == [0.1, 0.2, 0.3, 0.4]
        assert rows[5].expert_load is None and rows[5].aux is None
        # incremental: each step exactly once
        assert [r.step for r in reader.metrics(run.id, after_step=4)] == [5, 6]
        assert reader.metrics(run.id, after_step=6) == []
        assert [r.step for r in reader.metrics(run.id, after_step=0, limit=2)] == [1, 2]
        assert [(s.step, s.prompt, s.text) for s in reader.samples(run.id)] == [
            (1, "人工", "text1"),
            (3, "人工", "text3"),
            (5, "人工", "text5"),
        ]
        assert reader.internals_steps(run.id) == [6]
        assert reader.internals(run.id, 6) == {"forward": [{"module": "m", "mean": 1.5}]}
        assert reader.internals(run.id, 5) is None
        assert reader.integrity_check() == "ok"
        assert reader.connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert reader.connection.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
        assert reader.connection.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        assert reader.connection.execute("PRAGMA busy_timeout").fetchone()[0] >= 1000


def test_nan_is_stored_as_null_and_inf_round_trips(db):
    with RunStore(db, create=True) as store:
        w = store.create_run("r", {})
        w.log_step(MetricRow(step=1, wall=time.time(), ce=float("nan"), total=float("inf")))
        run = store.run("r")
        (row,) = store.metrics(run.id)
        assert row.ce is None and math.isinf(row.total)
        assert math.isinf(run.last_loss)


def test_finish_statuses_and_failure_fields(db):
    with RunStore(db, create=True) as store:
        store.create_run("a", {}).finish("finished", reason="finished")
        store.create_run("b", {}).finish("interrupted", reason="SIGTERM")
        store.create_run("c", {}).finish(
            "failed", reason="non-finite loss", fail_step=7, fail_module="model.layers.1.mlp"
        )
        with pytest.raises(ValueError):
            store.create_run("d", {}).finish("running")
        got = {r.name: r for r in store.runs()}
        assert got["a"].writer_state() == "finished" and got["a"].ended is not None
        assert got["b"].writer_state() == "interrupted" and got["b"].reason == "SIGTERM"
        assert (got["c"].status, got["c"].fail_step, got["c"].fail_module) == (
            "failed",
            7,
            "model.layers.1.mlp",
        )
        assert store.latest_run().name == "d"


def test_writer_gone_when_pid_dead_or_heartbeat_stale(db):
    with RunStore(db, create=True) as store:
        store.create_run("alive", {})
        assert store.run("alive").writer_state() == "running"
        # A pid that certainly no longer exists: a child we started and reaped.
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        store.create_run("dead", {})
        store.connection.execute("UPDATE runs SET pid = ? WHERE name = 'dead'", (child.pid,))
        dead = store.run("dead")
        assert dead.writer_state() == "gone"
        assert str(child.pid) in dead.gone_reason()
        # Stale heartbeat of a writer on this host whose process lives (stopped, or busy):
        # still running, its process is what counts (issue 32).
        store.create_run("stale", {})
        store.connection.execute(
            "UPDATE runs SET heartbeat = ? WHERE name = 'stale'", (time.time() - 100,)
        )
        assert store.run("stale").writer_state(stale_after=15) == "running"
        # On another host its process cannot be asked: no heartbeat for longer than
        # stale_after is gone.
        store.connection.execute("UPDATE runs SET host = 'elsewhere' WHERE name = 'stale'")
        stale = store.run("stale")
        assert stale.writer_state(stale_after=15) == "gone"
        assert stale.writer_state(stale_after=1000) == "running"
        assert "heartbeat" in stale.gone_reason(stale_after=15)
        assert "another host" in stale.gone_reason(stale_after=15)


def test_heartbeat_thread_keeps_beating(db):
    with RunStore(db, create=True) as store:
        w = store.create_run("hb", {})
        store.connection.execute("UPDATE runs SET heartbeat = 0 WHERE name = 'hb'")
        w.start_heartbeat(interval=0.05)
        wait_for(lambda: store.run("hb").heartbeat != 0, 60, "a heartbeat")
        assert store.run("hb").heartbeat > time.time() - 5
        thread = w._hb_thread
        w.finish("finished")
        beat = store.run("hb").heartbeat
        # finish() joined the thread: nothing can beat any more (no sleep-and-see window)
        assert w._hb_thread is None and not thread.is_alive()
        assert store.run("hb").heartbeat == beat


def test_duplicate_and_invalid_names(db):
    with RunStore(db, create=True) as store:
        store.create_run("x", {})
        with pytest.raises(RunExistsError, match="already exists"):
            store.create_run("x", {})
        for bad in ("", "a/b", "../x", "with space", "-lead"):
            with pytest.raises(RunStoreError, match="invalid run name"):
                store.create_run(bad, {})
    assert validate_run_name("overfit-2024.01_a") == "overfit-2024.01_a"


def test_run_not_found_lists_known_runs(db):
    with RunStore(db, create=True) as store:
        store.create_run("known", {})
        with pytest.raises(RunNotFoundError, match="no run named 'nope'.*known"):
            store.run("nope")


def test_resume_truncates_after_checkpoint_and_bumps_attempt(db, tmp_path):
    with RunStore(db, create=True) as store:
        w = store.create_run("r", {}, total_steps=20)
        for s in range(1, 11):
            w.log_step(_metric(s, 1.0 / s), internals={"s": s} if s in (4, 9) else None)
        w.set_checkpoint(5, checkpoint_dir(db, "r"))
        # The writer is this process: resuming must be refused while it "runs".
        with pytest.raises(WriterBusyError, match="still being written"):
            store.resume_run("r")
        w.finish("interrupted", reason="SIGTERM")
        w2 = store.resume_run("r", total_steps=30)
        run = store.run("r")
        assert (run.status, run.attempt, run.last_step, run.total_steps) == ("running", 2, 5, 30)
        assert run.last_loss == pytest.approx(1 / 5 + 0.01)
        assert run.checkpoint_path == "mdb-checkpoints/r"
        assert [m.step for m in store.metrics(run.id)] == [1, 2, 3, 4, 5]
        assert store.internals_steps(run.id) == [4]
        # a watcher whose cursor was at 10 learns that the run restarted at the checkpoint
        upd = store.poll(run.id, after_step=10)
        assert upd.restarted and upd.metrics == [] and upd.run.checkpoint_step == 5
        w2.log_step(_metric(6, 0.5))
        upd = store.poll(run.id, after_step=10)
        assert upd.restarted and [m.step for m in upd.metrics] == [6]


def test_resume_refusals(db):
    with RunStore(db, create=True) as store:
        store.create_run("nockpt", {}, total_steps=5).finish("interrupted")
        with pytest.raises(RunStoreError, match="no checkpoint"):
            store.resume_run("nockpt")
        w = store.create_run("done", {}, total_steps=5)
        w.set_checkpoint(5, "/tmp/x")
        w.finish("finished")
        with pytest.raises(RunStoreError, match="already reached step 5 of 5"):
            store.resume_run("done")
        with pytest.raises(RunNotFoundError):
            store.resume_run("missing")


def test_bad_databases_give_one_line_errors(tmp_path):
    missing = tmp_path / "nope.sqlite"
    with pytest.raises(RunStoreError, match="no run database at"):
        RunStore(missing)
    assert not missing.exists()  # a reader never creates the file

    with pytest.raises(RunStoreError, match="is a directory"):
        RunStore(tmp_path)

    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(RunStoreError, match="not an mdb run database"):
        RunStore(garbage)
    with pytest.raises(RunStoreError, match="not an mdb run database"):
        RunStore(garbage, create=True)

    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE users (id INTEGER, name TEXT)")
    conn.commit()
    conn.close()
    for create in (False, True):
        with pytest.raises(RunStoreError, match="something else"):
            RunStore(other, create=create)

    empty = tmp_path / "empty.sqlite"
    empty.write_bytes(b"")
    with pytest.raises(RunStoreError, match="empty database"):
        RunStore(empty)

    newer = tmp_path / "newer.sqlite"
    RunStore(newer, create=True).close()
    conn = sqlite3.connect(newer)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(RunStoreError, match="newer mdb"):
        RunStore(newer)

    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(RunStoreError, match="cannot create the run database"):
        RunStore(a_file / "sub" / "mdb.sqlite", create=True)
    with pytest.raises(RunStoreError, match="is a directory"):
        RunStore(tmp_path, create=True)

    for exc in (RunNotFoundError, RunExistsError, WriterBusyError):
        assert issubclass(exc, RunStoreError)


def test_messages_are_one_line(tmp_path):
    garbage = tmp_path / "g.sqlite"
    garbage.write_bytes(b"\x00" * 4096)
    for path in (tmp_path / "nope.sqlite", garbage):
        with pytest.raises(RunStoreError) as info:
            RunStore(path)
        assert "\n" not in str(info.value)


def test_default_db_path_env():
    assert str(default_db_path({})) == os.path.join("runs", "mdb.sqlite")
    assert str(default_db_path({"MDB_DB": "/x/y.sqlite"})) == "/x/y.sqlite"
    assert str(default_db_path({"MDB_DB": "  "})) == os.path.join("runs", "mdb.sqlite")


def test_concurrent_reader_thread_sees_whole_steps_in_order(db):
    """A reader polling while the writer writes: no lock errors, each step once, and a step's
    internals are visible exactly when its metrics row is (one transaction)."""
    n = 400
    with RunStore(db, create=True) as store:
        w = store.create_run("c", {}, total_steps=n)
        run_id = w.run_id
        seen: list[int] = []
        errors: list[BaseException] = []
        done = threading.Event()

        def reader():
            try:
                with RunStore(db) as r:
                    cursor = 0
                    while True:
                        finished = done.is_set()
                        upd = r.poll(run_id, cursor)
                        for m in upd.metrics:
                            seen.append(m.step)
                        assert set(upd.internals_steps) == {m.step for m in upd.metrics}
                        if upd.metrics:
                            assert upd.run.last_step >= upd.metrics[-1].step
                        cursor = upd.last_step
                        if finished and not upd.metrics:
                            return
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        t = threading.Thread(target=reader)
        t.start()
        for s in range(1, n + 1):
            w.log_step(_metric(s, 1.0), internals={"step": s})
        w.finish("finished")
        done.set()
        t.join(30)
        assert not errors, errors
        assert seen == list(range(1, n + 1))


def test_internals_json_accepts_tensor_like_values(db):
    class FakeTensor:
        def tolist(self):
            return [1.0, 2.0]

    with RunStore(db, create=True) as store:
        w = store.create_run("t", {})
        w.log_step({"step": 1, "ce": 1.0}, internals={"x": FakeTensor(), "nan": float("nan")})
        data = store.internals(w.run_id, 1)
        assert data["x"] == [1.0, 2.0] and math.isnan(data["nan"])
        raw = store.connection.execute("SELECT data FROM internals").fetchone()[0]
        assert json.loads(raw)["x"] == [1.0, 2.0]


# -- schema v1 → v2 ---------------------------------------------------------------------------

DATA = Path(__file__).resolve().parents[2] / "data"


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _check_v1_content(store):
    """The database written by mdb's schema-1 code (tests/data/runstore_v1.sqlite: an overfit
    run, one that failed on NaN, one written by hand through RunWriter) reads back as that
    code read it (tests/data/runstore_v1.expected.json, dumped by it)."""
    expected = json.loads((DATA / "runstore_v1.expected.json").read_text())
    runs = {r.name: r for r in store.runs()}
    assert sorted(runs) == sorted(expected)
    for name, exp in expected.items():
        run = runs[name]
        got = run.to_dict()
        assert {k: got[k] for k in exp["run"]} == exp["run"]
        rows = store.metrics(run.id)
        assert [{k: v for k, v in r.to_dict().items() if k != "values"} for r in rows] == \
            exp["metrics"]
        assert [[s.step, s.prompt, s.text] for s in store.samples(run.id)] == exp["samples"]
        steps = store.internals_steps(run.id)
        assert steps == exp["internals_steps"]
        for st in steps:
            data = json.dumps(store.internals(run.id, st), sort_keys=True).encode()
            assert _sha(data) == exp["internals_sha256"][str(st)]
            assert _sha(store.internals_tensors(run.id, st) or b"") == \
                exp["tensors_sha256"][str(st)]
    ov, nan, hand = runs["ov"], runs["nan"], runs["hand"]
    assert store.metric_names(ov.id) == ["ce", "aux", "total", "grad_norm", "lr", "step_time",
                                         "tokens_per_s", "steps_per_s"]
    assert set(store.metrics(ov.id)[0].values) == set(store.metric_names(ov.id))
    # the hand-written run never filled aux or lr: those are not metrics of it; a NULL in a
    # column it filled elsewhere was a NaN to schema 1 and stays one
    assert store.metric_names(hand.id) == ["ce", "total", "grad_norm", "step_time",
                                           "steps_per_s"]
    h = store.metrics(hand.id)
    assert h[0].values == {"ce": 2.5, "total": 2.5, "grad_norm": None}
    assert h[1].values == {"ce": None, "total": math.inf, "grad_norm": -math.inf}
    assert h[2].values == {"ce": 1.5, "total": 1.5, "grad_norm": None, "step_time": 0.02,
                           "steps_per_s": 50.0}
    assert nan.nonfinite == {"step": 4, "metric": "total",
                             "module": "model.layers.0.self_attn.v_proj", "direction": "forward"}
    assert ov.nonfinite is None and hand.nonfinite is None


def test_a_schema_1_database_is_migrated_on_open_with_nothing_lost(tmp_path):
    db = tmp_path / "v1.sqlite"
    shutil.copyfile(DATA / "runstore_v1.sqlite", db)
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("1",)
    conn.close()
    with RunStore(db) as store:  # a reader migrates it
        assert store.read_only is False and store.note is None
        meta = dict(store.connection.execute("SELECT key, value FROM meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION) == "4"
        assert store.integrity_check() == "ok"
        assert store.connection.execute("PRAGMA foreign_key_check").fetchall() == []
        _check_v1_content(store)
    with RunStore(db, create=True) as store:  # again: nothing to do; and it can be written
        _check_v1_content(store)
        w = store.resume_run("ov", total_steps=8)  # resumed from its checkpoint at step 6
        ov = store.run("ov")
        assert ov.last_loss == store.metrics(ov.id)[-1].total and ov.last_step == 6
        w.log_step({"step": 7, "ce": 1.0, "total": 1.0, "val_loss": 2.0})
        assert store.metric_names(ov.id)[-1] == "val_loss"
        assert store.run("ov").last_loss == 1.0


def test_resume_of_a_run_that_logged_loss_takes_last_loss_from_the_checkpoint_step(db):
    with RunStore(db, create=True) as store:
        w = store.create_run("r", {}, total_steps=10, kind="api")
        for s in range(1, 6):
            w.log_step({"step": s, "loss": 1.0 / s, "val_loss": 9.0})
        w.set_checkpoint(3, "/tmp/x")
        w.set_nonfinite({"step": 5, "metric": "loss", "module": None, "direction": None})
        w.finish("interrupted")
        store.resume_run("r")
        run = store.run("r")
        assert run.last_loss == pytest.approx(1 / 3) and run.last_step == 3
        assert run.nonfinite is None  # found after the checkpoint: gone with those steps
        with pytest.raises(ValueError, match="direction"):
            w.set_nonfinite({"step": 1, "direction": "sideways"})


# -- read-only databases ----------------------------------------------------------------------

@pytest.fixture
def ro_mount(tmp_path):
    """A tmpfs at tmp_path/ro and a function that remounts it read-only (root only: a real
    read-only mount, which permission bits cannot fake for root)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs read-only")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")

    def remount_ro():
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)

    try:
        yield mnt, remount_ro
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _three_steps(db, *, keep_open: bool = False):
    store = RunStore(db, create=True)
    store.connection.execute("PRAGMA wal_autocheckpoint = 0")  # steps stay in the -wal file
    w = store.create_run("r", {}, total_steps=3)
    for s in range(1, 4):
        w.log_step(_metric(s, 1.0 / s))
    if not keep_open:
        w.finish("finished")
        store.close()
    return store


def test_read_only_mount_clean_database_is_read(ro_mount, capsys):
    mnt, remount_ro = ro_mount
    db = mnt / "mdb.sqlite"
    _three_steps(db)
    assert not Path(str(db) + "-wal").exists()  # the last close checkpointed it
    remount_ro()
    with RunStore(db) as store:
        assert store.read_only and "read-only (a read-only file system)" in store.note
        assert [m.step for m in store.metrics(store.run("r").id)] == [1, 2, 3]
    assert main(["runs", "--db", str(db)]) == 0
    out = capsys.readouterr()
    assert "finished" in out.out and "3/3" in out.out
    assert "read-only" in out.err and "unable to open" not in out.err
    from tui.commands.watch import open_run

    store, run = open_run(str(db), None)
    assert store.poll(run.id).metrics[-1].step == 3
    store.close()
    for create in (lambda: RunStore(db, create=True), lambda: hooks_run(db)):
        with pytest.raises(RunStoreError, match="read-only") as info:
            create()
        assert "not an mdb run database" not in str(info.value)


def hooks_run(db):
    from hooks.recorder.run import Run

    return Run("x", db=db)


def test_read_only_mount_with_wal_and_shm_sees_every_committed_step(ro_mount, tmp_path):
    mnt, remount_ro = ro_mount
    src = tmp_path / "src" / "mdb.sqlite"
    store = _three_steps(src, keep_open=True)  # a writer that is still open (or crashed)
    assert Path(str(src) + "-wal").stat().st_size > 0
    for suffix in ("", "-wal", "-shm"):
        shutil.copyfile(str(src) + suffix, str(mnt / "mdb.sqlite") + suffix)
    store.close()
    remount_ro()
    with RunStore(mnt / "mdb.sqlite") as ro:
        assert ro.read_only and "reading it without writing" in ro.note
        run = ro.run("r")
        assert run.last_step == 3 and [m.step for m in ro.metrics(run.id)] == [1, 2, 3]


def test_read_only_mount_with_a_wal_but_no_shm_reads_a_private_copy(ro_mount, tmp_path):
    mnt, remount_ro = ro_mount
    src = tmp_path / "src" / "mdb.sqlite"
    store = _three_steps(src, keep_open=True)
    for suffix in ("", "-wal"):
        shutil.copyfile(str(src) + suffix, str(mnt / "mdb.sqlite") + suffix)
    store.close()
    remount_ro()
    with RunStore(mnt / "mdb.sqlite") as ro:
        assert ro.read_only and "private copy" in ro.note
        copy_dir = ro._copy_dir
        assert [m.step for m in ro.metrics(ro.run("r").id)] == [1, 2, 3]
    assert not os.path.exists(copy_dir)  # removed on close


def test_read_only_schema_1_database_is_migrated_in_a_copy(ro_mount):
    mnt, remount_ro = ro_mount
    db = mnt / "v1.sqlite"
    shutil.copyfile(DATA / "runstore_v1.sqlite", db)
    before = _sha(db.read_bytes())
    remount_ro()
    with RunStore(db) as store:
        assert store.read_only and "upgraded in a private copy" in store.note
        _check_v1_content(store)
    assert _sha(db.read_bytes()) == before


# -- resume_run: two processes at once ---------------------------------------------------------

_RESUMER = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("mdb_store", sys.argv[1])
m = importlib.util.module_from_spec(spec)
sys.modules["mdb_store"] = m
spec.loader.exec_module(m)
store = m.RunStore(sys.argv[2])
print("ready", flush=True)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.0005)
try:
    store.resume_run("r")
    print("won", flush=True)
except m.WriterBusyError:
    print("busy", flush=True)
sys.stdin.read()  # stay alive, a live writer, until the test has looked
"""


@pytest.mark.slow
def test_resume_run_takes_a_run_over_in_one_process_only(db, tmp_path):
    """resume_run checks the writer's liveness inside its write transaction: of processes
    resuming at once, exactly one takes the run over (the check before the transaction let
    two or more through in most trials)."""
    import hooks.store.store as store_module

    with RunStore(db, create=True) as store:
        w = store.create_run("r", {}, total_steps=100)
        w.log_step(_metric(1, 1.0))
        w.set_checkpoint(1, "/tmp/x")
        w.finish("interrupted")
    for trial in range(5):
        go = tmp_path / f"go{trial}"
        procs = [subprocess.Popen([sys.executable, "-c", _RESUMER, store_module.__file__,
                                   str(db), str(go)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True) for _ in range(5)]
        try:
            assert all(p.stdout.readline().strip() == "ready" for p in procs)
            go.touch()
            results = sorted(p.stdout.readline().strip() for p in procs)
        finally:
            for p in procs:
                p.stdin.close()
                p.wait(60)
        assert results == ["busy"] * 4 + ["won"], f"trial {trial}: {results}"
        with RunStore(db) as store:
            assert store.run("r").attempt == trial + 2
            store.connection.execute("UPDATE runs SET status = 'interrupted' WHERE name = 'r'")
