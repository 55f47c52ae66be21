"""``hooks.capture`` of sharded models (FSDP2 ``fully_shard``, tensor parallel): statistics of
the full tensors, reduced across the mesh (hooks.sharded.stats).

One real job (2 ranks, ``torchrun``, gloo, CPU, loopback) runs every scenario of
``tests/dtensor_worker.py``; the reference is computed here with plain torch on the unsharded
model (same seed) and the whole global batch.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hooks.sharded.stats import MeshStats, is_dtensor
from hooks.tensors.stats import HIST_SAMPLE
from tests import dtensor_worker as worker
from tests.conftest import terminal_signals

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = ("fsdp", "fsdp_keep", "tp", "fsdp_nan", "fsdp_uneven", "fsdp_mp", "tp_sp",
             "tp_partial", "fsdp_replicas", "fsdp_probes", "fsdp_infer", "tp_wide",
             "local_dtensor")
RTOL = 1e-5


def _torchrun(out: Path, nproc: int, scenarios: str, timeout: float = 300) -> Path:
    """Run the worker's ``scenarios`` under torchrun; a job still running after ``timeout``
    seconds (a hang: mismatched collectives) is killed with its ranks and fails the test."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), str(REPO / "tests" / "dtensor_worker.py"), "--out", str(out),
         "--scenario", scenarios],
        cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=terminal_signals)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank (its own session)
        log, _ = proc.communicate()
        pytest.fail(f"the job hung: still running after {timeout} s\n{log[-3000:]}")
    assert proc.returncode == 0, log[-6000:]
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    return _torchrun(tmp_path_factory.mktemp("dtensor"), 2, ",".join(SCENARIOS))


def _read(job: Path, scenario: str, rank: int) -> dict:
    return json.loads((job / f"{scenario}.rank{rank}.json").read_text(encoding="utf-8"))


def _reference(build=worker.build, batch=worker.batch
               ) -> tuple[dict[str, dict[str, float]], list[tuple[str, torch.Tensor]]]:
    """Plain torch, one process: per parameter (grad norm, weight norm, grad abs-max) and every
    module call's output, on the whole global batch."""
    model = build()
    outs: list[tuple[str, torch.Tensor]] = []
    names = {m: n for n, m in model.named_modules()}
    hooks_ = [m.register_forward_hook(lambda m, a, o: outs.append((names[m], o.detach())))
              for m in model.modules()]
    hooks_ += [m.register_forward_pre_hook(
        lambda m, a: outs.append((names[m] + " <in>", a[0].detach()))) for m in model.modules()]
    x, y = batch()
    F.mse_loss(model(x), y).backward()
    for h in hooks_:
        h.remove()
    params = {n: {"grad_norm": float(p.grad.norm()), "weight_norm": float(p.detach().norm()),
                  "grad_abs_max": float(p.grad.abs().max()), "shape": list(p.shape)}
              for n, p in model.named_parameters()}
    return params, outs


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["fsdp", "fsdp_keep", "tp"])
def test_parameters_are_those_of_the_unsharded_model_on_the_global_batch(job, scenario):
    ref, _ = _reference()
    got = _read(job, scenario, 0)
    assert got == _read(job, scenario, 1)  # every rank holds the same full-tensor numbers
    assert list(got["params"]) == list(ref)
    for name, r in ref.items():
        p = got["params"][name]
        assert p["shape"] == r["shape"] and p["status"] == "ok", (name, p)
        for key in ("grad_norm", "weight_norm", "grad_abs_max"):
            assert _close(p[key], r[key]), (scenario, name, key, p[key], r[key])


