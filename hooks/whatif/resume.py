"""Runs of a decoder-only model that patching sweeps are made of: one recorded forward pass
(each block's input call, its output, each attention's output-projection input), and patched runs
of many copies at once, resumed at the patched block from the recorded inputs.

A patched run of copy i changes the residual stream at block l only, so the blocks before l are
the recorded run's: :class:`Resumer` calls blocks l…L-1 (then the final norm, the head and what
the model applies after it) on a batch of n copies stacked copy-major, (n·B, T, D), with the
block's other recorded arguments (masks, rotary position embeddings) repeated to n·B rows where
they have B. :meth:`Resumer.check` verifies on the model itself that resuming reproduces the
model's logits; where it does not (a block that reads state outside its arguments), the caller
runs the whole model on the repeated batch instead (:func:`full_patched`).

Dimension legend: n copies, B batch, T positions, D hidden size, V vocabulary.

Never imports textual, rich or tui.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: A patch: (tensor of n·B rows, n) → the tensor with each copy's change made (in place or not).
Patch = Callable[[torch.Tensor, int], torch.Tensor]


def first_tensor(x: Any) -> torch.Tensor | None:
    """The first tensor of a module's output (a tensor, or a tuple/list whose first tensor)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        return next((v for v in x if isinstance(v, torch.Tensor)), None)
    return None


def with_first(x: Any, new: torch.Tensor) -> Any:
    """``x`` with its first tensor replaced by ``new``."""
    if isinstance(x, torch.Tensor):
        return new
    out, done = [], False
    for v in x:
        if not done and isinstance(v, torch.Tensor):
            out.append(new)
            done = True
        else:
            out.append(v)
    return type(x)(out) if isinstance(x, tuple) else out


def no_cache_batch(model: nn.Module, batch: Any):
    """:meth:`hooks.Batch.of` ``batch``, with ``use_cache=False`` where the model's forward takes
    it (an HF model run twice from the same block inputs must not append to a key/value cache)."""
    from hooks.batch import Batch

    b = Batch.of(batch)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return b
    if "use_cache" in params and "use_cache" not in b.kwargs:
        return b.replace(kwargs={**b.kwargs, "use_cache": False})
    return b


#: Keyword arguments of a block that hold a key/value cache (HF ``past_key_values``, Granite's
#: ``cache``): a resumed call gets None, so that it neither reads nor appends to the recorded run's.
CACHE_NAMES = ("past_key_value", "past_key_values", "layer_past", "cache")


def without_cache(kwargs: dict) -> dict:
    """``kwargs`` with every key/value cache (:data:`CACHE_NAMES`, or a value whose class name
    ends in ``Cache``) set to None."""
    return {k: None if k in CACHE_NAMES or type(v).__name__.endswith("Cache") else v
            for k, v in kwargs.items()}


