"""Map a Hugging Face ``LlamaForCausalLM`` / ``MixtralForCausalLM`` config and state dict onto
MiniLLM's (:meth:`minillm.MiniLLM.from_hf` builds the model from them).

Module names are the same on both sides, so most tensors copy by key. Two differences:

* HF transformers 5 stores Mixtral's experts fused: ``mlp.experts.gate_up_proj`` (E, 2I, D)
  whose first I rows are the gate projection, and ``mlp.experts.down_proj`` (E, D, I); the
  router is ``mlp.gate.weight`` (E, D). transformers 4 used ``block_sparse_moe.experts.{e}``
  with ``w1`` (gate), ``w3`` (up), ``w2`` (down) and ``block_sparse_moe.gate``. Both convert.
* HF keeps rotary tables outside the state dict, as we do (non-persistent buffers).
"""

from __future__ import annotations

import torch

from minillm.config import MiniLLMConfig


def _rope_config(hf_config) -> tuple[float, dict | None]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    scaling = getattr(hf_config, "rope_scaling", None) or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return float(theta), None
    if kind not in ("linear", "dynamic"):
        raise ValueError(f"HF rope type {kind!r} is not supported (only default, linear, dynamic)")
    out = {"rope_type": kind, "factor": float(scaling["factor"])}
    if kind == "dynamic":
        # HF's dynamic NTK measures the length against max_position_embeddings itself (its
        # _compute_dynamic_ntk_parameters and the "reset" below it), whatever else is given
        out["original_max_position_embeddings"] = int(hf_config.max_position_embeddings)
    elif scaling.get("original_max_position_embeddings"):
        out["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    else:
        out["original_max_position_embeddings"] = int(hf_config.max_position_embeddings)
    return float(theta), out


def max_positions_from_hf(hf_config, scaling: dict | None, limit: int | None = None) -> int:
    """MiniLLM's ``max_position_embeddings`` for a HF config: ``limit`` when given, else HF's
    ``max_position_embeddings`` — except for dynamic NTK, where HF's value is the *original*
    length L and HF accepts any longer input (the base grows with it): there the limit is
    ``L · factor``, the length the factor stretches the context to (minillm's own default
    relation between the two, see ``MiniLLMConfig.rope_scaling``). Pass ``limit`` for more."""
    if limit is not None:
        return int(limit)
    hf_max = int(hf_config.max_position_embeddings)
    if scaling is not None and scaling["rope_type"] == "dynamic":
        return max(hf_max, int(hf_max * scaling["factor"]))
    return hf_max


def config_from_hf(hf_config, *, max_position_embeddings: int | None = None) -> MiniLLMConfig:
    """A :class:`MiniLLMConfig` equivalent to a HF Llama or Mixtral config.

    Args:
        hf_config: a ``LlamaConfig`` or ``MixtralConfig``.
        max_position_embeddings: the longest input the MiniLLM accepts; default HF's
            ``max_position_embeddings``, or for dynamic-NTK RoPE (where HF's value is the
            original length and longer inputs are accepted) that length × the factor (see
            :func:`max_positions_from_hf`).

    Raises:
        ValueError: the HF config uses something MiniLLM does not implement (biases, an
            activation other than SiLU, a head_dim other than hidden_size / heads, sliding
            windows, another rope type).
    """
    model_type = getattr(hf_config, "model_type", "")
    if model_type not in ("llama", "mixtral"):
        raise ValueError(f"only llama and mixtral configs convert, got model_type={model_type!r}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not SwiGLU's silu")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ValueError("attention or MLP biases are not supported")
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim not in (None, hf_config.hidden_size // hf_config.num_attention_heads):
        raise ValueError(f"head_dim {head_dim} != hidden_size / num_attention_heads")
    if getattr(hf_config, "sliding_window", None):
        raise ValueError("sliding-window attention is not supported")
    theta, scaling = _rope_config(hf_config)
    is_moe = model_type == "mixtral"
    return MiniLLMConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_hidden_layers=hf_config.num_hidden_layers,
        num_attention_heads=hf_config.num_attention_heads,
        num_key_value_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        num_local_experts=hf_config.num_local_experts if is_moe else 0,
        num_experts_per_tok=hf_config.num_experts_per_tok if is_moe else 2,
        max_position_embeddings=max_positions_from_hf(hf_config, scaling,
                                                      max_position_embeddings),
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        router_aux_loss_coef=getattr(hf_config, "router_aux_loss_coef", 0.01) if is_moe else 0.01,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        initializer_range=getattr(hf_config, "initializer_range", 0.02),
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
    )


def state_dict_from_hf(
    hf_state: dict[str, torch.Tensor], config: MiniLLMConfig
) -> dict[str, torch.Tensor]:
    """Map a HF Llama/Mixtral state dict to MiniLLM's keys (tensors are not copied)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in hf_state.items():
        if "rotary_emb" in key:
            continue
        if key.startswith("model.layers."):
            prefix, rest = key.split(".", 3)[2], key.split(".", 3)[3]
            base = f"model.layers.{prefix}"
            if rest == "mlp.experts.gate_up_proj":  # (E, 2I, D)
                inter = config.intermediate_size
                for e in range(tensor.shape[0]):
                    out[f"{base}.mlp.experts.{e}.gate_proj.weight"] = tensor[e, :inter]
                    out[f"{base}.mlp.experts.{e}.up_proj.weight"] = tensor[e, inter:]
                continue
            if rest == "mlp.experts.down_proj":  # (E, D, I)
                for e in range(tensor.shape[0]):
                    out[f"{base}.mlp.experts.{e}.down_proj.weight"] = tensor[e]
                continue
            if rest.startswith("block_sparse_moe."):
                rest = rest.replace("block_sparse_moe.", "mlp.", 1)
                rest = (
                    rest.replace(".w1.", ".gate_proj.")
                    .replace(".w3.", ".up_proj.")
                    .replace(".w2.", ".down_proj.")
                )
            out[f"{base}.{rest}"] = tensor
        else:
            out[key] = tensor
    return out

