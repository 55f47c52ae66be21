"""Architecture numbers of a :class:`minillm.MiniLLMConfig`, from its fields alone.

What an ablation compares besides the loss (seed 000's test B and next step 4): parameters,
the attention parameters of one layer, the parameters a token passes through, and the bytes the
KV cache holds per token. Everything is computed from the config, before anything is allocated,
and equals what the built model has (``sum(p.numel())`` of :class:`minillm.MiniLLM` and of its
``self_attn`` modules, the bytes of its ``past_key_values``; tested).

Dimension legend: V vocabulary, D hidden size, L layers, H query heads, Hkv key/value heads,
Dh = D / H head dim, I SwiGLU width, E experts, k experts per token, P max positions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from minillm.config import MiniLLMConfig

__all__ = [
    "ArchNumbers",
    "arch_numbers",
    "attention_parameters_per_layer",
    "kv_cache_bytes_per_token",
]


def attention_parameters_per_layer(config: MiniLLMConfig) -> int:
    """Parameters of one layer's attention: ``q_proj`` D·H·Dh, ``k_proj`` and ``v_proj``
    D·Hkv·Dh each, ``o_proj`` H·Dh·D (no biases).

    Seed 000's test B (D = 512, H = 8, Dh = 64): MHA (Hkv = 8) has 1,048,576, GQA with
    Hkv = 2 has 655,360 (the seed's "about 1.05M vs 0.66M").
    """
    d, h, kv, dh = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                    config.head_dim)
    return d * h * dh + 2 * d * kv * dh + h * dh * d


def kv_cache_bytes_per_token(config: MiniLLMConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes the KV cache grows by per token: keys and values of every layer,
    ``2 · L · Hkv · Dh · itemsize(dtype)`` — proportional to Hkv (MQA 1/H of MHA's).

    Args:
        config: the model's config.
        dtype: the dtype of the cached keys and values (the model's; fp32 by default).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize


def _mlp_parameters(config: MiniLLMConfig, experts: int) -> int:
    d, i = config.hidden_size, config.intermediate_size
    return 3 * d * i * max(1, experts)


@dataclass(frozen=True)
class ArchNumbers:
    """What :func:`arch_numbers` returns.

    Attributes:
        parameters: unique parameters of the model (a tied LM head counts once), as
            ``MiniLLM(config).num_parameters()``.
        attention_parameters_per_layer: see :func:`attention_parameters_per_layer`.
        active_parameters: parameters one token passes through: ``parameters`` less the
            ``E - k`` experts per MoE layer it is not routed to (equal to ``parameters`` for a
            dense model).
        kv_cache_bytes_per_token: see :func:`kv_cache_bytes_per_token`.
        kv_dtype: the dtype those bytes assume (``"float32"``).
        num_key_value_heads: Hkv, which the KV bytes are proportional to.
    """

    parameters: int
    attention_parameters_per_layer: int
    active_parameters: int
    kv_cache_bytes_per_token: int
    kv_dtype: str
    num_key_value_heads: int

    def to_dict(self) -> dict[str, Any]:
        """The numbers as a JSON-serialisable dict."""
        return asdict(self)


def arch_numbers(config: MiniLLMConfig, dtype: torch.dtype = torch.float32) -> ArchNumbers:
    """The architecture numbers of ``config`` (nothing is allocated).

    Args:
        config: a validated :class:`MiniLLMConfig` (``vocab_size`` as trained).
        dtype: dtype of the cached keys and values.
    """
    e, k = config.num_local_experts, config.num_experts_per_tok
    unused = (e - k) * _mlp_parameters(config, 1) * config.num_hidden_layers if e else 0
    total = config.parameter_count()
    return ArchNumbers(
        parameters=total,
        attention_parameters_per_layer=attention_parameters_per_layer(config),
        active_parameters=total - unused,
        kv_cache_bytes_per_token=kv_cache_bytes_per_token(config, dtype),
        kv_dtype=str(dtype).removeprefix("torch."),
        num_key_value_heads=config.num_key_value_heads,
    )
