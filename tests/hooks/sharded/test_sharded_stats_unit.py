"""The sharded statistics (hooks.sharded.stats.MeshStats) in one process: a gloo process group
of world size 1 (a FileStore in a temporary folder) and a 1-rank CPU ``DeviceMesh``, so the
reduction runs its real collectives in the quick lane. Every statistic is checked against
plain torch on the full tensor: ``torch.std`` (Bessel's correction, as
:class:`hooks.tensors.stats.TensorStats` documents), ``mean``, ``aminmax``, ``norm``, over the
finite elements. A wrong variance divisor was caught only by the 2-rank job of the slow lane."""

from __future__ import annotations

import math

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

from hooks.sharded.stats import MeshStats  # noqa: E402

REL = 1e-6  # fp64 sums of fp32 values, 30–500 elements


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _reference(x: torch.Tensor) -> dict:
    f = x[torch.isfinite(x)].double()
    return {"numel": x.numel(), "mean": float(f.mean()), "std": float(f.std(correction=1)),
            "min": float(f.min()), "max": float(f.max()), "l2": float(f.norm()),
            "nan_count": int(x.isnan().sum()), "inf_count": int(x.isinf().sum())}


def _check(st, x: torch.Tensor) -> None:
    ref = _reference(x)
    assert st.numel == ref["numel"]
    assert (st.nan_count, st.inf_count) == (ref["nan_count"], ref["inf_count"])
    assert (st.min, st.max) == (ref["min"], ref["max"])
    for k in ("mean", "std", "l2"):
        assert math.isclose(getattr(st, k), ref[k], rel_tol=REL), (k, getattr(st, k), ref[k])


def test_the_statistics_of_sharded_replicated_and_plain_tensors_are_the_full_tensor_s(mesh):
    g = torch.Generator().manual_seed(7)
    shard = 0.5 + 2.0 * torch.randn(6, 5, generator=g)
    rep = torch.randn(4, 8, generator=g) - 3.0
    plain = torch.randn(3, 7, generator=g)
    wide = torch.randn(500, generator=g)  # n − 1 vs n: 1e-3 apart in std, well above REL
    ms = MeshStats(mesh)
    slots = [ms.add(distribute_tensor(shard, mesh, [Shard(0)])),
             ms.add(distribute_tensor(rep, mesh, [Replicate()])),
             ms.add(plain), ms.add(wide)]
    out = ms.finalize()
    for slot, x in zip(slots, (shard, rep, plain, wide), strict=True):
        _check(out[slot - slots[0]], x)


def test_non_finite_elements_are_counted_and_left_out_of_the_moments(mesh):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(40, generator=g)
    x[3], x[17], x[30] = float("nan"), float("inf"), float("-inf")
    ms = MeshStats(mesh)
    ms.add(distribute_tensor(x, mesh, [Shard(0)]))
    (st,) = ms.finalize()
    _check(st, x)
    assert ms.nonfinite_ranks == [[0]]


def test_two_elements_and_one(mesh):
    ms = MeshStats(mesh)
    ms.add(torch.tensor([1.0, 4.0]))
    ms.add(torch.tensor([2.5]))
    two, one = ms.finalize()
    assert two.mean == 2.5 and math.isclose(two.std, math.sqrt(4.5), rel_tol=REL)
    assert one.mean == 2.5 and one.std == 0.0  # one element: 0.0, as TensorStats says
