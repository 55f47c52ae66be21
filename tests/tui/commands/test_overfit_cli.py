"""``mdb overfit`` and ``mdb runs``: in-process runs, bad input, and real writer subprocesses
(2,000 steps read concurrently; SIGINT / SIGTERM / SIGHUP / SIGKILL, then resume)."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import torch

from hooks.store.store import RunStore
from tests.conftest import TINY_TOML
from tests.conftest import wait_for as _wait_for
from tests.processes import error_line as _the_error_line
from tests.processes import one_error_line as _one_error_line
from tests.processes import run_row as _run_row
from tests.processes import spawn_logged as _spawn
from tui.cli import main


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny(tmp_path) -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text(TINY_TOML)
    return p


def test_headless_run_then_runs_table(tmp_path, tiny, capsys):
    db = tmp_path / "d" / "mdb.sqlite"
    rc = main(["overfit", "--headless", "--config", str(tiny), "--steps", "6", "--db", str(db),
               "--run", "a", "--every", "3", "--sample-every", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "run a finished: step 6/6" in out and "step 6/6" in out
    assert "sample @2: 人工智能|" in out  # plain lines: stdout is not a terminal here
    with RunStore(db) as store:
        run = store.run("a")
        assert (run.status, run.last_step, run.checkpoint_step) == ("finished", 6, 6)
        assert run.config["resolved_model_config"]["hidden_size"] == 16
        assert [m.step for m in store.metrics(run.id)] == list(range(1, 7))
        assert [s.step for s in store.samples(run.id)] == [1, 2, 4, 6]
        assert store.internals_steps(run.id) == [3, 6]
        assert store.internals(run.id, 3)["kind"] == "mdb-trace"
    ckpt = db.parent / "mdb-checkpoints" / "a"
    assert [p.name for p in ckpt.iterdir()] == ["step-00000006"]
    assert {p.name for p in (ckpt / "step-00000006").iterdir()} == {
        "model.safetensors", "optimizer.safetensors", "checkpoint.json"}
    assert f"checkpoint in {ckpt / 'step-00000006'}" in out

    assert main(["runs", "--db", str(db)]) == 0
    table = capsys.readouterr().out
    assert "a" in table and "finished" in table and "6/6" in table

    # --resume with a larger --steps continues the finished run
    assert main(["overfit", "--headless", "--resume", "a", "--steps", "8", "--db", str(db)]) == 0
    with RunStore(db) as store:
        run = store.run("a")
        assert (run.status, run.last_step, run.attempt) == ("finished", 8, 2)
        assert [m.step for m in store.metrics(run.id)] == list(range(1, 9))


def test_env_var_selects_the_database(tmp_path, tiny, monkeypatch, capsys):
    db = tmp_path / "env.sqlite"
    monkeypatch.setenv("MDB_DB", str(db))
    assert main(["overfit", "--headless", "--config", str(tiny), "--steps", "2", "--run", "e",
                 "--sample-every", "0", "--every", "0"]) == 0
    assert main(["runs", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"name": "e"' in out and '"writer_state": "finished"' in out


def test_nan_run_is_marked_failed_with_step_and_module(tmp_path, tiny, capsys):
    db = tmp_path / "mdb.sqlite"
    rc = main(["overfit", "--headless", "--config", str(tiny), "--steps", "10", "--db", str(db),
               "--run", "n", "--debug-nan-at", "4", "--sample-every", "0"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "mdb: error: run n failed: non-finite loss at step 4" in err
    with RunStore(db) as store:
        run = store.run("n")
        assert (run.status, run.fail_step, run.last_step) == ("failed", 4, 4)
        # the poisoned weight is v_proj's: its output is where NaN first appears
        assert run.fail_module == "model.layers.0.self_attn.v_proj"
        assert store.last_metrics(run.id).ce is None  # NaN is stored as NULL
    assert main(["runs", "--db", str(db)]) == 0
    table = capsys.readouterr().out
    # one sentence under the row: what, where, when (the module named once)
    assert ("└ failed: non-finite loss at step 4, first in model.layers.0.self_attn.v_proj "
            "(parameter): its weight holds 1 NaN of 128 values") in table
    assert table.count("v_proj") == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["runs", "--db", "{tmp}/missing.sqlite"], "no run database at"),
        (["runs", "--db", "{garbage}"], "not an mdb run database"),
        (["runs", "--db", "{other}"], "something else"),
        (["runs", "--db", "{tmp}"], "is a directory"),
        (["overfit", "--headless", "--db", "{garbage}", "--steps", "1"], "not an mdb run database"),
        (["overfit", "--headless", "--db", "{db}", "--resume", "nope"], "no run named 'nope'"),
        (["overfit", "--headless", "--db", "{db}", "--resume", "ok", "--lr", "1"],
         "drop --lr"),
        (["overfit", "--headless", "--db", "{db}", "--resume", "ok"], "already reached step 2"),
        (["overfit", "--headless", "--db", "{db}", "--run", "ok", "--config", "{tiny}"],
         "already exists"),
        (["overfit", "--headless", "--db", "{db}", "--run", "a b", "--config", "{tiny}"],
         "invalid run name"),
        (["overfit", "--headless", "--db", "{db}", "--text", "{tmp}/none.txt"], "no such file"),
        (["overfit", "--headless", "--db", "{db}", "--preset", "nope"], "unknown preset"),
        (["overfit", "--headless", "--db", "{db}", "--config", "{tiny}", "--seq-len", "1"],
         "--seq-len must be at least 2"),
        (["overfit", "--headless", "--db", "{db}", "--config", "{tiny}", "--seq-len", "500",
          "--text", "{long}"], "max_position_embeddings"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, tiny, capsys, argv, message):
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not sqlite" * 500)
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    long_text = tmp_path / "long.txt"
    long_text.write_text("abcdefghij" * 60, encoding="utf-8")
    db = tmp_path / "mdb.sqlite"
    assert main(["overfit", "--headless", "--config", str(tiny), "--steps", "2", "--db", str(db),
                 "--run", "ok", "--sample-every", "0", "--every", "0"]) == 0
    capsys.readouterr()
    names = {"tmp": tmp_path, "garbage": garbage, "other": other, "db": db, "tiny": tiny,
             "long": long_text}
    rc = main([a.format(**names) for a in argv])
    assert rc == 2
    assert message in _one_error_line(capsys)
    if "missing" in argv[-1]:
        assert not (tmp_path / "missing.sqlite").exists()


# ---------------------------------------------------------------------------------------------
# Real processes
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_2000_steps_written_by_a_subprocess_are_read_exactly_once_in_order(tmp_path, tiny):
    db = tmp_path / "mdb.sqlite"
    proc, log = _spawn(
        ["overfit", "--headless", "--config", str(tiny), "--steps", "2000", "--db", str(db),
         "--run", "big", "--every", "500", "--sample-every", "250"],
        tmp_path, "writer",
    )
    _wait_for(lambda: _run_row(db, "big") is not None or proc.poll() is not None, 120,
              "the run to appear")
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        seen: list[int] = []
        try:
            with RunStore(db) as store:
                run_id = store.run("big").id
                cursor = 0
                while True:
                    upd = store.poll(run_id, cursor)
                    assert not upd.restarted
                    steps = [m.step for m in upd.metrics]
                    seen.extend(steps)
                    # a step's internals/sample are visible together with its metrics row
                    assert set(upd.internals_steps) <= set(steps)
                    cursor = upd.last_step
                    if upd.run.status != "running" and not steps:
                        break
                    time.sleep(0.01 * (k + 1))
        except BaseException as exc:
            errors.append(exc)
        results[k] = seen

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    rc = proc.wait(timeout=600)
    for t in threads:
        t.join(60)
    text = log.read_text()
    assert rc == 0, text
    assert "locked" not in text
    assert not errors, errors
    for k in results:
        assert results[k] == list(range(1, 2001))
    with RunStore(db) as store:
        run = store.run("big")
        assert run.status == "finished" and run.last_step == 2000
        steps = store.internals_steps(run.id)
        assert [s for s in steps if s % 500 == 0] == [500, 1000, 1500, 2000]
        for s in (s for s in steps if s % 500):  # the others: captured because they spiked
            assert "spike" in (store.internals(run.id, s) or {}).get("meta", {}), s
        assert store.integrity_check() == "ok"


@pytest.mark.slow
def test_signals_interrupt_checkpoint_and_resume(tmp_path, tiny, capsys):
    """SIGINT, SIGTERM, SIGHUP: interrupted + checkpoint + exit 128+n; SIGKILL: intact database,
    writer reported gone; all four resume from their checkpoints."""
    db = tmp_path / "mdb.sqlite"
    # create the database first so the four writers do not race to create the schema
    RunStore(db, create=True).close()
    sigs = {"int": signal.SIGINT, "term": signal.SIGTERM, "hup": signal.SIGHUP,
            "kill": signal.SIGKILL}
    procs = {}
    for name in sigs:
        procs[name] = _spawn(
            ["overfit", "--headless", "--config", str(tiny), "--steps", "100000", "--db", str(db),
             "--run", name, "--checkpoint-every", "5", "--every", "0", "--sample-every", "0",
             "--heartbeat", "0.2"],
            tmp_path, name,
        )
    for name, (proc, log) in procs.items():
        _wait_for(
            lambda n=name, p=proc: (p.poll() is not None)
            or ((r := _run_row(db, n)) is not None and (r.checkpoint_step or 0) >= 5),
            180, f"run {name} to pass step 5",
        )
        assert proc.poll() is None, log.read_text()
    for name, sig in sigs.items():
        procs[name][0].send_signal(sig)
    codes = {name: proc.wait(timeout=60) for name, (proc, _) in procs.items()}
    assert codes == {"int": 130, "term": 143, "hup": 129, "kill": -9}

    with RunStore(db) as store:
        assert store.integrity_check() == "ok"
        runs = {r.name: r for r in store.runs()}
        for name, reason in (("int", "SIGINT"), ("term", "SIGTERM"), ("hup", "SIGHUP")):
            r = runs[name]
            assert (r.status, r.reason) == ("interrupted", reason)
            assert r.checkpoint_step == r.last_step >= 5
            assert [m.step for m in store.metrics(r.id)] == list(range(1, r.last_step + 1))
            text = procs[name][1].read_text()
            assert f"interrupted ({reason})" in text and f"--resume {name}" in text
        k = runs["kill"]
        assert k.status == "running" and k.writer_state() == "gone"
        assert "no longer exists" in k.gone_reason()
        assert k.checkpoint_step is not None and k.checkpoint_step % 5 == 0

    capsys.readouterr()
    assert main(["runs", "--db", str(db)]) == 0
    assert "gone: process" in capsys.readouterr().out

    # resume in this process (the same code path as a new `mdb` process, without the startup)
    targets = {name: runs[name].last_step + 3 for name in sigs}
    for name in sigs:
        assert main(["overfit", "--headless", "--db", str(db), "--resume", name, "--steps",
                     str(targets[name])]) == 0
        assert f"run {name} finished" in capsys.readouterr().out
    with RunStore(db) as store:
        assert store.integrity_check() == "ok"
        for name in sigs:
            r = store.run(name)
            assert (r.status, r.last_step, r.attempt) == ("finished", targets[name], 2)
            assert [m.step for m in store.metrics(r.id)] == list(range(1, targets[name] + 1))


@pytest.mark.slow
def test_kill_9_before_any_periodic_checkpoint_resumes_from_step_0(tmp_path, tiny, capsys):
    """A new run checkpoints its initial state first, so a writer killed before its first
    periodic checkpoint leaves a run that resumes (found in review: it could not be resumed
    nor recreated under its name)."""
    db = tmp_path / "mdb.sqlite"
    proc, log = _spawn(["overfit", "--headless", "--config", str(tiny), "--steps", "100000",
                        "--db", str(db), "--run", "e", "--every", "0", "--sample-every", "0",
                        "--heartbeat", "0.2"], tmp_path, "e")
    _wait_for(lambda: (proc.poll() is not None)
              or ((r := _run_row(db, "e")) is not None and r.last_step >= 3), 120, "step 3")
    proc.kill()
    proc.wait(timeout=30)
    with RunStore(db) as store:
        run = store.run("e")
        assert run.checkpoint_step == 0 and run.writer_state() == "gone"
    capsys.readouterr()
    assert main(["overfit", "--headless", "--db", str(db), "--resume", "e", "--steps", "4"]) == 0
    assert "run e finished: step 4/4" in capsys.readouterr().out
    with RunStore(db) as store:
        assert [m.step for m in store.metrics(store.run("e").id)] == [1, 2, 3, 4]


def test_checkpoint_that_cannot_be_written_is_one_error_line_and_exit_1(tmp_path, tiny, capsys,
                                                                        monkeypatch):
    """Disk full / read-only: the run's steps are kept, the end line says the checkpoint failed
    and where a resume would start, exit 1, and no half-written directory is left."""
    from safetensors import SafetensorError

    import hooks.train.checkpoint as checkpoint

    real = checkpoint._write_checkpoint_files

    def disk_full(tmp, model, optimizer, step, extra):
        if step >= 5:
            (tmp / "model.safetensors").write_bytes(b"partial")
            raise SafetensorError("Error while serializing: No space left on device")
        real(tmp, model, optimizer, step, extra)

    monkeypatch.setattr(checkpoint, "_write_checkpoint_files", disk_full)
    db = tmp_path / "mdb.sqlite"
    rc = main(["overfit", "--headless", "--config", str(tiny), "--steps", "6", "--db", str(db),
               "--run", "full", "--every", "0", "--sample-every", "0", "--checkpoint-every", "3"])
    captured = capsys.readouterr()
    assert rc == 1
    line = _the_error_line(captured.err)
    assert "run full finished after step 6" in line
    assert "checkpoint of step 6 failed: Error while serializing: No space left" in line
    assert "a resume starts again from step 3" in line
    assert "Traceback" not in captured.out + captured.err
    with RunStore(db) as store:
        run = store.run("full")
        assert (run.status, run.last_step, run.checkpoint_step) == ("finished", 6, 3)
    ckpts = db.parent / "mdb-checkpoints" / "full"
    assert [p.name for p in ckpts.iterdir()] == ["step-00000003"]


def test_corrupt_checkpoint_resume_is_one_line_and_leaves_the_run_as_it_was(tmp_path, tiny,
                                                                              capsys):
    db = tmp_path / "mdb.sqlite"
    assert main(["overfit", "--headless", "--config", str(tiny), "--steps", "4", "--db", str(db),
                 "--run", "c1", "--every", "0", "--sample-every", "0"]) == 0
    ckpt = db.parent / "mdb-checkpoints" / "c1" / "step-00000004"
    for name in ("optimizer.safetensors", "model.safetensors"):
        data = (ckpt / name).read_bytes()
        (ckpt / name).write_bytes(data[:1000])
        capsys.readouterr()
        assert main(["overfit", "--headless", "--db", str(db), "--resume", "c1",
                     "--steps", "8"]) == 2
        err = capsys.readouterr().err
        assert "cannot resume 'c1'" in _the_error_line(err) and "Traceback" not in err
        (ckpt / name).write_bytes(data)
    with RunStore(db) as store:
        run = store.run("c1")
        assert (run.status, run.last_step, run.attempt) == ("finished", 4, 1)
        assert len(store.metrics(run.id)) == 4