def _check_activations(got: dict, scenario: str, outs=None) -> None:
    """Every module call's first input and its output against the reference's."""
    if outs is None:
        _, outs = _reference()
    fwd = {(f["module"], f["call"]): f for f in got["forward"]}
    seen: dict[str, int] = {}
    for name, t in outs:
        call = seen.get(name, 0)
        seen[name] = call + 1
        module, _, what = name.partition(" <")
        rec = fwd[(module, call)]
        st = (rec["inputs"] if what else rec["outputs"])[0]["stats"]
        t64 = t.double()
        assert st["numel"] == t.numel() and st["nan_count"] == 0, (scenario, name)
        for key, want in (("mean", t64.mean()), ("std", t64.std()), ("min", t64.min()),
                          ("max", t64.max()), ("l2", t64.norm()),
                          ("abs_max", t64.abs().max())):
            assert _close(st[key], float(want)), (scenario, name, key, st[key], float(want))
        if t.numel() > HIST_SAMPLE:  # each rank's piece is histogrammed on a sample
            assert 0 < sum(st["hist"]) == st["hist_count"] < t.numel(), name
            assert st["hist_min"] == st["min"] and st["hist_max"] == st["max"], name
            continue
        # every value binned once over the full tensor's range (torch.histc's bins; a value
        # on a bin edge may fall on either side after float rounding)
        want = torch.histc(t.float(), bins=len(st["hist"]), min=float(t.min()),
                           max=float(t.max())).tolist()
        assert st["hist_count"] == t.numel() == sum(st["hist"])
        assert sum(abs(a - b) for a, b in zip(st["hist"], want, strict=True)) <= 2, name
    assert {m for m, _ in fwd} <= {n.partition(" <")[0] for n in seen}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["fsdp", "fsdp_keep", "tp"])
def test_activation_statistics_are_those_of_the_global_batch(job, scenario):
    _check_activations(_read(job, scenario, 0), scenario)


def _check_replicas(got: dict) -> None:
    """:class:`tests.dtensor_worker.ReplicaNet`'s larger plain tensors (their pieces compared
    whole, not by their histogram samples alone): ``same`` counted once, ``off`` (rank 1's
    piece differs outside the sample) counted as both distinct pieces, ``later`` (written in
    place before the capture ended) not recorded, with a note saying why."""
    base, off1 = worker.replica_pieces(1)
    fwd = _by_call(got)
    for module, want in (("same", base.double()), ("off", torch.cat([base, off1]).double())):
        for side in ("inputs", "outputs"):
            st = fwd[(module, 0)][side][0]["stats"]
            assert st["numel"] == want.numel(), (module, side, st["numel"])
            for key, ref in (("mean", want.mean()), ("std", want.std()), ("min", want.min()),
                             ("max", want.max()), ("l2", want.norm())):
                assert _close(st[key], float(ref)), (module, side, key, st[key], float(ref))
    later = fwd[("later", 0)]
    assert later["inputs"][0]["stats"] is None and later["outputs"][0]["stats"] is None
    assert any("written in place (or its storage freed) before the capture ended" in n["message"]
               for n in got["notes"]), got["notes"]


@pytest.mark.slow
def test_larger_replicas_are_told_from_pieces_that_differ_outside_their_samples(job):
    got = _read(job, "fsdp_replicas", 0)
    assert got == _read(job, "fsdp_replicas", 1)
    _check_replicas(got)
    ref, _ = _reference()
    _check_params(got, ref)


@pytest.mark.slow
def test_pieces_a_position_weighted_checksum_confuses_are_counted_on_each_rank(job):
    """Each pair of :func:`tests.dtensor_worker.probe_pieces` differs between the ranks: both
    pieces count (a checksum weighted by position alone took each pair for one replica, and
    the fp32 sample of int64 ids past 2**24 for the ids). ``pos``, an FSDP2 parameter shown to
    a module (the same unsharded tensor on both ranks, its storage freed after the step), is
    one replica; and the step after the capture runs (the capture left that storage
    resizable)."""
    got = _read(job, "fsdp_probes", 0)
    assert got == _read(job, "fsdp_probes", 1)
    fwd = _by_call(got)
    for name in ("onehot", "eye", "tokens", "ids"):
        pieces = torch.cat([worker.probe_pieces(r)[name].reshape(-1) for r in (0, 1)]).double()
        st = fwd[(f"probes.{name}", 0)]["outputs"][0]["stats"]
        assert st["numel"] == pieces.numel(), (name, st["numel"])
        assert _close(st["mean"], float(pieces.mean())), name
        assert _close(st["l2"], float(pieces.norm())), name
    pos = torch.linspace(-1.0, 1.0, 64 * 32).double()
    st = fwd[("probes.pos", 0)]["outputs"][0]["stats"]
    assert st["numel"] == pos.numel() and _close(st["l2"], float(pos.norm())), st


