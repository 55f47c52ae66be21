"""Sharded and data-parallel jobs recorded by ``hooks.run``: FSDP2 (``fully_shard``), HSDP, and
the cross-rank checks at captured steps and at the job's last step.

Real jobs: 2 ranks started by ``torchrun`` (gloo, CPU, loopback): ``tests/fsdp_worker.py`` and
``tests/ddp_worker.py``, whose ranks also write what they logged to files of their own. The
reference numbers are computed here with plain torch on the unsharded model.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hooks.sharded.checksums import NOT_COMPARED
from hooks.store.store import RunStore, RunStoreError
from tests import dtensor_worker as worker
from tests.conftest import wait_for

REPO = Path(__file__).resolve().parents[3]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("MDB_DB", None)
    return env


@contextlib.contextmanager
def _job(tmp_path: Path, script: str, *args: str):
    """``torchrun --standalone --nproc-per-node 2 tests/SCRIPT ARGS`` in a process group of
    its own, killed (SIGKILL to the group) when the block ends."""
    log = tmp_path / f"{script}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(REPO / "tests" / script), *args],
            cwd=tmp_path, env=_env(), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
    proc.log = log  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)


def _run_job(tmp_path: Path, script: str, *args: str) -> None:
    with _job(tmp_path, script, *args) as proc:
        rc = proc.wait(600)
    assert rc == 0, proc.log.read_text(errors="replace")[-3000:]


def _reference_step(step: int) -> dict[str, dict[str, float]]:
    """One process, the whole global batch: SGD (lr 0.1) as the worker; at ``step``, each
    parameter's gradient norm and abs-max, and its weight norm before that step's update."""
    model = worker.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(1, step + 1):
        x, y = worker.batch(s)
        F.mse_loss(model(x), y).backward()
        if s == step:
            return {n: {"grad_norm": float(p.grad.norm()), "grad_abs_max":
                        float(p.grad.abs().max()), "weight_norm": float(p.detach().norm()),
                        "shape": list(p.shape)} for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    raise AssertionError("unreachable")


@pytest.mark.slow
def test_an_fsdp_job_is_one_run_whose_captures_hold_full_tensor_statistics(tmp_path):
    db = tmp_path / "m.sqlite"
    _run_job(tmp_path, "fsdp_worker.py", "--db", str(db), "--name", "fsdp", "--out",
             str(tmp_path), "--steps", "10", "--every", "5", "--watch-every", "5")
    ref = _reference_step(5)
    with RunStore(db) as store:
        (run,) = store.runs()
        assert (run.name, run.status, run.world_size, run.last_step) == ("fsdp", "finished", 2,
                                                                           10)
        assert store.internals_steps(run.id) == [5, 10]
        cap0 = store.internals(run.id, 5)
        cap1 = store.rank_internals(run.id, 5, 1)
        assert cap0["params"] == cap1["params"]  # every rank holds the full-tensor numbers
        params = {p["name"]: p for p in cap0["params"]}
        assert list(params) == list(ref)
        for name, r in ref.items():
            p = params[name]
            assert p["shape"] == r["shape"] and p["status"] == "ok"
            for key in ("grad_norm", "grad_abs_max", "weight_norm"):
                assert math.isclose(p[key], r[key], rel_tol=1e-5), (name, key, p[key], r[key])
        assert store.findings(run.id) == []
        records = store.checks(run.id)
        checks = {(c["step"], c["kind"]) for c in records}
        assert {(5, "params"), (5, "grads"), (10, "params")} <= checks
        # FSDP2 over 2 ranks, no replicas: each rank holds its own shard of every parameter,
        # so no tensor is compared (not "16 compared, all equal")
        for c in records:
            assert (c["ranks"], c["compared"], c["differing"]) == (2, 0, 0), c
            assert c["note"] == NOT_COMPARED and "FSDP2" in c["note"], c


@pytest.mark.slow
def test_a_nan_in_one_ranks_shard_names_the_parameter_and_the_rank(tmp_path):
    db = tmp_path / "m.sqlite"
    _run_job(tmp_path, "fsdp_worker.py", "--db", str(db), "--name", "nan", "--out",
             str(tmp_path), "--steps", "10", "--scenario", "nan")
    with RunStore(db) as store:
        run = store.run("nan")
    nf = run.nonfinite
    assert {k: nf.get(k) for k in ("step", "metric", "module", "direction", "rank")} == {
        "step": 7, "metric": "loss", "module": "blocks.1.w2", "direction": "parameter",
        "rank": 1}, nf
    assert nf["detail"] == ("its weight holds 1 NaN of 64 values in rank 1's shard (of the "
                            "full [8, 16])")


@pytest.mark.slow
def test_a_nan_in_one_ranks_shard_at_a_captured_step_names_the_parameter_and_the_rank(tmp_path):
    """The same NaN, with every step captured: rank 0's capture sees only the NaN output of
    blocks.1.w2 (the all-gathered weight holds it on every rank); its ``nonfinite_shard`` note
    names rank 1's shard, so the finding is the parameter's, on rank 1, as without a capture
    (it was ``blocks.1.w2 (forward)`` on rank 0)."""
    from hooks.nonfinite.origin import trace_origin
    from hooks.train.trainer import load_trace

    db = tmp_path / "m.sqlite"
    _run_job(tmp_path, "fsdp_worker.py", "--db", str(db), "--name", "nan", "--out",
             str(tmp_path), "--steps", "10", "--scenario", "nan", "--watch-every", "1")
    with RunStore(db) as store:
        run = store.run("nan")
        assert 7 in store.internals_steps(run.id)  # the NaN step was captured
        trace = load_trace(store, run.id, 7)  # rank 0's capture: its own shard is finite
    nf = run.nonfinite
    assert {k: nf.get(k) for k in ("step", "metric", "module", "direction", "rank")} == {
        "step": 7, "metric": "loss", "module": "blocks.1.w2", "direction": "parameter",
        "rank": 1}, nf
    assert "its weight holds 1 NaN of 64 values in rank 1's shard" in nf["detail"], nf
    # rank 0's capture alone blames the same parameter and rank: 1 NaN of the full 8×16
    origin = trace_origin(trace)
    assert (origin.module, origin.direction, origin.rank) == ("blocks.1.w2", "parameter", 1)
    assert origin.detail.startswith("its weight holds 1 NaN of 128 values, in rank 1's shard "
                                    "(of the full [8, 16])"), origin.detail


@pytest.mark.slow
def test_an_hsdp_replica_that_drifts_is_named(tmp_path):
    db = tmp_path / "m.sqlite"
    _run_job(tmp_path, "fsdp_worker.py", "--db", str(db), "--name", "hsdp", "--out",
             str(tmp_path), "--steps", "10", "--scenario", "hsdp")
    with RunStore(db) as store:
        run = store.run("hsdp")
        found = [f for f in store.findings(run.id) if f.kind == "param_divergence"]
    assert [(f.subject, f.step, f.rank) for f in found] == [("blocks.0.w1.bias [shard 0]", 5, 1)]
    assert "a desync between replicas" in found[0].line
    # 2 replicas × 1 shard: both ranks hold the same (only) shard of every parameter, so
    # every parameter and every gradient is compared
    n_params = sum(1 for _ in worker.build().parameters())
    assert n_params == 16
    with RunStore(db) as store:
        records = store.checks(store.run("hsdp").id)
    assert records and {(c["ranks"], c["compared"], c["note"]) for c in records} == {
        (2, n_params, None)}


@pytest.mark.slow
def test_a_40_step_ddp_job_is_checked_at_captured_steps_and_at_its_last(tmp_path):
    """Gathered every 50 steps (more than the job has): rank 1's change after step 10 is named
    at the captured step 25, its change after step 30 at the job's last step, 40."""
    db = tmp_path / "m.sqlite"
    _run_job(tmp_path, "ddp_worker.py", "--db", str(db), "--name", "ddp", "--out",
             str(tmp_path), "--steps", "40", "--every", "50", "--watch-every", "25",
             "--scenario", "perturb,perturb_late")
    with RunStore(db) as store:
        run = store.run("ddp")
        found = [f for f in store.findings(run.id) if f.kind == "param_divergence"]
        checks = [(c["step"], c["kind"], c["differing"]) for c in store.checks(run.id)]
    assert [(f.subject, f.step, f.rank) for f in found] == [("2.bias", 25, 1), ("0.bias", 40, 1)]
    assert (25, "params", 1) in checks and (40, "params", 2) in checks


