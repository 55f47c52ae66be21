"""Faults of the run machinery, each with real processes, signals and file systems where the
machine allows: two SIGINTs 50 ms apart, a disk that fills up (a real tmpfs when this process may
mount one, else ENOSPC simulated at the write calls), and ``--lr 5`` (gradients whose fp32 norm
overflows)."""

from __future__ import annotations

import math
import os
import signal
import sqlite3
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from hooks.store.store import RunStore
from tests.conftest import TINY_TOML
from tests.conftest import wait_for as _wait_for
from tests.processes import run_row as _run_row
from tests.processes import spawn_logged as _spawn_logged
from tui.cli import main
from tui.screens.live_data import metric_values

pytestmark = pytest.mark.usefixtures("one_thread")

#: A model big enough that its step and its checkpoint take tens of milliseconds (0.9 M
#: parameters), so a second signal 50 ms after the first lands while the run is stopping.
MID_TOML = """\
vocab_size = 256
hidden_size = 128
intermediate_size = 256
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 1
num_local_experts = 4
num_experts_per_tok = 2
max_position_embeddings = 128
"""


def _spawn(args, cwd: Path, log: Path) -> subprocess.Popen:
    proc, _ = _spawn_logged(args, cwd, log.stem)
    return proc


def _run(db: Path, name: str):
    return _run_row(db, name)


# ---------------------------------------------------------------------------------------------
# Two SIGINTs 50 ms apart
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_sigints_50ms_apart_exit_130_interrupted_with_the_final_checkpoint(tmp_path):
    """The second SIGINT used to raise KeyboardInterrupt into the final checkpoint or the last
    write: exit 130 but the run stayed "running" (then "gone") and resumed 6-27 steps back."""
    toml = tmp_path / "mid.toml"
    toml.write_text(MID_TOML)
    db = tmp_path / "mdb.sqlite"
    RunStore(db, create=True).close()
    results = {}
    for k, gap in enumerate((0.05, 0.01)):
        name = f"s{k}"
        proc = _spawn(["overfit", "--headless", "--config", str(toml), "--steps", "100000",
                       "--db", str(db), "--run", name, "--checkpoint-every", "20",
                       "--every", "0", "--sample-every", "0", "--heartbeat", "0.2"],
                      tmp_path, tmp_path / f"{name}.log")
        _wait_for(lambda n=name, p=proc: p.poll() is not None
                  or ((r := _run(db, n)) is not None and r.last_step >= 25), 180,
                  f"run {name} to pass step 25")
        assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()
        proc.send_signal(signal.SIGINT)
        time.sleep(gap)
        proc.send_signal(signal.SIGINT)
        results[name] = proc.wait(timeout=120)
    with RunStore(db) as store:
        assert store.integrity_check() == "ok"
        for name, rc in results.items():
            log = (tmp_path / f"{name}.log").read_text()
            assert rc == 130, log
            run = store.run(name)
            assert (run.status, run.reason) == ("interrupted", "SIGINT"), log
            assert run.checkpoint_step == run.last_step > 20, log  # nothing lost
            assert [m.step for m in store.metrics(run.id)] == list(range(1, run.last_step + 1))
            assert f"run {name} interrupted (SIGINT) after step {run.last_step}" in log
            # (the second one says "mdb: already stopping" unless the run had ended already)
            assert "Traceback" not in log and "mdb: interrupted" not in log
            ckpt = Path(db.parent / run.checkpoint_path)
            assert ckpt.name == f"step-{run.last_step:08d}" and (ckpt / "checkpoint.json").exists()


def test_a_second_signal_while_stopping_only_says_so(terminal_sigint):
    from hooks.train.trainer import TrainControl, install_stop_signals

    control = TrainControl()
    said: list[str] = []
    restore = install_stop_signals(control, on_repeat=said.append)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # used to raise KeyboardInterrupt here
        os.kill(os.getpid(), signal.SIGTERM)
        # handlers run in this thread, between bytecodes
        _wait_for(lambda: len(said) >= 2, 30, "both repeats said")
    finally:
        restore()
    assert control.stop_reason == "SIGINT" and said == ["SIGINT", "SIGTERM"]