@pytest.mark.slow
def test_under_inference_mode_larger_pieces_are_compared_whole_at_their_hooks(job):
    """Inference tensors count no versions, so none is held for the exit: each is checksummed
    whole at its hook, ``later`` too (written in place after it, counted as it was then)."""
    got = _read(job, "fsdp_infer", 0)
    assert got == _read(job, "fsdp_infer", 1)
    base, off1 = worker.replica_pieces(1)
    fwd = _by_call(got)
    for module, want in (("same", base), ("off", torch.cat([base, off1])), ("later", base)):
        st = fwd[(module, 0)]["outputs"][0]["stats"]
        want = want.double()
        assert st is not None and st["numel"] == want.numel(), (module, st)
        assert _close(st["mean"], float(want.mean())) and _close(st["l2"], float(want.norm()))


@pytest.mark.slow
def test_wider_tensor_parallel_activations_are_those_of_the_unsharded_model(job):
    """Activations larger than a histogram sample: the column-wise output (a shard on each
    rank, both counted), the row-wise output (a replica after its all-reduce, still in its
    collective when the hook sees it: counted once), their gradients and parameters."""
    ref, outs = _reference(build=worker.build_wide)
    got = _read(job, "tp_wide", 0)
    assert got == _read(job, "tp_wide", 1)
    assert max(math.prod(f["outputs"][0]["shape"]) for f in got["forward"]) > 1024
    _check_params(got, ref)
    _check_activations(got, "tp_wide", outs)


@pytest.mark.slow
def test_dtensors_of_a_model_without_dtensor_parameters_are_each_ranks_piece(job):
    """A module of one's own returns a DTensor in a model whose parameters are plain: the
    capture reduces nothing across the mesh (no hook error, no lost step), summarises this
    rank's local piece and says so."""
    torch.manual_seed(0)
    ref = worker.DTOutNet()
    x, _ = worker.batch()
    for rank in (0, 1):
        got = _read(job, "local_dtensor", rank)
        assert not [n for n in got["notes"] if n["kind"] == "hook_error"], got["notes"]
        assert any("local piece only" in n["message"] for n in got["notes"]), got["notes"]
        fwd = _by_call(got)
        for name in ("small", "big"):
            piece = (getattr(ref, name)(x) * (rank + 1)).detach().double()
            st = fwd[(f"to_{name}", 0)]["outputs"][0]["stats"]
            assert st["numel"] == piece.numel(), (rank, name, st["numel"])
            for key, want in (("mean", piece.mean()), ("l2", piece.norm()),
                              ("max", piece.max())):
                assert _close(st[key], float(want)), (rank, name, key, st[key], float(want))


@pytest.mark.slow
def test_a_2d_mesh_of_fsdp2_and_tensor_parallel_on_4_ranks(tmp_path):
    """dp × tp = 2 × 2: the column-parallel weights are _StridedShard × Shard, the layers'
    inputs DTensors of the tp sub-mesh, every rank's pair its own rows; all four ranks hold
    the numbers of the unsharded model on the global batch. With
    :class:`tests.dtensor_worker.ReplicaNet` (``fsdp_tp_replicas``): larger plain tensors
    compared whole along each mesh dimension."""
    out = _torchrun(tmp_path, 4, "fsdp_tp,fsdp_tp_replicas,fsdp_tp_lost")
    rep = [_read(out, "fsdp_tp_replicas", r) for r in range(4)]
    assert all(g == rep[0] for g in rep[1:])
    _check_replicas(rep[0])
    # a tensor whose pieces could not be compared along one dimension (dp row 0: written in
    # place) is not recorded on any rank, also on dp row 1, whose own pair was comparable
    lost = [_by_call(_read(out, "fsdp_tp_lost", r))[("t", 0)] for r in range(4)]
    assert all(c["outputs"][0]["stats"] is None for c in lost), lost
    got = [_read(out, "fsdp_tp", r) for r in range(4)]
    assert all(g == got[0] for g in got[1:])
    ref, _ = _reference()
    for name, r in ref.items():
        p = got[0]["params"][name]
        assert p["shape"] == r["shape"] and p["status"] == "ok", (name, p)
        for key in ("grad_norm", "weight_norm", "grad_abs_max"):
            assert _close(p[key], r[key]), (name, key, p[key], r[key])
    _check_activations(got[0], "fsdp_tp")