def _query(db: Path, fn):
    try:
        with RunStore(db) as store:
            return fn(store)
    except (RunStoreError, Exception):
        return None


@pytest.mark.slow
def test_an_fsdp_rank_killed_with_sigkill_is_named_and_nothing_recorded_is_lost(tmp_path):
    db = tmp_path / "m.sqlite"
    with _job(tmp_path, "fsdp_worker.py", "--db", str(db), "--name", "kill", "--out",
              str(tmp_path), "--steps", "100000", "--every", "5", "--watch-every", "1000",
              "--sleep", "0.02") as proc:
        def ten_steps() -> bool:
            assert proc.poll() is None, proc.log.read_text(errors="replace")[-3000:]
            return (_query(db, lambda s: len(s.rank_steps(s.run("kill").id, rank=1)))
                    or 0) >= 10

        wait_for(ten_steps, 300, "rank 1's 10th step")
        before = _query(db, lambda s: [(x.step, x.rank, x.values)
                                       for x in s.rank_steps(s.run("kill").id)])
        lines = (tmp_path / "rank1.jsonl").read_text().splitlines()
        pid1 = json.loads(lines[0])["pid"]
        os.kill(pid1, signal.SIGKILL)
        proc.wait(300)
    with RunStore(db) as store:
        run = store.run("kill")
        assert run.status == "failed"
        assert run.reason.startswith(f"rank 1 (pid {pid1} on {socket.gethostname()}) died"), \
            run.reason
        assert [(f.rank, f.detail["pid"]) for f in store.findings(run.id)
                if f.kind == "rank_dead"] == [(1, pid1)]
        have = {(x.step, x.rank): x.values for x in store.rank_steps(run.id)}
        assert all(have[(s, r)] == v for s, r, v in before)


