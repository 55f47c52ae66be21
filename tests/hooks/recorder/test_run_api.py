"""``hooks.run``: any metric names, watch (hooks only on recorded steps), non-finite values,
signals and exceptions (real processes, real signals), a writer that cannot write, the bounded
queue, the sample of docs/own-loop.md, and ``mdb runs --json`` / ``mdb export`` /
``--run NAME@STEP``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import hooks
from hooks.store.store import RunStore, RunStoreError, checkpoint_dir
from tests.conftest import REPO, SAMPLES, terminal_signals
from tests.conftest import wait_for as _wait
from tui.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture
def db(tmp_path):
    return tmp_path / "runs" / "mdb.sqlite"


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _hook_count(model: nn.Module) -> int:
    """Forward, forward-pre and parameter post-accumulate hooks attached to ``model``'s
    submodules and parameters (the root module carries the NaN sentinel's two hooks on every
    watched step: :func:`_root_hooks`)."""
    n = 0
    for m in list(model.modules())[1:]:
        n += len(m._forward_hooks) + len(m._forward_pre_hooks)
    for p in model.parameters():
        n += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    return n


def _root_hooks(model: nn.Module) -> int:
    return len(model._forward_hooks) + len(model._forward_pre_hooks)


def _read(db: Path, name: str):
    with RunStore(db) as store:
        info = store.run(name)
        return info, store.metrics(info.id), store.metric_names(info.id), \
            store.internals_steps(info.id)


# -- any metric names -------------------------------------------------------------------------

def test_log_keeps_any_scalars_nan_and_inf_and_merges_a_step(db):
    import numpy as np

    loss = torch.tensor(2.5, dtype=torch.float32)
    with hooks.run("m", db=db, config={"lr": 0.1, "tag": Path("x")}, total_steps=4) as run:
        run.log(loss=loss, lr=0.1, acc=1)
        run.log(loss=torch.tensor([1.25]), val_loss=np.float32(0.5))
        run.log(loss=float("nan"), lr=float("inf"), acc=float("-inf"))
        run.log(val_loss=0.75, step=run.step)  # added to step 3
        run.log(loss=0.125, step=10)  # a gap: step 10
        assert run.step == 10
    info, rows, names, _ = _read(db, "m")
    assert (info.kind, info.status, info.last_step, info.total_steps) == ("api", "finished", 10, 4)
    assert info.config == {"lr": 0.1, "tag": "x"}
    assert names == ["loss", "lr", "acc", "val_loss"]
    assert [r.step for r in rows] == [1, 2, 3, 10]
    assert rows[0].values == {"loss": 2.5, "lr": 0.1, "acc": 1.0}
    assert rows[1].values == {"loss": 1.25, "val_loss": 0.5}
    v3 = rows[2].values
    assert v3["loss"] is None and v3["lr"] == math.inf and v3["acc"] == -math.inf  # NaN ≠ inf
    assert v3["val_loss"] == 0.75
    assert rows[3].values == {"loss": 0.125}
    assert rows[0].lr == 0.1 and rows[1].lr is None  # the fixed attributes follow the values
    assert info.last_loss == 0.125
    assert info.nonfinite == {"step": 3, "metric": "loss", "module": None, "direction": None}


def test_log_rejects_bad_values_with_one_line(db):
    with hooks.run("bad", db=db) as run:
        run.log(loss=1.0)
        with pytest.raises(TypeError, match=r"run.log\(loss=...\): expected a number"):
            run.log(loss="1.0")
        with pytest.raises(ValueError, match=r"expected a scalar, got a tensor of shape \(3,\)"):
            run.log(loss=torch.ones(3))
        with pytest.raises(TypeError, match="step=...\\): expected an integer"):
            run.log(loss=1.0, step=2.5)
        run.log(loss=0.5, step=5)
        with pytest.raises(ValueError, match="before the last step logged"):
            run.log(loss=0.5, step=4)
    with pytest.raises(RuntimeError, match="after finish"):
        run.log(loss=1.0)
    info, rows, _, _ = _read(db, "bad")
    assert [r.step for r in rows] == [1, 5] and info.status == "finished"


def test_names_default_and_taken_names_get_a_suffix(db, capsys):
    with hooks.run("same", db=db):
        pass
    with hooks.run("same", db=db) as second:
        pass
    assert second.name == "same-2"
    assert "a run named 'same' exists" in capsys.readouterr().err
    with hooks.run(db=db) as auto:
        pass
    assert auto.name.startswith("run-")
    with pytest.raises(RunStoreError, match="invalid run name"):
        hooks.run("a/b", db=db)
    with pytest.raises(TypeError, match="config must be a mapping"):
        hooks.run("c", db=db, config=[1, 2])


def test_exception_marks_failed_with_its_last_line_and_propagates(db):
    with pytest.raises(ValueError, match="boom"), hooks.run("exc", db=db) as run:
        run.log(loss=1.0)
        raise ValueError("boom\nsecond line")
    info, rows, _, _ = _read(db, "exc")
    assert (info.status, info.reason) == ("failed", "ValueError: boom")
    assert [r.step for r in rows] == [1]
    with hooks.run("exit0", db=db) as run:
        run.finish()  # explicit finish inside the block; the exit does not change it
        run.finish("failed")  # idempotent
    assert _read(db, "exit0")[0].status == "finished"
    with pytest.raises(ValueError, match="status must be"):
        run.finish("weird")


def test_exception_reason_is_the_last_line(db):
    with pytest.raises(RuntimeError), hooks.run("exc2", db=db):
        raise RuntimeError("shapes do not match")
    assert _read(db, "exc2")[0].reason == "RuntimeError: shapes do not match"


@pytest.mark.slow
def test_import_hooks_does_not_load_the_run_store():
    code = "import sys, hooks; print('hooks.recorder.run' in sys.modules, hooks.run.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=ENV, check=True).stdout.split()
    assert out == ["False", "hooks.recorder.run"]


# -- watch ------------------------------------------------------------------------------------

def test_watch_hooks_only_the_recorded_steps_and_stores_what_the_model_computed(db):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    hooked_during: list[int] = []
    reference: dict[int, tuple[float, float, float]] = {}
    with hooks.run("w", db=db) as run:
        run.watch(model, every=3)
        for step in range(1, 11):
            if _hook_count(model):
                hooked_during.append(step)
            # the NaN sentinel's two on every step; the capture's own on the recorded ones
            assert _root_hooks(model) == 2 if step % 3 else _root_hooks(model) > 2
            out = model(x)
            loss = nn.functional.mse_loss(out, y)
            loss.backward()
            # what the model computed at this step: the reference for the stored trace
            reference[step] = (out.mean().item(), out.std().item(),
                               model[0].weight.grad.norm().item())
            opt.step()
            opt.zero_grad()
            run.log(loss=loss)
        assert _hook_count(model) == 0  # step 11 is not recorded: nothing attached after log(10)
    assert hooked_during == [3, 6, 9] and _root_hooks(model) == 0  # all removed at the end
    info, _, _, steps = _read(db, "w")
    assert steps == [3, 6, 9]
    from hooks.train.trainer import load_trace

    with RunStore(db) as store:
        for step in steps:
            trace = load_trace(store, info.id, step)
            root = trace.call("")
            mean, std, gnorm = reference[step]
            assert trace.step == step and trace.meta["run"] == "w"
            assert root.outputs[0].stats.mean == pytest.approx(mean, rel=1e-5, abs=1e-7)
            assert root.outputs[0].stats.std == pytest.approx(std, rel=1e-4)
            assert trace.params["0.weight"].grad_norm == pytest.approx(gnorm, rel=1e-5)
            assert [r.module for r in trace.forward] == ["", "0", "1", "2"]
            assert trace.meta["loss"] == pytest.approx(
                store.metrics(info.id, step - 1, 1)[0].values["loss"])


def test_watch_every_1_and_summary_and_step_options(db, capsys):
    model = _mlp()
    x = torch.randn(8, 4)
    with hooks.run("w1", db=db) as run:
        run.watch(model, every=1)
        for _ in range(3):
            model(x).sum().backward()
            model.zero_grad()
            run.log(loss=1.0)
    assert _read(db, "w1")[3] == [1, 2, 3]
    assert main(["summary", "--run", "w1@2", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "Linear" in out and "loss = run.log(loss=…) = 1" in out
    assert main(["summary", "--run", "w1", "--db", str(db)]) == 0  # the latest capture
    capsys.readouterr()
    for argv, message in (
        (["summary", "--run", "w1@7", "--db", str(db)], "no stored capture at step 7 (captured "
                                                        "steps: 1, 2, 3)"),
        (["summary", "--run", "w1@x", "--db", str(db)], "STEP must be a step number"),
        (["summary", "--run", "nope@1", "--db", str(db)], "no run named 'nope'"),
        (["summary", "--run", "w1@1", "--preset", "tiny", "--db", str(db)], "cannot be combined"),
        (["summary", "--db", str(db)], "give --run too"),
        (["step", "--run", "w1@9", "--db", str(db)], "no stored capture at step 9"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


def test_watch_arguments(db):
    with hooks.run("wa", db=db) as run:
        with pytest.raises(TypeError, match="nn.Module"):
            run.watch(object())
        with pytest.raises(ValueError, match="every=0"):
            run.watch(_mlp(), every=0)


# -- non-finite values ------------------------------------------------------------------------

class _NaNGrad(torch.autograd.Function):
    """Identity forward; its backward turns the gradient into NaN (a broken custom op)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class _BadBackward(nn.Module):
    def forward(self, x):
        return _NaNGrad.apply(x)


