"""Memory accounting of a captured step (``capture(model, memory=True)``, the default):
:class:`MemoryTracker` fills ``Trace.memory`` (:class:`hooks.trace.memory.StepMemory`).

How it measures (and why):

* Saved activations: ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd
  saves for backward while the capture records. Each is counted by its storage
  (``untyped_storage()``: a view counts against its base, a storage saved twice once), against
  the innermost recorded call open when it was saved; a storage that is a parameter's or a
  buffer's counts as ``param``. The pack hook keeps ``tensor.detach()`` (sharing the storage),
  never the tensor itself: a saved *output* kept as itself would hold its own ``grad_fn``
  alive (a reference cycle through autograd that Python's GC cannot see: the graph would leak).
  With hooks installed autograd no longer compares the saved tensor's version counter on
  unpack, so the unpack hook does it, with autograd's message: an in-place write to a saved
  tensor is still an error, never silently wrong gradients.
* Release: a small holder per save; when autograd frees a node's saved variables (after its
  backward, or when the graph is dropped) the holder goes, and a storage whose last holder went
  stops counting as live.
* Timeline: the live bytes (parameters, buffers, optimizer state, gradients allocated so far,
  saved activations held) after each forward call, each gradient of a call's output and each
  parameter gradient accumulated. Between two points saved bytes only grow in forward and
  gradients only grow in backward, so the peak of the step is one of the points.
* Parameters: ``numel × element_size``; gradients as the storage of ``.grad``; optimizer state
  from ``optimizer.state`` (estimated from the optimizer's known layout before its first step).

Off (a note says so) for a compiled model replayed call by call and for a sharded
(``DTensor``) model; activations saved inside ``torch.utils.checkpoint`` regions are counted
by checkpoint's own hooks, not these (its recomputation is what is saved).
Reference: PyTorch's "Hooks for saved tensors" (autograd mechanics notes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hooks.tensors.walk import named_parameters
from hooks.trace.memory import (
    AliveBytes,
    CallMemory,
    MemoryPoint,
    ParamMemory,
    StepMemory,
)
from hooks.trace.records import CallRecord

#: ``torch.optim`` optimizers whose state is allocated at their first ``step()``: the tensors
#: each parameter gets (shaped like the parameter), for the estimate before that step.
STATE_LAYOUT: dict[str, tuple[str, ...]] = {
    "Adam": ("exp_avg", "exp_avg_sq"),
    "AdamW": ("exp_avg", "exp_avg_sq"),
    "NAdam": ("exp_avg", "exp_avg_sq"),
    "RAdam": ("exp_avg", "exp_avg_sq"),
    "Adamax": ("exp_avg", "exp_inf"),
    "SGD": ("momentum_buffer",),
    "RMSprop": ("square_avg",),
}


def storage_key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s untyped storage (unique among the live storages of a process:
    host and device memory share one virtual address space, CUDA's unified addressing), None
    without one (meta, sparse, a subclass without storage) or for an empty storage."""
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (each ``untyped_storage().nbytes()`` once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        key = storage_key(t)
        if key is not None and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


class _Storage:
    """One saved storage: its bytes, kind (``param``; ``square``: a (..., T, T) tensor), owner
    call, and when it was born and released."""

    __slots__ = ("key", "nbytes", "param", "square", "call", "born", "died", "refs", "tracker")

    def __init__(self, key, nbytes: int, param: bool, square: bool, call: int | None,
                 born: int, tracker: MemoryTracker) -> None:
        self.key, self.nbytes, self.param, self.square, self.call = key, nbytes, param, \
            square, call
        self.born, self.died, self.refs, self.tracker = born, None, 0, tracker


class _Saved:
    """What autograd keeps for one saved tensor: a detached alias, its version then, and the
    storage entry it holds (released when autograd drops this)."""

    __slots__ = ("t", "version", "entry")

    def __init__(self, t: torch.Tensor, version: int, entry: _Storage | None) -> None:
        self.t, self.version, self.entry = t, version, entry
        if entry is not None:
            entry.refs += 1

    def __del__(self) -> None:
        e = self.entry
        if e is not None:
            e.refs -= 1
            if e.refs == 0:
                e.tracker.released(e)


def _unpack(saved: Any) -> torch.Tensor:
    if type(saved) is not _Saved:
        return saved
    t = saved.t
    if t._version != saved.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.dtype} {list(t.shape)}] is at version {t._version}; "
            f"expected version {saved.version} instead (checked by mdb's memory accounting, "
            "as autograd does)")
    return t


