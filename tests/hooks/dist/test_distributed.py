"""Distributed runs: a torchrun job recorded by ``hooks.run`` as one run (hooks.dist.distributed).

The job tests are real: 2 ranks started by ``torchrun`` (gloo, CPU, loopback), the DDP job of
``tests/ddp_worker.py`` whose ranks also write what they logged to files of their own — the
independent record the store is checked against. Every wait is a condition with a generous
timeout; every job runs in a process group of its own that the test kills at the end.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hooks.dist import distributed
from hooks.store.store import SCHEMA_VERSION, RunStore, RunStoreError
from hooks.train.ddp_overfit import rank_windows
from tests.checksum_reference import checksum as reference_checksum
from tests.conftest import wait_for
from tui.cli import main

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "tests" / "data"
WORKER = REPO / "tests" / "ddp_worker.py"

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# Pieces, no processes
# ---------------------------------------------------------------------------------------------


def _bits_sum(t: torch.Tensor) -> int:
    """Reference: what the checksum promises (tests/checksum_reference.py: the bits weighted by
    pseudo-random row and column weights, in Python integers)."""
    return reference_checksum(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_a_checksum_is_the_sum_of_the_bit_patterns_and_sees_one_ulp(dtype):
    t = (torch.randn(37, 5) * 100).to(dtype)
    assert int(distributed.tensor_checksum(t)) == _bits_sum(t)
    assert int(distributed.tensor_checksum(t.t())) == _bits_sum(t.t())  # not contiguous
    u = t.clone()
    u.view(-1)[17] = torch.nextafter(u.view(-1)[17], torch.tensor(math.inf, dtype=dtype)) \
        if dtype.is_floating_point else u.view(-1)[17] + 1
    assert distributed.checksums([("a", t), ("b", u), ("c", t.clone())]) == {
        "a": _bits_sum(t), "b": _bits_sum(u), "c": _bits_sum(t)}
    assert _bits_sum(t) != _bits_sum(u)


@pytest.mark.parametrize("shape", [(64, 48), (5, 3), (300,)])
def test_checksum_tells_a_reordering_of_the_same_values(shape):
    """A desync that only moves values (a shifted, flipped or transposed copy of a parameter on
    one rank) holds the same multiset of bits: a plain sum of bits could not see it."""
    torch.manual_seed(0)
    t = torch.randn(shape)
    k = min(shape)
    square = t[:k, :k] if t.dim() == 2 else t.view(10, 30)
    for a, b in ((t, t.flatten().roll(1).view(shape)), (t, t.flip(0)), (square, square.t())):
        assert sorted(a.flatten().tolist()) == sorted(b.flatten().tolist())
        assert int(distributed.tensor_checksum(b)) == _bits_sum(b)
        assert int(distributed.tensor_checksum(a)) == _bits_sum(a)
        assert _bits_sum(a) != _bits_sum(b)


def test_checksums_of_missing_bool_and_complex_tensors():
    b = torch.tensor([True, False, True])
    c = torch.tensor([1 + 2j, -3j], dtype=torch.complex64)
    got = distributed.checksums([("none", None), ("b", b), ("c", c)])
    assert got["none"] is None and got["b"] == _bits_sum(b.view(torch.uint8))  # as bytes
    assert got["c"] == _bits_sum(torch.view_as_real(c))


def test_compare_checksums_names_the_odd_ranks():
    by_rank = {0: {"w": 5, "b": 1}, 1: {"w": 5, "b": 2}, 2: {"w": 5, "b": 1}, 3: {"w": 6}}
    assert distributed.compare_checksums(by_rank) == [
        ("w", {0: 5, 1: 5, 2: 5, 3: 6}, [3]),
        ("b", {0: 1, 1: 2, 2: 1}, [1]),
    ]
    # a tie: the lowest rank's value is the reference
    assert distributed.compare_checksums({0: {"x": 1}, 1: {"x": 2}}) == [("x", {0: 1, 1: 2}, [1])]
    # a name on one rank only is not compared; a missing gradient (None) is a value
    assert distributed.compare_checksums({0: {"x": 1, "y": 3}, 1: {"x": 1}}) == []
    assert distributed.compare_checksums({0: {"g": None}, 1: {"g": 4}})[0][2] == [1]


def test_a_payload_round_trips_nan_inf_and_blobs():
    head = {"rows": [{"step": 3, "values": {"a": math.nan, "b": -math.inf, "c": 0.1}}]}
    data = distributed.encode_payload(head, [b"\x00\x01", b"", b"xyz"])
    got, blobs = distributed.decode_payload(data)
    v = got["rows"][0]["values"]
    assert math.isnan(v["a"]) and v["b"] == -math.inf and v["c"] == 0.1
    assert blobs == [b"\x00\x01", b"", b"xyz"]
    with pytest.raises(ValueError):
        distributed.decode_payload(b"nope" + data[4:])
    with pytest.raises(ValueError):
        distributed.decode_payload(data[:-1])


@pytest.mark.parametrize("world,batch", [(2, 1), (3, 2), (4, 1)])
def test_every_rank_trains_on_windows_of_its_own(world, batch):
    n, seq = 66, 33
    for step in (1, 2, 50):
        per_rank = [rank_windows(n, seq, batch, seed=0, step=step, rank=r, world=world)
                    for r in range(world)]
        flat = [s for w in per_rank for s in w]
        assert len(set(flat)) == len(flat)  # no two ranks (or rows) share a window
        assert all(0 <= s <= n - seq for s in flat)
        assert per_rank == [rank_windows(n, seq, batch, seed=0, step=step, rank=r, world=world)
                            for r in range(world)]  # seeded: the same on a rerun
    assert rank_windows(n, seq, 1, seed=0, step=1, rank=0, world=2) != \
        rank_windows(n, seq, 1, seed=0, step=2, rank=0, world=2) or \
        rank_windows(n, seq, 1, seed=0, step=3, rank=0, world=2) != \
        rank_windows(n, seq, 1, seed=0, step=1, rank=0, world=2)


def test_without_an_initialised_process_group_there_is_no_job():
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert distributed.job() is None


# ---------------------------------------------------------------------------------------------
# Schema 3
# ---------------------------------------------------------------------------------------------


def _sha(b: bytes) -> str:
    import hashlib

    return hashlib.sha256(b).hexdigest()


def test_a_schema_2_database_is_migrated_on_open_with_nothing_lost(tmp_path):
    """tests/data/runstore_v2.sqlite was written by mdb's schema-2 code (a hooks.run run with
    NaN/Inf scalars, a non-finite finding and captures; a hand-written overfit run with expert
    load, a sample and a checkpoint); runstore_v2.expected.json is what that code read."""
    import shutil

    db = tmp_path / "v2.sqlite"
    shutil.copyfile(DATA / "runstore_v2.sqlite", db)
    expected = json.loads((DATA / "runstore_v2.expected.json").read_text())
    with RunStore(db) as store:
        meta = dict(store.connection.execute("SELECT key, value FROM meta").fetchall())
        assert meta["schema_version"] == str(SCHEMA_VERSION) == "4"
        assert store.integrity_check() == "ok"
        runs = {r.name: r for r in store.runs()}
        assert sorted(runs) == sorted(expected)
        for name, exp in expected.items():
            run = runs[name]
            got = run.to_dict()
            assert {k: got[k] for k in exp["run"]} == exp["run"]
            assert got["world_size"] is None
            assert store.metric_names(run.id) == exp["metric_names"]
            assert [m.to_dict() for m in store.metrics(run.id)] == exp["metrics"]
            assert [[s.step, s.prompt, s.text] for s in store.samples(run.id)] == exp["samples"]
            assert store.internals_steps(run.id) == exp["internals_steps"]
            for st in exp["internals_steps"]:
                data = json.dumps(store.internals(run.id, st), sort_keys=True).encode()
                assert _sha(data) == exp["internals_sha256"][str(st)]
                assert _sha(store.internals_tensors(run.id, st) or b"") == \
                    exp["tensors_sha256"][str(st)]
            assert store.ranks(run.id) == [] and store.rank_steps(run.id) == []
            assert store.findings(run.id) == [] and store.checks(run.id) == []
    with RunStore(db, create=True) as store:  # and a distributed run can be added to it
        w = store.create_run("ddp", {}, kind="api")
        w.set_world_size(2)
        w.log_rank_steps(1, [{"step": 1, "wall": 1.0, "values": {"loss": 2.0}}])
        assert store.run("ddp").world_size == 2
        assert store.rank_steps(store.run("ddp").id)[0].values == {"loss": 2.0}


def test_a_database_of_a_newer_schema_is_refused_in_one_line(tmp_path, capsys):
    db = tmp_path / "newer.sqlite"
    RunStore(db, create=True).close()
    conn = sqlite3.connect(db)
    conn.execute("UPDATE meta SET value = '5' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(RunStoreError, match="newer mdb"):
        RunStore(db)
    capsys.readouterr()
    assert main(["runs", "--db", str(db)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "schema 5" in err[0] and "reads up to 4" in err[0], err


def test_rank_rows_findings_and_checks_round_trip(tmp_path):
    db = tmp_path / "r.sqlite"
    with RunStore(db, create=True) as store:
        w = store.create_run("d", {}, kind="api")
        w.set_world_size(2)
        w.set_ranks([{"rank": 0, "host": "h0", "pid": 10, "local_rank": 0, "state": "running"},
                     {"rank": 1, "host": "h1", "pid": 11, "local_rank": 1, "state": "running"}])
        w.log_rank_steps(1, [
            {"step": 1, "wall": 5.0, "values": {"loss": 1.5, "acc": math.nan}},
            {"step": 2, "wall": 6.0, "step_time": 1.0, "compute_time": 0.25,
             "expert_load": [[0.25, 0.75]], "values": {"loss": math.inf}},
        ], internals=[(2, {"meta": {"step": 2}}, b"T")])
        w.log_rank_steps(0, [{"step": 1, "wall": 5.1, "values": {"loss": 1.25}}])
        w.log_rank_steps(1, [{"step": 2, "wall": 6.5, "values": {"val": 3.0}}])  # merges
        w.set_ranks([{"rank": 1, "state": "dead", "reason": "gone"}])
        w.add_findings([{"kind": "rank_dead", "step": 2, "rank": 1, "subject": "rank 1",
                         "line": "rank 1 (pid 11 on h1) died", "detail": {"pid": 11}}])
        w.add_checks([{"step": 2, "kind": "params", "ranks": 2, "compared": 4,
                       "differing": 0}])
        rid = store.run("d").id
        rows = store.rank_steps(rid)
        assert [(r.step, r.rank) for r in rows] == [(1, 0), (1, 1), (2, 1)]
        assert rows[1].values == {"loss": 1.5, "acc": None}
        assert rows[2].values == {"loss": math.inf, "val": 3.0} and rows[2].wall == 6.5
        assert (rows[2].step_time, rows[2].compute_time, rows[2].expert_load) == \
            (1.0, 0.25, [[0.25, 0.75]])
        assert store.rank_steps(rid, after_step=1, rank=1) == [rows[2]]
        assert store.rank_internals_steps(rid) == [(2, 1)]
        assert store.rank_internals(rid, 2, 1) == {"meta": {"step": 2}}
        assert store.rank_internals_tensors(rid, 2, 1) == b"T"
        r1 = store.ranks(rid)[1]
        assert (r1.host, r1.pid, r1.state, r1.last_step, r1.reason) == ("h1", 11, "dead", 2,
                                                                          "gone")
        assert r1.describe() == "rank 1 (pid 11 on h1)"
        f = store.findings(rid)[0]
        assert (f.id, f.kind, f.rank, f.detail) == (1, "rank_dead", 1, {"pid": 11})
        assert store.checks(rid) == [{"step": 2, "kind": "params", "ranks": 2, "compared": 4,
                                      "differing": 0, "note": None}]
        # the run-level series stay rank 0's own log() calls: none were written here
        assert store.metrics(rid) == []
        with pytest.raises(ValueError):
            w.add_findings([{"kind": "nonsense", "subject": "x", "line": "y"}])
        with pytest.raises(ValueError):
            w.set_ranks([{"rank": 0, "state": "asleep"}])


# ---------------------------------------------------------------------------------------------
# Real jobs
# ---------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("MDB_DB", None)
    return env


@contextlib.contextmanager
def _job(tmp_path: Path, *worker_args: str, tag: str = "job"):
    """``torchrun --standalone --nproc-per-node 2 tests/ddp_worker.py ARGS`` in a process group
    of its own, killed (SIGKILL to the group) when the block ends."""
    log = tmp_path / f"{tag}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(WORKER), *worker_args],
            cwd=tmp_path, env=_env(), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
    proc.log = log  # type: ignore[attr-defined]
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)


def _wait_for(cond, timeout: float, what: str, proc=None) -> None:
    def ready() -> bool:
        if cond():
            return True
        if proc is not None and proc.poll() is not None and not cond():
            raise AssertionError(f"the job ended (exit {proc.returncode}) before {what}:\n"
                                 + proc.log.read_text(errors="replace")[-3000:])
        return False

    wait_for(ready, timeout, what)


def _reference(out: Path, rank: int) -> tuple[int, dict[int, dict[str, float]]]:
    """What rank ``rank`` logged, from its own file: (pid, {step: values})."""
    lines = [json.loads(x) for x in (out / f"rank{rank}.jsonl").read_text().splitlines() if x]
    pid = lines[0]["pid"]
    return pid, {d.pop("step"): d for d in lines[1:]}


def _same(a: float | None, b: float) -> bool:
    return (a is None and math.isnan(b)) or a == b


def _query(db: Path, fn):
    try:
        with RunStore(db) as store:
            return fn(store)
    except (RunStoreError, sqlite3.Error):
        return None


@pytest.mark.slow
def test_a_ddp_job_is_one_run_with_every_rank_every_step_once_and_desyncs_named(tmp_path,
                                                                                 capsys):
    db = tmp_path / "m.sqlite"
    with _job(tmp_path, "--db", str(db), "--name", "ddp", "--out", str(tmp_path),
              "--steps", "30", "--every", "5", "--watch-every", "10",
              "--scenario", "perturb,nosync,nan") as proc:
        rc = proc.wait(600)
    assert rc == 0, proc.log.read_text(errors="replace")[-3000:]
    with RunStore(db) as store:
        runs = store.runs()
        assert [r.name for r in runs] == ["ddp"]  # one run for the job
        run = runs[0]
        assert (run.status, run.world_size, run.last_step) == ("finished", 2, 30)
        ranks = store.ranks(run.id)
        assert [r.rank for r in ranks] == [0, 1]
        for r in ranks:
            pid, ref = _reference(tmp_path, r.rank)
            assert (r.pid, r.host, r.state, r.last_step) == (pid, socket.gethostname(),
                                                              "finished", 30)
            rows = store.rank_steps(run.id, rank=r.rank)
            assert [x.step for x in rows] == list(range(1, 31))  # each step once
            for x in rows:
                assert set(x.values) == set(ref[x.step])
                assert all(_same(x.values[k], v) for k, v in ref[x.step].items()), x
                assert x.step == 1 or x.step_time > 0
        # the run-level series is rank 0's own log()
        _, ref0 = _reference(tmp_path, 0)
        assert {m.step: m.values for m in store.metrics(run.id)} == ref0
        # rank 1's loss of step 28 was the first non-finite value
        assert run.nonfinite == {"step": 28, "metric": "loss", "module": None,
                                 "direction": None, "rank": 1}
        assert "on rank 1" in run.nonfinite_line()
        # parameter perturbed on rank 1 after step 10: named at the next check, step 15
        findings = store.findings(run.id)
        params = [f for f in findings if f.kind == "param_divergence"]
        grads = [f for f in findings if f.kind == "grad_not_reduced"]
        assert (params[0].subject, params[0].step, params[0].rank) == ("2.bias", 15, 1)
        assert "2.bias" in params[0].line and "rank 1" in params[0].line
        assert [f.subject for f in params if f.step == 15] == ["2.bias"]
        # the backward of step 20 under no_sync(): every gradient differs there, only there
        assert {f.subject for f in grads} == {"0.weight", "0.bias", "2.weight", "2.bias"}
        assert {f.step for f in grads} == {20}
        checks = {(c["step"], c["kind"]): c for c in store.checks(run.id)}
        assert checks[(10, "params")]["differing"] == 0 and checks[(10, "grads")]["ranks"] == 2
        assert checks[(15, "grads")]["differing"] == 0  # all-reduced again
        # captures of both ranks, tagged
        assert store.internals_steps(run.id) == [10, 20, 30]
        assert {(10, 1), (20, 1), (30, 1)} <= set(store.rank_internals_steps(run.id))
        cap = store.rank_internals(run.id, 10, 1)
        assert cap["meta"]["step"] == 10 and cap["forward"]
    capsys.readouterr()
    assert main(["runs", "--db", str(db), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["world_size"] == 2 and [r["rank"] for r in rec["ranks"]] == [0, 1]
    assert {f["subject"] for f in rec["findings"] if f["kind"] == "grad_not_reduced"} == \
        {"0.weight", "0.bias", "2.weight", "2.bias"}


@pytest.mark.slow
def test_a_rank_killed_with_sigkill_is_named_and_nothing_recorded_is_lost(tmp_path):
    db = tmp_path / "m.sqlite"
    with _job(tmp_path, "--db", str(db), "--name", "kill", "--out", str(tmp_path),
              "--steps", "100000", "--every", "5", "--sleep", "0.02") as proc:
        def rank1_steps():
            return _query(db, lambda s: len(s.rank_steps(s.run("kill").id, rank=1)))

        _wait_for(lambda: (rank1_steps() or 0) >= 30, 300, "rank 1's 30th step", proc)
        before = _query(db, lambda s: (s.rank_steps(s.run("kill").id),
                                       s.metrics(s.run("kill").id)))
        pid1, _ = _reference(tmp_path, 1)
        os.kill(pid1, signal.SIGKILL)
        rc = proc.wait(300)
    assert rc != 0
    host = socket.gethostname()
    with RunStore(db) as store:
        run = store.run("kill")
        assert run.status == "failed"
        assert run.reason.startswith(f"rank 1 (pid {pid1} on {host}) died (last step reported: "), \
            run.reason
        dead = [f for f in store.findings(run.id) if f.kind == "rank_dead"]
        assert [(f.rank, f.detail["pid"]) for f in dead] == [(1, pid1)]
        assert f"pid {pid1} on {host}" in dead[0].line
        r1 = store.ranks(run.id)[1]
        assert r1.state == "dead" and r1.pid == pid1
        # nothing already recorded is lost, and what is there is what each rank logged
        rows, metrics = store.rank_steps(run.id), store.metrics(run.id)
        have = {(x.step, x.rank): x.values for x in rows}
        for x in before[0]:
            assert have[(x.step, x.rank)] == x.values
        now = {m.step: m.values for m in metrics}
        assert all(now[m.step] == m.values for m in before[1])
        for rank in (0, 1):
            _, ref = _reference(tmp_path, rank)
            steps = sorted(s for s, r in have if r == rank)
            assert steps == list(range(1, len(steps) + 1))
            assert all(have[(s, rank)] == ref[s] for s in steps)
        assert [m.step for m in metrics] == list(range(1, len(metrics) + 1))
        assert store.integrity_check() == "ok"


@pytest.mark.slow
def test_a_rank_that_stops_reporting_is_named_with_its_host_and_pid(tmp_path):
    db = tmp_path / "m.sqlite"
    with _job(tmp_path, "--db", str(db), "--name", "hang", "--out", str(tmp_path),
              "--steps", "100000", "--every", "5", "--sleep", "0.02", "--stale", "3") as proc:
        _wait_for(lambda: (_query(db, lambda s: len(s.rank_steps(s.run("hang").id, rank=1)))
                           or 0) >= 10, 300, "rank 1's 10th step", proc)
        pid1, _ = _reference(tmp_path, 1)
        os.kill(pid1, signal.SIGSTOP)  # hung: alive, silent
        try:
            _wait_for(lambda: any(f.kind == "rank_silent" for f in
                                  _query(db, lambda s: s.findings(s.run("hang").id)) or []),
                      120, "rank 1 to be reported silent", proc)
            with RunStore(db) as store:
                run = store.run("hang")
                f = next(f for f in store.findings(run.id) if f.kind == "rank_silent")
                r1 = store.ranks(run.id)[1]
        finally:  # torchrun may be gone already: the stopped rank is ended by its pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid1, signal.SIGKILL)
    assert f.rank == 1 and f"rank 1 (pid {pid1} on {socket.gethostname()})" in f.line
    assert "stopped reporting" in f.line and "process still exists" in f.line
    assert r1.state == "silent"


@pytest.mark.slow
def test_the_first_non_finite_rank_is_named_with_its_module_from_its_capture(tmp_path):
    """Rank 1's first Linear gets a NaN weight after step 18: its step 19 is non-finite (rank
    0's only at step 20, once the all-reduced NaN gradient reached it); rank 1's own watch
    names the weight at that step, while it is still the one the forward used."""
    db = tmp_path / "m.sqlite"
    with _job(tmp_path, "--db", str(db), "--name", "nanw", "--out", str(tmp_path),
              "--steps", "24", "--every", "5", "--watch-every", "10",
              "--scenario", "nanweight") as proc:
        rc = proc.wait(600)
    assert rc == 0, proc.log.read_text(errors="replace")[-3000:]
    _, ref1 = _reference(tmp_path, 1)
    assert math.isnan(ref1[19]["loss"]) and not math.isnan(ref1[18]["loss"])
    with RunStore(db) as store:
        run = store.run("nanw")
    nf = run.nonfinite
    assert {k: nf.get(k) for k in ("step", "metric", "module", "direction", "rank")} == {
        "step": 19, "metric": "loss", "module": "0", "direction": "parameter", "rank": 1}, nf
    assert nf["detail"].startswith("its weight holds 1 NaN of ")
    assert "on rank 1" in run.nonfinite_line() and "0 (parameter)" in run.nonfinite_line()


@pytest.mark.slow
def test_mdb_overfit_nproc_2_headless_finishes_as_one_run_of_two_ranks(tmp_path):
    db = tmp_path / "m.sqlite"
    proc = subprocess.run(
        [sys.executable, "-m", "tui.cli", "overfit", "--nproc", "2", "--headless", "--steps",
         "50", "--db", str(db), "--run", "o2", "--every", "25", "--sample-every", "25"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900,
        start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "run o2 finished: step 50/50 on 2 ranks (rank 0 50, rank 1 50)" in proc.stdout
    with RunStore(db) as store:
        run = store.run("o2")
        assert (run.status, run.world_size, run.kind) == ("finished", 2, "overfit")
        assert run.config["nproc"] == 2 and run.config["seq_len"] == 33
        rows = store.rank_steps(run.id)
        by_rank = {r: [x for x in rows if x.rank == r] for r in (0, 1)}
        assert [x.step for x in by_rank[0]] == [x.step for x in by_rank[1]] == \
            list(range(1, 51))
        # different windows, the same weights (DDP): different losses, the same gradient norm
        assert by_rank[0][0].values["ce"] != by_rank[1][0].values["ce"]
        assert by_rank[0][0].values["grad_norm"] == by_rank[1][0].values["grad_norm"]
        loads = by_rank[1][0].expert_load
        assert loads and all(abs(sum(layer) - 1.0) < 1e-9 for layer in loads)
        assert store.samples(run.id) and store.internals_steps(run.id) == [25, 50]
        assert [f.kind for f in store.findings(run.id)] == []
        assert {c["kind"] for c in store.checks(run.id)} == {"params", "grads"}


@pytest.mark.parametrize("extra,needle", [
    (["--nproc", "1"], "--nproc must be 2 or more"),
    (["--nproc", "2", "--resume", "x"], "--resume does not apply with --nproc"),
    (["--nproc", "2", "--seq-len", "66"], "covers the whole text"),
])
def test_bad_nproc_options_are_one_line(tmp_path, capsys, extra, needle):
    rc = main(["overfit", "--headless", "--db", str(tmp_path / "m.sqlite"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err


@pytest.mark.slow
def test_the_readme_ddp_sample_is_one_run_of_two_ranks(tmp_path):
    db = tmp_path / "m.sqlite"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "samples" / "ddp_loop.py"), "--db", str(db), "--steps", "50"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900,
        start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "run ddp-loop: finished after 50 steps on 2 ranks" in proc.stdout
    with RunStore(db) as store:
        (run,) = store.runs()
        assert (run.status, run.world_size, run.last_step) == ("finished", 2, 50)
        rows = store.rank_steps(run.id)
        assert sorted((x.rank, x.step) for x in rows) == [(r, s) for r in (0, 1)
                                                           for s in range(1, 51)]
        assert all(x.compute_time is not None for x in rows if x.step > 1)
        assert store.findings(run.id) == []
        assert [(c["step"], c["kind"], c["differing"]) for c in store.checks(run.id)] == [
            (s, k, 0) for s in (25, 50) for k in ("grads", "params")]


def test_the_torchrun_guide_shows_the_ddp_sample_complete():
    guide = (REPO / "docs" / "torchrun.md").read_text(encoding="utf-8")
    block = guide.split("```python\n", 1)[1].split("\n```", 1)[0]
    sample = (REPO / "samples" / "ddp_loop.py").read_text(encoding="utf-8")
    assert block.strip() == sample.split('"""\n', 1)[1].strip()  # all but the docstring


def test_a_zombie_counts_as_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # once it exited, not reaped: a zombie, which os.kill(pid, 0) still finds
    wait_for(lambda: distributed.process_gone(child.pid), 60, "the child to exit")
    assert os.path.exists(f"/proc/{child.pid}")  # not reaped yet: it is the zombie
    assert not distributed.process_gone(os.getpid())
    child.wait()
    assert distributed.process_gone(child.pid)