def _poisoned_loop(db, name, *, every, poison_at, steps=12, watch=True):
    torch.manual_seed(0)
    model = _mlp()
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with hooks.run(name, db=db) as run:
        if watch:
            run.watch(model, every=every)
        for step in range(1, steps + 1):
            if step == poison_at:
                with torch.no_grad():
                    model[2].weight[0, 0] = float("nan")  # module "2" makes the first NaN
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            model.zero_grad()
            run.log(loss=loss, lr=0.1)
    return run


def test_nonfinite_step_not_captured_is_located_at_that_step(db, capsys):
    """The NaN weight is found by the forward of step 7 itself (not captured), while the
    weights are the ones it used: no extra capture is needed."""
    run = _poisoned_loop(db, "nan-next", every=5, poison_at=7)
    expected = {"step": 7, "metric": "loss", "module": "2", "direction": "parameter",
                "detail": "its weight holds 1 NaN of 8 values"}
    assert run.nonfinite == expected
    info, _, _, steps = _read(db, "nan-next")
    assert info.nonfinite == expected and info.status == "finished"
    assert steps == [5, 10]
    line = "non-finite loss at step 7, first in 2 (parameter): its weight holds 1 NaN of 8 values"
    assert info.nonfinite_line() == line
    assert main(["runs", "--json", "--db", str(db)]) == 0
    (rec,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rec["nonfinite"] == expected and rec["metrics"] == ["loss", "lr"]
    assert (rec["name"], rec["status"], rec["steps"], rec["captures"]) == ("nan-next", "finished",
                                                                          12, 2)
    assert main(["runs", "--db", str(db)]) == 0
    table = capsys.readouterr().out
    assert f"└ {line}" in table


def test_nonfinite_on_a_captured_step_and_without_watch(db):
    assert _poisoned_loop(db, "nan-here", every=5, poison_at=5).nonfinite == {
        "step": 5, "metric": "loss", "module": "2", "direction": "parameter",
        "detail": "its weight holds 1 NaN of 8 values"}
    assert _read(db, "nan-here")[3] == [5, 10]
    assert _poisoned_loop(db, "nan-blind", every=5, poison_at=7, watch=False).nonfinite == {
        "step": 7, "metric": "loss", "module": None, "direction": None}


def test_nonfinite_gradient_is_located_backward(db):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _BadBackward(), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    with hooks.run("nan-bwd", db=db) as run:
        run.watch(model, every=1)
        for _ in range(3):
            loss = model(x).pow(2).mean()
            loss.backward()
            gn = nn.utils.get_total_norm([p.grad for p in model.parameters()])
            model.zero_grad()
            run.log(loss=loss, grad_norm=gn)
    # forward all finite; the first NaN gradient autograd produced is that of module 0's
    # output (what _BadBackward passes back to it)
    assert run.nonfinite == {"step": 1, "metric": "grad_norm", "module": "0",
                             "direction": "backward", "detail": "the gradient of its output "
                             "(Linear, call 0) holds 128 NaN of 128 values"}
    assert _read(db, "nan-bwd")[0].nonfinite == run.nonfinite


# -- the writer cannot write ------------------------------------------------------------------

def test_queue_is_bounded_and_nothing_is_lost_when_the_writer_is_slow(db, monkeypatch):
    from hooks.store.store import RunWriter

    original = RunWriter.log_steps

    def slow(self, steps):
        time.sleep(0.05)
        return original(self, steps)

    monkeypatch.setattr(RunWriter, "log_steps", slow)
    monkeypatch.setattr(hooks.Run, "MAX_PENDING", 20)
    most = 0
    with hooks.run("slow", db=db) as run:
        for i in range(300):
            run.log(loss=float(i))
            most = max(most, len(run._queue))
    assert most <= 20
    _, rows, _, _ = _read(db, "slow")
    assert [r.values["loss"] for r in rows] == [float(i) for i in range(300)]


_LOCKER = """
import sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.read()
c.execute("ROLLBACK")
"""


def test_a_locked_database_stops_recording_once_said_and_the_run_is_marked(db, monkeypatch,
                                                                          capfd):
    import hooks.store.schema as schema_module

    monkeypatch.setattr(schema_module, "BUSY_TIMEOUT_MS", 200)
    run = hooks.run("locked", db=db)
    for _ in range(3):
        run.log(loss=1.0)
    _wait(lambda: _read(db, "locked")[0].last_step == 3, what="3 steps committed")
    locker = subprocess.Popen([sys.executable, "-c", _LOCKER, str(db)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        def a_step_said() -> bool:  # the loop goes on (a step per look) while the writer fails
            run.log(loss=2.0)
            return run.error is not None

        _wait(a_step_said, what="the writer to say it cannot write")
        for _ in range(5):
            run.log(loss=3.0)
    finally:
        locker.stdin.close()
        locker.wait(60)
    run.finish()
    err = capfd.readouterr().err
    assert err.count("recording of run locked stopped after step 3") == 1, err
    assert "database is locked" in err
    info, rows, _, _ = _read(db, "locked")
    assert [r.step for r in rows] == [1, 2, 3]  # what was committed stays
    assert info.status == "failed" and "stopped after step 3" in info.reason
    assert f"the loop went on to step {run.step}" in info.reason


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


def test_disk_full_keeps_the_committed_steps_and_marks_the_run(tmp_path, capfd):
    mnt = tmp_path / "full"
    if not _mount_tmpfs(mnt, "600k"):
        pytest.skip("needs root and tmpfs mounts (a small tmpfs stands for a full disk)")
    try:
        db = mnt / "mdb.sqlite"
        run = hooks.run("full", db=db)
        metrics = {f"m{i:03d}": float(i) for i in range(100)}
        n = 0
        while run.error is None:
            run.log(**metrics)
            n += 1
            assert n < 10**6, "the disk never filled"
        run.log(**metrics)  # the loop goes on
        run.finish()
        err = capfd.readouterr().err
        assert err.count("database or disk is full") == 1
        with RunStore(db) as store:
            info = store.run("full")
            rows = store.metrics(info.id)
        assert rows and [r.step for r in rows] == list(range(1, len(rows) + 1))
        assert all(r.values == metrics for r in rows)
        assert info.status == "failed" and "database or disk is full" in info.reason
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- signals (real processes) -------------------------------------------------------------------

_CHILD = """
import os, signal, sys, time
import hooks

mode, db = sys.argv[1], sys.argv[2]
calls = []
def mine(signum, frame):
    calls.append(signum)
if mode == "user-handler":
    signal.signal(signal.SIGTERM, mine)
if mode == "ignored-hup":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
stop = db + ".stop"
with hooks.run("sig", db=db) as run:
    for i in range(10**6):
        run.log(loss=1.0 / (i + 1))
        print("step", run.step, flush=True)
        if calls or os.path.exists(stop):
            break
        time.sleep(0.005)
print("mine called", len(calls), "restored", signal.getsignal(signal.SIGTERM) is mine,
      flush=True)
"""


def _child(tmp_path: Path, mode: str):
    db = tmp_path / f"{mode}.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, mode, str(db)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=terminal_signals)
    _wait(lambda: db.exists() and _last_step(db) >= 3, what=f"{mode}: 3 steps")
    return proc, db


def _last_step(db: Path) -> int:
    try:
        with RunStore(db) as store:
            return store.run("sig").last_step
    except (RunStoreError, sqlite3.Error):
        return 0


def _finish(proc, db: Path):
    out, err = proc.communicate(timeout=120)
    printed = [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]
    info, rows, _, _ = _read(db, "sig")
    # every step the loop logged (and printed) before the signal is in the database
    assert [r.step for r in rows] == list(range(1, info.last_step + 1))
    assert info.last_step >= max(printed), (out, err)
    return proc.returncode, out, err, info


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_default_terminating_signal_saves_the_run_then_terminates(tmp_path, sig):
    proc, db = _child(tmp_path, "plain")
    proc.send_signal(getattr(signal, sig))
    rc, out, _, info = _finish(proc, db)
    assert rc == -getattr(signal, sig)  # terminated by the signal, as without mdb
    assert (info.status, info.reason) == ("interrupted", sig)
    assert "mine called" not in out  # nothing after the with block ran


@pytest.mark.slow
def test_sigint_raises_keyboardinterrupt_and_marks_interrupted(tmp_path):
    proc, db = _child(tmp_path, "plain")
    proc.send_signal(signal.SIGINT)
    rc, _, err, info = _finish(proc, db)
    assert rc in (-signal.SIGINT, 130, 1) and "KeyboardInterrupt" in err
    assert (info.status, info.reason) == ("interrupted", "SIGINT")


@pytest.mark.slow
def test_two_sigints_50ms_apart_still_save_the_run(tmp_path):
    proc, db = _child(tmp_path, "plain")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    rc, _, _, info = _finish(proc, db)
    assert rc != 0
    assert (info.status, info.reason) == ("interrupted", "SIGINT")


@pytest.mark.slow
def test_the_users_own_handler_is_called_and_restored(tmp_path):
    proc, db = _child(tmp_path, "user-handler")
    proc.send_signal(signal.SIGTERM)
    rc, out, err, info = _finish(proc, db)
    assert rc == 0, err
    assert "mine called 1 restored True" in out
    assert (info.status, info.reason) == ("interrupted", "SIGTERM")


@pytest.mark.slow
def test_an_ignored_sighup_stays_ignored(tmp_path):
    proc, db = _child(tmp_path, "ignored-hup")
    proc.send_signal(signal.SIGHUP)
    seen = _last_step(db)
    _wait(lambda: _last_step(db) >= seen + 3, what="steps after SIGHUP")
    Path(str(db) + ".stop").touch()
    rc, _, err, info = _finish(proc, db)
    assert rc == 0, err
    assert info.status == "finished"


# -- mdb export, mdb watch's c, the sample ----------------------------------------------------

def test_export_csv_and_jsonl(db, capsys):
    with hooks.run("ex", db=db) as run:
        run.log(loss=1.5, lr=0.1)
        run.log(loss=float("nan"), acc=float("inf"))
        run.log(loss=float("-inf"), lr=1e-300)
    assert main(["export", "ex", "--db", str(db)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines() == ["step,loss,lr,acc", "1,1.5,0.1,", "2,nan,,inf",
                                 "3,-inf,1e-300,"]
    parsed = list(csv.DictReader(io.StringIO(text)))
    assert float(parsed[1]["acc"]) == math.inf and math.isnan(float(parsed[1]["loss"]))
    assert main(["export", "ex", "--format", "jsonl", "--db", str(db)]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0] == {"step": 1, "loss": 1.5, "lr": 0.1}
    assert math.isnan(lines[1]["loss"]) and lines[1]["acc"] == math.inf and "lr" not in lines[1]
    for argv, message in ((["export", "nope", "--db", str(db)], "no run named 'nope'"),
                          (["export", "ex", "--db", str(db.parent / "none.sqlite")],
                           "no run database at")):
        assert main(argv) == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_export_into_a_closed_pipe_is_quiet(db):
    with hooks.run("pipe", db=db) as run:
        for i in range(20000):
            run.log(loss=float(i))
    p = subprocess.run(f"{sys.executable} -m tui.cli export pipe --db {db} | head -3",
                       shell=True, capture_output=True, text=True, env=ENV, cwd=REPO)
    assert p.stdout.splitlines() == ["step,loss", "1,0.0", "2,1.0"]
    assert p.stderr == ""


async def test_watch_c_opens_the_stored_capture_of_an_api_run(db):
    from tests.conftest import wait_until
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app
    from tui.screens.step import StepScreen

    model = _mlp()
    x = torch.randn(8, 4)
    with hooks.run("apiw", db=db) as run:
        run.watch(model, every=2)
        for _ in range(5):
            model(x).sum().backward()
            model.zero_grad()
            run.log(loss=0.5)
    store, info = open_run(str(db), "apiw")
    app = make_watch_app(store, info)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.polls >= 1)
        await pilot.press("c")
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen), timeout=30)
        assert app.screen.trace.step == 4
        assert [r.module for r in app.screen.trace.forward] == ["", "0", "1", "2"]
        assert str(app.screen.query_one("#title").render()).startswith("step 4 · run apiw")
        await pilot.press("q")
        await wait_until(pilot, lambda: app.screen is app.live)
        await pilot.press("q")


@pytest.mark.slow
def test_the_readme_sample_runs_and_reads_back(tmp_path, capsys):
    db = tmp_path / "mdb.sqlite"
    p = subprocess.run([sys.executable, str(SAMPLES / "own_loop.py"), "--db", str(db),
                        "--steps", "120"], capture_output=True, text=True, env=ENV, timeout=900)
    assert p.returncode == 0, p.stderr
    last_loss = float(p.stdout.split("last loss")[1])
    assert main(["runs", "--json", "--db", str(db)]) == 0
    (rec,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert (rec["name"], rec["status"], rec["steps"], rec["kind"]) == ("own-loop", "finished",
                                                                      120, "api")
    assert rec["metrics"] == ["loss", "lr", "grad_norm", "val_loss", "val_acc"]
    assert rec["captures"] == 2 and rec["last_capture"] == 100 and rec["nonfinite"] is None
    assert main(["export", "own-loop", "--db", str(db)]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [int(r["step"]) for r in table] == list(range(1, 121))
    assert [int(r["step"]) for r in table if r["val_loss"]] == [50, 100]
    assert float(table[-1]["loss"]) == pytest.approx(last_loss, abs=5e-4)
    assert float(table[0]["loss"]) > float(table[-1]["loss"])  # it learns
    assert 0.0 <= float(table[99]["val_acc"]) <= 1.0
    assert main(["summary", "--run", "own-loop@100", "--db", str(db)]) == 0
    assert "MultiheadAttention" in capsys.readouterr().out


def test_the_own_loop_guide_shows_the_sample_complete():
    """The example of docs/own-loop.md ("your own training loop") is samples/own_loop.py,
    verbatim: the whole file but its docstring, from its imports on, so that it runs as
    printed."""
    guide = (REPO / "docs" / "own-loop.md").read_text(encoding="utf-8")
    block = guide.split("```python\n", 1)[1].split("\n```", 1)[0]
    sample = (SAMPLES / "own_loop.py").read_text(encoding="utf-8")
    assert block.strip() == sample.split('"""\n', 1)[1].strip()
    assert block.startswith("import ") and "\nclass TinyGPT(nn.Module):\n" in block
    compile(block, "docs/own-loop.md", "exec")  # a whole module: no indented start, no class gone


def test_nested_runs_chain_their_handlers_and_a_finished_one_passes_signals_on(db,
                                                                             terminal_sigint):
    outer = hooks.run("outer", db=db)
    inner = hooks.run("inner", db=db)
    assert signal.getsignal(signal.SIGINT) == inner._on_signal
    outer.finish()  # first: the handler in place is the inner run's, so it stays
    assert signal.getsignal(signal.SIGINT) == inner._on_signal
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # inner → outer (finished: passes on) → Python's
        _wait(lambda: False, 60, "the KeyboardInterrupt")  # raised between two looks
    inner.finish("interrupted", reason="SIGINT")
    assert signal.getsignal(signal.SIGINT) == outer._on_signal  # the handler before inner's
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        _wait(lambda: False, 60, "the KeyboardInterrupt")
    assert _read(db, "outer")[0].status == "finished"
    assert (_read(db, "inner")[0].status, _read(db, "inner")[0].reason) == ("interrupted",
                                                                           "SIGINT")


def test_a_disk_with_no_room_left_still_gets_the_run_marked_failed(tmp_path, capfd):
    """The disk is filled to the last byte once the run exists: the first commit fails, and
    marking the run as failed needs the bytes hooks.run set aside (hooks.store.reserve)."""
    mnt = tmp_path / "full"
    if not _mount_tmpfs(mnt, "600k"):
        pytest.skip("needs root and tmpfs mounts (a small tmpfs stands for a full disk)")
    try:
        db = mnt / "mdb.sqlite"
        run = hooks.run("nofree", db=db)
        reserve = checkpoint_dir(db, "nofree") / ".mdb-reserve"
        assert reserve.stat().st_size > 0  # set aside while the run is written
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # every byte left
            with contextlib.suppress(OSError):
                while os.write(fd, b"\1" * 4096):
                    pass
            with contextlib.suppress(OSError):
                while os.write(fd, b"\1"):
                    pass
        finally:
            os.close(fd)
        metrics = {f"m{i:03d}": float(i) for i in range(100)}
        while run.error is None:
            run.log(**metrics)
        run.finish()
        # SQLite says "database or disk is full", or "attempt to write a readonly database"
        # when it is the shared-memory file that cannot grow: either way the writer stopped
        err = capfd.readouterr().err
        assert "recording of run nofree stopped" in err
        assert not reserve.exists()  # given back
        (mnt / "filler").unlink()
        with RunStore(db) as store:
            info = store.run("nofree")
        assert info.status == "failed" and "recording of run nofree stopped" in info.reason
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
