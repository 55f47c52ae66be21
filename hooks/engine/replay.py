"""A compiled model's captured step: the step runs compiled, exactly as without the capture,
and each call of the model is replayed eagerly on the side, where the capture's hooks record
it (used by :class:`hooks.engine.capture.Capture`).

Why: running the captured step itself eagerly (``torch.compiler.set_stance("force_eager")``)
applies eager PyTorch's update, not the compiled graph's: where they differ (a hook the graph
ignores, pytorch #117265; a graph break's side effect; other kernels) a watched step of
``run.watch`` trained differently from an unwatched one. Here the compiled call runs with none
of the capture's module hooks attached (dynamo sees the model as it always does: nothing is
traced or recompiled), then:

* forward: the same call again, eagerly, with the RNG state it started with, on clones of the
  model's buffers (BatchNorm statistics, caches: the real ones are left as the compiled call
  left them), the capture's hooks attached only meanwhile; the RNG continues from where the
  compiled call left it;
* backward: at the end of the user's backward (autograd's ``queue_callback``), the gradient
  that reached each output of the compiled call is sent back through the eager replay's graph
  with ``torch.autograd.grad``: module output gradients are recorded, ``.grad`` is not touched.
  ``Trace.params`` holds the real (compiled) gradients, as accumulated in ``.grad``.

Eager and compiled outputs (and parameter gradients, where ``.grad`` was empty before the
backward) are compared; :func:`difference_note` says by how much.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import nn

from hooks.engine.compile import compiled_parts, force_eager
from hooks.tensors.walk import LeftOut, find_tensors, named_parameters
from hooks.trace.records import Note

#: Relative difference (max |a - b| / max |a|) that float rounding explains, per dtype: eager
#: and compiled kernels sum in other orders (fused, reordered reductions).
ROUNDING = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3,
            torch.bfloat16: 4e-2}


@contextlib.contextmanager
def held_state(model: nn.Module, rng_cpu: torch.Tensor | None = None,
               rng_cuda: list[torch.Tensor] | None = None) -> Iterator[None]:
    """Run a replay of ``model`` that leaves its training state as it was: every buffer is
    swapped for a clone while the block runs (the replay updates the clones; the real tensors
    are never written, so no version counter moves), the train/eval flags are restored, and
    the RNG is forked (set to ``rng_cpu``/``rng_cuda`` when given, restored after)."""
    flags = [(m, m.training) for m in model.modules()]
    swapped = []
    for m in model.modules():
        for name, b in list(m.named_buffers(recurse=False)):
            setattr(m, name, b.detach().clone())
            swapped.append((m, name, b))
    devices = list(range(len(rng_cuda))) if rng_cuda is not None else []
    try:
        with torch.random.fork_rng(devices=devices):
            if rng_cpu is not None:
                torch.set_rng_state(rng_cpu)
            if rng_cuda is not None:
                torch.cuda.set_rng_state_all(rng_cuda)
            yield
    finally:
        for m, name, b in reversed(swapped):
            setattr(m, name, b)
        for m, f in flags:
            m.training = f


def output_tensors(output: Any) -> dict[str, torch.Tensor]:
    """The tensors of a forward's output by path (as the capture names them)."""
    tensors: list[tuple[str, torch.Tensor]] = []
    find_tensors(output, "out", tensors, [], left_out=LeftOut())
    return dict(tensors)


class Differences:
    """The largest eager-vs-compiled differences seen, per kind (``outputs``, ``loss``,
    ``gradients``): ``(relative, absolute, where, dtype)``."""

    def __init__(self) -> None:
        self.worst: dict[str, tuple[float, float, str, torch.dtype]] = {}
        self.compared: dict[str, int] = {}

    def add(self, kind: str, where: str, eager: torch.Tensor, compiled: torch.Tensor) -> None:
        """Compare one pair of floating-point tensors of the same shape."""
        if (eager.shape != compiled.shape or not eager.is_floating_point()
                or not compiled.is_floating_point() or eager.numel() == 0):
            return
        a, b = compiled.detach().double(), eager.detach().to(compiled.device).double()
        diff = float((a - b).abs().max())
        scale = float(a.abs().max())
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        if math.isnan(diff):
            rel = 0.0 if bool(torch.equal(a.isnan(), b.isnan())) else math.inf
            diff = float(torch.nan_to_num(a - b, nan=0.0).abs().max())
        self.compared[kind] = self.compared.get(kind, 0) + 1
        old = self.worst.get(kind)
        if old is None or rel > old[0]:
            self.worst[kind] = (rel, diff, where, compiled.dtype)

    def beyond_rounding(self) -> list[str]:
        """The kinds whose worst difference is beyond what :data:`ROUNDING` explains."""
        return [k for k, (rel, _, _, dt) in self.worst.items()
                if rel > ROUNDING.get(dt, 1e-4)]


