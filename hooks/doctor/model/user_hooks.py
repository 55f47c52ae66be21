"""Check 24: the user's own hooks do what they are meant to.

* A gradient hook on a parameter (``p.register_hook``) is meant to see that parameter's whole
  gradient once per backward. Under reentrant activation checkpointing
  (``torch.utils.checkpoint(..., use_reentrant=True)``) the segment's backward runs as a
  separate backward inside the outer one, so a parameter used inside and outside a segment
  gets its gradient in parts and its hooks fire once per part, each seeing a partial gradient
  (pytorch #81296). Measured by counting, with a hook of mdb's own, how often each parameter's
  gradient arrives in one backward of the loss.
* A forward hook added to a module after ``torch.compile`` ran is not seen by the compiled
  code (Dynamo does not guard on module hooks by default, ``skip_nnmodule_hook_guards``:
  pytorch #117265). Measured by running the compiled model and its original module on the
  batch: where they differ, each forward hook of the original is removed in turn from an eager
  run; the hook whose removal makes the eager output match the compiled one is the ignored one.

The hooks themselves are read from the modules' and parameters' hook dictionaries
(``Module._forward_hooks``, ``Tensor._backward_hooks``: PyTorch has no public reader).

Dimension legend: B batch, T sequence.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hooks.doctor.model.registry import DoctorOptions, check
from hooks.doctor.model.result import Outcome
from hooks.doctor.model.target import NotApplicable, SkipCheck, Target, fmt


def _hook_name(fn: Any) -> str:
    """``module.qualname`` of a hook function (a lambda's ``<lambda>``, a partial's func)."""
    fn = getattr(fn, "func", fn)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def grad_hooks(model: nn.Module) -> dict[str, list[str]]:
    """Parameter name -> the names of the gradient hooks registered on it
    (``p.register_hook``)."""
    out = {}
    for name, p in model.named_parameters():
        hooks = getattr(p, "_backward_hooks", None) or {}
        if hooks:
            out[name] = [_hook_name(h) for h in hooks.values()]
    return out


def compiled_parts(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """``(compiled, original)`` of a ``torch.compile`` wrapper (an ``OptimizedModule``) or of a
    module compiled in place (``Module.compile()``); None for an eager model."""
    orig = getattr(model, "_orig_mod", None)
    if isinstance(orig, nn.Module):
        return model, orig
    if getattr(model, "_compiled_call_impl", None) is not None:
        return model, model
    return None


def arrivals(t: Target) -> dict[str, list[float]]:
    """Per trainable parameter, the norms of its gradient each time it arrived in one backward
    of the loss (train mode, on the batch): one entry normally, several when the backward
    delivers it in parts."""
    seen: dict[str, list[float]] = {}
    handles = []
    for name, p in t.model.named_parameters():
        if p.requires_grad:
            handles.append(p.register_hook(
                lambda g, n=name: seen.setdefault(n, []).append(float(g.detach().norm()))))
    try:
        with t.mode(True):
            choice = t.loss(t.run(t.batch))
            if not choice.loss.requires_grad:
                raise SkipCheck(f"the loss ({choice.source}) does not require grad")
            # backward(), not autograd.grad: reentrant checkpointing refuses the latter (the
            # runner restores every .grad after the check)
            choice.loss.backward()
    finally:
        for h in handles:
            h.remove()
    return seen


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    lg = Target.logits(out)
    return lg


@contextlib.contextmanager
def _without_hook(module: nn.Module, key: int) -> Iterator[None]:
    """``module``'s forward hooks without the one of id ``key``, for the block."""
    saved = module._forward_hooks
    module._forward_hooks = OrderedDict((k, v) for k, v in saved.items() if k != key)
    try:
        yield
    finally:
        module._forward_hooks = saved


