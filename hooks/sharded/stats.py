"""Statistics of the full tensor in sharded jobs (FSDP2, tensor parallel): reduced across the mesh.

``hooks.capture`` of a model whose parameters are ``DTensor``s (``fully_shard``,
``parallelize_module``, both on a 2-D ``DeviceMesh``) summarises every tensor it sees — module
inputs and outputs, their gradients, parameters and parameter gradients — as the tensor of the
whole job, not as this rank's piece of it (:class:`MeshStats`):

* **Each rank summarises its own piece** (a DTensor's local shard, or a plain tensor such as an
  activation) as one process's capture does on CPU (:class:`hooks.tensors.stats.StatsBatch`), a few
  numbers read back at once: finite count, sum and sum of squares (fp32 kernels, no copy of the
  tensor; fp64 where ``|mean|`` above ~1.7 std would lose them), non-zero count (counted where the
  piece has at most :data:`hooks.tensors.stats.ZERO_EXACT_NUMEL` elements or its sample holds a
  zero, else ``zero_exact`` is False, as in one process), NaN and Inf counts, the number of
  elements, min and max, a histogram sample (at most :data:`hooks.tensors.stats.HIST_SAMPLE`
  values) and, for a plain tensor, a fingerprint of its bits (:mod:`hooks.sharded.replicas`: the
  checksum of that sample, and of the whole piece only where another rank's sample matched).
* **Each element is counted once.** A DTensor's placements say it: a ``Shard`` mesh dimension
  holds different elements on each rank (counted on all), a ``Replicate`` one the same elements
  (counted on coordinate 0 only). A ``Partial`` DTensor's piece is kept (a copy) and reduced
  at the end, like ``redistribute`` to ``Replicate`` would (one flat buffer per Partial
  dimensions and dtype), once a probe showed that every rank of its mesh met the same Partial
  tensors: a collective where the hooks meet it would hang the job, or sum different tensors,
  when the ranks meet them in different orders or numbers. Those not every rank met are not
  recorded (``None``; a note says "the ranks met different partial-sum tensors"). A
  plain tensor carries no placement: along each mesh dimension, ranks whose pieces are bitwise
  equal (the same checksums of their bits, shape and dtype) hold a
  replica and count once (the input of a ``ColwiseParallel`` layer, a ``RowwiseParallel``
  output after its all-reduce, position ids), while pieces that differ are shards or another
  rank's data (a ``ColwiseParallel`` output, the batch of a data-parallel rank) and all count.
  So an activation of an FSDP2 job is summarised as the activation of the global batch.
* **Every mesh in one order.** The capture reduces every mesh it knows (the parameters', known
  to every rank at the start, then those met later) in an order that does not depend on the
  rank (the main mesh first, then by dimension names, shape and ranks), a mesh this rank met
  nothing on as well; when the ranks did not meet the same later meshes (told by the main
  mesh's probe), only the parameters' meshes are reduced and the rest is not recorded.
* **Few collectives, on the mesh's own groups**, once per capture and per mesh, whatever the
  number of tensors (each an ``all_reduce``/``all_gather`` along every mesh dimension): the
  number of tensors (a check that every rank captured the same ones), the plain tensors'
  fingerprints, one (N, 8) fp64 sum, one (N, 2) max (``-min``, ``max``), then the histograms
  over the now common range ``[min, max]``, binned like ``torch.histc``, in one (N, bins) sum
  (with the whole-piece checksums :mod:`hooks.sharded.replicas` asks for). On a 1-D mesh
  (FSDP2 alone, tensor parallel alone) that is one ``all_reduce`` and two all_gathers:
  every rank's numbers, then every rank's histograms, summed by each rank in rank order.
* **Which rank's piece holds a NaN/Inf**: a bit per rank, summed without the replica weights,
  kept in :attr:`MeshStats.nonfinite_ranks`; the capture names them in notes (``a NaN in rank
  1's shard of w2``).

Exactness: counts, min, max and the histogram are exact; sums are fp64 sums of per-rank sums
(the order differs from a single process's, so they agree to float rounding; the std of the
full tensor comes from ``Σx²`` and ``Σx``, which loses digits where ``|mean| >> std``: ~1e-3
relative at mean/std = 1e6). Gradients of
activations are those of each rank's own backward (each data-parallel rank differentiates its
own loss), summed like any tensor. A plain tensor whose shards happen to be bitwise equal on
every rank of a mesh dimension (an all-zero shard everywhere) is taken for a replica.

Tensors are matched across ranks by where the capture met them (module, call, input or output
or gradient, position; a parameter by name). When the ranks did not capture the same tensors
(an MoE expert that received no token on one rank is not called there), the union is reduced:
each tensor over the ranks that hold it, and a note says so.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Iterable
from typing import Any

import torch

from hooks.sharded.replicas import (
    MAX_HELD_BYTES,
    Fingerprint,
    candidates,
    confirm,
    replicas,
    table,
    wholes,
)
from hooks.tensors.stats import (
    CANCELLATION_MAX,
    HIST_SAMPLE,
    NUM_BINS,
    ZERO_EXACT_NUMEL,
    TensorStats,
    count_nonzero,
    hist_sample,
    stats_from_moments,
)
from hooks.trace.records import Note, ParamGradRecord

__all__ = ["MeshStats", "SLOT_BASE", "is_dtensor", "local_piece",
           "sharded_parameters"]

#: At most this many non-finite parameters (weights first, then gradients) get a note each.
MAX_NOTES = 4
#: Slots of :class:`MeshStats` start here, so that a capture tells them from
#: :class:`hooks.tensors.stats.StatsBatch` slots.
SLOT_BASE = 1 << 40

# columns of the summed moments (_UNCOUNTED: pieces whose zeros were not counted)
_COUNT, _SUM, _SUMSQ, _NNZ, _NAN, _INF, _NUMEL, _BITS, _UNCOUNTED = range(9)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it)."""
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(t, cls)


