"""``hooks.logit_attribution``: direct logit attribution, how much each block, attention, MLP and
head writes into one token's logit through the final norm and the LM head.

The residual stream before the final norm is a sum of what each part wrote into it::

    x_final = h_0 + Σ_l (h_{l+1} − h_l)          h_0: the embeddings (block 0's input)
    h_{l+1} − h_l = attn_l + mlp_l               attn_l = Σ_h head_{l,h} + o_proj bias

The final norm is linear in x once its scale is fixed, so each part's share of the logit is
``(P(c) · s · g) · U[token]``: P centres c over D for a LayerNorm (identity for an RMSNorm), s is
the final norm's scale *frozen* at its value on the whole residual stream (1/σ, or 1/rms, of
``x_final``), g is the norm's weight, U the head's weight. The shares plus the norm's and the
head's biases add up to the model's logit (:attr:`LogitAttribution.error` is what is left, from
rounding only). This is TransformerLens's convention (``ActivationCache.apply_ln_to_stack``,
``logit_attrs``: the cached ``ln_final.hook_scale`` of the real stream); Elhage et al. 2021, "A
mathematical framework for transformer circuits". A head's output is its slice of the output
projection's input times that slice of the projection's weight (TransformerLens's ``result``).

What the model applies after the head (a soft-cap) is not linear: the attribution is to the
logit before it, and :attr:`LogitAttribution.notes` says so.

Dimension legend: B batch, L decoder blocks, H query heads, Dh head dim, D hidden size.

Never imports textual, rich or tui.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: Names of a norm's epsilon, tried in order.
EPS_NAMES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "rms_norm_eps")


@dataclass
class LogitAttribution:
    """The result of :func:`logit_attribution` (float64 tensors).

    Attributes:
        layers: the L blocks' qualified names.
        position: the position read (0…T-1).
        tokens: (B,) int64, the token each row's logit is attributed for.
        logit: (B,) the model's logit of that token (before any post-processing).
        embed: (B,) the share of the embeddings (block 0's input).
        blocks: (B, L) each block's share (what it added to the stream).
        attention: (B, L) each block's attention's share, None where no attention is known.
        mlp: (B, L) ``blocks − attention`` (the rest of the block), None with ``attention``.
        heads: (B, L, H) each head's share (without the output projection's bias), None where
            the heads are not known.
        bias: (B,) the final norm's bias and the head's bias, through U.
        scale: (B,) the frozen final-norm scale s.
        error: max |embed + Σ blocks + bias − logit| over the rows.
        notes: what could not be done as described, in words.
    """

    layers: list[str]
    position: int
    tokens: torch.Tensor
    logit: torch.Tensor
    embed: torch.Tensor
    blocks: torch.Tensor
    attention: torch.Tensor | None
    mlp: torch.Tensor | None
    heads: torch.Tensor | None
    bias: torch.Tensor
    scale: torch.Tensor
    error: float
    notes: list[str] = field(default_factory=list)


def _eps(norm: nn.Module) -> float:
    for name in EPS_NAMES:
        v = getattr(norm, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, (tuple, list)) and v and isinstance(v[0], float):
            return float(v[0])
    return 1e-6


def _is_layernorm(norm: nn.Module) -> bool:
    name = type(norm).__name__
    return isinstance(norm, nn.LayerNorm) or (name.endswith("LayerNorm") and "RMS" not in name)


class _FrozenNorm:
    """The final norm as ``P(c) · s · g + b``, s taken from ``x_final`` (module docstring)."""

    def __init__(self, norm: nn.Module, x_final: torch.Tensor) -> None:
        d = x_final.shape[-1]
        self.center = _is_layernorm(norm)
        eps = _eps(norm)
        ref = next(norm.parameters(), x_final)
        with torch.no_grad():
            if self.center:
                w, b = getattr(norm, "weight", None), getattr(norm, "bias", None)
                self.g = torch.ones(d, dtype=torch.float64) if w is None else w.double()
                self.b = torch.zeros(d, dtype=torch.float64) if b is None else b.double()
            else:  # any RMS norm: its effective weight is its output on ones, times sqrt(1+eps)
                ones = torch.ones(1, d, dtype=ref.dtype, device=ref.device)
                self.g = norm(ones)[0].double() * math.sqrt(1 + eps)
                self.b = torch.zeros(d, dtype=torch.float64)
            x = self.p(x_final.double())
            self.s = torch.rsqrt(x.pow(2).mean(-1) + eps)  # (B,)
            self.check = float((x * self.s[:, None] * self.g + self.b
                                - norm(x_final).double()).abs().max())

    def p(self, c: torch.Tensor) -> torch.Tensor:
        return c - c.mean(-1, keepdim=True) if self.center else c


def _head_outputs(proj: nn.Module, z: torch.Tensor, h: int, dh: int) -> torch.Tensor:
    """(B, H, D) each head's output: its slice of ``z`` (B, H·Dh) times its slice of the output
    projection's weight (``nn.Linear``: (D, H·Dh); transformers' ``Conv1D``: (H·Dh, D))."""
    w = proj.weight.double()
    zh = z.double().view(z.shape[0], h, dh)
    if type(proj).__name__ == "Conv1D":
        return torch.einsum("bhk,hkd->bhd", zh, w.view(h, dh, -1))
    return torch.einsum("bhk,dhk->bhd", zh, w.view(-1, h, dh))


def _tokens(tokens: Any, logits: torch.Tensor) -> torch.Tensor:
    """(B,) ids: ``tokens`` as given (an int for every row, or one per row), else each row's
    top-1 at the position."""
    b = logits.shape[0]
    if tokens is None:
        return logits.argmax(-1)
    t = torch.as_tensor(tokens if isinstance(tokens, (Sequence, torch.Tensor)) else [tokens],
                        dtype=torch.long).flatten()
    if t.numel() == 1:
        t = t.expand(b).clone()
    if t.numel() != b:
        raise ValueError(f"tokens: {t.numel()} ids for a batch of {b} rows")
    v = logits.shape[-1]
    if bool(((t < 0) | (t >= v)).any()):
        raise ValueError(f"tokens: an id outside the vocabulary (0…{v - 1})")
    return t


def logit_attribution(model: nn.Module, batch: Any, tokens: Any = None, *,
                      position: int = -1) -> LogitAttribution:
    """Direct logit attribution of the blocks, attentions, MLPs and heads to one token's logit
    at ``position`` (module docstring).

    Args:
        model: a decoder-only model (:func:`hooks.whatif.stream.stream_parts`).
        batch: what the model is called with (anything :meth:`hooks.Batch.of` takes).
        tokens: the token id (for every row) or ids (one per row); default: each row's top-1.
        position: the position whose logits are read (negative counts from the end).

    Returns:
        A :class:`LogitAttribution`. One forward pass, without gradients, in eval mode (the
        model's flags restored after).

    Raises:
        ValueError: one line: a model whose parts are not found, a position out of range, a
            token id outside the vocabulary.
    """
    from hooks.whatif.resume import eval_mode, record
    from hooks.whatif.stream import stream_parts

    parts = stream_parts(model)
    modules = dict(model.named_modules())
    norm, head = modules[parts.norm], modules[parts.head]
    with eval_mode(model), torch.no_grad():
        rec = record(model, batch, parts, heads=True)
        t = int(rec.h_in[0].shape[1])
        if not -t <= position < t:
            raise ValueError(f"position {position} out of range: the batch has {t} positions")
        pos = position % t
        x_final = rec.h_out[-1][:, pos]
        pre = head(norm(x_final)).double()  # (B, V): the logits before any post-processing
        ids = _tokens(tokens, pre)
        fn = _FrozenNorm(norm, x_final)
        u = head.weight.double()[ids]  # (B, D)
        hb = getattr(head, "bias", None)

        def share(c: torch.Tensor) -> torch.Tensor:  # (B, ..., D) -> (B, ...)
            extra = (1,) * (c.dim() - 2)
            s = fn.s.view(-1, *extra, 1)
            return (fn.p(c.double()) * s * fn.g * u.view(u.shape[0], *extra, -1)).sum(-1)

        embed = share(rec.h_in[0][:, pos])
        blocks = share(torch.stack([o[:, pos] - i[:, pos]
                                    for i, o in zip(rec.h_in, rec.h_out, strict=True)], 1))
        bias = (fn.b * u).sum(-1) + (hb.double()[ids] if hb is not None else 0)
        attention, mlp, heads, notes = _attention_shares(parts, modules, rec, pos, share, blocks)
    logit = pre.gather(1, ids[:, None])[:, 0]
    error = float((embed + blocks.sum(1) + bias - logit).abs().max())
    if fn.check > 1e-4 * max(1.0, float(x_final.abs().max())):
        notes.append(f"{parts.norm} is not P(x)·s·g + b as a LayerNorm or RMSNorm is (off by "
                     f"{fn.check:.3g}): the shares do not add up to the logit")
    if parts.post is not None:
        notes.append(f"the model applies {parts.post_text} after the head: the shares are of "
                     "the logit before it")
    return LogitAttribution(parts.layers, pos, ids, logit, embed, blocks, attention, mlp,
                            heads, bias, fn.s, error, notes)


def _attention_shares(parts, modules, rec, pos, share, blocks):
    """(attention (B, L), mlp (B, L), heads (B, L, H), notes); None where not known."""
    notes: list[str] = []
    missing = [b for b in parts.blocks if b.attention is None or rec.attn[parts.blocks.index(b)]
               is None]
    if missing:
        notes.append(f"{missing[0].name}: no attention mdb recognises ({missing[0].why}): no "
                     "attention, MLP or head shares")
        return None, None, None, notes
    attention = share(torch.stack([a[:, pos] for a in rec.attn], 1))
    mlp = blocks - attention
    sizes = {b.heads for b in parts.blocks}
    heads = None
    if len(sizes) == 1 and all(z is not None for z in rec.z):
        heads = torch.stack([
            share(_head_outputs(modules[b.out_proj], z[:, pos], b.heads, b.head_dim))
            for b, z in zip(parts.blocks, rec.z, strict=True)], 1)
    else:
        notes.append("the blocks' heads differ in number or were not seen: no head shares")
    return attention, mlp, heads, notes


__all__ = ["EPS_NAMES", "LogitAttribution", "logit_attribution"]