def repeat_rows(x: Any, rows: int, n: int) -> Any:
    """``x`` with every tensor of at least 2 dimensions and ``rows`` rows repeated ``n`` times
    along dim 0 (copy-major), in nested tuples, lists and dicts too; other values as they are."""
    if n == 1:
        return x
    if isinstance(x, torch.Tensor):
        if x.dim() >= 2 and x.shape[0] == rows and rows > 1:
            return x.repeat(n, *([1] * (x.dim() - 1)))
        return x
    if isinstance(x, tuple):
        return tuple(repeat_rows(v, rows, n) for v in x)
    if isinstance(x, list):
        return [repeat_rows(v, rows, n) for v in x]
    if isinstance(x, dict):
        return {k: repeat_rows(v, rows, n) for k, v in x.items()}
    return x


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """The model in eval mode (no dropout: every run deterministic), its flags restored after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, f in flags:
            m.training = f


@dataclass
class Recording:
    """One recorded forward pass.

    Attributes:
        h_in: (B, T, D) each block's residual input.
        h_out: (B, T, D) each block's residual output.
        z: (B, T, H·Dh) each block's attention output-projection input (None where not kept).
        attn: (B, T, D) each block's attention module's output (None where not kept).
        calls: each block's call, ``(args, kwargs)``, the residual at ``args[0]``.
        logits: (B, T, V) the model's logits.
        rows: B.
    """

    h_in: list[torch.Tensor] = field(default_factory=list)
    h_out: list[torch.Tensor] = field(default_factory=list)
    z: list[torch.Tensor | None] = field(default_factory=list)
    attn: list[torch.Tensor | None] = field(default_factory=list)
    calls: list[tuple[tuple, dict]] = field(default_factory=list)
    logits: torch.Tensor | None = None
    rows: int = 0


def record(model: nn.Module, batch: Any, parts, *, heads: bool = False,
           grad: bool = False) -> Recording:
    """Run ``model`` on ``batch`` once and keep what :class:`Recording` holds (``z`` and
    ``attn`` with ``heads``).

    With ``grad`` the run is under ``torch.enable_grad()``, the first block's residual input is
    made a tensor that requires grad (so that every later activation does, even with frozen
    weights) and nothing kept is detached: the caller differentiates the logits.

    Raises:
        ValueError: a block that did not run or gave no tensor, or an output without logits.
    """
    from hooks.whatif.stream import output_logits

    modules = dict(model.named_modules())
    n = len(parts.blocks)
    rec = Recording(h_in=[None] * n, h_out=[None] * n, z=[None] * n, attn=[None] * n,
                    calls=[None] * n)
    keep = (lambda t: t) if grad else (lambda t: t.detach())

    def pre(i):
        def hook(_m, args, kwargs):
            if rec.calls[i] is not None:
                return None
            if not args or not isinstance(args[0], torch.Tensor):
                raise ValueError(f"block {parts.blocks[i].name} is called without the residual "
                                 "stream as its first positional argument")
            h = args[0]
            if grad and i == 0 and not h.requires_grad:
                h = h.detach().requires_grad_()
                args = (h, *args[1:])
            rec.h_in[i] = keep(h)
            rec.calls[i] = (args, kwargs)
            return args, kwargs
        return hook

    def post(i):
        def hook(_m, _args, out):
            if rec.h_out[i] is None:
                rec.h_out[i] = keep(first_tensor(out))
        return hook

    def zpre(i):
        def hook(_m, args):
            if rec.z[i] is None:
                rec.z[i] = keep(args[0])
        return hook

    def apost(i):
        def hook(_m, _args, out):
            if rec.attn[i] is None:
                rec.attn[i] = keep(first_tensor(out))
        return hook

    handles = []
    for i, bp in enumerate(parts.blocks):
        m = modules[bp.name]
        handles.append(m.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(m.register_forward_hook(post(i)))
        if heads and bp.out_proj is not None:
            handles.append(modules[bp.out_proj].register_forward_pre_hook(zpre(i)))
            handles.append(modules[bp.attention].register_forward_hook(apost(i)))
    b = no_cache_batch(model, batch)
    try:
        with torch.enable_grad() if grad else torch.no_grad():
            output = b.call(model)
    finally:
        for h in handles:
            h.remove()
    for i, bp in enumerate(parts.blocks):
        if rec.h_out[i] is None or rec.calls[i] is None:
            raise ValueError(f"decoder block {bp.name} did not run in the forward pass (or "
                             "returned no tensor)")
    rec.logits = output_logits(output)
    if rec.logits is None:
        raise ValueError("the model's output holds no (B, T, V) logits to measure")
    rec.rows = int(rec.h_in[0].shape[0])
    return rec


class Resumer:
    """Patched runs of n copies, resumed at a block from a :class:`Recording` (module docstring).

    Args:
        model: the model recorded.
        parts: its :class:`hooks.whatif.stream.StreamParts`.
        rec: the recording of the run the copies start from.
    """

    def __init__(self, model: nn.Module, parts, rec: Recording) -> None:
        modules = dict(model.named_modules())
        self.blocks = [modules[b.name] for b in parts.blocks]
        self.out_projs = [modules[b.out_proj] if b.out_proj else None for b in parts.blocks]
        self.norm, self.head, self.post = modules[parts.norm], modules[parts.head], parts.post
        self.rec = rec

    def logits(self, start: int, h: torch.Tensor, n: int, z_patch: Patch | None = None
               ) -> torch.Tensor:
        """(n·B, T, V) logits of the copies ``h`` (n·B, T, D), the residual input of block
        ``start`` (``start`` = L: the last block's output); ``z_patch`` changes block
        ``start``'s output-projection input."""
        handle = None
        if z_patch is not None:
            proj = self.out_projs[start]
            handle = proj.register_forward_pre_hook(lambda _m, a: (z_patch(a[0], n), *a[1:]))
        try:
            for i in range(start, len(self.blocks)):
                args, kwargs = self.rec.calls[i]
                rest = repeat_rows(args[1:], self.rec.rows, n)
                kw = repeat_rows(without_cache(kwargs), self.rec.rows, n)
                out = self.blocks[i](h, *rest, **kw)
                h = first_tensor(out)
        finally:
            if handle is not None:
                handle.remove()
        x = self.head(self.norm(h))
        return self.post(x) if self.post is not None else x

    def check(self) -> float:
        """The largest |resumed − recorded| logit when two unpatched copies are resumed at block
        0 (inf when resuming raised): 0 up to rounding where resuming is the model's own
        computation."""
        try:
            with torch.no_grad():
                h = self.rec.h_in[0].repeat(2, *([1] * (self.rec.h_in[0].dim() - 1)))
                got = self.logits(0, h, 2)
        except Exception:  # a block that cannot be called from its recorded arguments
            return float("inf")
        ref = self.rec.logits.float().repeat(2, 1, 1)
        if got.shape != ref.shape:
            return float("inf")
        return float((got.float() - ref).abs().max())


def full_patched(model: nn.Module, batch: Any, n: int, module: nn.Module, patch: Patch,
                 *, on_input: bool = False) -> torch.Tensor:
    """(n·B, T, V) logits of the whole model run on ``batch`` repeated n times (copy-major), with
    ``patch`` applied to ``module``'s first output (or, ``on_input``, its first input)."""
    from hooks.whatif.stream import output_logits

    b = no_cache_batch(model, batch)
    rows = None
    ids = b.ids(model)
    if ids is not None:
        rows = int(ids.shape[0])
    else:
        first = next(v for v in (*b.args, *b.kwargs.values()) if isinstance(v, torch.Tensor))
        rows = int(first.shape[0])

    def rep(v):
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == rows:
            return v.repeat(n, *([1] * (v.dim() - 1)))
        return v

    big = b.replace(args=tuple(rep(v) for v in b.args),
                    kwargs={k: rep(v) for k, v in b.kwargs.items()})
    if on_input:
        handle = module.register_forward_pre_hook(lambda _m, a: (patch(a[0], n), *a[1:]))
    else:
        handle = module.register_forward_hook(
            lambda _m, _a, out: with_first(out, patch(first_tensor(out), n)))
    try:
        with torch.no_grad():
            return output_logits(big.call(model))
    finally:
        handle.remove()


__all__ = ["CACHE_NAMES", "Patch", "Recording", "Resumer", "eval_mode", "first_tensor",
           "full_patched", "no_cache_batch", "record", "repeat_rows", "with_first",
           "without_cache"]
