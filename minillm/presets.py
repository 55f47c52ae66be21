"""Named model configurations (mirrored as TOML files in ``samples/presets/``)."""

from __future__ import annotations

from typing import Any

from minillm.config import MiniLLMConfig

#: Preset name -> (one-line description, config fields that differ from the defaults).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "default": (
        "seed 000's default: V=1000, D=256, 4 layers, 8 heads / 2 KV heads, 8 experts top-2",
        {},
    ),
    "seed-test-c": (
        "seed 000's test C (overfit): D=128, 4 layers, 4 heads / 1 KV head, 4 experts top-2",
        {
            "vocab_size": 1000,
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 256,
        },
    ),
    "mha": ("default with multi-head attention (8 KV heads)", {"num_key_value_heads": 8}),
    "mqa": ("default with multi-query attention (1 KV head)", {"num_key_value_heads": 1}),
    "dense": ("default with a dense SwiGLU MLP instead of the MoE", {"num_local_experts": 0}),
    "learned-pos": (
        "default with learned absolute positions instead of RoPE",
        {"position_embedding": "learned"},
    ),
    "tiny": (
        "a very small MoE for quick experiments and tests: D=32, 2 layers, 4 experts",
        {
            "vocab_size": 256,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 128,
        },
    ),
}


def list_presets() -> list[str]:
    """Names accepted by :func:`load_preset`."""
    return list(PRESETS)


def load_preset(name: str, **overrides: Any) -> MiniLLMConfig:
    """The config of preset ``name``, with ``overrides`` applied.

    Raises:
        ValueError: unknown preset name (the message lists the known ones), or invalid
            overrides.
    """
    try:
        _, fields = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
    return MiniLLMConfig.from_dict({**fields, **overrides})
