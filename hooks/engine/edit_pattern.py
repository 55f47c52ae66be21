"""The attention pattern of one attention module's call, handed to an edit: the post-softmax
probabilities P = softmax(q·kᵀ·scale + mask) of each head, (B, H, T, S), before they weigh the
values (``zero … pattern head=H``, ``patch … pattern head=H from=…``).

A :class:`torch.overrides.TorchFunctionMode` is entered for the attention module's call only
(a forward pre-hook enters it, a forward hook that always runs leaves it) and sees every torch
function called inside it:

* an eager softmax (``torch.softmax``, ``F.softmax``, ``Tensor.softmax``) over the last
  dimension of (B, H, T, S) scores with H the module's query heads (what
  :mod:`hooks.modelroles.traced` reads as attention) has its output edited;
* ``F.scaled_dot_product_attention`` (SDPA; HF's ``attn_implementation="sdpa"``) is computed
  explicitly instead: ``softmax(q·kᵀ·scale + mask)`` with the call's own ``attn_mask``,
  ``is_causal`` (top-left aligned, as SDPA), ``scale`` (default 1/√Dh) and grouped keys and
  values repeated to the H query heads; the edited P then weighs v. Dropout on P is applied as
  SDPA would when ``dropout_p > 0``.

Under a capture that records attention (:mod:`hooks.probes.attention`, which swaps the softmax
and SDPA names for wrappers), the wrapped builtins are recognised through ``__wrapped__``; the
softmax is computed as ``torch.special.softmax`` (the same kernel, a name not swapped) and the
edited P is what the capture records (handed to it by
:func:`hooks.probes.attention.observe_softmax` where the model's ``F.softmax`` would have reached
it); the capture's own recomputation of an SDPA call's P gets the same edit, uncounted.

Other kernels (FlashAttention's ``flash_attn_func``, HF's ``flex_attention``, a fused CUDA
op) hand no probabilities to a torch function and are not seen: load the model with
``attn_implementation="eager"`` (or ``"sdpa"``). Dimension legend: B batch, H query heads,
Hkv key/value heads, T query positions, S key positions, Dh head dim. Reference: PyTorch's
documented math of ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hooks.probes.attention import in_own_computation, observe_softmax

_SOFTMAX = (torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax)
_SDPA = F.scaled_dot_product_attention

#: What the edit is handed: (P (B, H, T, S), index of this softmax in the call, whether to
#: count it: False for an attention capture's record of a call already edited) -> new P.
ProbsEdit = Callable[[torch.Tensor, int, bool], torch.Tensor]


def sdpa_probs(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None = None,
               is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """P of ``F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=, scale=)``.

    Args:
        q: (B, H, T, Dh) queries.
        k: (B, Hkv, S, Dh) keys; Hkv divides H (each repeated H/Hkv times, as
            ``enable_gqa=True``).
        attn_mask: a boolean mask (True: attend) or a float mask added to the scores,
            broadcastable to (B, H, T, S).
        is_causal: mask key s > query t (top-left aligned).
        scale: the scores' factor, default 1/√Dh.

    Returns:
        torch.Tensor: (B, H, T, S) probabilities in q's dtype (the scores in fp32 at least).
    """
    h, hkv = q.shape[-3], k.shape[-3]
    if hkv != h:
        k = k.repeat_interleave(h // hkv, dim=-3)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q.float() @ k.float().transpose(-2, -1)) * s
    t, n = scores.shape[-2], scores.shape[-1]
    if is_causal:
        keep = torch.ones(t, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask.float()
    # torch.special.softmax: the same kernel, a name an attention capture does not swap
    return torch.special.softmax(scores, dim=-1).to(q.dtype)


class AttentionProbs(TorchFunctionMode):
    """Hands each attention probability tensor computed inside one module call to ``edit``
    (see the module docstring).

    Args:
        num_heads: H, the module's query heads (a softmax over scores of another shape is
            left alone).
        edit: ``edit(P, j, count)`` returns the P to use, (B, H, T, S), for the call's j-th
            softmax (``count`` False: the same P again, for an attention capture's record).
        record_only: True: the edit only records P; SDPA's own output is returned (the
            source run of a ``patch``).

    Attributes:
        seen: how many probability tensors were handed to ``edit`` in this call.
    """

    def __init__(self, num_heads: int, edit: ProbsEdit, record_only: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.edit = edit
        self.record_only = record_only
        self.seen = 0

    def _is_scores(self, x: object, dim: object) -> bool:
        return (isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[1] == self.num_heads
                and isinstance(dim, int) and dim % 4 == 3)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        base = getattr(func, "__wrapped__", func)  # an attention capture's wrapper: its builtin
        if base in _SOFTMAX:
            x = args[0] if args else kwargs.get("input")
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if not self._is_scores(x, dim):
                return func(*args, **kwargs)
            out = torch.special.softmax(x, dim, dtype=kwargs.get("dtype"))
            if in_own_computation():  # a capture recomputing the SDPA just edited: its record
                return out if self.record_only else self.edit(out, self.seen - 1, False)
            self.seen += 1
            new = self.edit(out, self.seen - 1, True)  # records, in a source run
            got = out if self.record_only else new
            if base is F.softmax:  # its inner Tensor.softmax, which a capture reads, was skipped
                observe_softmax(x, got, dim)
            return got
        if base is _SDPA:
            return self._sdpa(func, args, kwargs)
        return func(*args, **kwargs)

    def _sdpa(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        a = {**dict(zip(names, args, strict=False)), **kwargs}
        q, k, v = a["query"], a["key"], a["value"]
        if q.dim() != 4 or q.shape[1] != self.num_heads:
            return func(*args, **kwargs)
        p = sdpa_probs(q, k, a.get("attn_mask"), bool(a.get("is_causal", False)),
                       a.get("scale"))
        self.seen += 1
        new = self.edit(p, self.seen - 1, True)
        if self.record_only:
            return func(*args, **kwargs)
        drop = float(a.get("dropout_p", 0.0) or 0.0)
        if drop > 0:
            new = F.dropout(new, drop, training=True)
        if v.shape[1] != q.shape[1]:
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return new.to(v.dtype) @ v


def _enter_leave(module, mode_of, on_leave=None) -> list:
    """A pre-hook that enters ``mode_of()`` for the module's call and a forward hook (run even
    when the call raises) that leaves it."""
    stack: list[AttentionProbs] = []

    def enter(mod, args):
        mode = mode_of()
        mode.__enter__()
        stack.append(mode)

    def leave(mod, args, output):
        if stack:
            mode = stack.pop()
            mode.__exit__(None, None, None)
            if on_leave is not None:
                on_leave(mode)

    return [module.register_forward_pre_hook(enter, prepend=True),
            module.register_forward_hook(leave, always_call=True)]


def pattern_hooks(module, num_heads: int, edit: ProbsEdit, state) -> list:
    """Hooks on attention ``module`` that hand its probabilities to ``edit`` on every call.

    Args:
        module: the attention module (its role's ``name``).
        num_heads: H.
        edit: ``edit(P, j)``, see :class:`AttentionProbs`.
        state: an object with ``calls``, ``index`` (counted here; ``index`` not during a
            backward recompute) and ``why`` (set when a call showed no probabilities).

    Returns:
        list: the hook handles (``.remove()`` them).
    """
    from hooks.engine.recompute import in_backward

    def mode_of():
        if not in_backward():
            state.index += 1
        state.calls += 1
        return AttentionProbs(num_heads, edit)

    def left(mode):
        if mode.seen == 0:
            state.why = (f"no softmax over (B, {num_heads}, T, S) scores and no "
                         "F.scaled_dot_product_attention ran in this call (another kernel, e.g. "
                         "FlashAttention?): load the model with attn_implementation=\"eager\"")

    return _enter_leave(module, mode_of, left)


def record_pattern(module, num_heads: int, seen: list) -> list:
    """Hooks on attention ``module`` that append, for each call, the list of its
    probabilities (B, H, T, S) (detached copies) to ``seen``; the call's output is its own."""
    def mode_of():
        probs: list[torch.Tensor] = []
        seen.append(probs)

        def keep(p, j, count):
            probs.append(p.detach().clone())
            return p

        return AttentionProbs(num_heads, keep, record_only=True)

    return _enter_leave(module, mode_of)


__all__ = ["AttentionProbs", "ProbsEdit", "pattern_hooks", "record_pattern", "sdpa_probs"]
