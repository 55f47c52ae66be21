"""Tensor statistics: one summary per tensor, computed in as few passes as the numbers allow.

The capture engine summarises every module output, input and gradient, so this is the hot path. A
tensor is read as a detached flat fp32 view (no copy for contiguous fp32 tensors). On CPU three
passes over memory give everything: ``torch.aminmax`` (min, max), ``sum`` and ``torch.dot(x, x)``
(sum of squares), each read back with ``.item()``. The rest is derived: ``mean = sum / n``,
``var = (sumsq - n mean^2) / (n - 1)``, ``abs_max = max(-min, max)``, ``l2 = sqrt(sumsq)``. When
that variance formula would lose precision (``|mean|`` above ~1.7 std: :data:`CANCELLATION_MAX`)
or overflow, an exact two-pass fp64 computation replaces it. When min and max are finite the tensor
holds no NaN and no Inf, so the NaN/Inf counting passes are skipped; only a tensor with non-finite
values takes the slow path, whose statistics describe its finite elements. Zeros are counted with
``dot(sign(x), sign(x))`` (two more passes) in tensors of at most :data:`ZERO_EXACT_NUMEL` elements
and in any tensor whose histogram sample holds a zero; otherwise they are not counted and
:attr:`TensorStats.zero_exact` says so. (``torch.var_mean``, ``count_nonzero`` and a full-size
``torch.histc`` are avoided: on CPU they run 2-50x slower per element than the kernels above.) The
histogram is binned like ``torch.histc`` over ``[min, max]``, exact up to :data:`HIST_SAMPLE`
elements and taken on a strided sample beyond; all histograms of a capture are binned together at
the end.

On other devices :class:`StatsBatch` uses a sync-free formulation and keeps every result on the
device until :meth:`StatsBatch.finalize` converts all of them with one ``tolist()`` per statistic.

``StatsBatch(background=True)`` summarises CPU tensors (of at least :data:`BACKGROUND_MIN_NUMEL`
elements) on one shared worker thread (torch set to one thread there) while the caller's thread
goes on: the batch keeps each tensor and its version counter (``Tensor._version``) until
:meth:`StatsBatch.drain`, which waits for the worker and drops the statistics of any tensor written
in place since it was added (a view or an in-place op bumps the shared counter): such a slot is
``None`` and listed in :attr:`StatsBatch.modified`, never filled with numbers of values the tensor
no longer held when it was added.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

#: Number of histogram bins of every :class:`TensorStats`.
NUM_BINS = 32
#: Tensors with more elements are histogrammed on a strided sample of about this many.
HIST_SAMPLE = 1024
#: Zeros are always counted exactly in tensors of at most this many elements; a larger tensor is
#: counted exactly when its histogram sample holds a zero (see ``TensorStats.zero_exact``).
ZERO_EXACT_NUMEL = 1 << 14
_EXACT_COUNT = 1 << 24  # float32 sums of ones are exact below this
# torch.aminmax (one kernel) for tensors of at most _AMINMAX_SMALL elements, where a kernel's
# fixed cost dominates (a captured step of minillm `tiny` 4-7% faster than with amin + amax),
# and above _AMINMAX_NUMEL, read from memory; in between, in cache, amin + amax run ~1.4x faster
_AMINMAX_SMALL = 1 << 15
_AMINMAX_NUMEL = 1 << 18

#: The one-pass variance (fp32 sum and sum of squares) is kept while the sum of squares is less
#: than this many times the sum of squared deviations (|mean| below ~1.7 std): fp32 sums err by
#: ~1e-7 of themselves, and their difference by that much times this ratio, so the standard
#: deviation stays within ~1e-6 of an fp64 reference; beyond it, the exact two-pass route in fp64.
CANCELLATION_MAX = 4.0

_STAT_FIELDS = ("mean", "std", "min", "max", "abs_max", "l2", "zero_frac")


@dataclass(slots=True)
class TensorStats:
    """Summary statistics of one tensor.

    All values are Python numbers. For a tensor with NaN/Inf elements, ``mean``, ``std``, ``min``,
    ``max``, ``abs_max``, ``l2``, ``zero_frac`` and the histogram describe its *finite* elements
    only (``None`` when it has none), and ``nan_count`` / ``inf_count`` say how many were left out.

    Attributes:
        numel: number of elements.
        mean: arithmetic mean.
        std: standard deviation with Bessel's correction (``torch.std`` default); 0.0 for one
            element.
        min: smallest element.
        max: largest element.
        abs_max: largest absolute value.
        l2: Euclidean norm ``sqrt(sum(x**2))``.
        zero_frac: fraction of elements exactly equal to zero, in [0, 1]. Exact when
            ``zero_exact``; otherwise 0.0 (see there).
        zero_exact: False when ``zero_frac`` was not counted: a CPU tensor of more than
            :data:`ZERO_EXACT_NUMEL` elements whose histogram sample holds no zero. Counting
            them costs two more passes over memory (a third of the summary's time), so it is
            done only when the sample shows zeros. A tensor reported this way has no zero row
            when the sample's stride (about numel / HIST_SAMPLE, made coprime with the last
            dimension) is at most the last dimension; zeros scattered at random are then below
            ~0.3% (95% bound for a sample of HIST_SAMPLE elements). Zeros laid out with exactly
            the stride's period can hide from the sample.
        nan_count: number of NaN elements.
        inf_count: number of +Inf or -Inf elements.
        hist: element counts in ``NUM_BINS`` equal-width bins over ``[hist_min, hist_max]`` (the
            last bin includes ``hist_max``), as ``torch.histc`` counts them. Exact for tensors of
            at most :data:`HIST_SAMPLE` finite elements; larger tensors are counted on a strided
            sample (stride coprime with the last dimension, so every feature column is visited),
            whose size is ``hist_count``. Scale by ``numel / hist_count`` for absolute counts.
        hist_min: lower edge of the first bin (``min``, or ``min - 1`` when ``min == max``).
        hist_max: upper edge of the last bin (``max``, or ``max + 1`` when ``min == max``).
        hist_count: number of elements the histogram counted (``sum(hist)``).
    """

    numel: int
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None
    abs_max: float | None = None
    l2: float | None = None
    zero_frac: float | None = None
    zero_exact: bool = True
    nan_count: int = 0
    inf_count: int = 0
    hist: list[int] = field(default_factory=list)
    hist_min: float | None = None
    hist_max: float | None = None
    hist_count: int = 0

    @property
    def finite(self) -> bool:
        """True when the tensor holds no NaN and no Inf."""
        return self.nan_count == 0 and self.inf_count == 0

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict; non-finite floats become the strings ``"nan"``/``"inf"``."""
        d: dict[str, Any] = {"numel": self.numel}
        for name in _STAT_FIELDS:
            d[name] = encode_float(getattr(self, name))
        d["zero_exact"] = self.zero_exact
        d["nan_count"] = self.nan_count
        d["inf_count"] = self.inf_count
        d["hist"] = list(self.hist)
        d["hist_min"] = encode_float(self.hist_min)
        d["hist_max"] = encode_float(self.hist_max)
        d["hist_count"] = self.hist_count
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorStats:
        """Inverse of :meth:`to_dict`."""
        return cls(
            numel=int(d["numel"]),
            **{name: decode_float(d.get(name)) for name in _STAT_FIELDS},
            zero_exact=bool(d.get("zero_exact", True)),
            nan_count=int(d.get("nan_count", 0)),
            inf_count=int(d.get("inf_count", 0)),
            hist=[int(v) for v in d.get("hist", [])],
            hist_min=decode_float(d.get("hist_min")),
            hist_max=decode_float(d.get("hist_max")),
            hist_count=int(d.get("hist_count", 0)),
        )

    def values(self) -> dict[str, float | None]:
        """The scalar statistics by name (the ones :func:`hooks.trace.diff` compares); ``zero_frac``
        is ``None`` when it was not counted (``zero_exact`` False)."""
        out: dict[str, float | None] = {name: getattr(self, name) for name in _STAT_FIELDS}
        if not self.zero_exact:
            out["zero_frac"] = None
        out["nan_count"] = float(self.nan_count)
        out["inf_count"] = float(self.inf_count)
        return out