def local_piece(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t``, detached: a DTensor's local shard, else ``t`` itself."""
    if is_dtensor(t):
        local = getattr(t, "_local_tensor", None)  # what to_local() returns, without dispatch
        if isinstance(local, torch.Tensor):
            return local.detach()
        with torch.no_grad():
            return t.detach().to_local()
    return t.detach()


def sharded_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every DTensor parameter of ``model``, in
    ``named_parameters`` order."""
    return [(n, p) for n, p in model.named_parameters() if is_dtensor(p)]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _key(text: str) -> int:
    """A 62-bit hash of ``text``, the same in every process (``hash()`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


class _Entry:
    """One tensor's piece on this rank: ``head`` (count of finite values, NaN, Inf, numel, the
    rank's bit when non-finite, -min, max) and ``sums`` (sum, sum of squares, non-zero count,
    1.0 when zeros were not counted; a ``light`` entry: no sum, non-zeros not counted) as
    Python numbers, the histogram ``sample`` of its finite values and, for a plain tensor, its
    ``fingerprint`` (:class:`hooks.sharded.replicas.Fingerprint`)."""

    __slots__ = ("mesh", "weights", "head", "sums", "light", "sample", "fingerprint", "key",
                 "pending", "dropped")

    def __init__(self, mesh: Any, weights: list[float | None] | None, head: list[float] | None,
                 sums: list[float] | None, sample: torch.Tensor, fingerprint: Any,
                 key: int = 0, light: bool = False):
        self.mesh = mesh
        #: a Partial DTensor's piece, summarised at finalize (:class:`_Pending`), else None
        self.pending: _Pending | None = None
        self.dropped = False  # not recorded (its TensorStats is None)
        # per mesh dimension (DTensor; None on a dimension: from fingerprints), or None: all
        # dimensions from fingerprints (a plain tensor)
        self.weights = weights
        self.head = head
        self.sums = sums
        self.light = light
        self.sample = sample
        self.fingerprint = fingerprint
        self.key = key  # which tensor of the capture it is (matched across ranks)

    @classmethod
    def absent(cls, mesh: Any, key: int) -> _Entry:
        """A tensor another rank captured and this one did not: counts nothing."""
        fp = Fingerprint.unique(_rank())  # a replica of nothing
        return cls(mesh, None, list(_NONE), [0.0, 0.0, 0.0, 0.0], _EMPTY, fp, key)

    def drop(self) -> None:
        """Not recorded on this rank: counts nothing in the reduction, its result is None."""
        self.head, self.sums = list(_NONE), [0.0, 0.0, 0.0, 0.0]
        self.sample, self.light, self.weights = _EMPTY, False, None
        self.fingerprint = Fingerprint.unique(_rank())
        self.pending, self.dropped = None, True


class _Pending:
    """A ``Partial`` DTensor's local piece, kept (a copy) until :meth:`MeshStats.finalize`
    reduces it: ``pkey`` (which tensor, its shape, dtype and partial dimensions: matched across
    ranks), ``dims`` (``(mesh dimension, reduce op)`` of each ``Partial`` one), ``mesh`` (its
    DTensor's mesh), ``spread`` (a fingerprint is wanted after the reduction) and ``where``."""

    __slots__ = ("x", "pkey", "dims", "mesh", "spread", "where")

    def __init__(self, x: torch.Tensor, key: int, dims: tuple[tuple[int, str], ...], mesh: Any,
                 spread: bool, where: str) -> None:
        self.x, self.dims, self.mesh, self.spread, self.where = x, dims, mesh, spread, where
        self.pkey = _key(f"{key}|{tuple(x.shape)}|{x.dtype}|{dims}")


_EMPTY = torch.zeros(0)


def _host(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the CPU, where the histogram sample, the checksum and the reduction of a
    piece are taken (a copy of a device tensor: slow, but not yet measured on GPUs here)."""
    return x if x.is_cpu else x.cpu()


def _flat(x: torch.Tensor) -> torch.Tensor:
    if x.dtype is not torch.float32 and x.dtype is not torch.float64:
        x = x.float()
    return x.view(-1) if x.is_contiguous() else x.reshape(-1)


def _nonfinite(xf: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(NaN count, Inf count, the finite values) of a flat tensor."""
    fin = torch.isfinite(xf)
    nan = int(torch.isnan(xf).sum())
    good = xf[fin]
    return nan, xf.numel() - good.numel() - nan, good


_NONE = [0.0, 0.0, 0.0, 0.0, 0.0, -math.inf, -math.inf]


def _extremes(xf: torch.Tensor) -> tuple[float, float]:
    """(min, max) of a flat tensor, from one ``aminmax`` (on the capture's own activations it
    ran as fast as numpy's ``min`` and ``max``, or ``amin`` and ``amax``, or faster)."""
    mn, mx = torch.aminmax(xf)
    return mn.item(), mx.item()


def _moments(x: torch.Tensor) -> tuple[list[float], list[float], torch.Tensor]:
    """(head, sums, histogram sample of the finite values) of a local piece (see
    :class:`_Entry`), as :class:`hooks.tensors.stats.StatsBatch` takes them on CPU: no copy of the
    tensor, fp32 sum and dot (fp64, from an fp64 copy, where ``|mean| > ~1.7 std`` would lose
    their precision), zeros counted where the piece is small or its sample holds one (else
    ``sums[3]`` is 1: not counted)."""
    n = x.numel()
    if not n:
        return list(_NONE), [0.0, 0.0, 0.0, 0.0], _EMPTY
    xf = _flat(x)
    last = x.shape[-1] if x.dim() else 1
    lo, hi = _extremes(xf)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return _moments_nonfinite(xf, n, last)
    s, ss = xf.sum().item(), torch.dot(xf, xf).item()
    sample, k = hist_sample(xf, last)
    if n <= HIST_SAMPLE:  # the sample is the piece, padded with zeros
        counted, nnz = True, float(torch.count_nonzero(sample).item())
    else:
        counted = n <= ZERO_EXACT_NUMEL or torch.count_nonzero(sample).item() < HIST_SAMPLE
        nnz = float(count_nonzero(xf)) if counted else float(n)
    var = (ss - s * s / n) if n > 1 else 1.0
    if n > 1 and (not (math.isfinite(s) and math.isfinite(ss)) or var * CANCELLATION_MAX <= ss):
        xd = xf.double()
        s, ss = xd.sum().item(), torch.dot(xd, xd).item()
    return [float(n), 0.0, 0.0, n, 0.0, -lo, hi], [s, ss, nnz, float(not counted)], sample[:k]


def _moments_nonfinite(xf: torch.Tensor, n: int, last: int
                       ) -> tuple[list[float], list[float], torch.Tensor]:
    """:func:`_moments` of a piece holding NaN or Inf: of its finite values, in fp64."""
    nan, inf, xf = _nonfinite(xf)
    bit = float(2 ** _rank())
    if not xf.numel():
        return [0.0, nan, inf, n, bit, -math.inf, -math.inf], [0.0, 0.0, 0.0, 0.0], _EMPTY
    lo, hi = (v.item() for v in torch.aminmax(xf))
    xd = xf.double()
    s, ss = xd.sum().item(), torch.dot(xd, xd).item()
    sample, k = hist_sample(xf, last)
    return ([float(xf.numel()), nan, inf, n, bit, -lo, hi],
            [s, ss, float(count_nonzero(xf)), 0.0], sample[:k])


def _light(x: torch.Tensor) -> tuple[list[float], list[float]]:
    """(head, sums) of a parameter's or gradient's local piece: what a
    :class:`~hooks.trace.records.ParamGradRecord` needs (norm, abs-max, NaN/Inf counts); the sum is
    not taken and zeros are not counted."""
    n = x.numel()
    if not n:
        return list(_NONE), [0.0, 0.0, 0.0, 0.0]
    xf = _flat(x)
    lo, hi = _extremes(xf)
    nan = inf = 0
    if not (math.isfinite(lo) and math.isfinite(hi)):
        nan, inf, xf = _nonfinite(xf)
        lo, hi = (xf.min().item(), xf.max().item()) if xf.numel() else (math.inf, -math.inf)
    bit = float(2 ** _rank()) if nan or inf else 0.0
    count = float(xf.numel())
    ss = torch.dot(xf, xf).item() if xf.numel() else 0.0
    return [count, nan, inf, n, bit, -lo, hi], [0.0, ss, count, 1.0]


def _aliases_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter or a view of one (FSDP2 frees an unsharded parameter's
    storage after the step, without moving its version counter)."""
    return isinstance(t, torch.nn.Parameter) or isinstance(getattr(t, "_base", None),
                                                           torch.nn.Parameter)


def _mesh_groups(mesh: Any) -> list[Any]:
    return [mesh.get_group(d) for d in range(mesh.ndim)]


class MeshStats:
    """Full-tensor statistics of the tensors of one capture in a sharded job (see the module
    docstring); :meth:`for_model` makes one when the model has DTensor parameters.

    Args:
        mesh: The ``DeviceMesh`` plain tensors (activations) are reduced over: the model's
            parameters' mesh with the most ranks.
        bins: Histogram bins per tensor.
    """

    def __init__(self, mesh: Any, bins: int = NUM_BINS) -> None:
        self.mesh = mesh
        self.bins = bins
        self._entries: list[_Entry] = []
        #: Names of DTensor parameters whose gradient arrived during the capture.
        self.touched: set[str] = set()
        #: Per slot (``slot - SLOT_BASE``): ranks whose piece holds NaN/Inf, after finalize.
        self.nonfinite_ranks: list[list[int]] = []
        self._grads_before: dict[str, tuple[int, int]] = {}
        self._grad_now: dict[str, tuple[int, int]] = {}
        self._at_grad: dict[str, tuple[_Entry, _Entry]] = {}
        self._params: dict[str, tuple[int | None, int]] = {}
        #: Set by the capture before it adds a call's tensors (``module#call/out``): with the
        #: tensor's rank in that group, it names the tensor across ranks.
        self.where = ""
        self._seen: dict[str, int] = {}
        self._coords: dict[int, list[int]] = {}
        #: every mesh of the capture: the main one, the parameters' (known to every rank
        #: before the capture starts: ``_planned`` of them), then those met later
        self._meshes: list[Any] = [mesh]
        self._canon: dict[int, tuple[Any, Any]] = {id(mesh): (mesh, mesh)}
        self._planned = 1
        self._held = 0  # bytes of storages held for the exit (hooks.sharded.replicas)
        self._held_storages: set[int] = set()

    @classmethod
    def for_model(cls, model: torch.nn.Module, bins: int = NUM_BINS) -> MeshStats | None:
        """A :class:`MeshStats` for ``model`` when it has DTensor parameters and the process
        group is initialised; ``None`` otherwise (DDP and single-process models: nothing
        changes)."""
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        meshes = {}
        for _, p in sharded_parameters(model):
            m = p.device_mesh
            meshes.setdefault(id(m), m)
        if not meshes:
            return None
        mesh = max(meshes.values(), key=lambda m: (m.size(), m.ndim))
        ms = cls(mesh, bins)
        for m in meshes.values():  # the parameters' meshes, the same on every rank
            ms._know(m)
        ms._planned = len(ms._meshes)
        for name, p in sharded_parameters(model):
            g = p.grad
            ms._grads_before[name] = (id(g), g._version) if g is not None else (0, -1)
        return ms

    def owns(self, t: Any) -> bool:
        """Whether ``t`` is summarised here (a DTensor)."""
        return is_dtensor(t)

    def touch(self, name: str, param: torch.Tensor) -> None:
        """DTensor parameter ``name`` received its gradient (after FSDP2's reduce-scatter or
        the tensor-parallel backward): summarise its gradient and weight now (an optimizer may
        change or free them before the capture ends); reduced at :meth:`finalize`."""
        self.touched.add(name)
        g = param.grad
        if g is not None and is_dtensor(g):
            self._at_grad[name] = (self._entry(g, f"grad {name}", light=True),
                                   self._entry(param, f"param {name}", light=True))

    # -- adding ------------------------------------------------------------------------------
    def add(self, t: torch.Tensor) -> int | None:
        """Summarise this rank's piece of ``t`` (a DTensor, or a plain tensor of the job);
        return its slot (≥ :data:`SLOT_BASE`), or ``None`` for a complex tensor."""
        if t.is_complex():
            return None
        return self._append(self._entry(t))

    def _append(self, e: _Entry) -> int:
        self._entries.append(e)
        return SLOT_BASE + len(self._entries) - 1

    def _name(self, where: str | None = None) -> int:
        where = self.where if where is None else where
        k = self._seen.get(where, 0)
        self._seen[where] = k + 1
        return _key(f"{where}:{k}")

    def _entry(self, t: torch.Tensor, where: str | None = None, light: bool = False) -> _Entry:
        mesh, weights, dims = self.mesh, None, ()
        if is_dtensor(t):
            mesh = self._know(t.device_mesh)
            weights = self._placement_weights(mesh, t.placements)
            piece = local_piece(t)
            x = piece if light else _host(piece)
            spread = None if light else self._on_main_mesh(mesh, weights)
            # a Partial one: its piece kept, reduced at finalize once every rank is known to
            # hold the same ones (a collective here would hang when they do not)
            dims = tuple((d, p.reduce_op) for d, p in enumerate(t.placements) if p.is_partial())
            pmesh = mesh
            wanted = spread is not None and not dims
            if spread is not None:  # e.g. an activation on the "tp" sub-mesh of (dp, tp)
                mesh, weights = self.mesh, spread
        else:
            x, wanted = _host(t.detach()), True
        text = self.where if where is None else where
        key = self._name(where)
        if dims:
            e = _Entry(mesh, weights, None, None, _EMPTY, None, key, light=light)
            e.pending = _Pending(x.clone(), key, dims, pmesh, spread is not None, text)
            return e
        if light:
            head, sums = _light(x)
            return _Entry(mesh, weights, head, sums, _EMPTY, None, key, light=True)
        head, sums, sample = _moments(x)
        fp = self._fingerprint(x, head, sample, t.is_cpu and not _aliases_parameter(t)) \
            if wanted else None
        return _Entry(mesh, weights, head, sums, sample, fp, key)

    def _fingerprint(self, x: torch.Tensor, head: list[float], sample: torch.Tensor,
                     hold: bool) -> Fingerprint:
        """The :class:`~hooks.sharded.replicas.Fingerprint` of piece ``x`` whose
        :func:`_moments` are ``head`` and ``sample``; held (``hold``) while the storages the
        capture holds (each counted once, whole: a held view keeps all of its storage alive)
        stay within :data:`hooks.sharded.replicas.MAX_HELD_BYTES`."""
        return Fingerprint.of(x, sample, not (head[1] or head[2]), self._admit if hold else False)

    def _admit(self, ptr: int, nbytes: int) -> bool:
        """Whether a piece of the storage at ``ptr`` (``nbytes`` bytes) may be held: counted
        once per storage, against :data:`hooks.sharded.replicas.MAX_HELD_BYTES`."""
        if ptr in self._held_storages:
            return True
        if self._held + nbytes > MAX_HELD_BYTES:
            return False
        self._held_storages.add(ptr)
        self._held += nbytes
        return True

    def _on_main_mesh(self, mesh: Any, weights: list[float]) -> list[float | None] | None:
        """A DTensor activation on a sub-mesh of the capture's mesh (a tensor-parallel layer's
        input in a 2-D job): its weights on the capture's mesh dimensions, ``None`` on those
        its mesh lacks (its pieces there differ by data, or are replicas: told by
        checksums). ``None`` when ``mesh`` is the capture's or cannot be placed in it."""
        main = self.mesh
        if mesh is main or mesh.ndim >= main.ndim:
            return None
        names, mains = getattr(mesh, "mesh_dim_names", None), getattr(main, "mesh_dim_names",
                                                                     None)
        if not names or not mains or not set(names) <= set(mains):
            return None
        by_name = dict(zip(names, weights, strict=True))
        return [by_name.get(n) for n in mains]

    def _placement_weights(self, mesh: Any, placements: Any) -> list[float]:
        coord = self._coords.get(id(mesh))
        if coord is None:
            coord = self._coords[id(mesh)] = mesh.get_coordinate() or [0] * mesh.ndim
        # a Replicate dimension counts on coordinate 0 only; Shard and _StridedShard (FSDP2
        # over a tensor-parallel dimension) on every coordinate; a Partial one like Replicate
        # (its pieces are summed at finalize, every coordinate then holds the sum)
        return [float(not (p.is_replicate() or p.is_partial()) or coord[d] == 0)
                for d, p in enumerate(placements)]

    def _know(self, mesh: Any) -> Any:
        """The mesh this capture uses for ``mesh``: the first one met equal to it (a
        ``DeviceMesh`` compares by ranks, layout and dimension names), so that one mesh's
        entries are reduced together, on one set of groups."""
        hit = self._canon.get(id(mesh))
        if hit is not None:
            return hit[1]
        same = next((m for m in self._meshes if m == mesh), None)
        if same is None:
            self._meshes.append(mesh)
            same = mesh
        self._canon[id(mesh)] = (mesh, same)  # the mesh held: its id is not reused
        return same

    # -- parameters --------------------------------------------------------------------------
    def add_params(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Add the weight and gradient of each DTensor parameter of ``named`` (before
        :meth:`finalize`)."""
        for name, p in named:
            if not is_dtensor(p):
                continue
            at = self._at_grad.get(name)
            if at is not None:  # read when its gradient arrived
                self._params[name] = (self._append(at[0]), self._append(at[1]))
                continue
            g = p.grad
            gslot = self._append(self._entry(g, f"grad {name}", light=True)) \
                if g is not None and is_dtensor(g) else None
            self._params[name] = (gslot, self._append(self._entry(p, f"param {name}",
                                                                  light=True)))

    # -- reducing ----------------------------------------------------------------------------
    def finalize(self, trace: Any = None) -> list[TensorStats | None]:
        """Reduce every entry across its mesh (collectives: every rank of the mesh must call
        this at the same point) and return one :class:`TensorStats` per slot, in slot order
        (``None``: not recorded, a note says why); notes go to ``trace.notes``.

        Every mesh of the capture is processed, in an order that does not depend on the rank
        (the main mesh first, then by dimension names, shape and ranks), a mesh this rank has
        no entry on as well: the collectives of every rank match. A probe per mesh (counts
        and hashes of the tensors' keys, one ``all_reduce`` per mesh dimension) tells whether
        the ranks met the same tensors before anything depends on it."""
        out: list[TensorStats | None] = [None] * len(self._entries)
        self.nonfinite_ranks = [[] for _ in self._entries]
        meshes = [self.mesh] + sorted(self._meshes[1:], key=_mesh_order)
        by_mesh: list[list[int]] = [[] for _ in meshes]
        partial: list[list[int]] = [[] for _ in meshes]
        at = {id(m): j for j, m in enumerate(meshes)}
        for i, e in enumerate(self._entries):
            by_mesh[at[id(e.mesh)]].append(i)
            if e.pending is not None:
                partial[at[id(e.pending.mesh)]].append(i)
        # the main mesh's probe also compares the meshes met after the start: when they
        # differ, only the parameters' meshes (the same everywhere) are reduced
        extra = sorted(_mesh_name(m) for m in meshes if all(m is not k for k in
                                                            self._meshes[:self._planned]))
        first = self._probe(meshes[0], by_mesh[0], partial[0], extra)
        sames = [first[:2]]
        if not first[2]:
            meshes, lost = self._planned_only(meshes, by_mesh, partial)
            if trace is not None and lost:
                trace.notes.append(Note(
                    "sharded", f"{lost} tensor(s) not recorded: they are DTensors of a device "
                    "mesh that not every rank met during the capture"))
        sames += [self._probe(m, by_mesh[j], partial[j]) for j, m in enumerate(meshes) if j]
        for j, m in enumerate(meshes):
            self._partials(m, partial[j], sames[j][1], trace)
        for j, m in enumerate(meshes):
            self._reduce(m, by_mesh[j], out, trace, sames[j][0])
        return out

    def _planned_only(self, meshes: list[Any], by_mesh: list[list[int]],
                      partial: list[list[int]]) -> tuple[list[Any], int]:
        """Keep the meshes known at the start (drop the entries of the others, and the
        Partial ones of the others on a kept mesh); edits the lists in place."""
        planned = {id(m) for m in self._meshes[:self._planned]}
        keep = [j for j, m in enumerate(meshes) if id(m) in planned]
        lost = 0
        for j, m in enumerate(meshes):
            for i in by_mesh[j]:
                e = self._entries[i]
                if id(m) not in planned or (e.pending is not None
                                            and id(e.pending.mesh) not in planned):
                    e.drop()
                    lost += 1
        by_mesh[:] = [by_mesh[j] for j in keep]
        partial[:] = [[i for i in partial[j] if not self._entries[i].dropped] for j in keep]
        return [meshes[j] for j in keep], lost

    def _probe(self, mesh: Any, idxs: list[int], pidxs: list[int],
               extra: list[str] | None = None) -> list[bool]:
        """Whether every rank of ``mesh`` holds [the same entries in the same order, the same
        Partial pieces, (``extra``) the same names of other meshes]: counts and hashes,
        ``max`` of each and of its negative, one ``all_reduce`` per mesh dimension."""
        import torch.distributed as dist

        lists = [[self._entries[i].key for i in idxs],
                 sorted(self._entries[i].pending.pkey for i in pidxs)]
        if extra is not None:
            lists.append([_key(x) for x in extra])
        v = []
        for keys in lists:
            h = 0
            for k in keys:
                h = (h * 1_000_003 + k) % (1 << 61)
            v += [len(keys), h]
        probe = torch.tensor(v + [-x for x in v], dtype=torch.int64)
        for g in _mesh_groups(mesh):
            dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=g)
        n = len(v)
        same = (probe[:n] == -probe[n:]).tolist()
        return [same[k] and same[k + 1] for k in range(0, n, 2)]

    def _partials(self, mesh: Any, idxs: list[int], same: bool, trace: Any) -> None:
        """Sum (or reduce by their op) the Partial pieces of ``mesh`` that every rank holds,
        one flat buffer per (Partial dimensions, dtype), and summarise them; the others are
        not recorded (a note)."""
        import torch.distributed as dist

        groups = _mesh_groups(mesh)
        es = sorted((self._entries[i] for i in idxs), key=lambda e: e.pending.pkey)
        if not same:  # only the pieces every rank of the mesh holds
            common = set(_gathered([e.pending.pkey for e in es], groups, both=True)[0])
            gone = [e for e in es if e.pending.pkey not in common]
            es = [e for e in es if e.pending.pkey in common]
            if trace is not None and gone:
                names = ", ".join(e.pending.where for e in gone[:4])
                trace.notes.append(Note(
                    "sharded", f"{len(gone)} partial-sum DTensor(s) not recorded ({names}"
                    f"{' ...' if len(gone) > 4 else ''}): the ranks met different partial-sum "
                    "tensors, and summing their pieces would mix different tensors"))
            for e in gone:
                e.drop()
        buckets: dict[tuple, list[_Entry]] = {}
        for e in es:
            buckets.setdefault((e.pending.dims, str(e.pending.x.dtype)), []).append(e)
        for bk in sorted(buckets, key=repr):
            group = buckets[bk]
            flat = torch.cat([e.pending.x.reshape(-1) for e in group])
            for d, op in bk[0]:
                if op == "avg":
                    dist.all_reduce(flat, group=groups[d])
                    flat /= dist.get_world_size(groups[d])
                else:
                    dist.all_reduce(flat, op=getattr(dist.ReduceOp, op.upper(),
                                                     dist.ReduceOp.SUM), group=groups[d])
            pos = 0
            for e in group:
                x = e.pending.x
                self._fill(e, flat[pos:pos + x.numel()].view(x.shape))
                pos += x.numel()

    def _fill(self, e: _Entry, x: torch.Tensor) -> None:
        """Summarise a reduced Partial piece ``x`` into ``e``."""
        spread, e.pending = e.pending.spread, None
        if e.light:
            e.head, e.sums = _light(x)
        else:
            e.head, e.sums, e.sample = _moments(x)
        if spread:
            e.fingerprint = self._fingerprint(x, e.head, e.sample, True)  # (x: the sum)

    def _reduce(self, mesh: Any, idxs: list[int], out: list, trace: Any, same: bool) -> None:
        groups = _mesh_groups(mesh)
        mine = [self._entries[i] for i in idxs]
        if same:  # every rank captured the same tensors, in the same order
            entries, rows = mine, list(range(len(mine)))
        else:  # calls some ranks made and others did not (an MoE expert without tokens)
            union, differ = _gathered([e.key for e in mine], groups, both=False)
            at = {k: j for j, k in enumerate(union)}
            entries = [_Entry.absent(mesh, k) for k in union]
            rows = []
            for e in mine:
                entries[at[e.key]] = e
                rows.append(at[e.key])
            if trace is not None and differ:  # (not only in another order)
                trace.notes.append(Note(
                    "sharded", f"the ranks captured different tensors ({len(mine)} here, "
                    f"{len(union)} in all): each is reduced over the ranks that hold it; a call "
                    "that ran on some ranks only is recorded by those"))
        if not entries:
            return
        self._reduce_entries(mesh, groups, entries, rows, idxs, out, trace)

    def _reduce_entries(self, mesh: Any, groups: list[Any], entries: list[_Entry],
                        rows: list[int], idxs: list[int], out: list, trace: Any) -> None:
        """Reduce ``entries`` (the same list, in the same order, on every rank of ``mesh``);
        ``self._entries[idxs[k]]`` is ``entries[rows[k]]``."""
        import torch.distributed as dist

        if len(groups) == 1:  # two all_gathers bring every rank's numbers, summed here
            mom, mm, hist, lost = self._one_dim(entries, mesh, groups[0])
        else:
            weights, lost = self._weights(entries, mesh, groups)
            mom, mm = _matrices(entries)
            mom[:, :_BITS] *= weights[:, None]
            # a tensor lost along one dimension is lost on every rank of the mesh: its flag
            # rides with the maxima
            mm = torch.cat([mm, lost.double()[:, None]], 1)
            for g in groups:
                dist.all_reduce(mom, group=g)
                dist.all_reduce(mm, op=dist.ReduceOp.MAX, group=g)
            lost, mm = mm[:, 2] > 0, mm[:, :2].contiguous()
            hist = self._histograms(entries, mm, weights)
            for g in groups:
                dist.all_reduce(hist, group=g)
        moms, mms = mom.tolist(), mm.tolist()  # one read-back each
        hists = hist.to(torch.int64).tolist()  # (counts: integers)
        lost = lost.tolist()
        for e in entries:
            if e.fingerprint is not None:
                e.fingerprint.release()
        gone = sum(1 for row in rows if lost[row])
        if trace is not None and gone:
            trace.notes.append(Note(
                "sharded", f"{gone} tensor(s) not recorded: on some rank written in place (or "
                "its storage freed) before the capture ended, so whether the ranks' pieces are "
                "replicas (counted once) or different data (counted on each) could no longer "
                "be told from their bits"))
        for row, i in zip(rows, idxs, strict=True):
            if self._entries[i].dropped or lost[row]:
                continue
            out[i] = self._stats(moms[row], mms[row], hists[row][:-1], hists[row][-1])
            bits = int(moms[row][_BITS])
            self.nonfinite_ranks[i] = [r for r in range(bits.bit_length()) if bits >> r & 1]

    def _one_dim(self, entries: list[_Entry], mesh: Any, group: Any
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """On a 1-D mesh: (N, 9) summed moments, (N, 2) maxima, (N, bins + 1) summed
        histograms and the (N,) tensors whose pieces could not be compared, from two
        all_gathers: every rank's weights, fingerprints, moments and extremes; then every
        rank's histograms over the now common ranges, with the whole-piece checksums
        :func:`hooks.sharded.replicas.candidates` asks for. Each rank tells the replicas (a
        plain piece bitwise equal to a lower coordinate's) and sums in coordinate order, so
        every rank holds the same numbers, as :meth:`_weights` and ``all_reduce`` give them on
        a mesh of more dimensions."""
        import torch.distributed as dist

        mom, mm = _matrices(entries)
        plain = torch.tensor([float(e.weights is None or e.weights[0] is None)
                              for e in entries], dtype=torch.float64)
        fps = [e.fingerprint for e in entries]
        bits = table(fps).view(torch.float64)  # the bits, carried as they are
        static = _static_weights(entries)
        mine = torch.cat([static[:, None], plain[:, None], bits, mom, mm], 1)
        size = dist.get_world_size(group)
        got = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(got, mine, group=group)
        every = torch.stack(got)  # (S, N, 15)
        moms, top = every[:, :, 4:13], every[:, :, 13:15].amax(0)
        me = dist.get_rank(group)  # this rank's row of every gathered table
        cand, need = candidates(every[:, :, 2:4].contiguous().view(torch.int64),
                                every[:, :, 1] > 0)
        hist = self._histograms(entries, top, static)  # (N, bins + 1), unweighted
        whole = wholes(cand, need, fps, me).view(torch.float64)  # (M, 2), bits as they are
        row = torch.cat([hist.reshape(-1), whole.reshape(-1)])
        rows = [torch.empty_like(row) for _ in range(size)]
        dist.all_gather(rows, row, group=group)
        both = torch.stack(rows)  # (S, N·(bins + 1) + 2M)
        split = hist.numel()
        replica, lost = confirm(cand, need,
                                both[:, split:].contiguous().view(torch.int64).view(size, -1, 2))
        w = every[:, :, 0].clone()
        w[replica] = 0.0
        total = torch.cat([(moms[:, :, :_BITS] * w[:, :, None]).sum(0),
                           moms[:, :, _BITS:].sum(0)], 1)
        hists = (both[:, :split].view(size, *hist.shape) * w[:, :, None]).sum(0)
        return total, top, hists, lost

    def _weights(self, entries: list[_Entry], mesh: Any, groups: list[Any]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, lost)``: (N,) 1.0 where this rank's piece counts, 0.0 for a replica of
        a lower coordinate's (a DTensor's by its placements, a plain tensor's by the pieces'
        checksums: one ``all_gather`` per mesh dimension, a second where whole pieces are
        compared, :func:`hooks.sharded.replicas.replicas`); (N,) bool, the tensors whose
        pieces could not be compared."""
        import torch.distributed as dist

        w = _static_weights(entries)
        fps = [e.fingerprint for e in entries]
        tab = table(fps)
        lost = torch.zeros(len(entries), dtype=torch.bool)
        for d, g in enumerate(groups):
            # along this dimension: plain tensors, and DTensors of a sub-mesh without it
            plain = torch.tensor([e.weights is None or e.weights[d] is None for e in entries],
                                 dtype=torch.int64)
            mine = torch.cat([tab, plain[:, None]], 1)
            got = [torch.zeros_like(mine) for _ in range(dist.get_world_size(g))]
            dist.all_gather(got, mine, group=g)
            every = torch.stack(got)  # (S, N, 3), in group-rank order
            me = dist.get_rank(g)
            replica, gone = replicas(every[:, :, :2], every[:, :, 2] > 0, fps, me, g)
            w[replica[me]] = 0.0
            lost |= gone
        return w, lost

    def _histograms(self, entries: list[_Entry], mm: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """(N, bins + 1): each entry's sample binned over the common range like
        ``torch.histc``, weighted; the last column is the number of values binned. The
        samples are the rows of one zero-padded fp64 matrix, scaled by their row's range
        (``(x - lo) * bins / (hi - lo)``, histc's order of operations) and counted by one
        ``bincount``, the padding in a bin of its own that is dropped."""
        from torch.nn.utils.rnn import pad_sequence

        nb, n = self.bins, len(entries)
        hist = torch.zeros(n, nb + 1, dtype=torch.float64)
        w = weights.tolist()
        rows = [r for r, e in enumerate(entries) if e.sample.numel() and w[r]]
        if not rows:
            return hist
        samples = [entries[r].sample for r in rows]
        if any(x.dtype != torch.float32 for x in samples):
            samples = [x.double() for x in samples]
        mat = pad_sequence(samples, batch_first=True).double()  # (R, L)
        lens = torch.tensor([x.numel() for x in samples])
        at = torch.tensor(rows)
        lo, hi = -mm[at, 0], mm[at, 1]
        same = lo == hi
        lo, hi = torch.where(same, lo - 1.0, lo), torch.where(same, hi + 1.0, hi)
        mat.sub_(lo[:, None]).mul_(nb).div_((hi - lo)[:, None])
        idx = mat.nan_to_num_(nan=nb // 2).clamp_(0, nb - 1).to(torch.int64)
        k = len(rows)
        idx += torch.arange(0, k * nb, nb)[:, None]
        idx.masked_fill_(torch.arange(mat.shape[1])[None, :] >= lens[:, None], k * nb)
        counts = torch.bincount(idx.view(-1), minlength=k * nb + 1)[:-1]
        hist[at, :nb] = counts.view(k, nb).double()
        hist[at, nb] = lens.double()
        return hist

    @staticmethod
    def _stats(mom: list[float], mm: list[float], hist: list[int],
               hist_count: int) -> TensorStats:
        count, s, ss, nnz, nan, inf, n, _, uncounted = mom
        count, nan, inf, n = int(count), int(nan), int(inf), int(n)
        if count == 0:
            return TensorStats(numel=n, nan_count=nan, inf_count=inf)
        mean = s / count
        var = max((ss - count * mean * mean) / (count - 1), 0.0) if count > 1 else 0.0
        lo, hi = -mm[0], mm[1]
        st = stats_from_moments(n, count, mean, var, lo, hi, ss, nnz, nan, inf, hist, hist_count)
        if uncounted:
            st.zero_exact, st.zero_frac = False, 0.0
        return st

    # -- parameter records -------------------------------------------------------------------
    def param_records(self, results: Any, trace: Any = None) -> dict[str, ParamGradRecord]:
        """Records of the DTensor parameters added with :meth:`add_params` (names and shapes of
        the unsharded parameter; statistics of the full weight and gradient); notes name the
        ranks whose shard holds NaN/Inf."""
        out: dict[str, ParamGradRecord] = {}
        bad: list[tuple[str, str, TensorStats, int]] = []
        for name, (gslot, wslot) in self._params.items():
            w = results[wslot]
            rec = ParamGradRecord(name, [], "none")
            rec.weight_norm = _norm(w) if w is not None else None
            g = results[gslot] if gslot is not None else None
            if gslot is not None:
                rec.status = "ok" if name in self.touched or self._fresh(name) else "stale"
            if g is not None:  # (None: not recorded, a note says why)
                rec.grad_norm = _norm(g)
                rec.grad_abs_max = (math.nan if g.nan_count else math.inf if g.inf_count
                                    else (g.abs_max if g.abs_max is not None else 0.0))
                rec.nan_count, rec.inf_count = g.nan_count, g.inf_count
                if rec.status == "ok" and rec.grad_abs_max == 0.0:
                    rec.status = "zero"
                if not g.finite:
                    bad.append((name, "gradient", g, gslot))
            if rec.grad_norm is not None and rec.weight_norm:
                rec.ratio = rec.grad_norm / rec.weight_norm
            if w is not None and not w.finite:
                bad.insert(sum(1 for b in bad if b[1] == "weight"), (name, "weight", w, wslot))
            out[name] = rec
        if trace is not None:
            self._notes(trace, bad)
        return out

    def _fresh(self, name: str) -> bool:
        return self._grads_before.get(name) != self._grad_now.get(name)

    def set_shapes(self, named: Iterable[tuple[str, torch.Tensor]],
                   records: dict[str, ParamGradRecord]) -> None:
        """Fill the unsharded shapes and frozen status of ``records``."""
        for name, p in named:
            rec = records.get(name)
            if rec is not None:
                rec.shape = list(p.shape)
                if not p.requires_grad:
                    rec.status = "frozen"

    def remember_grads(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The gradients as they are at the end of the capture (tells fresh from stale)."""
        self._grad_now = {n: ((id(p.grad), p.grad._version) if p.grad is not None else (0, -1))
                          for n, p in named if is_dtensor(p)}

    def _notes(self, trace: Any, bad: list[tuple[str, str, TensorStats, int]]) -> None:
        """A note per non-finite weight, then gradient (at most :data:`MAX_NOTES`, the rest
        counted), naming the ranks whose shard holds the NaN/Inf."""
        for name, what, st, slot in bad[:MAX_NOTES]:
            ranks = self.nonfinite_ranks[slot - SLOT_BASE]
            if len(ranks) == 1:
                where = f"in rank {ranks[0]}'s shard"
            elif ranks:
                where = f"in the shards of ranks {', '.join(map(str, ranks))}"
            else:
                where = "on no rank's own piece"
            parts = [f"{st.nan_count} NaN"] if st.nan_count else []
            parts += [f"{st.inf_count} Inf"] if st.inf_count else []
            trace.notes.append(Note(
                "nonfinite_shard",
                f"{name}: its {what} holds {' and '.join(parts)} of {st.numel} values, {where}",
                module=name.rpartition(".")[0]))
        if len(bad) > MAX_NOTES:
            rest = bad[MAX_NOTES:]
            trace.notes.append(Note(
                "nonfinite_shard", f"and {len(rest)} more non-finite parameters or gradients: "
                + ", ".join(f"{n} ({w})" for n, w, _, _ in rest[:5])
                + (" ..." if len(rest) > 5 else "")))


def _mesh_name(mesh: Any) -> str:
    """What names a mesh alike on every rank: its dimension names, number and sizes."""
    return f"{getattr(mesh, 'mesh_dim_names', None)}|{mesh.ndim}|{tuple(mesh.shape)}"


def _mesh_order(mesh: Any) -> tuple[str, list[int]]:
    """A rank-independent order of meshes: by name, then by the ranks they hold (two meshes
    of one name, e.g. ranks (0, 1) and (0, 2), come in the same order on every rank)."""
    return _mesh_name(mesh), mesh.mesh.reshape(-1).tolist()


def _gathered(keys: list[int], groups: list[Any], both: bool) -> tuple[list[int], bool]:
    """The sorted union (``both``: intersection) of the keys of every rank of the mesh
    (``all_gather``s along each of its dimensions, in turn), and whether the sets this rank
    saw differed (False: the same keys, in another order)."""
    import torch.distributed as dist

    have, differ = sorted(set(keys)), False
    for g in groups:
        size = dist.get_world_size(g)
        n = torch.tensor([len(have)], dtype=torch.int64)
        ns = [torch.zeros_like(n) for _ in range(size)]
        dist.all_gather(ns, n, group=g)
        m = max(int(x) for x in ns)
        mine = torch.full((m,), -1, dtype=torch.int64)
        mine[: len(have)] = torch.tensor(have, dtype=torch.int64)
        got = [torch.zeros_like(mine) for _ in range(size)]
        dist.all_gather(got, mine, group=g)
        sets = [{int(v) for v in t.tolist() if v >= 0} for t in got]
        have = sorted(set.intersection(*sets) if both else set.union(*sets))
        differ = differ or any(len(x) != len(have) for x in sets)
    return have, differ


def _norm(st: TensorStats) -> float:
    if st.nan_count:
        return math.nan
    if st.inf_count:
        return math.inf
    return st.l2 if st.l2 is not None else 0.0


def _static_weights(entries: list[_Entry]) -> torch.Tensor:
    """(N,) fp64: each piece's weight from its placements (1.0 for a plain tensor)."""
    return torch.tensor([math.prod(x for x in e.weights if x is not None)
                         if e.weights is not None else 1.0 for e in entries],
                        dtype=torch.float64)


def _matrices(entries: list[_Entry]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 9) moments (see the ``_COUNT`` … ``_UNCOUNTED`` columns) and (N, 2) (-min, max),
    fp64, from every entry's numbers at once."""
    tab = torch.tensor([e.head + e.sums for e in entries], dtype=torch.float64)  # (N, 11)
    mom = tab[:, [0, 7, 8, 9, 1, 2, 3, 4, 10]]
    return mom, tab[:, 5:7].clone()


class Results:
    """Slot lookup over a :class:`hooks.tensors.stats.StatsBatch`'s results and a
    :class:`MeshStats`'s (slots ≥ :data:`SLOT_BASE`)."""

    def __init__(self, plain: list[TensorStats], mesh: list[TensorStats]) -> None:
        self.plain, self.mesh = plain, mesh

    def __getitem__(self, slot: int) -> TensorStats:
        return self.mesh[slot - SLOT_BASE] if slot >= SLOT_BASE else self.plain[slot]

