"""Architecture numbers from a config (minillm.arch) against what the built models have:
``sum(p.numel())`` of the model and of its attention modules, the bytes of a real KV cache, and
seed 000's test B with the seed's own attention class as the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minillm import MiniLLM, MiniLLMConfig, load_preset
from minillm.arch import arch_numbers, attention_parameters_per_layer, kv_cache_bytes_per_token
from minillm.attention import MiniLLMAttention


class SeedGQAAttention(nn.Module):
    """Seed 000's GQAAttention, as written there (the projections are all it has)."""

    def __init__(self, d_model, n_heads, n_kv_heads):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("kv, expected", [(8, 1_048_576), (2, 655_360), (1, 589_824)])
def test_seed_test_b_exact(kv, expected):
    """D = 512, 8 heads: MHA 1,048,576, GQA with 2 KV heads 655,360 (NOTES.md row 11)."""
    cfg = MiniLLMConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=kv)
    assert attention_parameters_per_layer(cfg) == expected
    assert _count(SeedGQAAttention(512, 8, kv)) == expected
    assert _count(MiniLLMAttention(cfg, 0)) == expected


CONFIGS = {
    **{name: load_preset(name) for name in ("default", "mha", "mqa", "dense", "learned-pos",
                                            "tiny", "seed-test-c")},
    "untied-linear": load_preset("tiny", tie_word_embeddings=False,
                                 rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_numbers_equal_the_built_model(name):
    cfg = CONFIGS[name]
    model = MiniLLM(cfg)
    n = arch_numbers(cfg)
    assert n.parameters == _count(model) == model.num_parameters()
    for layer in model.model.layers:
        assert n.attention_parameters_per_layer == _count(layer.self_attn)
    # a token passes through everything but the E - k experts it is not routed to
    if cfg.is_moe:
        unused = sum(_count(e) for layer in model.model.layers
                     for e in layer.mlp.experts[cfg.num_experts_per_tok:])
    else:
        unused = 0
    assert n.active_parameters == _count(model) - unused
    # the bytes a real cache holds, per token
    t = 5
    with torch.no_grad():
        past = model(torch.zeros(1, t, dtype=torch.long), use_cache=True).past_key_values
    cached = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in past)
    assert n.kv_cache_bytes_per_token == cached // t
    assert n.kv_dtype == "float32"


def test_kv_bytes_scale_with_kv_heads():
    base = load_preset("default")
    by_kv = {kv: kv_cache_bytes_per_token(base.replace(num_key_value_heads=kv))
             for kv in (1, 2, 4, 8)}
    assert by_kv == {1: by_kv[1], 2: 2 * by_kv[1], 4: 4 * by_kv[1], 8: 8 * by_kv[1]}
    assert by_kv[8] == 2 * 4 * 8 * 32 * 4  # K and V · L · Hkv · Dh · fp32
    assert kv_cache_bytes_per_token(base, torch.bfloat16) == by_kv[2] // 2