def difference_note(diffs: Differences) -> str:
    """The sentence a capture's ``compiled`` note ends with: each kind compared, its largest
    difference (absolute and relative to the compiled tensor's max |x|, where), and whether
    float rounding explains it."""
    if not diffs.worst:
        return "no eager replay was compared with the compiled step"
    parts = []
    for kind in ("loss", "outputs", "gradients"):
        if kind not in diffs.worst:
            continue
        rel, diff, where, dt = diffs.worst[kind]
        parts.append(f"{kind} max |Δ| {diff:.3g} ({rel:.3g} of max |x|, {where}, "
                     f"{diffs.compared[kind]} compared)")
    beyond = diffs.beyond_rounding()
    verdict = (f"beyond float rounding in {', '.join(beyond)}: the compiled graph computes "
               "something else than the eager model (a hook or code it does not run, a graph "
               "break's side effect, other kernels); the recorded module values are eager's"
               if beyond else "within float rounding")
    return "eager replay vs compiled step: " + "; ".join(parts) + f" — {verdict}"


class CompiledReplay:
    """The part of :class:`hooks.engine.capture.Capture` that captures a compiled model's step by
    eager replays on the side (see the module docstring). A mixin: it runs on the capture's
    own state (``_active``, ``_modules``, ``_recording_hooks`` …)."""

    # -- which way: replayed on the side, or the step itself run eagerly ------------------------
    def _start_eager(self, root: nn.Module) -> None:
        self._compiled = compiled_parts(self._modules)
        self._unwrapped = root is not self.model
        # a compiled model (wrapper, Module.compile, compiled submodules) runs its step
        # compiled, recorded by eager replays on the side (hooks.engine.replay); edits
        # change the step itself, so an edited step runs eagerly
        self._replay_mode = ((self._unwrapped or bool(self._compiled))
                             and "torch._dynamo" in sys.modules and self._editor is None
                             and self._dist is None
                             and getattr(torch.compiler, "set_stance", None) is not None)
        if self._replay_mode:
            self._stance, self._watch_wrapper, self._via_wrapper = None, False, False
            return
        self._stance = force_eager()
        # a module compiled elsewhere (torch.compile(model) called, model captured) is seen
        # when its first call arrives through the wrapper
        self._watch_wrapper = self._stance is not None
        self._via_wrapper = False
        if self._compiled and self._stance is None and "torch._dynamo" in sys.modules:
            self.trace.notes.append(
                Note(
                    "compiled",
                    f"{', '.join(self._compiled[:3])} torch.compile'd, and this torch has no "
                    "torch.compiler.set_stance (torch < 2.6) to run the step eagerly: hooks "
                    "added after compilation may not fire; capture the uncompiled module",
                )
            )

    def _stop_eager(self) -> None:
        if self._replay_mode:
            self._end_intercept()
        if self._stance is not None:
            self._stance.__exit__(None, None, None)
            self._stance = None

    def _finish_eager(self) -> None:
        if not (self._unwrapped or self._via_wrapper or self._compiled):
            return
        if self._unwrapped:
            what = "the model is a torch.compile wrapper (OptimizedModule): recorded under its "
            what += "original module's names (_orig_mod)"
        elif self._compiled:
            what = f"{', '.join(self._compiled[:3])} torch.compile'd"
        else:
            what = "the model ran inside its torch.compile wrapper (OptimizedModule)"
        if self._replay_mode:
            self._replay_notes(what)
        elif self._watch_wrapper:  # the stance was set
            self.trace.notes.append(
                Note(
                    "compiled",
                    f"{what}; the captured step ran eagerly (torch.compiler.set_stance("
                    "'force_eager')) so that every module call is recorded and dynamo traces "
                    "none of the hooks: values, gradients and this step's update are eager "
                    "PyTorch's, not the compiled graph's (capture the torch.compile wrapper "
                    "or the compiled model itself to keep the compiled update)",
                )
            )

    def _replay_notes(self, what: str) -> None:
        diffs = self._diffs
        self.trace.notes.append(Note(
            "compiled", f"{what}; the step ran compiled, as without the capture: its update, "
            "the gradients in Trace.params and the buffers are the compiled graph's. The "
            "module calls recorded are an eager replay of each call on the side (the same "
            "arguments, RNG state and buffers, torch.compiler.set_stance('force_eager')) "
            "that changed no parameter, gradient, buffer or RNG state; "
            + difference_note(diffs)))
        if diffs.beyond_rounding():
            self.trace.notes.append(Note("compiled_differs", difference_note(diffs)))

    # -- the replays -----------------------------------------------------------------------------
    def _intercept(self, root: nn.Module) -> None:
        """Watch the model's outermost calls without attaching anything dynamo traces: hooks
        on the ``torch.compile`` wrapper (run eagerly, outside the graph), ``Module.compile``'s
        compiled call wrapped on the instance, else hooks on the (eager) root."""
        self._replay_root = root
        self._replaying = False
        self._calls: list[tuple | None] = []  # open calls: (args, kwargs, rng cpu, rng cuda)
        self._eager_calls: list[dict] = []  # replays whose backward has not run yet
        self._diffs = Differences()
        self._attention_on = False
        self._trained = [(n, p) for n, p in named_parameters(self._modules) if p.requires_grad]
        self._compiled_impl = None
        impl = getattr(root, "_compiled_call_impl", None)  # Module.compile()'s slot
        if not self._unwrapped and impl is not None:
            def call(*args: Any, **kwargs: Any) -> Any:
                if self._replaying:
                    return impl(*args, **kwargs)
                self._call_pre(root, args, kwargs)
                out = impl(*args, **kwargs)
                self._call_post(root, args, kwargs, out)
                return out

            self._compiled_impl = impl
            # torch private: where Module.compile() keeps the compiled forward (no public API)
            root._compiled_call_impl = call
            return
        outer = self.model if self._unwrapped else root
        self._handles.append(outer.register_forward_pre_hook(
            self._call_pre, with_kwargs=True, prepend=True))
        self._handles.append(outer.register_forward_hook(self._call_post, with_kwargs=True))

    def _end_intercept(self) -> None:
        if self._compiled_impl is not None:
            self._replay_root._compiled_call_impl = self._compiled_impl
            self._compiled_impl = None
        for call in self._eager_calls:  # forwards whose backward never came
            call["eager"] = None
        self._eager_calls.clear()
        self._calls.clear()

    @property
    def replaying(self) -> bool:
        """True while the capture replays a call of a compiled model eagerly (its forward
        or backward): calls of the model now are the capture's, not the user's."""
        return getattr(self, "_replaying", False)

    def _call_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._active or self._replaying or self.recomputing:
            self._calls.append(None)
            return None
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._calls.append((tuple(args), dict(kwargs), torch.get_rng_state(), cuda))
        return None

    def _call_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        call = self._calls.pop() if self._calls else None
        if call is None or not self._active:
            return None
        try:
            self._replay(*call, output)
        except Exception as exc:  # never break the user's step
            self._error("", exc)
        return None

    def _replay(self, args: tuple, kwargs: dict, rng_cpu: torch.Tensor,
                rng_cuda: list | None, output: Any) -> None:
        """Run the call again eagerly, recorded, on the side; prepare its backward."""
        root = self._replay_root
        handles: list[Any] = []
        self._replaying = True
        stance = force_eager()
        try:
            handles = self._recording_hooks(root)
            if self._attention is not None and not self._attention_on:
                self._attention.start()
                self._attention_on = True
            with held_state(root, rng_cpu, rng_cuda):
                eager = root(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
            if stance is not None:
                stance.__exit__(None, None, None)
            self._replaying = False
        compiled, replayed = output_tensors(output), output_tensors(eager)
        call: dict[str, Any] = {"eager": replayed, "grads": {}, "queued": False}
        hooked = False
        seen: set[int] = set()  # an output reachable by several paths (out.loss, out[0])
        for path, t in compiled.items():
            e = replayed.get(path)
            if e is None or id(t) in seen or id(e) in seen:
                continue
            seen.update((id(t), id(e)))
            self._diffs.add("loss" if t.numel() == 1 else "outputs", path, e, t)
            if t.requires_grad and e.requires_grad:
                self._tensor_handles.append(t.register_hook(partial(self._out_grad, call, path)))
                hooked = True
        if hooked:  # the eager graph is kept until the real backward has run
            self._eager_calls.append(call)

    def _out_grad(self, call: dict, path: str, grad: torch.Tensor) -> None:
        """A gradient reached an output of the compiled call: its eager replay's backward runs
        at the end of this backward pass."""
        if not self._active or call["eager"] is None:
            return None
        call["grads"][path] = grad
        if not call["queued"]:
            call["queued"] = True
            call["empty"] = [p.grad is None for _, p in self._trained]
            torch.autograd.Variable._execution_engine.queue_callback(
                partial(self._replay_backward, call))
        return None

    def _replay_backward(self, call: dict) -> None:
        eager = call["eager"]
        call["eager"] = None
        if eager is None or not self._active:
            return
        if call in self._eager_calls:
            self._eager_calls.remove(call)
        outs = [(eager[p], g) for p, g in call["grads"].items()]
        params = [p for _, p in self._trained]
        self._replaying = True
        stance = force_eager()
        try:
            grads = self._backward_through(outs, params)
            for (name, p), g, empty in zip(self._trained, grads, call["empty"], strict=True):
                if g is not None and empty and p.grad is not None and not (
                        g.is_sparse or p.grad.is_sparse):
                    self._diffs.add("gradients", name, g, p.grad)
        except Exception as exc:  # never break the user's backward
            self._error("", exc)
        finally:
            if stance is not None:
                stance.__exit__(None, None, None)
            self._replaying = False

    def _backward_through(self, outs: list[tuple[torch.Tensor, torch.Tensor]],
                          params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The parameters' gradients of the eager replay, given the gradient that reached each
        compiled output. An output computed from another (``loss = ce_loss + c·aux_loss``)
        received a gradient through that one too: only the outputs no other one was computed
        from are sent back first; what reached the others from outside (the gradient minus
        what came through those) is sent back after, unrecorded (rare: a loss built from
        several of a model's outputs outside it)."""
        roots, inner = split_outputs(outs)
        res = torch.autograd.grad([e for e, _ in roots], params + [e for e, _ in inner],
                                  [g for _, g in roots], allow_unused=True,
                                  retain_graph=bool(inner))
        grads = list(res[: len(params)])
        rest = []
        for (e, g), via in zip(inner, res[len(params):], strict=True):
            left = g if via is None else g - via
            if float(left.abs().max()) > ROUNDING.get(g.dtype, 1e-4) * float(g.abs().max()):
                rest.append((e, left))
        if rest:
            with self.paused():  # the module gradients recorded are the first pass's
                more = torch.autograd.grad([e for e, _ in rest], params,
                                           [g for _, g in rest], allow_unused=True)
            grads = [b if a is None else (a if b is None else a + b)
                     for a, b in zip(grads, more, strict=True)]
        return grads


def split_outputs(outs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list, list]:
    """``(roots, inner)``: the (output, gradient) pairs no other output of ``outs`` was
    computed from, and those another one was (its autograd graph reaches them)."""
    seen: set[Any] = set()
    stack = [n for e, _ in outs if e.grad_fn is not None
             for n, _ in e.grad_fn.next_functions if n is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    roots = [(e, g) for e, g in outs if e.grad_fn is None or e.grad_fn not in seen]
    inner = [(e, g) for e, g in outs if e.grad_fn is not None and e.grad_fn in seen]
    return roots, inner
