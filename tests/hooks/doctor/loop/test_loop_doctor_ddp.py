"""The loop doctor in a DDP job (2 ranks, gloo on CPU, started by ``torchrun``): the
accumulation check runs on every rank against every rank's micro-batches (DDP's ``.grad`` is
their mean), and each rank's findings reach the run, tagged with the rank that found them;
the same job fixed has no finding. The worker is tests/ddp_loop_doctor_worker.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hooks.store.store import RunStore

REPO = Path(__file__).resolve().parents[4]
WORKER = REPO / "tests" / "ddp_loop_doctor_worker.py"

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def _job(tmp_path: Path, *args: str, checks: int = 2) -> list:
    """The job's findings as stored; every rank ran the accumulation check ``checks`` times
    (its own line on stdout; 2: at both watched steps), so no finding is not a silent
    check."""
    db = tmp_path / "m.sqlite"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("MDB_DB", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(WORKER), "--db", str(db), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
        start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: accumulation checks {checks}" in proc.stdout, proc.stdout[-3000:]
    with RunStore(db) as store:
        (run,) = store.runs()
        assert (run.status, run.world_size) == ("finished", 2)
        return store.findings(run.id)


def test_ddp_summed_accumulation_and_a_rank_s_own_eval_bug_reach_the_run(tmp_path):
    found = _job(tmp_path, "--bug", "sum", "--eval-bug")
    by = {f.kind: f for f in found}
    assert sorted(by) == ["grad_accumulation", "train_eval"] and len(found) == 2
    acc = by["grad_accumulation"]
    assert (acc.step, acc.subject, acc.rank) == (2, "gradient scale", 0)
    assert acc.detail["factor"] == pytest.approx(4.0, rel=1e-3)  # 4 micro-batches, summed
    assert acc.detail["tokens"] == [2 * 2 * 11] * 4  # both ranks' scored tokens
    ev = by["train_eval"]
    assert (ev.step, ev.subject, ev.rank) == (2, "model.train()", 1)  # rank 1's alone


def test_ddp_averaged_accumulation_has_no_finding(tmp_path):
    assert _job(tmp_path, "--bug", "none") == []


def test_ddp_ranks_with_different_micro_batch_counts_skip_the_check_together(tmp_path):
    """Rank 1 accumulates 3 micro-batches at step 8, rank 0 four: after 3 checks (steps 2, 4,
    6) rank 0 would skip its usual count and rank 1 check its new one; neither checks step 8,
    and the job's DDP all-reduces after it pair up as they should (no rank ran a collective
    the other skipped)."""
    assert _job(tmp_path, "--bug", "none", "--uneven", checks=3) == []