def _overfit(tmp_path: Path, db: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tui.cli", "overfit", "--nproc", "2", *extra, "--headless",
         "--steps", "30", "--db", str(db), "--run", name, "--every", "15"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900,
        start_new_session=True)


@pytest.mark.slow
def test_mdb_overfit_fsdp_is_one_run_whose_losses_are_the_ddp_runs(tmp_path):
    db = tmp_path / "m.sqlite"
    fsdp = _overfit(tmp_path, db, "f", "--fsdp")
    assert fsdp.returncode == 0, fsdp.stdout[-2000:] + fsdp.stderr[-2000:]
    assert "FSDP2 job of 2 ranks" in fsdp.stdout
    assert "run f finished: step 30/30 on 2 ranks (rank 0 30, rank 1 30)" in fsdp.stdout
    ddp = _overfit(tmp_path, db, "d")
    assert ddp.returncode == 0, ddp.stdout[-2000:] + ddp.stderr[-2000:]
    with RunStore(db) as store:
        f, d = store.run("f"), store.run("d")
        assert (f.status, f.world_size, f.config["parallel"]) == ("finished", 2, "fsdp")
        assert len(store.runs()) == 2  # each job one run
        rows = {n: {(x.rank, x.step): x.values for x in store.rank_steps(r.id)}
                for n, r in (("f", f), ("d", d))}
        assert set(rows["f"]) == set(rows["d"]) == {(r, s) for r in (0, 1)
                                                    for s in range(1, 31)}
        for key, v in rows["d"].items():
            for metric in ("ce", "aux", "total", "grad_norm"):
                assert math.isclose(rows["f"][key][metric], v[metric], rel_tol=1e-5,
                                    abs_tol=1e-5), (key, metric)
        # different windows per rank, as the DDP run's
        assert rows["f"][(0, 1)]["ce"] != rows["f"][(1, 1)]["ce"]
        assert store.internals_steps(f.id) == [15, 30]
        cap = store.internals(f.id, 15)
        shapes = {p["name"]: p["shape"] for p in cap["params"]}
        assert shapes["model.layers.0.mlp.experts.0.up_proj.weight"] == [384, 128]  # unsharded
        assert cap["params"] == store.rank_internals(f.id, 15, 1)["params"]
        assert [x.kind for x in store.findings(f.id)] == []
        # FSDP2: every rank's shard of every parameter is its own, nothing compared; the DDP
        # run holds every parameter whole on both ranks and compares them all
        f_checks, d_checks = store.checks(f.id), store.checks(d.id)
        assert f_checks and all((c["compared"], c["note"]) == (
            0, NOT_COMPARED) for c in f_checks), f_checks
        assert d_checks and all((c["compared"], c["note"]) == (len(shapes), None)
                                for c in d_checks if c["kind"] == "params"), d_checks


