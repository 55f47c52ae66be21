"""``hooks.capture``: record shapes, statistics and gradients of every module call.

How it works (and why):

* Forward: a forward *pre*-hook (with kwargs) opens a :class:`~hooks.trace.records.CallRecord` and
  summarises the inputs before the module runs (an in-place module would overwrite them); a
  forward hook closes it, summarises the outputs and registers a tensor hook
  (``Tensor.register_hook``) on every output that requires grad. Full module backward hooks are
  not used: they break on in-place ops and views and never fire for dict outputs.
* Backward: each tensor hook receives the gradient of the loss with respect to that output and
  appends a :class:`~hooks.trace.records.GradRecord` in the order autograd produces them. It returns
  ``None``, so gradients are never changed.
* Parameters: ``register_post_accumulate_grad_hook`` marks which parameters received a gradient
  during the capture; their statistics are computed once at exit with ``torch._foreach_norm``.
* Statistics are launched in the hooks and converted to Python numbers once at exit
  (:class:`~hooks.tensors.stats.StatsBatch`); a tensor seen again unchanged (same object, same
  version counter) reuses its slot, so a module's input that is the previous module's output costs
  nothing. Opt-in (``Capture.background``): the CPU reductions of module tensors run on
  hooks.tensors.stats' worker thread; a tensor written in place before the worker read it is then
  not recorded (note ``modified_in_place``), an ``inplace=True`` module's inputs are read before it
  runs, and parameter gradient norms stay in their hook. No other reference to an activation
  or the autograd graph is kept unless ``keep_bytes`` asks for copies.
"""

from __future__ import annotations

import fnmatch
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from hooks.engine.compile import (
    in_compiled_wrapper,
    unwrap_compiled,
)
from hooks.engine.edit_apply import Editor
from hooks.engine.env import (
    check_data,
    core_left,
    distributed,
    fewer_gc_passes,
    gc_passes_back,
)
from hooks.engine.fast_path import (
    encoder_layer_fast_path_blocker,
    fast_path_layers,
    has_forward_hooks,
)
from hooks.engine.memory import memory_tracker
from hooks.engine.params import GradStatsBuffer, param_records, unread_notes
from hooks.engine.recompute import Recomputed, in_backward, same_values, storage_signature
from hooks.engine.replay import CompiledReplay
from hooks.probes.attention import DEFAULT_ATTENTION_BYTES, AttentionCapture
from hooks.probes.base import ProbeContext, probes_for
from hooks.probes.routing import ExpertsRouting
from hooks.sharded.stats import MeshStats, Results, is_dtensor, local_piece
from hooks.tensors.stats import NUM_BINS, StatsBatch, TensorStats
from hooks.tensors.walk import LeftOut, dtype_name, find_tensors, named_modules, named_parameters
from hooks.trace.modules import module_infos  # noqa: F401  (hooks.module_infos)
from hooks.trace.ops import Replay
from hooks.trace.records import (
    CallRecord,
    GradRecord,
    Note,
    ParamGradRecord,
    TensorInfo,
)
from hooks.trace.trace import Trace

Selector = str | type
"""A module selector: a ``fnmatch`` pattern on the qualified name (a pattern also selects the
named module's descendants), a class name, or a class (``isinstance``)."""


def _matches(name: str, module: nn.Module, selectors: Sequence[Selector]) -> bool:
    for sel in selectors:
        if isinstance(sel, type):
            if isinstance(module, sel):
                return True
        elif sel == type(module).__name__:
            return True
        elif fnmatch.fnmatchcase(name, sel) or (sel and name.startswith(sel + ".")):
            return True
    return False