@pytest.mark.slow
def test_a_nan_in_one_ranks_shard_names_the_parameter_and_the_rank(job):
    got = _read(job, "fsdp_nan", 0)
    assert got == _read(job, "fsdp_nan", 1)
    w = got["params"]["blocks.1.w2.weight"]
    assert w["weight_norm"] == "nan" and w["shape"] == [16, 8][::-1]
    others = [n for n, p in got["params"].items() if p["weight_norm"] == "nan"]
    assert others == ["blocks.1.w2.weight"]
    lines = [n["message"] for n in got["notes"] if n["kind"] == "nonfinite_shard"]
    assert lines[0] == ("blocks.1.w2.weight: its weight holds 1 NaN of 128 values, "
                        "in rank 1's shard"), lines
    assert got["notes"][0]["module"] == "blocks.1.w2" or any(
        n["module"] == "blocks.1.w2" for n in got["notes"])


@pytest.mark.slow
def test_a_call_one_rank_alone_made_is_its_own_and_the_rest_stays_global(job):
    """Rank 1 calls blocks.0.act once more (on three 0.5s): matched by module and call, the
    other tensors are still those of the global batch; that call is rank 1's alone."""
    _, outs = _reference()
    r0, r1 = _read(job, "fsdp_uneven", 0), _read(job, "fsdp_uneven", 1)
    assert r0["params"] == r1["params"] == _read(job, "fsdp", 0)["params"]
    extra = [f for f in r1["forward"] if (f["module"], f["call"]) == ("blocks.0.act", 1)]
    assert not [f for f in r0["forward"] if (f["module"], f["call"]) == ("blocks.0.act", 1)]
    st = extra[0]["outputs"][0]["stats"]
    assert st["numel"] == 3 and _close(st["mean"], math.tanh(0.5)) and st["std"] == 0.0
    common = {(f["module"], f["call"]): f for f in r0["forward"]}
    for f in r1["forward"]:
        if (f["module"], f["call"]) in common:
            assert f["outputs"] == common[(f["module"], f["call"])]["outputs"]
    want = dict(outs)["head"].double()
    head = common[("head", 0)]["outputs"][0]["stats"]
    assert _close(head["mean"], float(want.mean())) and head["numel"] == want.numel()
    assert any(n["kind"] == "sharded" for n in r0["notes"])


@pytest.mark.slow
def test_mixed_precision_weights_are_the_fp32_shards_and_activations_bfloat16(job):
    """MixedPrecisionPolicy(param_dtype=bfloat16): the weights are the fp32 sharded ones
    (exact), the forward runs in bfloat16: activations recorded as bfloat16 and near the
    reference model's cast to bfloat16 (bfloat16 has 8 bits of mantissa)."""
    ref, _ = _reference()
    got = _read(job, "fsdp_mp", 0)
    assert got == _read(job, "fsdp_mp", 1)
    for name, r in ref.items():
        p = got["params"][name]
        assert p["shape"] == r["shape"] and _close(p["weight_norm"], r["weight_norm"])
        assert math.isclose(p["grad_norm"], r["grad_norm"], rel_tol=3e-2), name
    model = worker.build().to(torch.bfloat16)
    x, _ = worker.batch()
    want = model(x.to(torch.bfloat16)).detach().double()
    head = [f for f in got["forward"] if f["module"] == "head"][0]["outputs"][0]
    assert head["stats"]["numel"] == want.numel()
    for key, w in (("mean", want.mean()), ("std", want.std()), ("l2", want.norm())):
        assert math.isclose(head["stats"][key], float(w), rel_tol=3e-2, abs_tol=1e-2), key


@pytest.mark.slow
def test_sequence_parallel_pieces_are_reduced_like_the_others(job):
    """torchtitan's plan on a sequence model: the embedding's output and the norm sharded along
    the sequence (``SequenceParallel``, DTensor ``Shard(1)`` activations), the MLP
    column/row parallel; every call and parameter equals the unsharded model's."""
    ref, outs = _reference(worker.build_seq, worker.seq_batch)
    got = _read(job, "tp_sp", 0)
    assert got == _read(job, "tp_sp", 1)
    for name, r in ref.items():
        p = got["params"][name]
        assert p["shape"] == r["shape"], name
        for key in ("grad_norm", "weight_norm", "grad_abs_max"):
            assert _close(p[key], r[key]), (name, key, p[key], r[key])
    _check_activations(got, "tp_sp", outs)


def _by_call(got: dict) -> dict[tuple[str, int], dict]:
    return {(f["module"], f["call"]): f for f in got["forward"]}


def _check_params(got: dict, ref: dict, skip: tuple[str, ...] = ()) -> None:
    for name, r in ref.items():
        p = got["params"][name]
        assert p["shape"] == r["shape"] and p["status"] == "ok", (name, p)
        assert _close(p["weight_norm"], r["weight_norm"]), name
        if not name.startswith(skip):
            for key in ("grad_norm", "grad_abs_max"):
                assert _close(p[key], r[key]), (name, key, p[key], r[key])