@pytest.mark.slow
def test_mdb_overfit_tp_runs_the_global_batch_on_every_rank(tmp_path):
    """--tp: every rank runs the windows of all ranks, so at step 1 (the same weights) its ce
    is the mean of the DDP ranks' ce; the run is one run of two ranks with equal losses."""
    db = tmp_path / "m.sqlite"
    for name, extra in (("t", ["--tp"]), ("d", [])):
        proc = subprocess.run(
            [sys.executable, "-m", "tui.cli", "overfit", "--nproc", "2", *extra, "--headless",
             "--steps", "3", "--db", str(db), "--run", name, "--every", "3"],
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900,
            start_new_session=True)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with RunStore(db) as store:
        t, d = store.run("t"), store.run("d")
        assert (t.status, t.world_size, t.config["parallel"]) == ("finished", 2, "tp")
        rows = {n: {(x.rank, x.step): x.values for x in store.rank_steps(r.id)}
                for n, r in (("t", t), ("d", d))}
        assert rows["t"][(0, 1)]["ce"] == rows["t"][(1, 1)]["ce"]
        mean = (rows["d"][(0, 1)]["ce"] + rows["d"][(1, 1)]["ce"]) / 2
        assert math.isclose(rows["t"][(0, 1)]["ce"], mean, rel_tol=1e-5)
        cap = store.internals(t.id, 3)
        shapes = {p["name"]: p["shape"] for p in cap["params"]}
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == [128, 128]  # unsharded
        assert [x.kind for x in store.findings(t.id)] == []
        # only the replicated parameters (embeddings, norms, router, LM head; a row-wise
        # layer's bias) are held by both ranks under one name; each shard of a column- or
        # row-wise layer is one rank's: those are not compared
        kv_split = t.config["resolved_model_config"]["num_key_value_heads"] % 2 == 0
        split = {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} | (
            {"k_proj", "v_proj"} if kv_split else set())
        replicated = [n for n in shapes if n.split(".")[-2] not in split
                      or (n.endswith(".bias") and n.split(".")[-2] in ("o_proj", "down_proj"))]
        assert 0 < len(replicated) < len(shapes)
        records = store.checks(t.id)
        assert {(c["step"], c["kind"]) for c in records} == {(3, "params"), (3, "grads")}
        for c in records:
            assert (c["ranks"], c["compared"], c["note"]) == (2, len(replicated), None), c


@pytest.mark.parametrize("extra,needle", [
    (["--fsdp"], "--fsdp applies only with --nproc"),
    (["--tp"], "--tp applies only with --nproc"),
    (["--nproc", "2", "--fsdp", "--tp"], "--fsdp and --tp exclude each other"),
])
def test_bad_sharding_options_are_one_line(tmp_path, capsys, extra, needle):
    from tui.cli import main

    rc = main(["overfit", "--headless", "--db", str(tmp_path / "m.sqlite"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err
