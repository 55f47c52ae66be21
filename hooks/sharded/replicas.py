"""Which ranks hold replicas of a plain tensor in a sharded job: checksums of bits, in two stages.

A plain tensor (an activation, its gradient) carries no placement. :mod:`hooks.sharded.stats`
counts it once along a mesh dimension where two ranks hold bitwise equal pieces (a replica: the
input of a ``ColwiseParallel`` layer, RoPE's tables, position ids) and on every rank where they
differ (a shard, or another data-parallel rank's batch). Telling them apart from the bits of
the whole piece costs about as much as the piece's statistics, and in a data-parallel job
almost every piece differs from every other rank's. So it is done in two stages:

1. **At the hook** (:meth:`Fingerprint.of`): the piece's shape and dtype, and the
   :func:`position_checksum` of the histogram sample the statistics take anyway (at most
   :data:`hooks.tensors.stats.HIST_SAMPLE` strided finite values as fp32; all of a piece that small,
   which is then exact where fp32 holds its dtype's every value and it has no NaN/Inf).
   Pieces whose samples differ are not replicas. Where the sample is not the whole piece, a
   CPU piece is *held* (no copy; with its version counter and its storage's address and size)
   until the capture ends, within :data:`MAX_HELD_BYTES` per capture; past that, and for a
   parameter's storage, an inference tensor (no version counter) or a piece of another device
   (read through a host copy that is not kept), the whole piece is checksummed at once.
2. **At the reduction** (:func:`candidates`, :func:`wholes`, :func:`confirm`; or
   :func:`replicas`, all three): only where two ranks' samples matched and a sample is not
   its whole piece, each of those ranks takes the checksum of its whole piece, and the ranks
   compare them (one more ``all_gather``, or in the one that brings the histograms). A held
   piece written in place since its hook (its version moved) or whose storage was freed or
   moved (FSDP2 frees an unsharded parameter's storage without a version bump) cannot be
   compared any more: the tensor is *lost* on every rank of the mesh (not recorded, never
   counted by a guess).

The checksum weighs each element's bits by pseudo-random 64-bit row and column weights
(:func:`position_checksum`), so that structured differences (a permutation, one-hot rows with
the same counts) do not cancel out. A user's tensor is never handed to numpy (which would mark
its storage as not resizable, and FSDP2 resizes its parameters' storage).

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import Any

import torch

from hooks.tensors.stats import HIST_SAMPLE, hist_sample

__all__ = ["Fingerprint", "candidates", "confirm", "position_checksum", "replicas", "wholes"]

_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Dtypes whose every value fp32 holds exactly: a piece of one of them is its fp32 sample.
_LOSSLESS = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool,
             torch.uint8, torch.int8, torch.int16)
#: At most this many bytes of pieces are held for the exit per capture; past it a piece is
#: checksummed whole at its hook.
MAX_HELD_BYTES = 256 << 20
_ROW, _COL = 0x5851F42D4C957F2D, 0x14057B7EF767814F  # the two weight streams' seeds
_CHUNK = 1 << 16  # elements per block of the whole-piece checksum (an int64 copy of a block)
_CACHED = 1 << 20  # weights cached per stream and device
_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


def _mix(i: Any, seed: int) -> Any:
    """splitmix64 of the uint64 array ``i`` (Steele, Lea and Flood, "Fast splittable
    pseudorandom number generators", 2014), made odd: wrapping uint64 arithmetic."""
    import numpy as np

    z = i * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)


def _weights(start: int, n: int, seed: int, device: torch.device) -> torch.Tensor:
    """Weights ``start`` … ``start + n - 1`` of stream ``seed`` as int64 on ``device``: the
    first :data:`_CACHED` are cached (grown as asked), later ones made for the call."""
    import numpy as np

    if start + n > _CACHED:
        own = _mix(np.arange(start, start + n, dtype=np.uint64), seed).view(np.int64)
        return torch.from_numpy(own).to(device)  # (our own array)
    key = (seed, str(device))
    w = _WEIGHTS.get(key)
    if w is None or w.numel() < start + n:
        size = min(_CACHED, max(start + n, 2 * (w.numel() if w is not None else 0), 1024))
        own = _mix(np.arange(size, dtype=np.uint64), seed).view(np.int64)
        w = _WEIGHTS[key] = torch.from_numpy(own).to(device)
    return w[start:start + n]


