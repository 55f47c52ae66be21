"""Buggy models beside the same code fixed, for the doctor's magnitude and gradient-path checks
(issue 34, families 2 and 3). Built in the tests only.

:class:`Llama2c` is shaped like karpathy/llama2.c's ``model.py`` (``tok_embeddings``,
``layers[i].attention.{wq,wk,wv,wo}``, ``feed_forward.{w1,w2,w3}``, RMSNorms, tied output),
with options that plant one public bug each:

* ``scaled``: the weights initialised at 0.02/√(2·L). llama2.c #579 scaled ``w3`` and ``wo``;
  GPT-2's convention scales ``w2`` and ``wo`` (the projections writing to the residual).
* ``qk_norm``: ``"head"`` normalises q and k per head (Qwen3), ``"across"`` has a weight of
  ``head_dim`` entries but takes the RMS over all heads at once.
* ``partial_rotary_factor`` in the config; ``rope_all=True`` builds the rotary table for the
  whole head anyway (the factor ignored).
* ``kv_shared``: the last layer borrows layer 0's keys and values; ``declare=True`` says so
  (``is_kv_shared_layer``, Gemma 3n's name), else it is silent.
* ``checkpoint_head``: the final norm and the tied LM head run under
  ``torch.utils.checkpoint`` (a memory trick for a large vocabulary), ``reentrant`` or not.

The MoE variants patch minillm's sparse block (``module.__class__ = ...``, weights kept).

Dimension legend: B batch, T sequence, V vocabulary, D width, H heads, Dh head dim, N tokens,
E experts, k experts per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from minillm.moe import MiniLLMSparseMoeBlock
from tests.models import batch_for, tiny

V, B, T = 96, 2, 16


@dataclass
class ModelArgs:
    """llama2.c's ``ModelArgs``, plus ``partial_rotary_factor`` (HF's name)."""

    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = V
    max_seq_len: int = 64
    partial_rotary_factor: float = 1.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, across: bool = False) -> None:
        super().__init__()
        self.eps, self.across = eps, across
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = (-2, -1) if self.across else (-1,)  # across: (B, T, H, Dh) normalised over H·Dh
        xf = x.float()  # statistics in fp32, as llama2.c's RMSNorm
        return (xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + self.eps)).type_as(x) \
            * self.weight


class RotaryEmbedding(nn.Module):
    """cos/sin tables for ``rot`` channels of each head (HF's rotate_half pairing)."""

    def __init__(self, rot: int, length: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        f = torch.outer(torch.arange(length).float(), inv_freq)
        emb = torch.cat([f, f], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:t], self.sin[:t]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    a, b = xr.chunk(2, dim=-1)
    return torch.cat([xr * cos + torch.cat([-b, a], dim=-1) * sin, xp], dim=-1)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, qk_norm: str | None) -> None:
        super().__init__()
        self.n_heads, self.head_dim = a.n_heads, a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.dim, bias=False)
        self.wk = nn.Linear(a.dim, a.dim, bias=False)
        self.wv = nn.Linear(a.dim, a.dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, across=qk_norm == "across")
            self.k_norm = RMSNorm(self.head_dim, across=qk_norm == "across")
        self.borrow: Attention | None = None  # the layer whose keys and values it uses
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        shape = (b, t, self.n_heads, self.head_dim)
        q = self.wq(x).view(shape)
        if self.borrow is not None:
            k, v = self.borrow.kv
        else:
            k, v = self.wk(x).view(shape), self.wv(x).view(shape)
            if hasattr(self, "k_norm"):
                k = self.k_norm(k)
            k = _rotate(k.transpose(1, 2), cos, sin)
            v = v.transpose(1, 2)
            self.kv = (k, v)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        q = _rotate(q.transpose(1, 2), cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: ModelArgs, qk_norm: str | None) -> None:
        super().__init__()
        self.attention = Attention(a, qk_norm)
        self.feed_forward = FeedForward(a.dim, 4 * a.dim)
        self.attention_norm = RMSNorm(a.dim)
        self.ffn_norm = RMSNorm(a.dim)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama2c(nn.Module):
    """See the module docstring. ``forward(tokens, targets=None)`` returns (B, T, V) logits, or
    ``(logits, loss)`` with targets (next-token targets shifted by the data loader)."""

    def __init__(self, a: ModelArgs | None = None, *, scaled: tuple[str, ...] = ("w2", "wo"),
                 qk_norm: str | None = None, rope_all: bool = False, kv_shared: bool = False,
                 declare: bool = True, checkpoint_head: str | None = None) -> None:
        super().__init__()
        self.params = self.config = a = a or ModelArgs()
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(TransformerBlock(a, qk_norm) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.tok_embeddings.weight = self.output.weight
        head_dim = a.dim // a.n_heads
        rot = head_dim if rope_all else int(head_dim * a.partial_rotary_factor)
        self.rotary_emb = RotaryEmbedding(rot, a.max_seq_len)
        if kv_shared:
            last = self.layers[-1].attention
            last.borrow = self.layers[0].attention
            if declare:
                last.is_kv_shared_layer = True
        self.checkpoint_head = checkpoint_head
        for m in self.modules():  # llama2.c's _init_weights
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        for pn, p in self.named_parameters():
            if pn.endswith(tuple(f"{s}.weight" for s in scaled)):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * a.n_layers))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        t = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        cos, sin = self.rotary_emb(t)
        for layer in self.layers:
            h = layer(h, cos, sin)
        if self.checkpoint_head:
            logits = checkpoint(self._head, h, use_reentrant=self.checkpoint_head == "reentrant")
        else:
            logits = self._head(h)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def llama2c(**kw):
    torch.manual_seed(0)
    return Llama2c(**kw), batch()