class Capture(CompiledReplay):
    """Context manager that records one :class:`~hooks.trace.trace.Trace` of ``model``.

    Prefer :func:`capture`, which builds one. ``start()``/``stop()`` are the same as
    ``__enter__``/``__exit__`` for code that cannot use ``with``.

    ``Capture.background``: CPU statistics on hooks.tensors.stats' worker thread (True), in the
    hooks (False, the default: every tensor summarised as its hook saw it), or on the worker only
    while torch leaves a core free (None). The worker's limits: a tensor written in place after
    its hook and before the worker read it is not recorded (a note says which), and a write that
    does not move the version counter (``.data``, a NumPy or DLPack alias, a raw kernel) is not
    seen at all; never used in a ``torch.distributed`` job.
    """

    background: bool | None = False

    def __init__(
        self,
        model: nn.Module,
        *,
        keep_bytes: int = 0,
        include: Iterable[Selector] | None = None,
        exclude: Iterable[Selector] | None = None,
        inputs: bool = True,
        grads: bool = True,
        params: bool = True,
        attention: bool | Iterable[str] = False,
        attention_bytes: int = DEFAULT_ATTENTION_BYTES,
        probes: bool = True,
        step: int | None = None,
        every: int = 1,
        meta: dict[str, Any] | None = None,
        bins: int = NUM_BINS,
        edits: Sequence[Any] | None = None,
        sources: dict[str, Any] | None = None,
        memory: bool = True,
        optimizer: Any = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"capture expects a torch.nn.Module, got {type(model).__name__}")
        # edits are checked against the model here, before anything runs (hooks.engine.edits)
        self._editor = Editor(model, edits, sources) if edits else None
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if keep_bytes < 0:
            raise ValueError(f"keep_bytes must be >= 0, got {keep_bytes}")
        if attention_bytes < 0:
            raise ValueError(f"attention_bytes must be >= 0, got {attention_bytes}")
        self.model = model
        self.keep_bytes = int(keep_bytes)
        self.include = list(include) if include is not None else None
        self.exclude = list(exclude) if exclude is not None else []
        self.inputs = inputs
        self.grads = grads
        self.params = params
        self.attention = attention
        self.attention_bytes = int(attention_bytes)
        self.probes = probes
        self.step = step
        self.every = every
        self.bins = bins
        self.memory, self.optimizer = memory, optimizer
        self.trace = Trace(meta=dict(meta or {}), step=step)
        if self._editor is not None and not self.sampled:  # said, never silently skipped
            self.trace.notes.append(Note("edit", f"step {step} is not captured (every={every})"
                                         ": the edits were not applied"))
        self._active = False
        self._started = False
        self._memory = None  # the memory tracker, from start() (paused() reads it before)

    # -- public lifecycle -----------------------------------------------------------------------
    @property
    def sampled(self) -> bool:
        """Whether this step is captured (``step % every == 0``, or no step given)."""
        return self.step is None or self.step % self.every == 0

    @property
    def recording(self) -> bool:
        """True from ``start()`` to ``stop()`` of a sampled step (also during backward)."""
        return self._active

    @property
    def recomputing(self) -> bool:
        """True while autograd runs a backward pass during the capture: a forward call made now
        is activation checkpointing re-running an earlier call (``torch.utils.checkpoint``,
        reentrant or not; HF ``gradient_checkpointing_enable``), not a new call. The capture
        keeps such calls with the call they repeat (``CallRecord.recomputed``); probes must not
        record them again."""
        return self._active and in_backward()

    @property
    def active(self) -> bool:
        """True while forward hooks should record: ``recording`` and not ``recomputing``.
        Probes' forward hooks check it (through ``ProbeContext.active``), so a call re-run by
        activation checkpointing adds no second routing or attention record."""
        return self._active and not in_backward()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """``with cap.paused():`` the hooks record nothing inside the block (``recording`` is
        False there) and record again after it, exception or not. For a forward and backward
        that mdb itself runs during a captured step (the loop doctor's replay of a
        micro-batch), which must not be recorded as the user's calls. A capture that is not
        recording (not started, stopped, or a step that is not sampled) stays as it is."""
        was, mem = self._active, self._memory
        self._active = False
        if mem is not None:  # nor are the tensors that forward saves counted
            mem.counting = False
        try:
            yield
        finally:
            self._active = was
            if mem is not None:
                mem.counting = was

    def __enter__(self) -> Trace:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.stop()
        return False

    def start(self) -> Trace:
        """Attach the hooks and return the (still empty) trace."""
        if self._started:
            raise RuntimeError("a Capture can be started only once; build a new one per step")
        self._started = True
        tr = self.trace
        tr.model_type = type(unwrap_compiled(self.model)).__name__
        tr.captured = self.sampled
        if not tr.captured:
            return tr
        # thousands of small objects from here to stop() (the hooks' handles, the records):
        # fewer young-generation GC passes (a pass walks every young object; a pass of the
        # middle generation cost a captured step of minillm `tiny` ~2.5 ms)
        fewer_gc_passes()
        try:
            return self._start_recording(tr)
        except BaseException:
            gc_passes_back()
            raise

    def _start_recording(self, tr: Trace) -> Trace:
        root = unwrap_compiled(self.model)
        self._modules = named_modules(root)
        check_data(self._modules)
        # a sharded model (DTensor parameters): full-tensor statistics reduced across the mesh
        self._dist = MeshStats.for_model(self.model, self.bins)
        # CPU statistics on the worker thread (hooks.tensors.stats), checked against in-place writes
        bg = self.background  # the worker beside a model that takes every core slows it
        # never in a distributed job: DDP writes the averaged gradients into .grad (or its
        # bucket views) while its collectives run, so a later read could see them half done
        self._bg = (self._dist is None and not distributed()
                    and (bg or bg is None and core_left()))
        self._batch = StatsBatch(bins=self.bins, background=self._bg)
        self._init_state()

        if self._editor is not None:  # patch sources run first; edit hooks go first
            self._editor.start()
        tr.model_type = type(root).__name__
        tr.modules = module_infos(root, self._modules)
        self._start_eager(root)
        # routing from each MoE block's experts call; attention from the model's own calls
        ctx = self._ctx = ProbeContext(self)
        self._routing = ExpertsRouting(ctx) if self.probes else None
        self._attention = AttentionCapture(ctx, self.attention_bytes) if self.attention else None
        if self._attention is not None:
            ctx.attention = self._attention
        if self._replay_mode:  # compiled: hooks only while each call is replayed eagerly
            self._watch_fast_path([])
            self._intercept(root)
        else:
            fast_path = fast_path_layers(self._modules)
            self._handles.extend(self._recording_hooks(root))
            self._watch_fast_path(fast_path)
        if self.params:
            trained = [(n, p) for n, p in named_parameters(self._modules) if p.requires_grad]
            self._touched = GradStatsBuffer([n for n, _ in trained],
                                            [p.device for _, p in trained])
            for name, p in trained:
                self._handles.append(
                    p.register_post_accumulate_grad_hook(partial(self._on_param, name)))
        self._active = True
        if self._attention is not None and not self._replay_mode:
            self._attention.start()  # last: nothing is left installed if start() raised
        off = "compiled" if self._replay_mode else "sharded" if self._dist else None
        self._memory = memory_tracker(self.memory, off, tr, self._stack, self._modules,
                                      self.optimizer)
        return tr

    def _recording_hooks(self, root: nn.Module) -> list[Any]:
        """Attach the hooks that record module calls (the root's call for Trace.ops, each
        selected module's, the probes', routing's and attention's); return their handles."""
        handles = [root.register_forward_pre_hook(  # what re-runs this forward (Trace.ops)
            self._remember_call, with_kwargs=True, prepend=True)]
        ctx = self._ctx
        for name, m in self._modules:
            tname = type(m).__name__
            if self._selected(name, m):
                handles.append(
                    m.register_forward_pre_hook(partial(self._pre, name, tname), with_kwargs=True)
                )
                handles.append(
                    m.register_forward_hook(partial(self._post, name, tname), with_kwargs=True)
                )
            if self.probes:
                for probe in probes_for(m):
                    handles.extend(probe.attach(name, m, ctx))
        if self._routing is not None:
            handles.extend(self._routing.attach(self._modules, probes_for))
        if self._attention is not None:
            handles.extend(self._attention.attach(self._modules))
        return handles

    def _init_state(self) -> None:
        self._drain_task = -1  # autograd graph task whose end drains the worker
        self._pending: list[tuple[Any, int]] = []  # (TensorInfo | GradRecord, slot)
        self._cache: dict[Any, tuple[weakref.ref, int, int]] = {}
        self._counts: dict[str, int] = {}
        self._stack: list[CallRecord] = []
        self._memory = None  # hooks.engine.memory.MemoryTracker, set last in start()
        self._t0: list[float] = []
        self._end = 0
        self._handles: list[Any] = []
        self._tensor_handles: list[Any] = []
        self._no_grad: dict[str, int] = {}
        # per parameter (|g|^2, min g, max g, |w|^2), read back together at exit
        self._touched = GradStatsBuffer([], [])
        self._kept = 0
        self._dropped = 0
        self._errors: dict[str, str] = {}
        self._local_dtensors = 0  # DTensors summarised as this rank's piece (no MeshStats)
        self._init_recompute()

    def stop(self) -> Trace:
        """Remove every hook, convert the statistics and return the finished trace."""
        tr = self.trace
        if not self._started or not tr.captured or not self._active:
            return tr
        self._active = False
        try:
            return self._stop()
        finally:
            gc_passes_back()

    def _stop(self) -> Trace:
        tr = self.trace
        if self._attention is not None:
            self._attention.stop()  # restores scaled_dot_product_attention and softmax
        if self._routing is not None:
            self._routing.finish()
        self._stop_eager()
        for h in self._handles:
            h.remove()
        for h in self._tensor_handles:
            h.remove()
        self._handles.clear()
        self._tensor_handles.clear()
        self._cache.clear()
        if self._memory is not None:
            tr.memory = self._memory.stop()
        if self._editor is not None:
            tr.edits, notes = self._editor.stop(bool(tr.backward or self._touched))
            tr.notes.extend(notes)
        for rec in self._stack:
            rec.notes.append("call did not finish (an exception unwound it)")
        self._stack.clear()
        self._rstack.clear()
        self._drain()
        modified, errors = set(self._batch.modified), dict(self._batch.errors)
        results = self._batch.finalize()
        if self._dist is not None:
            named = named_parameters(self._modules) if self.params else []
            self._dist.add_params(named)
            self._dist.remember_grads(named)
            results = self._results = Results(results, self._dist.finalize(tr))
        for obj, slot in self._pending:
            obj.stats = results[slot]
        if modified or errors:
            tr.notes.extend(unread_notes(tr, self._pending, modified, errors))
        self._pending.clear()
        self._finish_recompute(results)
        self._finish_fast_path()
        if self.params and (tr.backward or self._touched or (self._dist and self._dist.touched)):
            tr.params = self._param_records()
        elif self.params and self.grads:
            tr.notes.append(Note("no_backward", "no backward pass ran inside the capture"))
        if tr.backward:
            for name, n in self._no_grad.items():
                tr.notes.append(
                    Note(
                        "no_grad",
                        f"{n} call(s) produced outputs that do not require grad (torch.no_grad, "
                        "detached or integer outputs): no gradient to record",
                        module=name,
                    )
                )
        if self._dropped:
            tr.notes.append(
                Note(
                    "budget",
                    f"keep_bytes={self.keep_bytes} reached: {self._dropped} tensor(s) kept as "
                    "statistics only",
                )
            )
        for name, msg in self._errors.items():
            tr.notes.append(Note("hook_error", msg, module=name))
        if self._local_dtensors:
            tr.notes.append(Note(
                "sharded", f"{self._local_dtensors} DTensor(s) summarised as this rank's local "
                "piece only, not the full tensor: the model has no DTensor parameters, so the "
                "capture reduces nothing across the mesh (their shapes are the full tensor's)"))
        self._finish_eager()
        tr.kept_bytes = self._kept
        return tr

    # -- selection, stats, keeping --------------------------------------------------------------
    def _selected(self, name: str, m: nn.Module) -> bool:
        if self.include is not None and not _matches(name, m, self.include):
            return False
        return not (self.exclude and _matches(name, m, self.exclude))

    def wants_attention(self, name: str) -> bool:
        """Whether attention probabilities were requested for module ``name``."""
        a = self.attention
        if a is True:
            return True
        if not a:
            return False
        return any(fnmatch.fnmatchcase(name, p) or name.startswith(p + ".") for p in a)

    def _drain(self) -> None:
        """Wait for the worker (``StatsBatch.drain``): tensors written in place since their
        hook are dropped, the others let go."""
        if self._bg:
            self._batch.drain()

    def _drain_after_backward(self) -> None:
        try:
            self._drain()
        except Exception as exc:  # pragma: no cover - never break the user's backward
            self._error("", exc)

    def _queue_drain(self) -> None:
        """Once per backward pass, at its end (autograd's queue_callback), wait for the worker:
        its tensors are checked and freed before an optimizer step can write them. Keyed by
        autograd's graph task, so a backward that raised (its callbacks dropped) does not stop
        the next one from draining."""
        try:
            task = torch._C._current_graph_task_id()
        except (AttributeError, RuntimeError):  # pragma: no cover - older torch: at stop only
            return
        if task != self._drain_task and task >= 0:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(
                    self._drain_after_backward)
                self._drain_task = task
            except RuntimeError:  # not inside a backward pass: drained at stop
                pass

    def _slot(self, t: torch.Tensor, sync: bool = False) -> int | None:
        # A tensor seen before (the same object, or a contiguous view of the same memory, e.g.
        # ``x.reshape(-1, d)`` passed on to the next module) reuses its statistics, as long as
        # the first tensor is alive (its memory cannot have been reused) and neither was
        # modified in place since (views share the version counter).
        if t.is_meta:
            return None
        try:
            version = t._version
        except RuntimeError:  # inference tensors track no version: never reuse their slot
            return self._add(t)
        # (in a sharded job by object: collectives reuse buffers of live tensors)
        plain = type(t) is torch.Tensor or not is_dtensor(t)  # (a DTensor has no data_ptr)
        key = (t.data_ptr(), t.numel(), t.dtype) \
            if plain and t.is_contiguous() and not self._dist else id(t)
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is not None and hit[1] == version:
            return hit[2]
        slot = self._add(t, sync)
        if slot is not None:
            try:
                self._cache[key] = (weakref.ref(t), version, slot)
            except TypeError:  # pragma: no cover - tensor subclasses without weakref support
                pass
        return slot

    def _add(self, t: torch.Tensor, sync: bool = False) -> int | None:
        if self._dist is not None:
            return self._dist.add(t)
        if type(t) is not torch.Tensor and is_dtensor(t):  # no DTensor parameters: a note
            self._local_dtensors += 1
            t = local_piece(t)
        return self._batch.add(t, sync)

    def _info(self, path: str, t: torch.Tensor, sync: bool = False) -> TensorInfo:
        info = TensorInfo(path, list(t.shape), dtype_name(t.dtype), t.requires_grad)
        slot = self._slot(t, sync)
        if slot is not None:
            self._pending.append((info, slot))
        return info

    def _keep(self, key: str, t: torch.Tensor) -> str | None:
        if self.keep_bytes <= 0:
            return None
        nbytes = t.numel() * t.element_size()
        if self._kept + nbytes > self.keep_bytes:
            self._dropped += 1
            return None
        self._kept += nbytes
        self.trace.tensors[key] = t.detach().to("cpu", copy=True).contiguous()
        return key

    def _error(self, name: str, exc: BaseException) -> None:
        self._errors.setdefault(name, f"capture hook failed: {type(exc).__name__}: {exc}")

    # -- hooks ----------------------------------------------------------------------------------
    def _remember_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.active and self.trace.replay is None and not in_backward():
            self.trace.replay = Replay.at(module, args, kwargs)
        return None

    def _pre(self, name: str, tname: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._active:
            return None
        try:
            backward = in_backward()
            if backward:
                if self._pre_recomputed(name, args, kwargs):
                    return None
            elif self._rstack:  # left open by a recomputation that stopped early
                self._rstack.clear()
            stack = self._stack
            if not stack and self._watch_wrapper and in_compiled_wrapper():
                self._via_wrapper = True
            ci = self._counts.get(name, 0)
            self._counts[name] = ci + 1
            fwd = self.trace.forward
            rec = CallRecord(
                len(fwd), name, tname, ci, len(stack), stack[-1].index if stack else None
            )
            fwd.append(rec)
            if backward:
                rec.notes.append(
                    "called while autograd ran a backward pass, and no earlier forward call of "
                    "this module matches it: recorded as a new call"
                )
            if self.inputs:
                tensors: list[tuple[str, torch.Tensor]] = []
                others: list[tuple[str, str]] = []
                cut = LeftOut()  # what the caps left out is said on the call
                if args:
                    find_tensors(args, "args", tensors, others, left_out=cut)
                if kwargs:
                    find_tensors(kwargs, "kwargs", tensors, others, left_out=cut)
                rec.notes.extend(cut.notes("inputs", len(tensors)))
                if self._dist is not None:  # names the tensors across ranks
                    self._dist.where = f"{name}#{ci}/in"
                # an in-place module (ReLU(inplace=True)) overwrites its inputs: their
                # statistics are taken now, and earlier tensors read before it runs
                sync = self._bg and getattr(module, "inplace", False) is True
                if sync:
                    self._drain()
                rec.inputs = [self._info(p, t, sync) for p, t in tensors]
                if self._memory is not None:
                    self._memory.call_start(rec, [t for _, t in tensors])
                self._sigs[rec.index] = storage_signature(tensors)
            stack.append(rec)
            self._t0.append(time.perf_counter())
        except Exception as exc:  # never break the user's forward
            self._error(name, exc)
        return None

    def _post(
        self, name: str, tname: str, module: nn.Module, args: tuple, kwargs: dict, output: Any
    ) -> None:
        if not self._active:
            return None
        t_end = time.perf_counter()
        try:
            if self._rstack and in_backward() and self._post_recomputed(name, output):
                return None
            stack = self._stack
            while stack and stack[-1].module != name:  # a child raised and was not closed
                stack.pop().notes.append("call did not finish (an exception unwound it)")
                self._t0.pop()
            if not stack:
                return None
            rec = stack.pop()
            rec.time_ms = (t_end - self._t0.pop()) * 1e3
            rec.end_order = self._end
            self._end += 1
            cut = LeftOut()
            if isinstance(output, torch.Tensor) and not output.is_nested:
                tensors = [("out", output)]
                others: list[tuple[str, str]] = []
            else:
                tensors = []
                others = []
                find_tensors(output, "out", tensors, others, left_out=cut)
            rec.notes.extend(cut.notes("outputs", len(tensors)))
            if not tensors and not cut.total:
                if others and others[0][1] == "nested tensor":
                    rec.notes.append("output is a nested tensor (no single shape): not recorded")
                else:
                    rec.notes.append(
                        f"non-tensor output ({type(output).__name__}): nothing to record"
                    )
            elif others:
                rec.notes.append(
                    "non-tensor output parts not recorded: "
                    + ", ".join(f"{p} ({t})" for p, t in others[:4])
                )
            if self._memory is not None:
                self._memory.call_end(rec, [t for _, t in tensors])
            outs = []
            if self._dist is not None:
                self._dist.where = f"{name}#{rec.call_index}/out"
            grad_on = self.grads
            no_grad = False
            for path, t in tensors:
                info = self._info(path, t)
                if self.keep_bytes:
                    info.kept = self._keep(f"fwd/{rec.index}/{path}", t)
                if grad_on and t.requires_grad:
                    self._tensor_handles.append(t.register_hook(partial(self._on_grad, rec, path)))
                elif grad_on and t.is_floating_point():
                    no_grad = True
                outs.append(info)
            rec.outputs = outs
            if no_grad:
                self._no_grad[name] = self._no_grad.get(name, 0) + 1
        except Exception as exc:
            self._error(name, exc)
        return None

    def _on_grad(self, rec: CallRecord, path: str, grad: torch.Tensor) -> None:
        if not self._active or grad is None:
            return None
        try:
            bwd = self.trace.backward
            g = GradRecord(
                len(bwd),
                rec.index,
                rec.module,
                rec.module_type,
                rec.call_index,
                path,
                list(grad.shape),
                dtype_name(grad.dtype),
            )
            if self._dist is not None:
                self._dist.where = f"{rec.module}#{rec.call_index}/grad {path}"
            elif self._bg:
                self._queue_drain()
            slot = self._slot(grad)  # hooks on one tensor share one gradient object
            if slot is not None:
                self._pending.append((g, slot))
            if self.keep_bytes:
                g.kept = self._keep(f"bwd/{g.index}", grad)
            bwd.append(g)
            if self._memory is not None:
                self._memory.grad_arrived(rec.index)
        except Exception as exc:
            self._error(rec.module, exc)
        return None

    def _on_param(self, name: str, param: torch.Tensor) -> None:
        # Runs right after autograd accumulated .grad, while the gradient (and usually the
        # weight) is still in cache: far cheaper than reading every gradient again at exit.
        if not self._active:
            return
        if self._dist is not None and self._dist.owns(param):  # reduced at exit
            return self._dist.touch(name, param)
        try:
            if self._memory is not None:  # (off for a sharded model)
                self._memory.param_grad(name, param)
            # in the hook, never on the worker: an optimizer step in a later hook of this
            # backward (optimizer-in-backward) would change them before the worker read them
            self._touched.put(name, param.grad, param)
        except Exception as exc:
            self._error(name, exc)

    # -- activation checkpointing: calls re-run during backward ---------------------------------
    # torch.utils.checkpoint (and HF's gradient checkpointing, built on it) runs a region's
    # forward again during backward. Such a re-run is matched to the forward call it repeats and
    # kept there (CallRecord.recomputed), never appended to trace.forward: a re-run's children are
    # matched to the original's children (same module, same order), a region's outermost calls
    # by module and by the storage of their inputs (checkpoint hands the region the tensors it
    # saved), else to the latest call of that module not matched yet. Non-reentrant
    # checkpointing back-propagates through the original graph, so gradients arrive on the
    # original outputs; reentrant checkpointing ran the region under no_grad and
    # back-propagates through the re-run, whose outputs then get the tensor hooks, attributed
    # to the original call. A re-run's output statistics are compared with the original's.
    def _init_recompute(self) -> None:
        self._rstack: list[Recomputed] = []  # open re-runs, innermost last
        self._sigs: dict[int, tuple] = {}  # trace.forward index -> its inputs' storage
        self._by_module: dict[str, list[CallRecord]] = {}
        self._kids: dict[int, dict[str, list[CallRecord]]] = {}
        self._indexed = 0  # trace.forward records indexed in _by_module / _kids
        self._claimed: set[int] = set()
        self._regrad: set[int] = set()  # originals whose gradients come from a re-run
        self._recheck: list[tuple[CallRecord, TensorInfo, int]] = []
        self._reruns = 0

    def _index_forward(self) -> None:
        fwd = self.trace.forward
        for rec in fwd[self._indexed :]:
            self._by_module.setdefault(rec.module, []).append(rec)
            if rec.parent is not None:
                self._kids.setdefault(rec.parent, {}).setdefault(rec.module, []).append(rec)
        self._indexed = len(fwd)

    def _pre_recomputed(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Open a re-run of an earlier call of ``name``; False when none matches."""
        self._index_forward()
        rs = self._rstack
        # entries that cannot contain this call were left open by a re-run that stopped early
        # (non-reentrant checkpointing stops once it has recomputed what backward needs)
        while rs and name not in self._kids.get(rs[-1].original.index, ()):
            rs.pop()
        orig = None
        if rs:
            parent = rs[-1]
            kids = self._kids[parent.original.index][name]
            k = parent.children.get(name, 0)
            parent.children[name] = k + 1
            if k < len(kids):
                orig = kids[k]
        if orig is None:
            orig = self._match_outermost(name, args, kwargs)
            if orig is None:
                return False
        self._claimed.add(orig.index)
        orig.recomputed += 1
        if orig.recomputed == 1:
            orig.notes.append(
                "recomputed during backward (activation checkpointing): the re-run is kept "
                "with this call, not recorded as a new one; its gradients are recorded here"
            )
        self._reruns += 1
        rs.append(Recomputed(name, orig))
        return True

    def _match_outermost(self, name: str, args: tuple, kwargs: dict) -> CallRecord | None:
        cands = self._by_module.get(name)
        if not cands:
            return None
        if len(cands) == 1:
            return cands[0]
        pool = cands
        if self.inputs:
            tensors: list[tuple[str, torch.Tensor]] = []
            find_tensors(args, "args", tensors, [], left_out=LeftOut())  # as _pre walked them
            find_tensors(kwargs, "kwargs", tensors, [], left_out=LeftOut())
            sig = storage_signature(tensors)
            pool = [c for c in cands if self._sigs.get(c.index) == sig] or cands
        for c in reversed(pool):  # backward re-runs regions from the last one
            if c.index not in self._claimed:
                return c
        return pool[-1]

    def _post_recomputed(self, name: str, output: Any) -> bool:
        """Close the re-run of ``name``; False when no re-run of it is open."""
        rs = self._rstack
        for i in range(len(rs) - 1, -1, -1):
            if rs[i].module == name:
                break
        else:
            return False
        orig = rs[i].original
        del rs[i:]
        tensors: list[tuple[str, torch.Tensor]] = []
        find_tensors(output, "out", tensors, [], left_out=LeftOut())  # as _post walked them
        for path, t in tensors:
            info = orig.output(path)
            if self.grads and t.requires_grad and not (info is not None and info.requires_grad):
                # reentrant checkpointing: the original ran under no_grad, backward runs here
                self._tensor_handles.append(t.register_hook(partial(self._on_grad, orig, path)))
                if info is not None:
                    info.requires_grad = True
                if orig.index not in self._regrad:
                    self._regrad.add(orig.index)
                    n = self._no_grad.get(orig.module, 0) - 1
                    if n > 0:
                        self._no_grad[orig.module] = n
                    else:
                        self._no_grad.pop(orig.module, None)
            if info is not None and info.shape == list(t.shape):
                slot = self._slot(t)
                if slot is not None:
                    self._recheck.append((orig, info, slot))
        return True

    def _finish_recompute(self, results: list[TensorStats]) -> None:
        if not self._reruns:
            return
        tr = self.trace
        differs: list[tuple[CallRecord, TensorInfo, TensorStats]] = []
        for orig, info, slot in self._recheck:
            again = results[slot]
            if info.stats is not None and again is not None and not same_values(info.stats,
                                                                                  again):
                differs.append((orig, info, again))
                orig.notes.append(
                    f"recomputed {info.path} differs from this call's: mean "
                    f"{again.mean:.6g} vs {info.stats.mean:.6g}, std {again.std:.6g} vs "
                    f"{info.stats.std:.6g}; its gradients are those of the recomputed values"
                )
        self._recheck.clear()
        mods = len({r.module for r in tr.forward if r.recomputed})
        tr.notes.append(
            Note(
                "recomputed",
                f"activation checkpointing re-ran {self._reruns} call(s) of {mods} module(s) "
                "during backward: kept with the calls they repeat (CallRecord.recomputed), with "
                "the gradients they produced, not recorded as new calls",
            )
        )
        if differs:
            orig, info, again = differs[0]
            tr.notes.append(
                Note(
                    "recompute_differs",
                    f"{len(differs)} recomputed output(s) differ from the forward call they "
                    f"repeat (first: {orig.module or '<root>'} call {orig.call_index} "
                    f"{info.path}): the recomputation is not deterministic (dropout or other "
                    "randomness without checkpoint's preserve_rng_state?), so the gradients "
                    "belong to other values than the forward recorded",
                    module=orig.module,
                    call_index=orig.call_index,
                )
            )

    # -- PyTorch fast paths the hooks turn off ----------------------------------------------------
    def _watch_fast_path(self, layers: list[tuple[str, nn.Module, bool]]) -> None:
        """``nn.TransformerEncoderLayer`` runs one fused kernel in inference only while no
        module of it has forward hooks; where the capture's hooks are the first ones there,
        a pre-hook notes each call that would have taken that path without them."""
        self._fast_path: dict[str, int] = {}
        for name, layer, had_hooks in layers:
            if not had_hooks and has_forward_hooks(layer):
                self._handles.append(
                    layer.register_forward_pre_hook(
                        partial(self._on_fast_path_layer, name), with_kwargs=True
                    )
                )

    def _on_fast_path_layer(self, name: str, layer: nn.Module, args: tuple, kwargs: dict):
        if not self._active:
            return None
        try:
            if not encoder_layer_fast_path_blocker(layer, args, kwargs):
                self._fast_path[name] = self._fast_path.get(name, 0) + 1
        except Exception as exc:
            self._error(name, exc)
        return None

    def _finish_fast_path(self) -> None:
        for name, n in self._fast_path.items():
            self.trace.notes.append(
                Note(
                    "fast_path",
                    f"{n} call(s) would have run PyTorch's fused inference kernel "
                    "(torch._transformer_encoder_layer_fwd, the TransformerEncoderLayer fast "
                    "path); the capture's forward hooks turn it off, so they ran the layer's "
                    "standard path (its submodules, one by one): the same function, other "
                    "kernels, outputs equal up to float rounding",
                    module=name,
                )
            )

    # -- parameters -----------------------------------------------------------------------------
    def _param_records(self) -> dict[str, ParamGradRecord]:
        """Per-parameter records; gradient numbers come from ``_on_param`` where it ran."""
        named = named_parameters(self._modules)
        sharded = self._dist.param_records(self._results, self.trace) if self._dist else {}
        if sharded:
            self._dist.set_shapes(named, sharded)
        return param_records(named, self._touched.values(), sharded)


def capture(
    model: nn.Module,
    *,
    keep_bytes: int = 0,
    include: Iterable[Selector] | None = None,
    exclude: Iterable[Selector] | None = None,
    inputs: bool = True,
    grads: bool = True,
    params: bool = True,
    attention: bool | Iterable[str] = False,
    attention_bytes: int = DEFAULT_ATTENTION_BYTES,
    probes: bool = True,
    step: int | None = None,
    every: int = 1,
    meta: dict[str, Any] | None = None,
    bins: int = NUM_BINS,
    edits: Sequence[Any] | None = None,
    sources: dict[str, Any] | None = None,
    memory: bool = True,
    optimizer: Any = None,
) -> Capture:
    """Record every module call of ``model`` (and its gradients) inside a ``with`` block.

    Example::

        with hooks.capture(model) as trace:
            out = model(ids, labels=ids)
            out.loss.backward()
        trace.forward[0].outputs[0].stats.mean

    The hooks are attached on entry and removed on exit, also when the body raises; the model
    computes exactly what it computes without them (outputs and gradients are read, never
    replaced). Run forward, and optionally backward, inside the block.

    A sharded model (``DTensor`` parameters: FSDP2 ``fully_shard``, tensor parallel, both on a
    2-D mesh) is summarised as the whole job's tensors: parameter names and shapes of the
    unsharded parameters, every statistic reduced exactly across the mesh at exit
    (:mod:`hooks.sharded.stats`, a few collectives), so every rank of the mesh must run the
    capture (and leave it) at the same step.

    Args:
        model: any ``torch.nn.Module`` (minillm, HF ``LlamaForCausalLM``/``MixtralForCausalLM``,
            a CNN...).
        keep_bytes: budget in bytes for full copies (on CPU) of forward outputs and gradients,
            kept in ``trace.tensors`` in recording order until the budget is spent; 0 keeps
            statistics only (default). What did not fit is said in ``trace.notes``.
        include: only record modules matching one of these selectors (see :data:`Selector`);
            None records every module.
        exclude: never record modules matching one of these selectors.
        inputs: also summarise each call's tensor inputs (needed by
            :meth:`Trace.first_nonfinite` to tell where NaN/Inf started).
        grads: record gradients of module outputs (tensor hooks).
        params: record per-parameter gradient statistics after backward.
        attention: attention probabilities (B, H, T, S) the model computed (its
            ``scaled_dot_product_attention`` calls, recomputed from their q, k, mask and scale,
            and its softmax over keys; see :mod:`hooks.probes.attention`): True for all, or
            ``fnmatch`` patterns of module names; False (default) adds no cost.
        attention_bytes: budget in bytes for those probabilities (and masks); calls past it
            are not kept and are named in a note. Default 64 MiB.
        probes: run the registered probes (MoE routing, attention); see
            :func:`hooks.register_probe`.
        step: training step number; with ``every``, only steps where ``step % every == 0`` are
            captured (others attach nothing and return a trace with ``captured=False``).
        every: capture every ``every``-th step.
        meta: JSON-serialisable values stored as ``trace.meta`` (config, token texts, losses).
        bins: histogram bins per tensor.
        edits: edit specs (``"zero model.layers.1.self_attn head=3"``) or
            :class:`hooks.engine.edits.Edit` objects applied to this step (see
            :mod:`hooks.engine.edits`); ``trace.edits`` says what each did, ``trace.notes`` names an
            edit that changed nothing. Applied on captured steps only.
        sources: batches by name for ``patch MODULE from=NAME`` (a tensor of ids, a tuple,
            a dict of kwargs or a :class:`hooks.Batch`).
        memory: account the step's bytes in ``trace.memory`` (:mod:`hooks.engine.memory`:
            saved activations per call, parameters, gradients, optimizer state, timeline).
        optimizer: the loop's optimizer, whose state ``trace.memory`` counts.

    Returns:
        Capture: a context manager whose ``__enter__`` returns the :class:`~hooks.Trace` that
        fills while the block runs and is complete after it exits.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``every < 1``, ``keep_bytes < 0``, ``attention_bytes < 0`` or a bad edit
            (one line; nothing runs); on entry, a model with no data (a parameter or buffer on
            the ``meta`` device): the message says how to materialise it.
    """
    return Capture(model, keep_bytes=keep_bytes, include=include, exclude=exclude,
                   inputs=inputs, grads=grads, params=params, attention=attention,
                   attention_bytes=attention_bytes, probes=probes, step=step, every=every,
                   meta=meta, bins=bins, edits=edits, sources=sources, memory=memory,
                   optimizer=optimizer)