def _int_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(m, c)``: the bits of ``x`` as an (R, c) integer tensor (no copy of a contiguous
    ``x``): its last dimension's elements read as integers of their width, an 8-byte element
    as its two 4-byte halves in memory order (so c is twice the last dimension); ``bool`` as
    bytes."""
    y = x.reshape(-1)
    if y.dtype == torch.bool:
        y = y.view(torch.uint8)
    size = y.element_size()
    c = max(x.shape[-1] if x.dim() else 1, 1)
    if size == 8:  # two halves: a flipped top bit in two elements would cancel in int64
        y, c = y.view(torch.int32), 2 * c
    elif y.dtype != _WIDTH[size]:
        y = y.view(_WIDTH[size])
    return y.view(-1, c) if y.numel() else y.view(0, c), c


def position_checksum(x: torch.Tensor) -> torch.Tensor:
    """``Σ_ij bits_ij · r_i · c_j`` over the (R, C) integer view of ``x``'s bits, wrapping in
    ``int64``, as a 0-dim ``int64`` tensor on ``x``'s device.

    The view (:func:`_int_view`): C is the last dimension (a 0-dim tensor is (1, 1)), each
    element's bits read as an integer of its width (``float32`` → ``int32``, ``bfloat16`` →
    ``int16``, ``bool`` as bytes), an 8-byte element as its two 4-byte halves (C doubled: in
    int64 a flipped sign bit times an odd weight is 2**63, and two of them cancel). ``r`` and
    ``c`` are fixed pseudo-random odd 64-bit weights (splitmix64 of the row and of the column
    index, two streams), the same in every process and on every machine: integer arithmetic,
    no rounding. Equal tensors have equal checksums. Two different tensors of one shape collide
    only when the weighted sum of their difference vanishes modulo 2**64: unlike a sum
    weighted by position (which depends only on row and column sums, so two one-hot masks with
    the same loads, or a permutation with the same positional sum, collide), a reordering, a
    swapped pair of rows or columns, or one-hot rows with equal counts all change it. Taken in
    blocks of at most :data:`_CHUNK` elements (an int64 copy of one block at a time); the
    tensor is only read (never handed to numpy, which would mark its storage as not
    resizable).
    """
    m, c = _int_view(x)
    total = torch.zeros((), dtype=torch.int64, device=m.device)
    r, dev = m.shape[0], m.device
    rows, cols = max(1, _CHUNK // c), min(c, _CHUNK)
    for a in range(0, r, rows):
        rw = _weights(a, min(rows, r - a), _ROW, dev)
        for b in range(0, c, cols):
            # (out of place: for an int32 view, .to(int32) would return the piece itself)
            block = m[a:a + rows, b:b + cols].to(torch.int64) * _weights(b, min(cols, c - b),
                                                                         _COL, dev)
            total += (block.sum(1) * rw).sum()
    return total


def _shape_key(x: torch.Tensor) -> int:
    """A 62-bit hash of ``x``'s shape and dtype, the same in every process."""
    return _layout_key(tuple(x.shape), x.dtype)


