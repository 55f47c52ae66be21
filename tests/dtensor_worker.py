"""Sharded jobs for the tests of DTensor capture, started by ``torchrun`` (gloo, CPU).

Every rank builds the same small model (:func:`build`, seeded), shards it, runs one step under
``hooks.capture`` and rank ``R`` writes what the capture holds to ``<out>/<scenario>.rank<R>.json``.
The tests compute the reference themselves, with plain torch on the unsharded model and the
whole global batch (:func:`batch`).

Scenarios (``--scenario``): ``fsdp`` (``fully_shard`` per block and on the root, each rank
takes its own rows of the global batch), ``fsdp_keep`` (the same with
``reshard_after_forward=False``), ``tp`` (``ColwiseParallel`` ``w1``, ``RowwiseParallel``
``w2`` of each block; every rank runs the whole batch), ``fsdp_nan`` (``fsdp``; after a first
step rank 1 writes a NaN into its shard of ``blocks.1.w2.weight``, then the step is captured),
``fsdp_uneven`` (``fsdp``; rank 1 alone calls ``blocks.0.act`` once more, on three 0.5s),
``fsdp_mp`` (``fsdp`` with ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``), ``fsdp_tp`` (4 ranks, a 2-D mesh: ``tp`` within pairs of ranks,
``fully_shard`` across them, each pair on its own rows), ``tp_sp`` (:class:`SeqNet` with
sequence parallelism, :func:`_sequence_parallel`; every rank runs the whole batch),
``tp_partial`` (:class:`PartNet`: two ``Partial`` DTensors, met by the ranks in different
orders), ``tp_partial_uneven`` (the same; rank 0 alone meets one more), ``fsdp_tp_order``
(4 ranks, ``fsdp_tp`` with :class:`OrderNet`: two more meshes, met in different orders),
``tp_mesh_uneven`` (``tp`` with :class:`OrderNet`: rank 0 alone meets a DTensor of another
1-D mesh), ``fsdp_replicas`` and ``fsdp_tp_replicas`` (``fsdp`` and ``fsdp_tp`` with
:class:`ReplicaNet`), ``fsdp_probes`` (``fsdp`` with :class:`ProbeNet`, then one more step
uncaptured), ``fsdp_infer`` (``fsdp_replicas``, the capture's forward under
``torch.inference_mode``)
``fsdp_tp_lost`` (``fsdp_tp`` with :class:`LostNet`) and ``tp_wide`` (``tp`` with
:class:`WideNet`), ``local_dtensor`` (:class:`DTOutNet`: no DTensor parameters; every rank
runs the whole batch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROWS, D_IN, D, D_OUT = 4, 6, 8, 3

if __name__ == "__main__":  # run as a script: tests/ must not shadow the hooks package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]


class Block(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.w1 = nn.Linear(d, 2 * d)
        self.act = nn.Tanh()
        self.w2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(self.act(self.w1(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class WideNet(nn.Module):
    """:class:`Net` with one block of width ``WIDE``: its activations have more elements than
    a histogram sample (the row-wise output, replicated on every tp rank, among them)."""

    WIDE = 384

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, self.WIDE)
        self.blocks = nn.ModuleList([Block(self.WIDE)])
        self.head = nn.Linear(self.WIDE, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks[0](self.embed(x)))


def build_wide() -> WideNet:
    """The wide model every rank (and the reference) starts from."""
    torch.manual_seed(0)
    return WideNet()


class ToDT(nn.Module):
    """Returns this rank's ``h · (rank + 1)`` as a ``Shard(0)`` DTensor of ``mesh``."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(h * (dist.get_rank() + 1), self.mesh, [Shard(0)],
                                  run_check=False)


