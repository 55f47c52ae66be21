"""Every invalid config gives one ValueError naming the field; presets and TOML agree."""

from __future__ import annotations

import pytest

from minillm import MiniLLMConfig, list_presets, load_preset
from tests.conftest import SAMPLES


def test_odd_head_dim():
    with pytest.raises(ValueError, match="head_dim .* is odd"):
        MiniLLMConfig(hidden_size=24, num_attention_heads=8, num_key_value_heads=2)


def test_heads_not_multiple_of_kv_heads():
    with pytest.raises(
        ValueError,
        match="num_attention_heads \\(8\\) must be a multiple of num_key_value_heads \\(3\\)",
    ):
        MiniLLMConfig(num_key_value_heads=3)


@pytest.mark.parametrize("k", [0, 9, -1])
def test_experts_per_token_out_of_range(k):
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MiniLLMConfig(num_experts_per_tok=k)


@pytest.mark.parametrize(
    "field",
    [
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
        "intermediate_size",
        "num_key_value_heads",
    ],
)
def test_non_positive_sizes(field):
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        MiniLLMConfig(**{field: 0})


def test_hidden_not_divisible_by_heads():
    with pytest.raises(
        ValueError, match="hidden_size \\(250\\) must be divisible by num_attention_heads"
    ):
        MiniLLMConfig(hidden_size=250)


def test_unknown_field_and_bad_rope_scaling():
    with pytest.raises(ValueError, match="unknown config field"):
        MiniLLMConfig.from_dict({"hidden_sise": 3})
    with pytest.raises(ValueError, match="rope_type"):
        MiniLLMConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="position_embedding"):
        MiniLLMConfig(position_embedding="alibi")


@pytest.mark.parametrize("name", list_presets())
def test_toml_file_equals_preset(name):
    assert MiniLLMConfig.from_toml(SAMPLES / "presets" / f"{name}.toml") == load_preset(name)


def test_bad_toml(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("hidden_size = [")
    with pytest.raises(ValueError, match="not valid TOML"):
        MiniLLMConfig.from_toml(p)