@functools.lru_cache(maxsize=1024)
def _layout_key(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    text = f"{shape}|{dtype}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


class Fingerprint:
    """One piece's fingerprint (see the module docstring): ``shape`` (a hash of its shape and
    dtype, shifted left, its low bit set where the sample is the whole piece bit for bit),
    ``cheap`` (checksum of its sample), ``sample`` (until :func:`fill_cheap` takes that),
    ``full`` (checksum of the whole piece, where taken at the hook), ``held``, ``version`` and
    ``storage`` (the piece, its version counter and its storage's address and size, where its
    whole checksum may be wanted at the reduction)."""

    __slots__ = ("shape", "cheap", "sample", "full", "held", "version", "storage")

    def __init__(self, shape: int, cheap: int | None = None, full: int | None = None) -> None:
        self.shape, self.cheap, self.full = shape, cheap, full
        self.sample: torch.Tensor | None = None
        self.held: torch.Tensor | None = None
        self.version = 0
        self.storage = (0, 0)  # (address, bytes) of the held piece's storage at its hook

    @property
    def exact(self) -> bool:
        """Whether the sample is the whole piece, bit for bit."""
        return bool(self.shape & 1)

    @classmethod
    def of(cls, x: torch.Tensor, sample: torch.Tensor, finite: bool,
           hold: bool | Callable[[int, int], bool]) -> Fingerprint:
        """The fingerprint of piece ``x`` (its host copy, for a piece of another device).

        Args:
            x: The piece.
            sample: Its histogram sample of finite values, in order, as fp32 or fp64 (all of
                ``x`` when ``x`` has at most :data:`~hooks.tensors.stats.HIST_SAMPLE` elements).
            finite: Whether ``x`` holds no NaN and no Inf.
            hold: Whether ``x`` may be held until the reduction (a CPU piece that is not a
                copy and not a parameter's storage), or a callable asked, with the address
                and size in bytes of ``x``'s storage, once ``x`` is about to be held (the
                capture's budget, :data:`MAX_HELD_BYTES`). Otherwise, or where ``x`` counts
                no versions (an inference tensor) or has no storage of its own (a wrapper
                tensor subclass), a piece whose sample is not all of it is checksummed whole
                now.
        """
        exact = finite and x.numel() <= HIST_SAMPLE and x.dtype in _LOSSLESS
        fp = cls(_shape_key(x) << 1 | int(exact))
        fp.sample = sample
        if exact:
            return fp
        if hold and finite:  # (a held piece's sample is taken again: of finite values)
            try:
                version = x._version  # (an inference tensor counts no versions)
                st = x.untyped_storage()  # (a wrapper subclass has no storage)
                storage = (st.data_ptr(), st.nbytes())
            except (RuntimeError, NotImplementedError, TypeError):
                pass
            else:
                if hold is True or hold(*storage):
                    fp.held, fp.version, fp.storage = x, version, storage
                    return fp
        fp.full = int(position_checksum(x))
        return fp

    @classmethod
    def unique(cls, rank: int) -> Fingerprint:
        """A fingerprint no other rank's piece has (a tensor this rank does not hold)."""
        return cls(-1, -1 - rank, -1 - rank)

    def whole(self) -> int | None:
        """The checksum of the whole piece; ``None`` where it was held and has changed since its
        hook: written in place (its version moved), its storage freed or moved (FSDP2 frees an
        unsharded parameter's storage without a version bump), or its sample, taken again,
        differs (a storage freed and allocated again at the same address, a write through
        ``.data`` or an in-place collective, which move no version, on a sampled element).
        A write that moves no version and misses every sampled element is not seen."""
        if self.full is None and self.held is None:  # the sample is all of it
            self.full = self.cheap
        elif self.full is None:
            if self.cheap is None:
                fill_cheap([self])
            x = self.held
            st = x.untyped_storage()
            if x._version != self.version or (st.data_ptr(), st.nbytes()) != self.storage:
                return None
            xf = x.reshape(-1)
            if xf.dtype is not torch.float32 and xf.dtype is not torch.float64:
                xf = xf.float()
            sample, k = hist_sample(xf, x.shape[-1] if x.dim() else 1)
            if int(position_checksum(sample[:k])) != self.cheap:
                return None
            self.full = int(position_checksum(x))
        return self.full

    def release(self) -> None:
        """Drop the held piece and the sample (after the reduction)."""
        self.held = self.sample = None


def fill_cheap(fps: list[Fingerprint | None]) -> None:
    """Take the sample checksum of every fingerprint that has none yet, all at once: each
    sample's :func:`position_checksum` as a 1-D tensor, from one zero-padded (N, L) matrix of
    their bits per bit width."""
    from torch.nn.utils.rnn import pad_sequence

    todo: dict[int, list[Fingerprint]] = {}
    for fp in fps:
        if fp is not None and fp.cheap is None:
            todo.setdefault(fp.sample.element_size(), []).append(fp)
    for width, group in todo.items():
        m = pad_sequence([fp.sample.reshape(-1) for fp in group], batch_first=True)
        # (padding: zeros, weighing nothing; 8-byte values as two halves, as _int_view reads)
        bits = m.view(torch.int32 if width == 8 else _WIDTH[width]).to(torch.int64)
        sums = (bits * _weights(0, bits.shape[1], _COL, m.device)).sum(1) * _weights(
            0, 1, _ROW, m.device)
        for fp, v in zip(group, sums.tolist(), strict=True):
            fp.cheap = v


def table(fps: list[Fingerprint | None]) -> torch.Tensor:
    """(N, 2) int64: ``cheap`` and ``shape`` of each fingerprint (0, 0 for ``None``: a
    DTensor's piece, counted by its placements)."""
    fill_cheap(fps)
    return torch.tensor([[fp.cheap, fp.shape] if fp is not None else [0, 0] for fp in fps],
                        dtype=torch.int64).view(-1, 2)


def candidates(got: torch.Tensor, plain: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cand, need)`` along one mesh dimension, from every coordinate's :func:`table`:
    (S, S, N) bool, ``cand[c, c', i]``: piece ``i`` of coordinate ``c`` has the fingerprint of
    that of a lower coordinate ``c'`` (both told by fingerprints); (M,) int64, the tensors
    where such a pair's samples are not the whole pieces, to be compared whole
    (:func:`wholes`, :func:`confirm`). The same on every rank that holds the same ``got``.

    Args:
        got: (S, N, 2) int64: every coordinate's :func:`table` (S ranks along the dimension,
            in group-rank order; N tensors in the same order on each).
        plain: (S, N) bool: the pieces told by fingerprints (not by placements).
    """
    s = plain.shape[0]
    lower = torch.ones(s, s, dtype=torch.bool).tril(-1)  # [c, c']: c' < c
    cand = (got[:, None] == got[None, :]).all(-1) & lower[:, :, None]  # (S, S, N)
    cand &= plain[:, None, :] & plain[None, :, :]
    inexact = (got[:, :, 1] & 1) == 0  # (S, N): the sample is not the whole piece
    return cand, (cand & inexact[:, None, :]).any(1).any(0).nonzero().flatten()


def wholes(cand: torch.Tensor, need: torch.Tensor, fps: list[Fingerprint | None],
           me: int) -> torch.Tensor:
    """(M, 2) int64: this rank's whole-piece checksum of each tensor of ``need`` where its
    piece is in a candidate pair (0 elsewhere: not compared), and 1 in the second column
    where it could not be taken (written in place or freed since its hook, or the checksum
    failed: never raised here, between two collectives). ``me``: this rank's rank in the
    group (its row of ``cand``)."""
    mine = (cand[me].any(0) | cand[:, me].any(0))[need].tolist()
    vals = []
    for j, i in zip(mine, need.tolist(), strict=True):
        try:
            whole = fps[i].whole() if j and fps[i] is not None else 0
        except Exception:  # an unreadable piece: lost, on every rank, after the exchange
            whole = None
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
        ok = every[:, :, 1] == 0  # (S, M): a checksum was taken
        cand[:, :, need] &= ((every[:, None, :, 0] == every[None, :, :, 0])
                             & ok[:, None, :] & ok[None, :, :])
        lost[need] = ~ok.all(0)
    return cand.any(1), lost


def replicas(got: torch.Tensor, plain: torch.Tensor, fps: list[Fingerprint | None], me: int,
             group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Which pieces are replicas of a lower coordinate's, along one mesh dimension:
    :func:`candidates`, then (where whole pieces are compared) one ``all_gather`` on ``group``
    of every coordinate's :func:`wholes`, and :func:`confirm`. Every rank of ``group`` calls
    this with the same ``got``.

    Args:
        got, plain: As for :func:`candidates`.
        fps: This rank's N fingerprints.
        me: This rank's rank in ``group``.
        group: The dimension's process group.

    Returns:
        ``(replica, lost)`` as :func:`confirm` gives them.
    """
    import torch.distributed as dist

    cand, need = candidates(got, plain)
    every = None
    if need.numel():  # the same on every rank of the group: computed from the same table
        row = wholes(cand, need, fps, me)
        got_rows = [torch.empty_like(row) for _ in range(plain.shape[0])]
        dist.all_gather(got_rows, row, group=group)
        every = torch.stack(got_rows)  # (S, M, 2)
    return confirm(cand, need, every)