@pytest.mark.slow
def test_partial_dtensors_met_in_different_orders_are_those_of_the_unsharded_model(job):
    """Two ``Partial`` DTensors (each rank a share of ``1·h`` and ``2·h``), met by rank 0 in
    the order a, b and by rank 1 in b, a: each is summed with the same tensor's pieces (its
    mean is h's, and twice h's), and every call equals the unsharded model's. (Reduced when
    met, rank 0's ``a`` was summed with rank 1's ``b``.)"""
    ref, outs = _reference(worker.build_part, worker.batch)
    r0, r1 = _read(job, "tp_partial", 0), _read(job, "tp_partial", 1)
    assert [f["module"] for f in r0["forward"]][2:4] == ["split_a", "split_b"]
    assert [f["module"] for f in r1["forward"]][2:4] == ["split_b", "split_a"]
    h = dict(outs)["embed"].double()
    for got in (r0, r1):
        calls = _by_call(got)
        for name, scale in (("split_a", 1.0), ("split_b", 2.0)):
            st = calls[(name, 0)]["outputs"][0]["stats"]
            assert st["numel"] == h.numel() and _close(st["mean"], scale * float(h.mean()))
            assert _close(st["l2"], scale * float(h.norm())), (name, st)
        _check_activations(got, "tp_partial", outs)
        # the embedding's gradient is each rank's share (Split's backward); the rest is exact
        _check_params(got, ref, skip=("embed.",))
        assert not [n for n in got["notes"] if "partial" in n["message"]]


@pytest.mark.slow
def test_a_partial_dtensor_one_rank_alone_met_is_not_recorded_and_the_job_finishes(tmp_path):
    """Rank 0 alone calls ``split_a`` once more: that Partial DTensor has no counterpart on
    rank 1, so its statistics are not recorded (a note says why) instead of a collective
    that hangs the job or sums different tensors; everything else is the unsharded model's."""
    out = _torchrun(tmp_path, 2, "tp_partial_uneven", timeout=90)
    ref, outs = _reference(worker.build_part, worker.batch)
    r0, r1 = _read(out, "tp_partial_uneven", 0), _read(out, "tp_partial_uneven", 1)
    extra = _by_call(r0)[("split_a", 1)]
    assert extra["outputs"][0]["stats"] is None and ("split_a", 1) not in _by_call(r1)
    notes = [n["message"] for n in r0["notes"] if "partial-sum" in n["message"]]
    assert len(notes) == 1 and "the ranks met different partial-sum tensors" in notes[0]
    assert "split_a#1/out" in notes[0]
    row = 3 * dict(outs)["embed"][:1].double()  # its input, rank 0's own (plain) tensor
    st = extra["inputs"][0]["stats"]
    assert st["numel"] == row.numel() and _close(st["mean"], float(row.mean()))
    for got in (r0, r1):
        _check_activations(got, "tp_partial_uneven", outs)
        _check_params(got, ref, skip=("embed.",))


@pytest.mark.slow
def test_a_2d_job_whose_ranks_meet_meshes_in_different_orders(tmp_path):
    """dp × tp on 4 ranks, and two more meshes met during the forward, by even ranks in one
    order and by odd ranks in the other (the input rows as a DTensor of an (a, b) mesh,
    ``Shard(0)`` × ``Replicate()``; a constant replicated over the 1-D world mesh): every
    mesh is reduced in the same order on every rank, and the numbers are the unsharded
    model's on the global batch. (In each rank's own order the ranks waited on each other's
    collectives until gloo's timeout.)"""
    out = _torchrun(tmp_path, 4, "fsdp_tp_order", timeout=90)
    got = [_read(out, "fsdp_tp_order", r) for r in range(4)]
    assert [f["module"] for f in got[0]["forward"]][1:3] == ["views.rows", "views.const"]
    assert [f["module"] for f in got[1]["forward"]][1:3] == ["views.const", "views.rows"]
    ref, outs = _reference()
    x, _ = worker.batch()
    for g in got:
        assert _by_call(g) == _by_call(got[0]) and g["params"] == got[0]["params"]
    _check_params(got[0], ref)
    calls = _by_call(got[0])
    for name, t in (("views.rows", x.double()), ("views.const", worker.OrderNet.CONST.double())):
        st = calls[(name, 0)]["outputs"][0]["stats"]
        assert st["numel"] == t.numel(), (name, st)
        for key, want in (("mean", t.mean()), ("std", t.std()), ("min", t.min()),
                          ("max", t.max()), ("l2", t.norm())):
            assert _close(st[key], float(want)), (name, key, st[key], float(want))
    rest = {**got[0], "forward": [f for f in got[0]["forward"]
                                  if not f["module"].startswith("views")]}
    _check_activations(rest, "fsdp_tp_order", outs)


