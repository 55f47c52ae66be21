"""Grouped-query self-attention with RoPE, an SDPA path and an eager path that returns weights.

Dimension legend: B batch, T query length, S key length (past + T), D hidden size,
H query heads, Hkv key/value heads, Dh head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minillm.config import MiniLLMConfig
from minillm.layers import apply_rotary_pos_emb, attention_scale, repeat_kv

KVCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's cache: keys and values, each (B, Hkv, S, Dh), keys already rotated."""


def causal_mask(t: int, s: int, device: torch.device) -> torch.Tensor:
    """Boolean mask (T, S), True where query i (absolute position S-T+i) may see key j ≤ it."""
    q_pos = torch.arange(s - t, s, device=device)[:, None]
    k_pos = torch.arange(s, device=device)[None, :]
    return k_pos <= q_pos


def padding_attention_mask(attention_mask_BS: torch.Tensor, t: int) -> torch.Tensor:
    """The boolean (B, 1, T, S) "may attend" mask of a padded batch, for the last T queries.

    Query i (absolute position S-T+i) of row b may see key j when j ≤ S-T+i (causal) and key j
    is a real token (``attention_mask_BS[b, j] != 0``). Every query also sees itself: a pad
    query whose earlier keys are all pads (left padding, or a row of pads only) would otherwise
    have no key at all, and its softmax would be 0/0 = NaN, in the forward and in the gradients.
    What pad positions compute is never read by a real token (their keys are masked out).

    Args:
        attention_mask_BS: (B, S) padding mask over past + current positions, 1 (or True) for
            real tokens and 0 for pads, as HF's ``attention_mask``.
        t: T, the number of current (query) positions, ``T ≤ S``.

    Returns:
        (B, 1, T, S) bool, True where attention is allowed (``F.scaled_dot_product_attention``'s
        convention for a boolean ``attn_mask``).
    """
    b, s = attention_mask_BS.shape
    device = attention_mask_BS.device
    q_pos = torch.arange(s - t, s, device=device)[:, None]
    k_pos = torch.arange(s, device=device)[None, :]
    allowed_BTS = ((k_pos <= q_pos)[None] & attention_mask_BS.bool()[:, None, :]) | (
        k_pos == q_pos
    )[None]
    return allowed_BTS[:, None]


class MiniLLMAttention(nn.Module):
    """Causal multi-head attention with H query heads sharing Hkv key/value heads (GQA).

    Query head h attends with KV head ``h // num_key_value_groups`` (Ainslie et al. 2023;
    HF ``repeat_kv``). MHA is Hkv = H, MQA is Hkv = 1. Keys are rotated by RoPE before they
    enter the cache, so cached keys never need rotating again (dynamic-NTK RoPE past its
    original length changes every rotation with the length; the model then recomputes the
    whole sequence instead of using the cache, see :class:`minillm.model.PastKeyValues`).

    Two paths compute the same function:

    * ``sdpa`` — ``F.scaled_dot_product_attention`` with ``enable_gqa`` (no KV copy).
    * ``eager`` — explicit ``softmax(q kᵀ / sqrt(Dh) + mask)`` in fp32; the only path that can
      return the attention probabilities. Used when ``config.attn_implementation == "eager"``
      or while ``return_attn_weights`` is set (the debugger's attention probe sets it).

    A padded batch passes ``attention_mask``, the boolean (B, 1, T, S) mask of
    :func:`padding_attention_mask` (causality included); both paths then apply it instead of
    the plain causal mask (SDPA receives it as its ``attn_mask``).

    Shape:
        hidden_states (B, T, D), position_embeddings (cos, sin) each (B, T, Dh) or None
        (learned positions), past_key_value a :data:`KVCache` or None, attention_mask
        (B, 1, T, S) bool or None
        -> (attn_output (B, T, D), attn_weights (B, H, T, S) or None, present KVCache or None).
    """

    def __init__(self, config: MiniLLMConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_key_value_groups
        self.head_dim = config.head_dim
        self.scaling = attention_scale(self.head_dim)
        self.attention_dropout = config.attention_dropout
        self.attn_implementation = config.attn_implementation
        self.return_attn_weights = False
        d, dh = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(d, self.num_heads * dh, bias=False)
        self.k_proj = nn.Linear(d, self.num_key_value_heads * dh, bias=False)
        self.v_proj = nn.Linear(d, self.num_key_value_heads * dh, bias=False)
        self.o_proj = nn.Linear(self.num_heads * dh, d, bias=False)

    def kv_head_of(self, query_head: int) -> int:
        """The KV head that query head ``query_head`` attends with (h // n_rep)."""
        return query_head // self.num_key_value_groups

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_value: KVCache | None = None,
        use_cache: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, KVCache | None]:
        b, t, _ = hidden_states.shape
        q_BHTd = (
            self.q_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        )
        k_BKTd = (
            self.k_proj(hidden_states)
            .view(b, t, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        v_BKTd = (
            self.v_proj(hidden_states)
            .view(b, t, self.num_key_value_heads, self.head_dim)
            .transpose(1, 2)
        )
        if position_embeddings is not None:
            cos, sin = position_embeddings
            q_BHTd, k_BKTd = apply_rotary_pos_emb(q_BHTd, k_BKTd, cos, sin)
        if past_key_value is not None:
            k_BKTd = torch.cat((past_key_value[0], k_BKTd), dim=2)
            v_BKTd = torch.cat((past_key_value[1], v_BKTd), dim=2)
        present = (k_BKTd, v_BKTd) if use_cache else None
        s = k_BKTd.shape[2]
        dropout = self.attention_dropout if self.training else 0.0

        attn_weights = None
        if self.return_attn_weights or self.attn_implementation == "eager":
            k_rep = repeat_kv(k_BKTd, self.num_key_value_groups)
            v_rep = repeat_kv(v_BKTd, self.num_key_value_groups)
            scores_BHTS = torch.matmul(q_BHTd, k_rep.transpose(2, 3)).float() * self.scaling
            if attention_mask is not None:
                allowed = attention_mask  # (B, 1, T, S)
            else:
                allowed = causal_mask(t, s, hidden_states.device)
            scores_BHTS = scores_BHTS.masked_fill(~allowed, float("-inf"))
            attn_weights = torch.softmax(scores_BHTS, dim=-1).to(q_BHTd.dtype)
            probs = F.dropout(attn_weights, p=dropout, training=self.training)
            out_BHTd = torch.matmul(probs, v_rep)
        else:
            if attention_mask is not None:
                mask, causal = attention_mask, False
            elif t == s:
                mask, causal = None, True
            elif t == 1:  # one new token attends to every cached position
                mask, causal = None, False
            else:
                mask, causal = causal_mask(t, s, hidden_states.device), False
            out_BHTd = F.scaled_dot_product_attention(
                q_BHTd,
                k_BKTd,
                v_BKTd,
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=causal,
                scale=self.scaling,
                enable_gqa=self.num_key_value_groups > 1,
            )
        out_BTD = out_BHTd.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out_BTD), attn_weights, present

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_key_value_heads}, "
            f"head_dim={self.head_dim}, impl={self.attn_implementation}"
        )
