"""Checksums compared across the ranks of a distributed run: a sum of a tensor's bit patterns
as integers weighted by pseudo-random row and column weights (:func:`tensor_checksum`), which
changes with any single element and with a reordering of the elements, taken of many
tensors at once (:func:`checksums`) and compared rank against rank (:func:`compare_checksums`).
Used by :mod:`hooks.dist.distributed` (re-exported there)."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Any


def _is_sharded(t: Any) -> bool:
    """A DTensor (FSDP2, tensor parallel): each rank holds another shard by design."""
    return type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor")


def replica_key(name: str, t: Any) -> str:
    """The name under which a DTensor's local piece is compared across ranks: the ranks that
    share it hold replicas of the same piece (HSDP's replicas, a tensor-parallel
    ``Replicate`` parameter), which must be bitwise equal. ``name`` when the DTensor is
    replicated on every mesh dimension; ``name [shard i, j]`` (the coordinates along its
    ``Shard`` dimensions) otherwise, so that only the ranks holding that shard compare it."""
    coord = t.device_mesh.get_coordinate() or []
    shards = [str(c) for c, p in zip(coord, t.placements, strict=False) if not p.is_replicate()]
    return f"{name} [shard {', '.join(shards)}]" if shards else name


def tensor_checksum(t: Any) -> Any:
    """A weighted sum of a tensor's bit patterns as integers, a 0-dim ``int64`` tensor (on the
    CPU for a CPU tensor, else on its device):
    :func:`hooks.sharded.replicas.position_checksum` (complex tensors as their real and
    imaginary parts).

    Every element's bits are read as an integer of its width (``float32`` → ``int32``,
    ``bfloat16`` → ``int16`` …, ``bool`` as bytes), times fixed pseudo-random 64-bit weights of
    its row and of its column, summed in ``int64`` (wrapping; the same on every rank). Two
    tensors with equal bits have equal checksums; a change of any one element changes it, and
    so does a reordering of the same values (a permuted or transposed copy of the same shape).
    The tensor is only read.
    """
    import torch

    from hooks.sharded.replicas import position_checksum

    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    return position_checksum(x)


def checksums(named: Iterable[tuple[str, Any]]) -> dict[str, int | None]:
    """:func:`tensor_checksum` of each named tensor, as Python ints (one device sync per
    device); ``None`` for a missing tensor (a gradient not computed). Sharded tensors
    (DTensor) are taken of this rank's local piece, under :func:`replica_key`."""
    import torch

    out: dict[str, int | None] = {}
    by_device: dict[Any, list[tuple[str, Any]]] = {}
    for name, t in named:
        if t is None:
            out[name] = None
            continue
        if _is_sharded(t):
            name, t = replica_key(name, t), t.detach().to_local()
        by_device.setdefault(t.device, []).append((name, tensor_checksum(t)))
    for items in by_device.values():
        values = torch.stack([v for _, v in items]).tolist()
        for (name, _), v in zip(items, values, strict=True):
            out[name] = int(v)
    return out


def compare_checksums(
    by_rank: Mapping[int, Mapping[str, int | None]],
) -> list[tuple[str, dict[int, int | None], list[int]]]:
    """The names whose checksums differ across ranks.

    Args:
        by_rank: Per rank, checksums by name. Only names held by two ranks or more are
            compared.

    Returns:
        ``(name, checksums by rank, odd ranks)`` per differing name, in the first rank's name
        order: the odd ranks are those that do not hold the value most ranks hold (on a tie,
        the value of the lowest rank counts as the reference).
    """
    ranks = sorted(by_rank)
    names: list[str] = []
    seen = set()
    for r in ranks:
        for name in by_rank[r]:
            if name not in seen:
                seen.add(name)
                names.append(name)
    out = []
    for name in names:
        values = {r: by_rank[r][name] for r in ranks if name in by_rank[r]}
        if len(values) < 2 or len(set(values.values())) == 1:
            continue
        counts = collections.Counter(values.values())
        top = max(counts.values())
        ref = next(v for r, v in values.items() if counts[v] == top)
        out.append((name, values, [r for r, v in values.items() if v != ref]))
    return out


#: Why a comparison compared nothing: every tensor was held by one rank only (each rank's FSDP2
#: shard, a tensor-parallel ``Shard`` piece), so there is no replica to compare it with.
NOT_COMPARED = ("every tensor is one rank's own shard (FSDP2, a tensor-parallel Shard): no "
                "replica to compare")


def shared_names(by_rank: Mapping[int, Mapping[str, int | None]]) -> list[str]:
    """The names :func:`compare_checksums` compares and that hold a tensor somewhere: those
    held by two ranks or more (a replicated tensor, or one replica of a shard under
    :func:`replica_key`) and not ``None`` (no gradient) on every one of them, in the first
    rank's name order. A shard that one rank alone holds (FSDP2 without replicas, a
    tensor-parallel ``Shard`` piece) is not among them: it differs from the others by design;
    nor is a frozen parameter's missing gradient on every rank (nothing was compared).

    Args:
        by_rank: Per rank, checksums by name (:func:`checksums`).

    Returns:
        The names, each once; empty when no name is held by two ranks.
    """
    counts: collections.Counter[str] = collections.Counter()
    order: dict[str, None] = {}
    some: set[str] = set()
    for r in sorted(by_rank):
        for name, v in by_rank[r].items():
            counts[name] += 1
            order.setdefault(name, None)
            if v is not None:
                some.add(name)
    return [n for n in order if counts[n] >= 2 and n in some]


def grads_by_key(params: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``(name, gradient)`` of each named parameter for :func:`checksums`, a missing gradient
    of a sharded parameter named by the parameter's :func:`replica_key` (as its gradient
    would be): a frozen FSDP2 shard's ``None`` meets only its replicas', not every rank's."""
    return [(replica_key(n, p) if p.grad is None and _is_sharded(p) else n, p.grad)
            for n, p in params]


def hex64(v: int | None) -> str:
    """A checksum as 16 hex digits (its two's complement for a negative one), or ``"None"``."""
    return "None" if v is None else f"{v & 0xFFFFFFFFFFFFFFFF:016x}"
