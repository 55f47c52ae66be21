"""Which ranks hold replicas of a plain tensor in a sharded job: checksums of bits, in two stages.

A plain tensor (an activation, its gradient) carries no placement. :mod:`hooks.dtensor_stats`
counts it once along a mesh dimension where two ranks hold bitwise equal pieces (a replica: the
input of a ``ColwiseParallel`` layer, RoPE's tables, position ids) and on every rank where they
differ (a shard, or another data-parallel rank's batch). Telling them apart from the bits of
the whole piece costs about as much as the piece's statistics, and in a data-parallel job
almost every piece differs from every other rank's. So it is done in two stages:

1. **At the hook** (:meth:`Fingerprint.of`): the piece's shape and dtype, and the
   :func:`position_checksum` of the histogram sample the statistics take anyway (at most
   :data:`hooks.stats.HIST_SAMPLE` strided values; all of a piece that small, which is then
   exact). Pieces whose sample differ are not replicas. A larger CPU piece is *held* (no
   copy; with its version counter, ``Tensor._version``) until the capture ends.
2. **At the reduction** (:func:`candidates`, :func:`wholes`, :func:`confirm`; or
   :func:`replicas`, all three): only where two ranks' samples matched and the piece is
   larger than its sample, each of those ranks takes the checksum of its whole piece, and the
   ranks compare them (one more ``all_gather``, or in the one that brings the histograms). A
   held piece written in place since its hook (its version moved) cannot be compared any
   more: the tensor is *lost* on every rank (not recorded, never counted by a guess).

A piece holding NaN or Inf (its sample skips them), or on another device than the CPU (read
through a host copy that is not kept), is checksummed whole at the hook, as before.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import torch

from hooks.stats import HIST_SAMPLE

__all__ = ["Fingerprint", "candidates", "confirm", "position_checksum", "replicas", "wholes"]

_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_POSITIONS = torch.zeros(0, dtype=torch.int64)
_NP_POSITIONS: Any = None


def _positions(n: int, device: torch.device) -> torch.Tensor:
    """``1, 2, …, n`` as int64 on ``device`` (cached: the longest asked for so far, sliced)."""
    global _POSITIONS
    if _POSITIONS.numel() < n or _POSITIONS.device != device:
        size = max(n, 2 * _POSITIONS.numel() if _POSITIONS.device == device else n)
        _POSITIONS = torch.arange(1, size + 1, dtype=torch.int64, device=device)
    return _POSITIONS[:n]


def _checksum_np(m: Any) -> torch.Tensor:
    """:func:`position_checksum` of an (R, C) integer
    numpy array, from its row and column sums in int64 (wrapping like torch's int64)."""
    import numpy as np

    global _NP_POSITIONS
    r, c = m.shape
    if _NP_POSITIONS is None or _NP_POSITIONS.size < max(r, c):
        _NP_POSITIONS = np.arange(1, max(r, c, 1 << 12) + 1, dtype=np.int64)
    pos = _NP_POSITIONS
    cols = m.sum(0, dtype=np.int64)
    v = int((cols * pos[:c]).sum())  # (array arithmetic wraps silently, as torch's does)
    if r > 1:
        v += int((m.sum(1, dtype=np.int64) * ((pos[:r] - 1) * c)).sum())
    return torch.tensor((v + (1 << 63)) % (1 << 64) - (1 << 63), dtype=torch.int64)


def position_checksum(x: torch.Tensor) -> torch.Tensor:
    """``Σ_i bits(x_i) · (i + 1)`` over the elements of ``x`` in row-major order, as a 0-dim
    ``int64`` tensor (on the CPU for a CPU tensor, else on ``x``'s device).

    Each element's bit pattern is read as an integer of its width (``float32`` → ``int32``,
    ``bfloat16`` → ``int16``, ``bool`` as bytes) and weighted by its position + 1; the sum
    wraps in ``int64`` (two's complement, the same on every rank and every machine: integer
    sums, no floating-point rounding). Equal tensors have equal checksums; changing one element,
    or moving elements to other positions (a transposed or permuted tensor of the same shape),
    changes it except by a collision of the 64-bit sum. Taken from row and column sums (no
    int64 copy of the tensor): position ``i·C + j + 1`` of element ``(i, j)`` of the
    (R, C) view gives ``C · Σ_i i·r_i + Σ_j (j + 1)·c_j``.
    """
    y = x.reshape(-1)
    if y.dtype == torch.bool:
        y = y.view(torch.uint8)
    width = _WIDTH[y.element_size()]
    ints = y if y.dtype == width else y.view(width)
    n, c = ints.numel(), x.shape[-1] if x.dim() else 1
    if ints.is_cpu:  # numpy's integer sums run 2-3x faster than torch's on CPU
        r = n // c if c >= 16 and n // c >= 16 else 1  # small, or one long row: (1, n)
        return _checksum_np(ints.numpy().reshape(r, n // r))
    if c < 16 or n // c < 16:
        return (ints.to(torch.int64) * _positions(n, ints.device)).sum()
    m = ints.view(n // c, c)
    rows, cols = m.sum(1, dtype=torch.int64), m.sum(0, dtype=torch.int64)
    pos = _positions(max(n // c, c), ints.device)
    return (rows * (pos[:n // c] - 1)).sum() * c + (cols * pos[:c]).sum()


def _shape_key(x: torch.Tensor) -> int:
    """A 62-bit hash of ``x``'s shape and dtype, the same in every process."""
    return _layout_key(tuple(x.shape), x.dtype)


@functools.lru_cache(maxsize=1024)
def _layout_key(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    text = f"{shape}|{dtype}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


class Fingerprint:
    """One piece's fingerprint (see the module docstring): ``shape`` (its shape and dtype),
    ``cheap`` (checksum of its sample, or of the whole piece where ``full`` is set at the hook),
    ``sample`` (the sample, until :func:`fill_cheap` takes its checksum), ``held`` and
    ``version`` (the piece and its version counter, where its whole checksum may be wanted at
    the reduction)."""

    __slots__ = ("shape", "cheap", "sample", "full", "held", "version")

    def __init__(self, shape: int, cheap: int | None = None, full: int | None = None) -> None:
        self.shape, self.cheap, self.full = shape, cheap, full
        self.sample: torch.Tensor | None = None
        self.held: torch.Tensor | None = None
        self.version = 0

    @classmethod
    def of(cls, x: torch.Tensor, sample: torch.Tensor | None, hold: bool) -> Fingerprint:
        """The fingerprint of piece ``x`` (its host copy, for a piece of another device).

        Args:
            x: The piece, as the statistics read it.
            sample: Its histogram sample, in order (all of ``x`` when ``x`` has at most
                :data:`~hooks.stats.HIST_SAMPLE` elements); ``None`` where ``x`` holds
                NaN/Inf (the sample skips them): ``x`` is then checksummed whole.
            hold: Whether ``x`` may be held until the reduction (a CPU piece, not a copy).
        """
        fp = cls(_shape_key(x))
        if sample is None or (not hold and x.numel() > HIST_SAMPLE):
            fp.full = fp.cheap = int(position_checksum(x))
            return fp
        fp.sample = sample
        if x.numel() > HIST_SAMPLE:
            fp.held, fp.version = x, x._version
        return fp

    @classmethod
    def unique(cls, rank: int) -> Fingerprint:
        """A fingerprint no other rank's piece has (a tensor this rank does not hold)."""
        return cls(-1, -1 - rank, -1 - rank)

    def whole(self) -> int | None:
        """The checksum of the whole piece; ``None`` where it was held and written in place
        since its hook (its values are gone)."""
        if self.full is None and self.held is None:  # the sample was all of it
            self.full = self.cheap
        elif self.full is None:
            if self.held._version != self.version:
                return None
            self.full = int(position_checksum(self.held))
        return self.full

    def release(self) -> None:
        """Drop the held piece and the sample (after the reduction)."""
        self.held = self.sample = None


def fill_cheap(fps: list[Fingerprint | None]) -> None:
    """Take the sample checksum of every fingerprint that has none yet, all at once, positions
    counted from 1 within each sample.

    32-bit samples (all but fp64 pieces'): one zero-padded (N, L) matrix of their bits as fp64
    times the positions. Exact, so the same on every rank and equal to the integer definition:
    each product is below 2**41 in magnitude and each sum of at most
    :data:`~hooks.stats.HIST_SAMPLE` of them below 2**51, integers fp64 holds exactly in any
    order of summation. 64-bit ones: in int64, one concatenation."""
    todo: dict[int, list[Fingerprint]] = {}
    for fp in fps:
        if fp is not None and fp.cheap is None:
            todo.setdefault(fp.sample.element_size(), []).append(fp)
    narrow = todo.pop(4, None)
    if narrow:
        from torch.nn.utils.rnn import pad_sequence

        assert max(fp.sample.numel() for fp in narrow) <= HIST_SAMPLE  # (the bound above)
        m = pad_sequence([fp.sample.reshape(-1) for fp in narrow], batch_first=True)
        sums = m.view(torch.int32).double() @ _positions(m.shape[1], m.device).double()
        for fp, v in zip(narrow, sums.tolist(), strict=True):
            fp.cheap = int(v)
    for width, group in todo.items():
        lens = torch.tensor([fp.sample.numel() for fp in group])
        flat = torch.cat([fp.sample.reshape(-1) for fp in group])
        bits = flat.view(_WIDTH[width]).to(torch.int64)
        starts = torch.cumsum(lens, 0) - lens
        which = torch.repeat_interleave(torch.arange(len(group)), lens)
        pos = torch.arange(1, flat.numel() + 1) - starts[which]
        sums = torch.zeros(len(group), dtype=torch.int64).index_add_(0, which, bits * pos)
        for fp, v in zip(group, sums.tolist(), strict=True):
            fp.cheap = v


def table(fps: list[Fingerprint | None]) -> torch.Tensor:
    """(N, 2) int64: ``cheap`` and ``shape`` of each fingerprint (0, 0 for ``None``: a
    DTensor's piece, counted by its placements)."""
    fill_cheap(fps)
    return torch.tensor([[fp.cheap, fp.shape] if fp is not None else [0, 0] for fp in fps],
                        dtype=torch.int64).view(-1, 2)


def candidates(got: torch.Tensor, plain: torch.Tensor, numel: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cand, need)`` along one mesh dimension, from every coordinate's :func:`table`:
    (S, S, N) bool, ``cand[c, c', i]``: piece ``i`` of coordinate ``c`` has the fingerprint of
    that of a lower coordinate ``c'`` (both told by fingerprints); (M,) int64, the tensors
    where such a pair's pieces are larger than their samples, to be compared whole
    (:func:`wholes`, :func:`confirm`). The same on every rank that holds the same ``got``.

    Args:
        got: (S, N, 2) int64: every coordinate's :func:`table` (S ranks along the dimension,
            N tensors in the same order on each).
        plain: (S, N) bool: the pieces told by fingerprints (not by placements).
        numel: (S, N): each piece's number of elements.
    """
    s = plain.shape[0]
    lower = torch.ones(s, s, dtype=torch.bool).tril(-1)  # [c, c']: c' < c
    cand = (got[:, None] == got[None, :]).all(-1) & lower[:, :, None]  # (S, S, N)
    cand &= plain[:, None, :] & plain[None, :, :]
    big = numel > HIST_SAMPLE  # (S, N): the sample is not the whole piece
    return cand, (cand & big[:, None, :]).any(1).any(0).nonzero().flatten()


def wholes(cand: torch.Tensor, need: torch.Tensor, fps: list[Fingerprint | None],
           me: int) -> torch.Tensor:
    """(M, 2) int64: this rank's whole-piece checksum of each tensor of ``need`` where its
    piece is in a candidate pair (0 elsewhere: not compared), and 1 in the second column
    where it was lost (written in place since its hook)."""
    mine = (cand[me].any(0) | cand[:, me].any(0))[need].tolist()
    vals = []
    for j, i in zip(mine, need.tolist(), strict=True):
        whole = fps[i].whole() if j and fps[i] is not None else 0
        vals.append([0, 1] if whole is None else [whole, 0])
    return torch.tensor(vals, dtype=torch.int64).view(-1, 2)


def confirm(cand: torch.Tensor, need: torch.Tensor, every: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(replica, lost)`` from :func:`candidates` and every coordinate's :func:`wholes`
    (``every``: (S, M, 2)): (S, N) bool, piece ``c`` equals that of a lower coordinate (count
    it zero times); (N,) bool, tensors whose pieces could not be compared (not to be
    recorded)."""
    lost = torch.zeros(cand.shape[-1], dtype=torch.bool)
    if need.numel():
        cand = cand.clone()
        cand[:, :, need] &= every[:, None, :, 0] == every[None, :, :, 0]
        lost[need] = every[:, :, 1].any(0)
    return cand.any(1), lost


def replicas(got: torch.Tensor, plain: torch.Tensor, numel: torch.Tensor,
             fps: list[Fingerprint | None], me: int, group: Any
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Which pieces are replicas of a lower coordinate's, along one mesh dimension:
    :func:`candidates`, then (where whole pieces are compared) one ``all_gather`` on ``group``
    of every coordinate's :func:`wholes`, and :func:`confirm`. Every rank of ``group`` calls
    this with the same ``got``.

    Args:
        got, plain, numel: As for :func:`candidates`.
        fps: This rank's N fingerprints.
        me: This rank's coordinate along the dimension.
        group: The dimension's process group.

    Returns:
        ``(replica, lost)`` as :func:`confirm` gives them.
    """
    import torch.distributed as dist

    cand, need = candidates(got, plain, numel)
    every = None
    if need.numel():  # the same on every rank of the group: computed from the same table
        row = wholes(cand, need, fps, me)
        got_rows = [torch.empty_like(row) for _ in range(plain.shape[0])]
        dist.all_gather(got_rows, row, group=group)
        every = torch.stack(got_rows)  # (S, M, 2)
    return confirm(cand, need, every)