@pytest.mark.slow
def test_a_mesh_one_rank_alone_met_is_not_reduced_and_the_job_finishes(tmp_path):
    """Rank 0 alone wraps a constant as a DTensor of a mesh no parameter lives on: the ranks'
    meshes differ (told by the main mesh's probe), so that DTensor is not recorded (a note)
    instead of collectives only rank 0 runs; the rest equals the unsharded model's. (Before:
    rank 0 waited on its own mesh's collectives until gloo's timeout.)"""
    out = _torchrun(tmp_path, 2, "tp_mesh_uneven", timeout=90)
    ref, outs = _reference()
    r0, r1 = _read(out, "tp_mesh_uneven", 0), _read(out, "tp_mesh_uneven", 1)
    const = _by_call(r0)[("views.const", 0)]
    assert const["outputs"][0]["stats"] is None and ("views.const", 0) not in _by_call(r1)
    notes = [n["message"] for n in r0["notes"] if "device mesh" in n["message"]]
    assert notes == ["1 tensor(s) not recorded: they are DTensors of a device mesh that not "
                     "every rank met during the capture"], r0["notes"]
    assert const["inputs"][0]["stats"]["mean"] == 2.5  # its input, a plain tensor: recorded
    for got in (r0, r1):
        _check_params(got, ref)
        rest = {**got, "forward": [f for f in got["forward"]
                                   if not f["module"].startswith("views")]}
        _check_activations(rest, "tp_mesh_uneven", outs)


def test_a_pieces_sums_keep_fp64_precision_where_its_mean_dwarfs_its_spread():
    """A rank's piece is summed in fp32 like one process's capture, and again in fp64 where
    ``|mean| >> std`` makes fp32 sums useless: 1000 + N(0, 1e-3) keeps fp64 sums (its std
    from them, ``(Σx² − (Σx)²/n) / (n − 1)``, to ~1e-2: the formula's own cancellation)."""
    from hooks.sharded.stats import _moments

    g = torch.Generator().manual_seed(3)
    x = 1000 + 1e-3 * torch.randn(50_000, generator=g)
    head, sums, _ = _moments(x)
    xd = x.double()
    assert head[0] == head[3] == x.numel() and -head[5] == float(x.min())
    assert math.isclose(sums[0], float(xd.sum()), rel_tol=1e-12)
    assert math.isclose(sums[1], float(torch.dot(xd, xd)), rel_tol=1e-12)
    n, s, ss = x.numel(), sums[0], sums[1]
    std = math.sqrt((ss - s * s / n) / (n - 1))
    assert math.isclose(std, float(xd.std()), rel_tol=1e-2), (std, float(xd.std()))
    y = torch.randn(50_000, generator=g)  # well conditioned: fp32 sums
    _, sums, _ = _moments(y)
    yd = y.double()
    assert math.isclose(sums[1], float(torch.dot(yd, yd)), rel_tol=1e-5)
    assert abs(sums[0] - float(yd.sum())) <= 1e-5 * float(yd.abs().sum())


def test_zeros_are_counted_where_the_piece_is_small_or_its_sample_holds_one():
    from hooks.sharded.stats import _moments

    g = torch.Generator().manual_seed(4)
    big = torch.randn(100_000, generator=g)  # no zero: not counted, said so (sums[3])
    assert _moments(big)[1][2:] == [100_000.0, 1.0]
    big[::7] = 0.0  # zeros the sample meets: counted exactly
    assert _moments(big)[1][2:] == [float(torch.count_nonzero(big)), 0.0]
    small = torch.tensor([0.0, 1.0, -2.0, 0.0])
    assert _moments(small)[1][2:] == [2.0, 0.0]


def test_without_a_process_group_nothing_is_sharded():
    model = worker.build()
    assert MeshStats.for_model(model) is None
    assert not any(is_dtensor(p) for p in model.parameters())