# ---------------------------------------------------------------------------------------------
# Disk full
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def tmpfs(tmp_path):
    """A 6 MiB tmpfs (needs the right to mount: root in a container that allows it)."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("cannot mount a tmpfs here (the simulated disk-full tests still run)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=30)


@pytest.mark.slow
def test_disk_full_on_a_real_tmpfs_with_every_1(tmp_path, tmpfs):
    """--every 1 --checkpoint-every 1 on 6 MiB: the first checkpoints with optimizer state do
    not fit (said at once, not only at the end), the database fills up with internals, and the
    run ends "failed" naming the step that was not recorded — not "running", not a step past the
    metrics."""
    toml = tmp_path / "mid.toml"
    toml.write_text(MID_TOML)
    db = tmpfs / "mdb.sqlite"
    log = tmp_path / "full.log"
    proc = _spawn(["overfit", "--headless", "--config", str(toml), "--steps", "300",
                   "--db", str(db), "--run", "full", "--every", "1", "--checkpoint-every", "1",
                   "--sample-every", "0", "--heartbeat", "0.2"], tmp_path, log)
    rc = proc.wait(timeout=300)
    text = log.read_text()
    assert rc == 1, text
    assert "Traceback" not in text
    warnings = [ln for ln in text.splitlines() if ln.startswith("mdb: warning: checkpoint of")]
    assert warnings and "No space left on device" in warnings[0], text
    assert "training goes on, a resume would start from step 0" in warnings[0]
    error = [ln for ln in text.splitlines() if ln.startswith("mdb: error:")]
    assert len(error) == 1 and "database or disk is full" in error[0], text
    with RunStore(db) as store:
        run = store.run("full")
        steps = [m.step for m in store.metrics(run.id)]
        assert run.status == "failed" and run.writer_state() == "failed"
        assert run.reason == f"step {run.last_step + 1} not recorded: database or disk is full"
        assert run.fail_step is None  # no non-finite value: the status line says the reason
        assert steps == list(range(1, run.last_step + 1)) and run.last_step >= 1
        assert run.checkpoint_step == 0  # the initial one fitted, none with optimizer state
        assert f"holds steps up to {run.last_step}, a resume starts from step 0" in error[0]
        assert "failed (step" in run.status_line() and "@ step" not in run.status_line()
    assert not any(p.name.endswith(".tmp") for p in (tmpfs / "mdb-checkpoints" / "full").iterdir())


@pytest.mark.slow
def test_disk_filled_by_another_file_the_run_is_still_marked_ended(tmp_path, tmpfs):
    """Every byte taken while the run writes (another process fills the disk): without the
    bytes the run set aside, its final status could not be written and it stayed "running"."""
    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY_TOML)
    db = tmpfs / "mdb.sqlite"
    log = tmp_path / "fill.log"
    proc = _spawn(["overfit", "--headless", "--config", str(toml), "--steps", "100000",
                   "--db", str(db), "--run", "f", "--every", "0", "--sample-every", "0",
                   "--heartbeat", "0.2"], tmp_path, log)
    try:
        _wait_for(lambda: proc.poll() is not None
                  or ((r := _run(db, "f")) is not None and r.last_step >= 20), 120, "step 20")
        fd = os.open(tmpfs / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 65536)
        except OSError:
            pass
        finally:
            os.close(fd)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 1, text
    with RunStore(db) as store:
        run = store.run("f")
        assert run.status == "failed", text
        assert run.reason == f"step {run.last_step + 1} not recorded: database or disk is full"
        assert [m.step for m in store.metrics(run.id)] == list(range(1, run.last_step + 1))
    assert not (tmpfs / "mdb-checkpoints" / "f" / ".mdb-reserve").exists()


def test_disk_full_simulated_at_the_write_calls(tmp_path, capfd, monkeypatch):
    """ENOSPC where no tmpfs can be mounted: step 4's write fails, and so does the final status
    until the reserved bytes are given back — as on a full disk."""
    from hooks.store.store import RunWriter

    real_log, real_finish = RunWriter.log_step, RunWriter.finish
    reserve_dropped = {}

    def log_step(self, metrics, **kw):
        if metrics.step == 4:
            raise sqlite3.OperationalError("database or disk is full")
        real_log(self, metrics, **kw)

    def finish(self, status, **kw):
        reserve = tmp_path / "mdb-checkpoints" / "sim" / ".mdb-reserve"
        if reserve.exists():
            raise sqlite3.OperationalError("database or disk is full")
        reserve_dropped["status"] = status
        real_finish(self, status, **kw)

    monkeypatch.setattr(RunWriter, "log_step", log_step)
    monkeypatch.setattr(RunWriter, "finish", finish)
    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY_TOML)
    db = tmp_path / "mdb.sqlite"
    rc = main(["overfit", "--headless", "--config", str(toml), "--steps", "10", "--db", str(db),
               "--run", "sim", "--every", "0", "--sample-every", "0", "--checkpoint-every", "2"])
    err = capfd.readouterr().err
    assert rc == 1 and "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("mdb: error:")]
    assert "writing step 4" in line and "holds steps up to 3, a resume starts from step 2" in line
    assert reserve_dropped == {"status": "failed"}
    with RunStore(db) as store:
        run = store.run("sim")
        assert (run.status, run.last_step, run.checkpoint_step, run.fail_step) == (
            "failed", 3, 2, None)
        assert run.reason == "step 4 not recorded: database or disk is full"
        assert [m.step for m in store.metrics(run.id)] == [1, 2, 3]


def test_checkpoint_failures_are_said_when_they_happen(tmp_path, capfd, monkeypatch):
    """The initial and periodic checkpoints used to fail silently (only the end line said it)."""
    import hooks.train.checkpoint as checkpoint

    real = checkpoint._write_checkpoint_files
    calls = []

    def flaky(tmp, model, optimizer, step, extra):
        calls.append(step)
        if step in (0, 2, 4):
            raise OSError(28, "No space left on device")
        real(tmp, model, optimizer, step, extra)

    monkeypatch.setattr(checkpoint, "_write_checkpoint_files", flaky)
    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY_TOML)
    db = tmp_path / "mdb.sqlite"
    rc = main(["overfit", "--headless", "--config", str(toml), "--steps", "6", "--db", str(db),
               "--run", "w", "--every", "1", "--sample-every", "0", "--checkpoint-every", "1"])
    err = capfd.readouterr().err.splitlines()
    assert rc == 0 and calls == [0, 1, 2, 3, 4, 5, 6]
    assert err == [
        "mdb: warning: checkpoint of step 0 failed: No space left on device; training goes on,"
        " the run cannot be resumed until one is written",
        "mdb: warning: checkpoint of step 1 written: checkpoints work again",
        "mdb: warning: checkpoint of step 2 failed: No space left on device; training goes on,"
        " a resume would start from step 1",
        "mdb: warning: checkpoint of step 3 written: checkpoints work again",
        "mdb: warning: checkpoint of step 4 failed: No space left on device; training goes on,"
        " a resume would start from step 3",
        "mdb: warning: checkpoint of step 5 written: checkpoints work again",
    ]
    with RunStore(db) as store:
        assert store.run("w").checkpoint_step == 6


# ---------------------------------------------------------------------------------------------
# --lr 5
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_lr_5_gradient_norms_are_finite_until_a_gradient_is_not(tmp_path):
    """`mdb overfit --lr 5` said "non-finite gradient at step 5: no non-finite gradient found":
    every gradient was finite but their fp32 norm overflowed, and the scan ran after
    zero_grad had cleared them. Now every step records its real norm and the run goes on until
    a gradient really holds Inf/NaN, and then names where. How large the norms grow (past
    fp32's overflow at 1.8e19 or not) depends on the CPU's floating-point path; the exact norm
    of huge finite gradients is pinned by tests/hooks/train/test_training.py
    (``test_total_norm_of_huge_finite_gradients_does_not_overflow``)."""
    db = tmp_path / "mdb.sqlite"
    log = tmp_path / "lr5.log"
    proc = _spawn(["overfit", "--headless", "--lr", "5", "--steps", "40", "--db", str(db),
                   "--run", "lr5", "--every", "0", "--sample-every", "0"], tmp_path, log)
    rc = proc.wait(timeout=600)
    text = log.read_text()
    assert "no non-finite gradient found" not in text and "Traceback" not in text
    with RunStore(db) as store:
        run = store.run("lr5")
        rows = store.metrics(run.id)
    norms = [metric_values(r)["grad_norm"] for r in rows]
    failed = run.status == "failed"
    before = norms[:-1] if failed else norms
    assert all(n is not None and math.isfinite(n) and n > 0 for n in before), norms
    assert max(before) > 1e3 * norms[0], norms  # lr 5 diverges: the case this test is about
    if failed:
        assert rc == 1 and run.fail_step == rows[-1].step and run.fail_module, text
        assert "non-finite" in text and f"step {run.fail_step}" in text, text
        assert run.fail_module in text, text
    else:
        assert rc == 0 and run.status == "finished" and len(rows) == 40, (run.status, text)
