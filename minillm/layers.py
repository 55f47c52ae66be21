"""Building blocks: RMSNorm, rotary position embeddings (RoPE) and the GQA key/value repeat.

Dimension legend used in names and docstrings:
    B batch, T query length, S key length (past + T), D hidden size, H query heads,
    Hkv key/value heads, Dh head dim, P max positions.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from minillm.config import MiniLLMConfig


class MiniLLMRMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), as HF ``LlamaRMSNorm``.

    ``y = weight * x / sqrt(mean(x², dim=-1) + eps)``. The mean of squares and the scaling are
    computed in fp32 whatever the input dtype (bf16 squares lose precision), then cast back.

    Args:
        hidden_size: D, size of the normalised last dimension.
        eps: added to the mean square before the square root.

    Shape:
        x (..., D) -> (..., D), same dtype as x.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """RoPE angular frequencies θ_i = theta^(-2i/Dh), i = 0..Dh/2-1 (RoFormer, Su et al. 2021).

    Returns:
        (Dh/2,) float32 tensor, radians per position.
    """
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


class MiniLLMRotaryEmbedding(nn.Module):
    """Precomputed RoPE cos/sin tables, looked up by position id.

    Pairing convention: dimension i is rotated with dimension i + Dh/2 ("halves", HF's
    ``rotate_half``), not Meta's interleaved (2i, 2i+1) complex pairs; the two are the same
    model up to a permutation of q/k weight rows. Tables are non-persistent buffers of length
    ``max_position_embeddings`` built once at construction.

    Scaling (``config.rope_scaling``):
        * ``linear`` — position interpolation: every θ_i is divided by ``factor``.
        * ``dynamic`` — dynamic NTK: for sequences up to the original length the plain table is
          used; for a longer sequence of length S the base becomes
          ``theta * (factor·S/orig - (factor-1)) ** (Dh/(Dh-2))`` (HF's
          ``_compute_dynamic_ntk_parameters``), recomputed for that S. S is each row's own
          length, ``max(position_ids[b]) + 1``, so a row's rotation never depends on the other
          rows of its batch (HF takes the maximum over the whole batch; the two agree on
          unpadded batches). Because the base depends on S, every position's rotation — and
          with it every hidden state after the first attention layer — changes when the
          sequence grows past the original length: see :class:`minillm.model.PastKeyValues`
          for what that means for the KV cache.

    Shape:
        position_ids (B, T) int64 -> (cos, sin), each (B, T, Dh) float32.
    """

    def __init__(self, config: MiniLLMConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = float(config.rope_theta)
        self.max_position_embeddings = config.max_position_embeddings
        self.scaling_type = config.rope_scaling_type
        self.factor = float(config.rope_scaling["factor"]) if config.rope_scaling else 1.0
        self.original_max_position_embeddings = config.original_max_position_embeddings
        inv_freq = rope_inv_freq(self.head_dim, self.theta)
        if self.scaling_type == "linear":
            inv_freq = inv_freq / self.factor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        cos, sin = self._table(inv_freq, self.max_position_embeddings)
        self.register_buffer("cos_cached", cos, persistent=False)  # (P, Dh)
        self.register_buffer("sin_cached", sin, persistent=False)  # (P, Dh)

    @staticmethod
    def _table(inv_freq: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(length, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(pos, inv_freq)  # (P, Dh/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, Dh): halves pairing
        return emb.cos(), emb.sin()

    def dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        """Dynamic-NTK frequencies for a sequence of ``seq_len`` positions (Dh/2,)."""
        orig = self.original_max_position_embeddings
        if seq_len <= orig:
            return self.inv_freq
        base = self.theta * ((self.factor * seq_len / orig) - (self.factor - 1)) ** (
            self.head_dim / (self.head_dim - 2)
        )
        return rope_inv_freq(self.head_dim, base).to(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scaling_type == "dynamic":
            seq_len_B = position_ids.amax(dim=-1) + 1  # each row's length S_b
            if int(seq_len_B.max()) > self.original_max_position_embeddings:
                inv_freq_BF = torch.stack(
                    [self.dynamic_inv_freq(int(s)) for s in seq_len_B.tolist()]
                )  # (B, Dh/2): the plain frequencies for rows within the original length
                freqs = position_ids[..., None].float() * inv_freq_BF[:, None, :]
                emb = torch.cat((freqs, freqs), dim=-1)
                return emb.cos(), emb.sin()
        return self.cos_cached[position_ids], self.sin_cached[position_ids]

    def extra_repr(self) -> str:
        s = (
            f"head_dim={self.head_dim}, theta={self.theta:g}, "
            f"max_positions={self.max_position_embeddings}"
        )
        if self.scaling_type:
            s += f", scaling={self.scaling_type}x{self.factor:g}"
        return s


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by their positions' angles (halves pairing).

    Args:
        q: (B, H, T, Dh) queries.
        k: (B, Hkv, T, Dh) keys.
        cos, sin: (B, T, Dh) tables from :class:`MiniLLMRotaryEmbedding`.

    Returns:
        (q_rot, k_rot) with the input shapes and dtypes; the rotation runs in the tables' fp32
        only if q is fp32 (tables are cast to q's dtype, as HF does).
    """
    cos = cos.unsqueeze(1).to(q.dtype)  # (B, 1, T, Dh)
    sin = sin.unsqueeze(1).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Repeat KV heads for grouped-query attention: query head h reads KV head h // n_rep.

    Equivalent to ``x.repeat_interleave(n_rep, dim=1)`` (not ``repeat``, which would map h to
    h % Hkv), written as expand + reshape like HF/Meta so no copy is made before the reshape.

    Shape:
        (B, Hkv, S, Dh) -> (B, Hkv·n_rep, S, Dh).
    """
    if n_rep == 1:
        return x
    b, hkv, s, dh = x.shape
    return x[:, :, None, :, :].expand(b, hkv, n_rep, s, dh).reshape(b, hkv * n_rep, s, dh)


def attention_scale(head_dim: int) -> float:
    """Softmax temperature 1/sqrt(Dh) (Vaswani et al. 2017)."""
    return 1.0 / math.sqrt(head_dim)