# -- MoE variants of minillm (the tiny preset: E = 4) -------------------------------------------
class SwitchTop1(MiniLLMSparseMoeBlock):
    """Top-1 routing that keeps the router's probability as the expert's weight (Switch
    Transformers), so the LM loss reaches the router: the fix of minillm's renormalised
    top-1 (p / p = 1)."""

    def forward(self, hidden_states):
        b, t, d = hidden_states.shape
        x = hidden_states.reshape(-1, d)
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        w, ids = probs.max(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = (ids == e).nonzero().squeeze(-1)
            if sel.numel():
                out = out.index_add(0, sel, expert(x[sel]) * w[sel, None].to(x.dtype))
        return out.view(b, t, d), logits


class TokenAxisSoftmax(MiniLLMSparseMoeBlock):
    """Router probabilities taken over the tokens (dim=0 of (N, E)) instead of the experts."""

    def forward(self, hidden_states):
        b, t, d = hidden_states.shape
        x = hidden_states.reshape(-1, d)
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=0 if self.wrong else -1)  # the bug
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = (ids == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]) * w[rows, slot, None].to(x.dtype))
        return out.view(b, t, d), logits


def _swap_moe(model, cls, **attrs):
    for m in model.modules():
        if isinstance(m, MiniLLMSparseMoeBlock):
            m.__class__ = cls
            for k, v in attrs.items():
                setattr(m, k, v)
    return model


def moe(top_k: int = 2, **changes):
    """minillm's tiny MoE preset, ``num_experts_per_tok=top_k``."""
    torch.manual_seed(0)
    model = tiny(num_experts_per_tok=top_k, **changes)
    return model, batch_for(model)


def top1_renormalised():
    """The bug: minillm's top-k renormalisation with k = 1 gives every token weight 1."""
    return moe(top_k=1)


def top1_switch():
    """The fix: top-1 weighted by the router's probability."""
    model, b = moe(top_k=1)
    return _swap_moe(model, SwitchTop1), b


def router_softmax(wrong: bool):
    model, b = moe()
    return _swap_moe(model, TokenAxisSoftmax, wrong=wrong), b


def negative_aux(negative: bool):
    """minillm with its aux loss negated (a sign error) or as it is."""
    model, b = moe()
    if negative:
        orig = model._aux_losses

        def flipped(*args):
            losses, aux = orig(*args)
            return -losses, -aux

        model._aux_losses = flipped
    return model, b


def aux_coef_zero():
    """minillm MoE with ``router_aux_loss_coef = 0``: the aux loss is off, not detached."""
    return moe(router_aux_loss_coef=0.0)


def _hooked(model):
    model.tok_embeddings.weight.register_hook(lambda g: g.clamp(-1, 1))  # a per-tensor clip
    return model


def _hooked_llama2c(mode: str):
    model, b = llama2c(checkpoint_head=mode)
    return _hooked(model), b


#: bug -> (buggy builder, fixed builder, the checks the bug fails, the module named)
PAIRS = {
    "llama2c_579_w3_scaled": (lambda: llama2c(scaled=("w3", "wo")), llama2c, {"init"},
                              "layers.0.feed_forward.w3"),
    "qk_norm_across_heads": (lambda: llama2c(qk_norm="across"),
                             lambda: llama2c(qk_norm="head"), {"shapes"},
                             "layers.0.attention.k_norm"),  # k is normalised first
    "partial_rotary_ignored": (
        lambda: llama2c(a=ModelArgs(partial_rotary_factor=0.5), rope_all=True),
        lambda: llama2c(a=ModelArgs(partial_rotary_factor=0.5)), {"shapes"}, "rotary_emb"),
    "kv_sharing_undeclared": (lambda: llama2c(kv_shared=True, declare=False),
                              lambda: llama2c(kv_shared=True), {"grad-flow"},
                              "layers.3.attention.wk"),
    "top1_renormalised": (top1_renormalised, top1_switch, {"loss-terms"},
                          "model.layers.0.mlp.gate"),
    "negative_aux_loss": (lambda: negative_aux(True), lambda: negative_aux(False), {"shapes"},
                          None),
    "hook_under_reentrant_checkpoint": (lambda: _hooked_llama2c("reentrant"),
                                        lambda: _hooked_llama2c("non-reentrant"), {"hooks"},
                                        "tok_embeddings"),
}
