"""The checksum ``hooks.sharded.replicas.position_checksum`` promises, computed independently
with Python integers: ``Σ_ij bits(x_ij) · r_i · c_j`` over the (R, C) view of a tensor's bits
(C its last dimension, doubled for 8-byte elements read as two halves), wrapped to int64,
where ``r`` and ``c`` are splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom
number generators", 2014) of the row and column index, made odd, from two fixed seeds."""

from __future__ import annotations

import torch

_M = (1 << 64) - 1
ROW_SEED, COL_SEED = 0x5851F42D4C957F2D, 0x14057B7EF767814F


def splitmix(i: int, seed: int) -> int:
    """splitmix64 of ``i`` from ``seed``, made odd."""
    z = (i * 0x9E3779B97F4A7C15 + seed) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return (z ^ (z >> 31)) | 1


def checksum(x: torch.Tensor) -> int:
    """The reference checksum of ``x`` (its bits read as integers of its element width, an
    8-byte element as its two 4-byte halves in memory order, doubling the columns; ``bool`` as
    bytes)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}[x.element_size()]
    y = x.detach().contiguous().reshape(-1)
    if y.dtype == torch.bool:
        y = y.view(torch.uint8)
    c = max(x.shape[-1] if x.dim() else 1, 1) * (2 if x.element_size() == 8 else 1)
    v = 0
    for k, b in enumerate(y.view(ints).tolist()):
        v += b * splitmix(k // c, ROW_SEED) * splitmix(k % c, COL_SEED)
    v &= _M
    return v - (1 << 64) if v >> 63 else v