def encode_float(v: float | None) -> float | str | None:
    """Encode a float for strict JSON: NaN and +-Inf become ``"nan"``, ``"inf"``, ``"-inf"``."""
    if v is None or math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def decode_float(v: float | str | None) -> float | None:
    """Inverse of :func:`encode_float`."""
    if v is None:
        return None
    return float(v)


@functools.lru_cache(maxsize=256)
def _sample_index(n: int, last_dim: int) -> tuple[torch.Tensor, int]:
    """Positions of the strided histogram sample of a flat tensor of ``n > HIST_SAMPLE``
    elements, padded to HIST_SAMPLE with position 0, and how many are real.

    Every ``stride``-th element, ``stride ~ n / HIST_SAMPLE`` coprime with the last dimension:
    the sample walks through every column instead of repeatedly hitting the same few features
    (and, while ``stride <= last_dim``, through every row).
    """
    stride = -(-n // HIST_SAMPLE)
    while math.gcd(stride, max(last_dim, 1)) != 1:
        stride += 1
    idx = torch.zeros(HIST_SAMPLE, dtype=torch.int64)
    real = torch.arange(0, n, stride)
    idx[: real.numel()] = real
    return idx, real.numel()


def hist_sample(xf: torch.Tensor, last_dim: int) -> tuple[torch.Tensor, int]:
    """``(sample, k)``: a copy of HIST_SAMPLE values of ``xf`` (1-D, CPU) whose first ``k`` are
    the histogram sample — all of ``xf`` when it is that small, else its strided sample
    (:func:`_sample_index`). The padding after them repeats one value (zero, or element 0), so
    that the binning can take it back out of a single bin."""
    n = xf.numel()
    if n <= HIST_SAMPLE:
        return torch.nn.functional.pad(xf, (0, HIST_SAMPLE - n)), n
    idx, k = _sample_index(n, last_dim)
    return torch.index_select(xf, 0, idx), k


def count_nonzero(xf: torch.Tensor) -> int:
    """Non-zero elements of a finite 1-D float tensor.

    ``dot(sign(x), sign(x))`` runs about twice as fast as ``torch.count_nonzero`` on CPU and is
    exact while the count fits the float mantissa (2**24 for fp32); larger tensors fall back.
    """
    if xf.numel() < _EXACT_COUNT:
        sg = torch.sign(xf)
        return int(torch.dot(sg, sg).item())
    return int(torch.count_nonzero(xf).item())


#: A background batch summarises tensors of fewer elements at once, in the caller's thread:
#: their reductions cost less than handing them over, and their results never depend on when
#: the worker reads them.
BACKGROUND_MIN_NUMEL = HIST_SAMPLE
_BIN_EVERY = 64  # the worker bins its histogram samples this many at a time
#: A sleeping worker is woken once this many jobs wait (or by a drain): one wake-up, and one
#: handover of the GIL, per several tensors instead of per tensor.
WAKE_AFTER = 32
#: A background batch waits for the worker once the tensors it holds unread pass this many
#: bytes: memory stays bounded when the worker falls behind (a long no_grad loop).
MAX_PENDING_BYTES = 256 << 20


class _Worker:
    """One daemon thread that runs jobs ``fn(arg)`` in submission order (torch set to one
    thread there, beside the caller's)."""

    def __init__(self) -> None:
        self.jobs: collections.deque[tuple[Callable[[Any], None], Any]] = collections.deque()
        self.wake = threading.Event()
        self.sleeping = False
        self.backlog = 0
        n = torch.get_num_threads()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), name="mdb-stats",
                                       daemon=True)
        self.thread.start()
        ready.wait()
        # set_num_threads(1) there also became the default of threads started later: restore
        # it (this thread's own count is unchanged)
        torch.set_num_threads(n)

    def _run(self, ready: threading.Event) -> None:
        torch.set_num_threads(1)  # this thread's OpenMP team: one thread beside the model's
        try:  # Linux: the model's threads go first; the worker takes the time they leave idle
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + 5)
        except (AttributeError, OSError):  # pragma: no cover - other systems
            pass
        # ATen initialises a thread's count lazily, from the process default, on its first
        # parallel call: make that happen now, while the default is 1
        torch.get_num_threads()
        ready.set()
        jobs, wake = self.jobs, self.wake
        while True:
            while jobs:
                fn, arg = jobs.popleft()
                try:
                    fn(arg)  # jobs catch their own errors
                except BaseException:  # pragma: no cover - the thread must outlive any job
                    pass
            self.sleeping = True
            if jobs:  # appended before we said so: the appender did not wake us
                self.sleeping = False
                continue
            wake.wait()
            wake.clear()
            self.sleeping = False

    def put(self, fn: Callable[[Any], None], arg: Any, urgent: bool = False) -> None:
        self.jobs.append((fn, arg))
        if self.sleeping:
            self.backlog += 1
            if urgent or self.backlog >= WAKE_AFTER:
                self.backlog = 0
                self.wake.set()