class DTOutNet(nn.Module):
    """No DTensor parameter: ``to_small`` and ``to_big`` (:class:`ToDT`) return DTensors of
    the outputs of ``small`` (D wide) and ``big`` (512 wide: more elements than a histogram
    sample), made whole again by ``full_tensor``."""

    def __init__(self, mesh=None) -> None:
        super().__init__()
        self.small, self.big = nn.Linear(D_IN, D), nn.Linear(D_IN, 512)
        self.to_small, self.to_big = ToDT(mesh), ToDT(mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.to_small(self.small(x)).full_tensor()
        b = self.to_big(self.big(x)).full_tensor()
        return (a[:, :D_OUT] + b[:, :D_OUT])[:x.shape[0]]


def build() -> Net:
    """The model every rank (and the tests' reference) starts from."""
    torch.manual_seed(0)
    return Net()


class SeqNet(nn.Module):
    """A model over sequences (B, T, D_IN) for sequence parallelism: embed, norm, MLP, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D)
        self.norm = nn.LayerNorm(D)
        self.w1 = nn.Linear(D, 2 * D)
        self.act = nn.Tanh()
        self.w2 = nn.Linear(2 * D, D)
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.w2(self.act(self.w1(self.norm(self.embed(x))))))


def build_seq() -> SeqNet:
    """The sequence model every rank (and the reference) starts from."""
    torch.manual_seed(0)
    return SeqNet()


def seq_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of the sequence model: (2, 4, D_IN) and (2, 4, D_OUT)."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(2, 4, D_IN, generator=g), torch.randn(2, 4, D_OUT, generator=g)


def _sequence_parallel(model: SeqNet, mesh) -> None:
    """torchtitan's plan: the embedding's output and the norm sharded along the sequence
    (``SequenceParallel``), the MLP column/row parallel, the head's output replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })


class Split(nn.Module):
    """``scale · x`` as a ``Partial`` DTensor of ``mesh`` once set: rank r holds
    ``scale · SHARES[r] · x`` (the shares sum to 1, so the full tensor is ``scale · x``);
    without a mesh ``scale · x`` itself (the reference)."""

    SHARES = (0.25, 0.75)

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale, self.mesh = scale, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mesh is None:
            return x * self.scale
        from torch.distributed.tensor import DTensor, Partial

        share = self.SHARES[self.mesh.get_local_rank()]
        return DTensor.from_local(x * (self.scale * share), self.mesh, [Partial()],
                                  run_check=False)


class PartNet(nn.Module):
    """Two partial-sum branches (:class:`Split`), summed, then a tensor-parallel block: the
    branches run in ``order`` (set per rank by the worker: the ranks meet the Partial
    DTensors in different orders), their sums taken in a fixed order; ``extra``: one more
    call of ``split_a`` (a Partial DTensor the other ranks never meet)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, D)
        self.split_a, self.split_b = Split(1.0), Split(2.0)
        self.block = Block()
        self.head = nn.Linear(D, D_OUT)
        self.order, self.extra = ("a", "b"), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        got = {k: getattr(self, f"split_{k}")(h) for k in self.order}
        a, b = got["a"], got["b"]
        if self.split_a.mesh is not None:
            a, b = a.full_tensor(), b.full_tensor()
        if self.extra:
            self.split_a(h[:1] * 3)
        return self.head(self.block(a + b))


def build_part() -> PartNet:
    """The partial-sum model every rank (and the reference) starts from."""
    torch.manual_seed(0)
    return PartNet()


class Wrap(nn.Module):
    """Its input as a DTensor of ``mesh`` with ``placements`` (no collective)."""

    def __init__(self, mesh, placements) -> None:
        super().__init__()
        self.mesh, self.placements = mesh, placements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(x, self.mesh, self.placements, run_check=False)


class OrderNet(Net):
    """:class:`Net` whose ``views`` first wrap the input rows as a DTensor of a second
    (``a``, ``b``) mesh of the ranks (``views.rows``: ``Shard(0)``, ``Replicate()``) and
    ``CONST`` as a replicated DTensor of the 1-D world mesh (``views.const``), in ``order``
    (set per rank: the ranks meet these meshes in different orders)."""

    CONST = torch.arange(6, dtype=torch.float32)

    def __init__(self, ab_mesh, world_mesh) -> None:
        from torch.distributed.tensor import Replicate, Shard

        super().__init__()
        self.views = nn.ModuleDict({"rows": Wrap(ab_mesh, [Shard(0), Replicate()]),
                                    "const": Wrap(world_mesh, [Replicate()])})
        self.order = ("rows", "const")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in self.order:
            self.views[k](x if k == "rows" else self.CONST)
        return super().forward(x)


class ReplicaNet(Net):
    """:class:`Net` that first shows three larger plain tensors (:func:`replica_pieces`, more
    elements than a histogram sample) to ``nn.Identity`` modules: ``same`` (the same on every
    rank: one replica), ``off`` (rank 1's differs from the others' in one element outside the
    sample: not a replica) and ``later`` (the same everywhere, then written in place before the
    capture ends: its pieces can no longer be compared)."""

    def __init__(self) -> None:
        super().__init__()
        self.same, self.off, self.later = nn.Identity(), nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base, off = replica_pieces(dist.get_rank())
        self.same(base)
        self.off(off)
        later = base.clone()
        self.later(later)
        later.mul_(2.0)
        return super().forward(x)


def replica_pieces(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``base``, rank ``rank``'s ``off``) of :class:`ReplicaNet`: ``off`` is ``base`` but on
    rank 1, where its first element outside the histogram sample is 1.0 higher."""
    from hooks.tensors.stats import HIST_SAMPLE, _sample_index

    n = 3 * HIST_SAMPLE
    base = torch.linspace(-1.0, 1.0, n).sin()
    off = base.clone()
    if rank == 1:
        idx, k = _sample_index(n, n)
        off[min(set(range(n)) - set(idx[:k].tolist()))] += 1.0
    return base, off


class ProbeNet(Net):
    """:class:`Net` that first shows crafted plain tensors (:func:`probe_pieces`) to
    ``nn.Identity`` modules ``probes.<name>``, and its own parameter ``pos`` (sharded by FSDP2
    with the root: during the step a plain, unsharded parameter whose storage FSDP2 frees
    afterwards) to ``probes.pos``."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.linspace(-1.0, 1.0, 64 * 32).view(64, 32))
        self.probes = nn.ModuleDict({k: nn.Identity() for k in [*probe_pieces(0), "pos"]})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, t in probe_pieces(dist.get_rank()).items():
            self.probes[k](t)
        y = self.probes["pos"](self.pos)
        return super().forward(x) + 0.0 * y.sum()


def probe_pieces(rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s pieces of :class:`ProbeNet`: pairs of different tensors that a checksum
    weighted by position alone takes for equal (one-hot masks with the same loads, ``eye(2)``
    and its flip, ``[5, 7, 6]`` and ``[6, 5, 7]``), and int64 ids past 2**24 that differ by
    one (their fp32 samples are equal); every pair differs between ranks 0 and 1."""
    rows = 16
    onehot = torch.zeros(rows, 8)
    cols = [i % 8 for i in range(rows)] if rank == 0 else \
        [(i + 1) % 8 if i < 8 else (i - 1) % 8 for i in range(rows)]
    onehot[torch.arange(rows), torch.tensor(cols)] = 1.0
    return {"onehot": onehot, "eye": torch.eye(2) if rank == 0 else torch.eye(2).flip(0),
            "tokens": torch.tensor([[5.0, 7.0, 6.0]] if rank == 0 else [[6.0, 5.0, 7.0]]),
            "ids": torch.tensor([2**24 + rank, 3, 4])}


class LostNet(Net):
    """:class:`Net` that first shows one larger plain tensor to ``nn.Identity`` ``t`` on a
    (dp, tp) = (2, 2) mesh: on dp row 0 the two tp ranks' pieces differ outside the sample and
    are written in place after the hook; on dp row 1 both hold another tensor, a replica."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank()
        base, off = replica_pieces(1)
        if rank // 2 == 0:
            t = (base if rank % 2 == 0 else off).clone()
            self.t(t)
            t.mul_(2.0)
        else:
            self.t(torch.linspace(-2.0, 2.0, base.numel()).cos())
        return super().forward(x)


def batch(step: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: inputs (ROWS, D_IN) and targets (ROWS, D_OUT)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, D_IN, generator=g), torch.randn(ROWS, D_OUT, generator=g)


def _dump(trace, path: Path) -> None:
    out = {
        "params": {n: r.to_dict() for n, r in trace.params.items()},
        "forward": [{"module": r.module, "call": r.call_index,
                     "outputs": [{"path": t.path, "shape": t.shape,
                                  "stats": t.stats.to_dict() if t.stats else None}
                                 for t in r.outputs],
                     "inputs": [{"path": t.path, "shape": t.shape,
                                 "stats": t.stats.to_dict() if t.stats else None}
                                for t in r.inputs]} for r in trace.forward],
        "notes": [n.to_dict() for n in trace.notes],
    }
    path.write_text(json.dumps(out), encoding="utf-8")


def _tp_block(blk: nn.Module, mesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(blk, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


def _two_d(model: Net, world: int, rank: int, x: torch.Tensor, y: torch.Tensor):
    """dp × tp (FSDP2 × tensor parallel, 4 ranks): each tp pair on its own rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh2 = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    for blk in model.blocks:
        _tp_block(blk, mesh2["tp"])
        fully_shard(blk, mesh=mesh2["dp"])
    fully_shard(model, mesh=mesh2["dp"])
    dp, rows = mesh2.get_coordinate()[0], ROWS // (world // 2)
    return model, x[dp * rows:(dp + 1) * rows], y[dp * rows:(dp + 1) * rows]


def _setup(scenario: str, mesh, rank: int, world: int):
    """(model, inputs, targets) of ``scenario`` on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build()
    x, y = batch()
    if scenario == "tp_sp":
        model = build_seq()
        _sequence_parallel(model, mesh)
        return (model, *seq_batch())
    if scenario in ("fsdp_tp", "fsdp_tp_replicas", "fsdp_tp_lost"):
        torch.manual_seed(0)
        model = {"fsdp_tp": Net, "fsdp_tp_replicas": ReplicaNet, "fsdp_tp_lost": LostNet}[
            scenario]()
        return _two_d(model, world, rank, x, y)
    if scenario == "local_dtensor":  # DTensors of a model without DTensor parameters
        torch.manual_seed(0)
        return DTOutNet(mesh), x, y
    if scenario in ("fsdp_replicas", "fsdp_probes", "fsdp_infer"):
        torch.manual_seed(0)
        model = ProbeNet() if scenario == "fsdp_probes" else ReplicaNet()
    if scenario == "fsdp_tp_order":  # the ranks meet two more meshes in different orders
        ab = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("a", "b"))
        torch.manual_seed(0)
        model = OrderNet(ab, mesh)
        model.order = ("rows", "const") if rank % 2 == 0 else ("const", "rows")
        return _two_d(model, world, rank, x, y)
    if scenario == "tp_mesh_uneven":  # rank 0 alone meets a DTensor of a mesh of its own
        x_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
        ab = init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))
        torch.manual_seed(0)
        model = OrderNet(ab, x_mesh)
        model.order = ("const",) if rank == 0 else ()
        for blk in model.blocks:
            _tp_block(blk, mesh)
        return model, x, y
    if scenario in ("tp", "tp_wide", "tp_partial", "tp_partial_uneven"):
        if scenario == "tp_wide":
            model = build_wide()
        elif scenario != "tp":
            model = build_part()
            model.split_a.mesh = model.split_b.mesh = mesh
            model.order = ("a", "b") if rank == 0 else ("b", "a")
            model.extra = scenario == "tp_partial_uneven" and rank == 0
        for blk in (model.blocks if scenario in ("tp", "tp_wide") else [model.block]):
            _tp_block(blk, mesh)
        return model, x, y
    keep = scenario == "fsdp_keep"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if scenario == "fsdp_mp" else MixedPrecisionPolicy()
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, reshard_after_forward=not keep, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=not keep, mp_policy=mp)
    rows = ROWS // world
    return model, x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import hooks

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--scenario", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    for scenario in args.scenario.split(","):
        model, x, y = _setup(scenario, mesh, rank, world)
        if scenario == "fsdp_nan":
            F.mse_loss(model(x), y).backward()
            if rank == 1:
                with torch.no_grad():
                    model.blocks[1].w2.weight.to_local()[0, 0] = float("nan")
            model.zero_grad(set_to_none=True)
        if scenario == "fsdp_infer":
            with hooks.capture(model) as trace, torch.inference_mode():
                model(x)
        else:
            with hooks.capture(model) as trace:
                F.mse_loss(model(x), y).backward()
                if scenario == "fsdp_uneven" and rank == 1:  # a call rank 0 does not make
                    model.blocks[0].act(torch.full((3,), 0.5))
        if scenario == "fsdp_probes":  # FSDP2 resizes the storage the capture read
            F.mse_loss(model(x), y).backward()
        _dump(trace, Path(args.out) / f"{scenario}.rank{rank}.json")
    dist.barrier()
    dist.destroy_process_group()
    # Every result is written (and closed). Leave without the interpreter's teardown: under
    # load, destroying the FSDP2/DTensor modules' leftover gloo state after the process group
    # once ended rank 0 with "terminate called without an active exception" (SIGABRT), after
    # every scenario had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