def ignored_hooks(t: Target, compiled: nn.Module,
                  orig: nn.Module) -> tuple[list[tuple[str, str, float]], float]:
    """Forward hooks of ``orig`` that the compiled model does not run: ``[(module, hook,
    effect)]`` (effect: how much the hook changes the eager output), and the largest
    difference between the compiled and the eager outputs."""
    def out_of(m: nn.Module) -> torch.Tensor | None:
        with torch.enable_grad():
            x = _first_tensor(m(*t.batch.args, **t.batch.kwargs))
        return None if x is None else x.detach().float()

    # called as training calls it (the batch as given, gradients on, the model's own mode):
    # another grad mode, train flag or call signature makes Dynamo recompile, and the
    # recompiled code would see the hooks the running code ignores
    comp, eager = out_of(compiled), out_of(orig)
    if comp is None or eager is None or comp.shape != eager.shape:
        return [], 0.0
    tol = 64 * torch.finfo(torch.float32).eps * max(1.0, float(eager.abs().max()))
    gap = float((comp - eager).abs().max())
    if gap <= tol:
        return [], gap
    found = []
    for name, m in orig.named_modules():
        for key, fn in list(m._forward_hooks.items()):
            with _without_hook(m, key):
                alone = out_of(orig)
            if alone is not None and float((alone - comp).abs().max()) <= tol:
                found.append((name or "<root>", _hook_name(fn),
                              float((eager - alone).abs().max())))
    return found, gap


@check(14, "hooks", "The user's own hooks")
def user_hooks(t: Target, o: DoctorOptions) -> Outcome:
    """Gradient hooks that fire more than once for one parameter in one backward (reentrant
    activation checkpointing: pytorch #81296), and forward hooks a compiled model ignores
    (added after ``torch.compile``: pytorch #117265). See the module docstring."""
    hooked = grad_hooks(t.model)
    parts = compiled_parts(t.model)
    data: dict[str, Any] = dict(grad_hooks=hooked, compiled=parts is not None)
    lines = []
    dropout = [n for n, m in t.model.named_modules()
               if m.training and isinstance(m, nn.Dropout) and m.p > 0]
    if parts is not None and parts[0] is not parts[1] and dropout:
        lines.append(f"compiled model not compared with its eager forward: dropout is active "
                     f"({dropout[0]})")
    elif parts is not None and parts[0] is not parts[1]:
        found, gap = ignored_hooks(t, *parts)
        data["ignored"] = [list(x) for x in found]
        if found:
            mod, fn, effect = found[0]
            return Outcome.fail(
                f"the compiled model's output differs from its eager forward by {fmt(gap)}: "
                f"the forward hook {fn} on {mod} (it changes the output by {fmt(effect)} when it "
                "runs) is not run by the compiled code",
                "a hook added after torch.compile is not seen by the compiled code (pytorch "
                "#117265): register hooks before compiling, or recompile "
                "(torch._dynamo.reset()) after adding them", None if mod == "<root>" else mod,
                **data)
        lines.append(f"compiled model: its output matches its eager forward (Δ {fmt(gap)})")
    seen = arrivals(t)
    many = {n: v for n, v in seen.items() if len(v) > 1}
    data["arrivals"] = {n: v for n, v in many.items()}
    if many:
        user = [n for n in many if n in hooked]
        name = user[0] if user else next(iter(many))
        parts_txt = ", ".join(fmt(x) for x in many[name])
        ev = (f"{name}'s gradient arrives {len(many[name])} times in one backward (partial "
              f"gradients of norm {parts_txt}); {len(many)} parameter(s) so")
        hint = ("reentrant activation checkpointing runs each segment's backward apart, so a "
                "parameter used inside and outside it gets its gradient in parts (pytorch "
                "#81296): use torch.utils.checkpoint(..., use_reentrant=False), or act on "
                "the gradient in a post-accumulate-grad hook")
        if user:
            return Outcome.fail(f"{ev}; its gradient hook {hooked[name][0]} runs on each part",
                                hint, name.rpartition(".")[0] or None, **data)
        return Outcome.ok(f"{ev}, none with a gradient hook of the user's (a hook on them "
                          "would see partial gradients)", **data)
    lines.append(f"{len(seen)} parameters each got their gradient once in one backward"
                 + (f"; {len(hooked)} with gradient hooks of the user's" if hooked else ""))
    if not hooked and parts is None and not any(
            m._forward_hooks for m in t.model.modules()):
        lines.append("no hooks of the user's")
    if not seen:
        raise NotApplicable("no trainable parameter")
    return Outcome.ok("; ".join(lines), **data)