_worker: _Worker | None = None
_worker_lock = threading.Lock()


def _shared_worker() -> _Worker:
    """The shared statistics worker, started on first use (and again in a forked child, which
    has no copy of the thread)."""
    global _worker
    with _worker_lock:
        if _worker is None or not _worker.thread.is_alive():
            _worker = _Worker()
        return _worker


def _forget_worker() -> None:
    global _worker, _worker_lock
    _worker, _worker_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker)


def summarize_tensor(t: torch.Tensor, bins: int = NUM_BINS) -> TensorStats:
    """Summarise one tensor (any shape, any real dtype, any device).

    Args:
        t: the tensor; it is read, never modified, and not kept. Integer and bool tensors are
            summarised as fp32 values.
        bins: number of histogram bins.

    Returns:
        TensorStats: see the class for the meaning of each field.

    Raises:
        TypeError: for a complex tensor or a non-tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"summarize_tensor expects a torch.Tensor, got {type(t).__name__}")
    batch = StatsBatch(bins=bins)
    slot = batch.add(t)
    if slot is None:
        raise TypeError(f"cannot summarise a complex tensor (dtype {t.dtype})")
    return batch.finalize()[slot]


class StatsBatch:
    """Collects statistics of many tensors and converts them to Python numbers once.

    ``add`` runs the reductions and keeps only small results, never the tensor itself: on CPU
    five numbers (read back at once) and a copy of the histogram sample (at most
    :data:`HIST_SAMPLE` values); ``finalize`` bins all samples in one vectorised pass.

    Args:
        bins: histogram bins per tensor.
        sync_free: use the device-agnostic formulation that never reads a value back before
            ``finalize`` (default: only on non-CPU devices, where a read-back would stall).
        background: summarise CPU tensors on the shared worker thread (see the module's
            docstring): ``add`` keeps the tensor until :meth:`drain`, which drops the result of
            any tensor written in place after it was added (:attr:`modified`).

    Attributes:
        modified: slots whose tensor was written in place between ``add`` and :meth:`drain`
            (their result is ``None``), in slot order.
        errors: slot -> one line, for a tensor the worker could not summarise (result ``None``).
    """

    def __init__(
        self, bins: int = NUM_BINS, sync_free: bool | None = None, background: bool = False
    ) -> None:
        self.bins = bins
        self.sync_free = sync_free
        self.background = background
        self._out: list[TensorStats | None] = []
        # CPU path: histogram samples binned in finalize, one (sample, k, slot) per tensor:
        # HIST_SAMPLE values each (see hist_sample), the first k of them the sample
        self._samples: list[tuple[torch.Tensor, int, int]] = []
        self._wsamples: list[tuple[torch.Tensor, int, int]] = []  # the worker's, not yet binned
        # sync-free path: per slot device tensors, converted in finalize
        self._dev: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        # background: (slot, tensor, its version when added), until checked after the worker
        # read it (release); _done counts the jobs the worker finished, _checked those checked
        self._jobs: collections.deque[tuple[int, torch.Tensor, int]] = collections.deque()
        self._pending_bytes = 0  # of the tensors added since the last drain
        self._done = 0
        self._checked = 0
        self._worker: _Worker | None = None
        self.modified: list[int] = []
        self.errors: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._out)

    def add(self, t: torch.Tensor, sync: bool = False) -> int | None:
        """Summarise ``t``; return its slot, or ``None`` for a complex tensor. ``sync`` computes
        the statistics now even in a background batch (a tensor about to be overwritten)."""
        x = t.detach()
        if x.is_complex():
            return None
        slot = len(self._out)
        n = x.numel()
        if n == 0:
            self._out.append(TensorStats(numel=0))
            return slot
        if (self.background and not sync and n >= BACKGROUND_MIN_NUMEL and x.is_cpu
                and not self.sync_free):
            try:
                version = x._version  # torch private: the in-place write counter
            except RuntimeError:  # an inference tensor counts no versions: summarised now
                pass
            else:
                if self._checked < self._done:
                    self.release()
                self._out.append(None)
                self._jobs.append((slot, x, version))
                self._pending_bytes += n * x.element_size()
                self.submit(self._job, (slot, x, n))
                if self._pending_bytes > MAX_PENDING_BYTES:
                    self.drain()
                return slot
        if x.dtype is not torch.float32 and x.dtype is not torch.float64:
            x = x.float()
        self._out.append(None)
        sync_free = self.sync_free if self.sync_free is not None else not x.is_cpu
        if sync_free:
            self._add_sync_free(slot, x, n)
        else:
            self._add_cpu(slot, x, n)
        return slot

    def submit(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Run ``fn(arg)`` on the shared worker thread, after every job submitted before it;
        :meth:`drain` waits for it. ``fn`` must catch its own exceptions."""
        if self._worker is None:
            self._worker = _shared_worker()
        self._worker.put(fn, arg)

    def _job(self, arg: tuple[int, torch.Tensor, int]) -> None:
        slot, x, n = arg
        try:
            if x.dtype is not torch.float32 and x.dtype is not torch.float64:
                x = x.float()
            self._add_cpu(slot, x, n, self._wsamples)
            if len(self._wsamples) >= _BIN_EVERY:  # binned here, not at finalize
                self._bin_samples(self._wsamples)
                self._wsamples = []
        except Exception as exc:  # said by the caller, never raised on the worker
            self.errors[slot] = f"{type(exc).__name__}: {exc}"
        self._done += 1  # only this thread writes it

    def release(self) -> None:
        """Check, without waiting, the tensors the worker has finished reading, and let them
        go (a tensor kept until :meth:`drain` would hold its memory): one whose version counter
        moved since ``add`` is dropped (:attr:`modified`). Call it from the thread that runs the
        model, between its ops (no write can be under way then); ``add`` does."""
        jobs, out, errors = self._jobs, self._out, self.errors
        done = self._done
        while self._checked < done:
            slot, x, version = jobs.popleft()
            self._checked += 1
            if x._version != version:
                out[slot] = None
                self.modified.append(slot)
                errors.pop(slot, None)
            elif slot in errors:
                out[slot] = None

    def drain(self) -> None:
        """Wait until the worker has run every job submitted so far; then drop (``None``, and
        listed in :attr:`modified`) the result of every tensor whose version counter moved
        since ``add``, and release the tensors. No-op for a batch with nothing pending."""
        if self._worker is None:
            return
        worker = self._worker
        if worker.thread.is_alive():
            done = threading.Event()
            worker.put(threading.Event.set, done, urgent=True)
            done.wait()
        else:  # a forked child has no copy of the thread: what it had not read is not recorded
            worker.jobs.clear()  # (the job it was running at the fork never finishes here)
            for slot, _, _ in list(self._jobs)[self._done - self._checked:]:
                self.errors[slot] = ("not read: the process forked while the statistics "
                                     "worker had it")
            self._done = self._checked + len(self._jobs)
        self._pending_bytes = 0
        self.release()

    # -- CPU: read a few numbers back (free on CPU), skip NaN/Inf passes for finite tensors --
    def _add_cpu(
        self, slot: int, x: torch.Tensor, n: int, samples: list | None = None
    ) -> None:
        xf = x.reshape(-1)  # a view when x is contiguous
        last = x.shape[-1] if x.dim() else 1
        if _AMINMAX_SMALL < n <= _AMINMAX_NUMEL:
            lo, hi = torch.amin(xf).item(), torch.amax(xf).item()  # .item() on CPU: a read
        else:
            mn, mx = torch.aminmax(xf)
            lo, hi = mn.item(), mx.item()
        nan = inf = 0
        count = n
        if math.isfinite(lo) and math.isfinite(hi):
            # the histogram sample, copied (the tensor is not kept); binned in finalize, all
            # samples at once (one histc per tensor costs ~20 us of overhead)
            sample, k = hist_sample(xf, last)
            # the padding repeats element 0, a zero only if the sample holds one already
            zero_exact = n <= ZERO_EXACT_NUMEL or torch.count_nonzero(sample).item() < HIST_SAMPLE
            if not zero_exact:
                nnz_ = n
            elif n < _EXACT_COUNT:  # dot(sign x, sign x): 2x faster than count_nonzero
                sg = torch.sign(xf)
                nnz_ = torch.dot(sg, sg).item()
            else:
                nnz_ = torch.count_nonzero(xf).item()
            s_, ss_ = xf.sum().item(), torch.dot(xf, xf).item()
        else:
            nan = int(torch.isnan(xf).sum())
            finite = torch.isfinite(xf)
            count = int(finite.sum())
            inf = n - count - nan
            if count == 0:
                self._out[slot] = TensorStats(numel=n, nan_count=nan, inf_count=inf)
                return
            xf = xf[finite]
            mn, mx = torch.aminmax(xf)
            lo, hi, s_, ss_ = torch.stack([mn, mx, xf.sum(), torch.dot(xf, xf)]).tolist()
            nnz_ = count_nonzero(xf)
            zero_exact = True
            sample, k = hist_sample(xf, last)
        mean = s_ / count
        var = (ss_ - count * mean * mean) / (count - 1) if count > 1 else 0.0
        # sum and sum of squares lose precision when |mean| is not small against std (or
        # overflow in fp32): then take the exact two-pass route in fp64 (CANCELLATION_MAX).
        if count > 1 and (
            not (math.isfinite(s_) and math.isfinite(ss_))
            or var * (count - 1) * CANCELLATION_MAX <= ss_
        ):
            xd = xf.double()
            mean = float(xd.mean())
            d = xd - mean
            ss2 = float(torch.dot(d, d))
            var = ss2 / (count - 1)
            ss_ = ss2 + count * mean * mean
        var = max(var, 0.0)
        # one append: the worker may add beside us
        (self._samples if samples is None else samples).append((sample, k, slot))
        st = stats_from_moments(n, count, mean, var, lo, hi, ss_, nnz_, nan, inf, [], k)
        st.zero_exact = zero_exact
        self._out[slot] = st

    def _bin_samples(self, items: list[tuple[torch.Tensor, int, int]]) -> None:
        """Histogram every CPU sample at once, binning like ``torch.histc``.

        The samples are the rows of one (R, HIST_SAMPLE) matrix per dtype; each value maps to
        ``(x - lo) * bins / (hi - lo)`` of its own row, truncated and clamped to the bins; one
        ``bincount`` counts everything. A row's padding (the positions past its sample, all equal
        to the value at position ``k``) is then taken back out of the bin it went to.
        """
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, int, TensorStats]]] = {}
        out = self._out
        for sample, k, slot in items:
            # each result read once: on the worker, release() may drop it (None) meanwhile
            st = out[slot]
            if st is not None:  # not dropped by drain
                by_dtype.setdefault(sample.dtype, []).append((sample, k, st))
        nb, size = self.bins, HIST_SAMPLE
        for kept in by_dtype.values():
            stats = [st for _, _, st in kept]
            rows = len(stats)
            mat = torch.stack([sample for sample, _, _ in kept])
            lo_hi = [(st.hist_min, st.hist_max) for st in stats]  # type: ignore[union-attr]
            bounds = torch.tensor(lo_hi, dtype=mat.dtype)
            lo, width = bounds[:, :1], bounds[:, 1:] - bounds[:, :1]
            if bool(torch.isfinite(width).all() and (width > 0).all()):
                mat.sub_(lo).mul_(nb).div_(width)  # histc's order of operations
            else:
                # a range that is 0 or overflows in this dtype (a constant >= 2**24 in fp32,
                # [-3e38, 3e38]): bin in fp64, where hist_min/hist_max were computed, on halved
                # values (exact), dividing before scaling, so nothing overflows
                mat = mat.double().mul_(0.5)
                bounds = torch.tensor(lo_hi, dtype=torch.float64).mul_(0.5)
                lo, width = bounds[:, :1], bounds[:, 1:] - bounds[:, :1]
                mat.sub_(lo).div_(width).mul_(nb)
            # 0/0 is left only for a constant whose +-1 range vanished: the middle bin, as histc
            mat.nan_to_num_(nan=nb // 2).clamp_(0, nb - 1)
            # int32 indices: half the memory of int64 to write; bincount takes either
            offsets = torch.arange(0, rows * nb, nb, dtype=torch.int32)[:, None]
            idx = mat.to(torch.int32).add_(offsets)
            counts = torch.bincount(idx.view(-1), minlength=rows * nb)
            lens = torch.tensor([k for _, k, _ in kept])
            pad_bins = idx[torch.arange(rows), lens.clamp(max=size - 1)].long()
            counts.index_add_(0, pad_bins, lens - size)  # rows with no padding subtract 0
            for st, h in zip(stats, counts.view(rows, nb).tolist(), strict=True):
                st.hist = h  # type: ignore[union-attr]

    # -- any device: no read-back; counts NaN/Inf always ----------------------------------------
    def _add_sync_free(self, slot: int, x: torch.Tensor, n: int) -> None:
        finite = torch.isfinite(x)
        nan = torch.isnan(x).sum()
        count = finite.sum()
        xz = torch.where(finite, x, 0.0)
        lo = torch.where(finite, x, math.inf).amin()
        hi = torch.where(finite, x, -math.inf).amax()
        cnt = count.to(x.dtype)
        mean = xz.sum() / cnt.clamp_min(1)
        ss = (xz - mean).square().mul_(finite).sum()
        var = ss / (cnt - 1).clamp_min(1)
        nnz = torch.count_nonzero(xz)  # non-finite entries were zeroed, so not counted
        same = lo == hi
        h_lo = torch.where(same, lo - 1.0, lo)
        h_hi = torch.where(same, hi + 1.0, hi)
        width = (h_hi - h_lo).clamp_min(torch.finfo(x.dtype).tiny)
        idx = ((xz - h_lo) / width * self.bins).to(torch.int64).clamp_(0, self.bins - 1)
        hist = torch.zeros(self.bins, dtype=x.dtype, device=x.device)
        hist.scatter_add_(0, idx.reshape(-1), finite.reshape(-1).to(x.dtype))
        scalars = torch.stack(
            [mean, var, lo, hi, nnz.to(x.dtype), nan.to(x.dtype), count.to(x.dtype)]
        ).double()
        self._dev.append((slot, n, scalars, hist.double()))

    def _convert_dev(self) -> None:
        if not self._dev:
            return
        scal = torch.stack([s.cpu() for _, _, s, _ in self._dev]).tolist()
        hists = torch.stack([h.cpu() for _, _, _, h in self._dev]).tolist()
        for (slot, n, _, _), (mean, var, lo, hi, nnz, nan, c), h in zip(
            self._dev, scal, hists, strict=True
        ):
            c, nan = int(c), int(nan)
            if c == 0:
                self._out[slot] = TensorStats(numel=n, nan_count=nan, inf_count=n - nan)
                continue
            var = max(var, 0.0)
            sumsq = (c - 1) * var + c * mean * mean
            self._out[slot] = stats_from_moments(
                n, c, mean, var, lo, hi, sumsq, nnz, nan, n - c - nan, [int(v) for v in h], c
            )

    def finalize(self) -> list[TensorStats]:
        """Finish every pending result; return one :class:`TensorStats` per slot, in slot order.

        Drains a background batch first (:meth:`drain`); a slot it dropped is ``None`` (read
        :attr:`modified` and :attr:`errors` after ``drain``, before ``finalize``). The batch is
        empty afterwards (it drops the samples and device results).
        """
        self.drain()
        self._bin_samples(self._samples + self._wsamples)
        self._convert_dev()
        out = self._out
        self.__init__(self.bins, self.sync_free, self.background)  # type: ignore[misc]
        return out  # type: ignore[return-value]


def stats_from_moments(
    n: int,
    count: int,
    mean: float,
    var: float,
    lo: float,
    hi: float,
    sumsq: float,
    nnz: float,
    nan: int,
    inf: int,
    hist: list[int],
    hist_count: int,
) -> TensorStats:
    """A :class:`TensorStats` from the moments of the ``count`` finite elements of ``n``."""
    return TensorStats(
        numel=n,
        mean=mean,
        std=math.sqrt(var),
        min=lo,
        max=hi,
        abs_max=max(-lo, hi),
        l2=math.sqrt(max(sumsq, 0.0)),
        zero_frac=1.0 - nnz / count,
        nan_count=nan,
        inf_count=inf,
        hist=hist,
        hist_min=lo if lo != hi else lo - 1.0,
        hist_max=hi if lo != hi else hi + 1.0,
        hist_count=hist_count,
    )