class MemoryTracker:
    """Counts a captured step's bytes; see the module docstring.

    Args:
        stack: the capture's open calls (innermost last), read when a tensor is saved.
        modules: ``hooks.tensors.walk.named_modules(model)``.
        optimizer: the training loop's optimizer, or None.
    """

    def __init__(self, stack: list[CallRecord], modules: list[tuple[str, nn.Module]],
                 optimizer: Any = None) -> None:
        self._stack = stack
        self._optimizer = optimizer
        self._params = named_parameters(modules)  # tied ones once, under their first name
        self._param_keys: set[int] = {k for k in map(storage_key, (p for _, p in self._params))
                                      if k is not None}
        buffers = 0
        for b in modules[0][1].buffers() if modules else ():
            key = storage_key(b)
            if key is not None and key not in self._param_keys:
                self._param_keys.add(key)
                buffers += b.untyped_storage().nbytes()
        self.memory = StepMemory(buffer_bytes=buffers)
        self.memory.param_bytes = sum(p.numel() * p.element_size() for _, p in self._params)
        self._grads: dict[str, int] = {n: storage_bytes([p.grad]) for n, p in self._params
                                       if p.grad is not None}
        self._grad_live = sum(self._grads.values())
        self._opt = self._optimizer_bytes()
        self._base = self.memory.param_bytes + buffers + self.memory.optimizer_bytes
        self._live: dict[int, _Storage] = {}
        self._all: list[_Storage] = []
        self._calls: dict[int, CallMemory] = {}
        # per call: [parent, input storage keys, output storages by key, seq at its end,
        # CallRecord.end_order]
        self._spans: dict[int, list[Any]] = {}
        self._owned: dict[int, list[_Storage]] = {}  # saved activation storages by call
        self._saved = 0  # activation bytes autograd holds now
        self._seq = 0
        self._points: list[tuple] = []  # MemoryPoint fields, made MemoryPoints at the end
        self._on = False
        #: False while the capture is paused (``Capture.paused``): saves are not counted
        self.counting = True
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Install the saved-tensor hooks (this thread) and take the first point."""
        self._ctx.__enter__()
        self._on = True
        self._point("start", None, None)

    def stop(self) -> StepMemory:
        """Remove the hooks and return the finished :class:`StepMemory`."""
        if self._on:
            self._on = False
            self._ctx.__exit__(None, None, None)
        self._point("end", None, None)
        return self._finish()

    # -- hooks ----------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        # the hot path (every saved tensor): the entry only; per-call sums at the end
        try:
            st = t.untyped_storage()
            key = st.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            return t.detach()
        entry = self._live.get(key) if key else None
        if entry is None and key and self._on and self.counting:
            stack = self._stack
            param = key in self._param_keys
            nbytes = st.nbytes()
            self._seq += 1
            entry = _Storage(key, nbytes, param, t.dim() >= 3 and t.size(-1) == t.size(-2) > 1,
                             stack[-1].index if stack else None, self._seq, self)
            self._live[key] = entry
            self._all.append(entry)
            if not param:
                self._saved += nbytes
        return _Saved(t.detach(), t._version, entry)

    def _sum_saved(self, seq: int) -> dict[int, int]:
        """Per call and in all: the saved bytes of the entries (at the end, once); returns the
        saved activation bytes alive at ``seq`` (the peak's) by call."""
        mem, calls = self.memory, self._calls
        alive: dict[int, int] = {}
        for e in self._all:
            cm = None
            if e.call is not None:
                cm = calls.get(e.call)
                if cm is None:
                    cm = calls[e.call] = CallMemory(e.call)
            if e.param:
                if cm is not None:
                    cm.param_saved_bytes += e.nbytes
                continue
            mem.saved_bytes += e.nbytes
            if e.square:
                mem.square_bytes += e.nbytes
            if cm is None:
                mem.unattributed_bytes += e.nbytes
                continue
            cm.saved_bytes += e.nbytes
            self._owned.setdefault(e.call, []).append(e)
            if e.square:
                cm.square_bytes += e.nbytes
            if e.born <= seq and (e.died is None or e.died > seq):
                alive[e.call] = alive.get(e.call, 0) + e.nbytes
        return alive

    def released(self, entry: _Storage) -> None:
        """Autograd dropped the last saved alias of ``entry``'s storage."""
        if self._live.get(entry.key) is entry:
            del self._live[entry.key]
        if entry.died is None and self._on:
            self._seq += 1
            entry.died = self._seq
            if not entry.param:
                self._saved -= entry.nbytes

    def call_start(self, rec: CallRecord, inputs: Sequence[torch.Tensor]) -> None:
        """Before a forward call: its inputs' storages (not what the call retains)."""
        keys = set()
        for t in inputs:
            try:
                keys.add(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError, TypeError):
                pass
        self._spans[rec.index] = [rec.parent, keys, {}, None, 0]

    def call_end(self, rec: CallRecord, outputs: Sequence[torch.Tensor]) -> None:
        """After a forward call: its outputs' storages and a timeline point (the sums at the
        end)."""
        outs: dict[int, int] = {}
        for t in outputs:
            try:
                st = t.untyped_storage()
                key = st.data_ptr()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            if key and key not in outs:
                outs[key] = st.nbytes()
        span = self._spans.get(rec.index)
        if span is None:
            span = self._spans[rec.index] = [rec.parent, set(), {}, None, 0]
        span[2], span[3], span[4] = outs, self._seq, rec.end_order
        saved, grads = self._saved, self._grad_live
        self._points.append(("forward", rec.index, None, self._base + grads + saved, saved,
                             grads, self._seq))

    def grad_arrived(self, forward_index: int) -> None:
        """After the gradient of a recorded call's output arrived: a timeline point."""
        saved, grads = self._saved, self._grad_live
        self._points.append(("backward", forward_index, None, self._base + grads + saved, saved,
                             grads, self._seq))

    def param_grad(self, name: str, param: torch.Tensor) -> None:
        """After ``param.grad`` was accumulated: its bytes, and a timeline point."""
        g = param.grad
        n = g.untyped_storage().nbytes() if g is not None else 0
        grads = self._grad_live = self._grad_live + n - self._grads.get(name, 0)
        self._grads[name] = n
        saved = self._saved
        self._points.append(("backward", None, name, self._base + grads + saved, saved, grads,
                             self._seq))

    def _point(self, phase: str, call: int | None, param: str | None) -> None:
        saved, grads = self._saved, self._grad_live  # a tuple now, a MemoryPoint at the end
        self._points.append((phase, call, param, self._base + grads + saved, saved, grads,
                             self._seq))

    # -- the end --------------------------------------------------------------------------------
    def _optimizer_bytes(self) -> dict[int, tuple[int, list[str], bool]]:
        """Per parameter id: (state bytes, state names, estimated); sets the totals."""
        opt, mem = self._optimizer, self.memory
        out: dict[int, tuple[int, list[str], bool]] = {}
        if opt is None:
            return out
        mem.optimizer = type(opt).__name__
        mine = {id(p) for _, p in self._params}
        layout = STATE_LAYOUT.get(type(opt).__name__, ())
        for group in getattr(opt, "param_groups", []):
            if type(opt).__name__ == "SGD" and not group.get("momentum", 0):
                layout = ()
            for p in group.get("params", []):
                state = opt.state.get(p, {}) if hasattr(opt, "state") else {}
                tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
                if tensors:
                    n, names, est = storage_bytes(list(tensors.values())), list(tensors), False
                else:  # before the first step(): the layout (Adam's ``step``: 4-byte float)
                    steps = 4 if layout and layout[0] == "exp_avg" else 0
                    n = len(layout) * p.numel() * p.element_size() + steps
                    names, est = [*layout, *(["step"] if steps else [])], True
                out[id(p)] = (n, names, est and bool(layout))
                mem.optimizer_bytes += n
                if id(p) not in mine:  # a master copy: the tensor and its state
                    extra = p.numel() * p.element_size()
                    mem.master_bytes += n + extra
                    mem.optimizer_bytes += extra
        return out

    def _call_memory(self, i: int) -> CallMemory:
        cm = self._calls.get(i)
        if cm is None:
            cm = self._calls[i] = CallMemory(i)
        return cm

    def _retained(self) -> None:
        """``CallMemory.retained_bytes`` (and ``output_bytes``) of each call whose start and
        end were seen: the saved storages of its subtree still held at its end, and its
        outputs, less its inputs."""
        spans = self._spans
        for i, span in spans.items():
            if span[2]:
                self._call_memory(i).output_bytes = sum(span[2].values())
        first_death = min((e.died for e in self._all if e.died is not None), default=None)
        if first_death is None or all(s[3] is None or s[3] < first_death
                                      for s in spans.values()):
            return self._retained_all_alive()
        self._retained_held()

    def _retained_all_alive(self) -> None:
        """:meth:`_retained` when every saved storage outlived every call: the subtree's
        bytes summed child to parent (a call's descendants are the calls after it up to
        ``last``), less the storages that are its inputs or outputs."""
        spans, owned = self._spans, self._owned
        total: dict[int, int] = {}
        last: dict[int, int] = {}
        by_key: dict[int, _Storage] = {}
        for i in sorted(spans, reverse=True):  # a child's index is larger than its parent's
            mine = owned.get(i, ())
            for e in mine:
                by_key[e.key] = e
            total[i] = total.get(i, 0) + sum(e.nbytes for e in mine)
            last[i] = max(last.get(i, i), i)
            parent = spans[i][0]
            if parent is not None:
                total[parent] = total.get(parent, 0) + total[i]
                last[parent] = max(last.get(parent, parent), last[i])
        for i, (_, inputs, outs, end, _) in spans.items():
            if end is None:
                continue
            n = total[i] + sum(b for k, b in outs.items() if k not in inputs)
            for k in inputs | outs.keys():
                e = by_key.get(k)
                if e is not None and i <= e.call <= last[i]:
                    n -= e.nbytes
            if n:
                self._call_memory(i).retained_bytes = n

    def _retained_held(self) -> None:
        """:meth:`_retained` in general: the held storages built child by child (calls in the
        order they ended: children first), each kept while alive at the call's end."""
        ended = sorted((span[4], i) for i, span in self._spans.items() if span[3] is not None)
        first_death = min((e.died for e in self._all if e.died is not None), default=None)
        held_by: dict[int, dict[int, _Storage]] = {}
        for _, i in ended:
            parent, inputs, outs, end, _ = self._spans[i]
            held = held_by.pop(i, {})
            for e in self._owned.get(i, ()):
                held[e.key] = e
            if first_death is not None and first_death <= end:  # else all alive at its end
                held = {k: e for k, e in held.items() if e.died is None or e.died > end}
            if parent is not None:
                held_by.setdefault(parent, {}).update(held)
            n = sum(e.nbytes for k, e in held.items() if k not in inputs and k not in outs)
            n += sum(b for k, b in outs.items() if k not in inputs)
            if n:
                self._call_memory(i).retained_bytes = n

    def _finish(self) -> StepMemory:
        mem = self.memory
        points = self._points  # (phase, call, param, live, saved, grads, seq) each
        peak = max(range(len(points)), key=lambda i: points[i][3])
        mem.peak_point, mem.peak_bytes = peak, points[peak][3]
        alive = self._sum_saved(points[peak][6])
        self._retained()
        mem.params = [ParamMemory(n, p.numel() * p.element_size(), self._grads.get(n, 0),
                                  *self._opt.get(id(p), (0, [], False)))
                      for n, p in self._params]
        mem.grad_bytes = sum(self._grads.values())
        mem.calls = [self._calls[k] for k in sorted(self._calls)]
        mem.timeline = [MemoryPoint(*p) for p in points]
        mem.at_peak = [AliveBytes(c, n) for c, n in sorted(alive.items(), key=lambda x: -x[1])]
        self._all.clear()
        self._live.clear()
        self._spans.clear()
        self._owned.clear()
        return mem


def memory_tracker(wanted: bool, off: str | None, trace: Any, stack: list[CallRecord],
                   modules: list[tuple[str, nn.Module]],
                   optimizer: Any = None) -> MemoryTracker | None:
    """A started :class:`MemoryTracker` for a capture, or None: not ``wanted``, or ``off``
    (``"compiled"``: a compiled model replayed call by call; ``"sharded"``: DTensor
    parameters), which a note on ``trace`` says."""
    from hooks.trace.records import Note

    if not wanted:
        return None
    if off is not None:
        trace.notes.append(Note("memory", f"memory accounting is off for a {off} model: "
                                "trace.memory is not recorded"))
        return None
    tracker = MemoryTracker(stack, modules, optimizer)
    tracker.start()
    return tracker
