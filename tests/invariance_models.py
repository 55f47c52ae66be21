"""Tiny decoders with one named invariance bug each, beside the same code fixed, for the
doctor's invariance checks (``padding``, ``batch``, ``cache``, ``attn-impl``, ``packing``).

:class:`TinyLM` is a small RoPE decoder (RMSNorm, q/k/v/o attention with an eager and an SDPA
path, a KV cache as a list of (k, v) per layer). ``bugs`` switches on the mistakes of public
reports:

* ``shared_positions`` — without ``position_ids``, one position vector ``arange(T)`` is shared
  by every row, ignoring the padding (nnsight #672); fixed: counted per row from the mask.
  Visible with ``learned_positions=True`` (a constant shift of a row is invisible to RoPE).
* ``mask_ignored`` — attention ignores the padding mask, so real tokens attend to pads
  (unsloth #3699 / PR #4100).
* ``batch_norm`` — the RMS of the first norm is taken over the batch axis too.
* ``kv_in_cache`` — layer 1 borrows layer 0's K/V, but reads it from the cache object, so with
  ``use_cache=False`` it runs on its own K/V (transformers #45242); fixed: passed through the
  forward. Only with ``share_kv=True`` (layer 1 borrows K/V at all).
* ``cache_positions`` — incremental calls restart positions at 0 instead of the cached length.
* ``eager_scale`` — the eager attention path forgets the 1/√Dh scale.
* ``no_doc_mask`` — packed documents (``position_ids`` restarting at 0) attend to each other.

Built in the tests only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

V, D, H, L = 64, 32, 4, 2
MAX_POS = 64
DH = D // H


@dataclass
class Out:
    logits: torch.Tensor
    past_key_values: Any = None


class Rotary(nn.Module):
    """(B, T) positions -> (cos, sin), each (B, T, Dh), HF's rotate-half layout."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, DH, 2).float() / DH),
                             persistent=False)

    def forward(self, position_ids: torch.Tensor):
        f = position_ids.float()[..., None] * self.inv_freq  # (B, T, Dh/2)
        emb = torch.cat([f, f], -1)
        return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Norm(nn.Module):
    def __init__(self, over_batch: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))
        self.over_batch = over_batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = (0, -1) if self.over_batch else (-1,)
        return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, bugs: set[str]) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.v_proj, self.o_proj = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.attn_implementation = "sdpa"
        self.bugs = bugs

    def kv(self, x, cos, sin):
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, H, DH).transpose(1, 2)
        v = self.v_proj(x).view(b, t, H, DH).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def forward(self, x, cos, sin, allowed_BTS, kv=None, past=None):
        b, t, _ = x.shape
        q = _rotate(self.q_proj(x).view(b, t, H, DH).transpose(1, 2), cos, sin)
        k, v = kv if kv is not None else self.kv(x, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        mask = allowed_BTS[:, None]  # (B, 1, T, S)
        if self.attn_implementation == "eager":
            scale = 1.0 if "eager_scale" in self.bugs else 1 / math.sqrt(DH)
            s = (q @ k.transpose(-1, -2)) * scale
            y = s.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, D)), (k, v)


class Block(nn.Module):
    def __init__(self, bugs: set[str], first: bool) -> None:
        super().__init__()
        self.norm1 = Norm(over_batch="batch_norm" in bugs and first)
        self.attn = Attention(bugs)
        self.norm2 = Norm()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x, cos, sin, allowed, kv=None, past=None):
        a, present = self.attn(self.norm1(x), cos, sin, allowed, kv, past)
        x = x + a
        return x + self.mlp(self.norm2(x)), present


class TinyLM(nn.Module):
    """A 2-layer RoPE decoder; ``bugs`` from the module docstring; ``share_kv``: layer 1 attends
    with layer 0's K/V; ``learned_positions``: absolute position embeddings added to the token
    embeddings (besides RoPE)."""

    def __init__(self, bugs: set[str] | frozenset[str] = frozenset(), share_kv: bool = False,
                 learned_positions: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.bugs, self.share_kv = set(bugs), share_kv
        self.embed_tokens = nn.Embedding(V, D)
        # absolute positions (GPT-2's wpe): a shifted position changes the output (RoPE alone
        # is relative, so a whole row shifted by its pads would not show)
        self.embed_positions = nn.Embedding(MAX_POS, D) if learned_positions else None
        self.rotary_emb = Rotary()
        self.layers = nn.ModuleList(Block(self.bugs, i == 0) for i in range(L))
        self.norm = Norm()
        self.lm_head = nn.Linear(D, V, bias=False)

    def _positions(self, ids, mask, position_ids, past_len):
        if position_ids is not None:
            return position_ids.expand(ids.shape[0], -1)
        b, t = ids.shape
        if mask is None or "shared_positions" in self.bugs:
            start = 0 if "cache_positions" in self.bugs else past_len
            return torch.arange(start, start + t).expand(b, t)
        return ((mask.long().cumsum(1) - 1).clamp_min(0))[:, past_len:]

    def _allowed(self, b, t, past_len, mask, position_ids):
        s = past_len + t
        qi = torch.arange(past_len, s)[:, None]
        allowed = (torch.arange(s)[None, :] <= qi).expand(b, t, s).clone()  # causal
        if mask is not None and "mask_ignored" not in self.bugs:
            allowed &= mask.bool()[:, None, :]
            allowed |= torch.arange(s)[None, None, :] == qi[None]  # a pad query sees itself
        if position_ids is not None and "no_doc_mask" not in self.bugs and not past_len:
            p = position_ids.expand(b, -1)
            doc = torch.cat([torch.zeros_like(p[:, :1]), (p[:, 1:] != p[:, :-1] + 1).long()],
                            1).cumsum(1)
            allowed &= doc[:, :, None] == doc[:, None, :]
        return allowed

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False):
        b, t = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values else 0
        pos = self._positions(input_ids, attention_mask, position_ids, past_len)
        cos, sin = self.rotary_emb(pos)
        allowed = self._allowed(b, t, past_len, attention_mask, position_ids)
        x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            x = x + self.embed_positions(pos)
        presents, kv0 = [], None
        for i, layer in enumerate(self.layers):
            past = past_key_values[i] if past_key_values else None
            kv = None
            if i == 1 and self.share_kv:
                if "kv_in_cache" in self.bugs:
                    kv = (presents[0] if use_cache else None)
                    past = None if use_cache else past
                else:
                    kv, past = kv0, None
            x, present = layer(x, cos, sin, allowed, kv, past)
            kv0 = present if i == 0 else kv0
            presents.append(present)
        logits = self.lm_head(self.norm(x))
        return Out(logits, presents if use_cache else None)


class PaddedLM(TinyLM):
    """:class:`TinyLM` whose forward takes no ``position_ids`` (positions come from the mask, or
    are shared, under ``shared_positions``), as most hand-written decoders."""

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False):
        return super().forward(input_ids, attention_mask, None, past_key_values, use_cache)


def batch(b: int = 2, t: int = 12, seed: int = 0) -> torch.Tensor:
    """(B, T) random ids, avoiding 0 (the pad id)."""
    return torch.randint(1, V, (b, t), generator=torch.Generator().manual_seed(seed))
