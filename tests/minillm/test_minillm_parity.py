"""Parity with Hugging Face transformers' Mixtral and Llama, built from configs (no hub)."""

from __future__ import annotations

import pytest
import torch

from minillm import MiniLLM
from minillm.moe import load_balancing_loss

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

SMALL = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)


def _mixtral(layers=2, tie=False, **kw):
    cfg = MixtralConfig(
        **{**SMALL, **kw},
        num_hidden_layers=layers,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
    )
    return MixtralForCausalLM(cfg).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_mixtral_logits_match(tie):
    hf = _mixtral(tie=tie)
    ours = MiniLLM.from_hf(hf).eval()
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert ours.weights_tied == tie
    ids = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        h = hf(input_ids=ids, output_router_logits=True)
        o = ours(ids)
    torch.testing.assert_close(o.logits, h.logits, atol=1e-4, rtol=0)
    for ours_r, hf_r in zip(o.router_logits, h.router_logits, strict=True):
        torch.testing.assert_close(ours_r, hf_r, atol=1e-5, rtol=0)


def test_llama_logits_match_with_mqa_and_tied_head():
    cfg = LlamaConfig(
        **{**SMALL, "num_key_value_heads": 1}, num_hidden_layers=2, tie_word_embeddings=True
    )
    hf = LlamaForCausalLM(cfg).eval()
    ours = MiniLLM.from_hf(hf).eval()
    assert not ours.config.is_moe and ours.weights_tied
    ids = torch.randint(0, 97, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(input_ids=ids).logits, atol=1e-4, rtol=0)


def test_gradients_match_hf():
    hf = _mixtral(layers=1).train()
    ours = MiniLLM.from_hf(hf).train()
    ids = torch.randint(0, 97, (2, 16))
    hf(input_ids=ids, labels=ids).logits.float()  # warm
    hf.zero_grad()
    hf_loss = torch.nn.functional.cross_entropy(
        hf(input_ids=ids).logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1)
    )
    hf_loss.backward()
    ours(ids, labels=ids).ce_loss.backward()
    hf_params = dict(hf.named_parameters())
    torch.testing.assert_close(
        ours.model.layers[0].self_attn.q_proj.weight.grad,
        hf_params["model.layers.0.self_attn.q_proj.weight"].grad,
        atol=1e-5,
        rtol=1e-4,
    )
    gate_up = hf_params["model.layers.0.mlp.experts.gate_up_proj"].grad
    i = ours.config.intermediate_size
    for e in range(4):
        torch.testing.assert_close(
            ours.model.layers[0].mlp.experts[e].up_proj.weight.grad,
            gate_up[e, i:],
            atol=1e-5,
            rtol=1e-4,
        )


def test_aux_loss_relates_to_hf_by_top_k():
    """One layer: HF's load_balancing_loss_func == k x ours (HF divides counts by N, we by
    N*k). Several layers: HF pools rows before multiplying, so compare layer by layer."""
    hf = _mixtral(layers=3)
    ours = MiniLLM.from_hf(hf)
    ids = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        out = ours(ids)
    k, e = 2, 4
    for r, ours_aux in zip(out.router_logits, out.aux_losses, strict=True):
        hf_aux = load_balancing_loss_func((r,), num_experts=e, top_k=k)
        torch.testing.assert_close(hf_aux, k * ours_aux, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(load_balancing_loss(r, e, k), ours_aux)
    coef = ours.config.router_aux_loss_coef
    torch.testing.assert_close(out.aux_loss, coef * out.aux_losses.sum())


def test_aux_loss_is_one_when_perfectly_balanced():
    # Uniform router probabilities and every expert equally loaded: E * sum(1/E * 1/E) = 1.
    logits = torch.zeros(8, 4)
    logits[torch.arange(8), torch.arange(8) % 4] = 1.0  # top-1 rotates over the experts
    logits[torch.arange(8), (torch.arange(8) + 1) % 4] = 0.5
    value = load_balancing_loss(logits, num_experts=4, top_k=2)
    probs = torch.softmax(logits, -1).mean(0)
    assert torch.allclose(probs, torch.full((4,), 0.25))
    torch.testing.assert_close(value, torch.tensor(1.0))


@pytest.mark.parametrize("kind", ["linear", "dynamic"])
def test_rope_scaling_matches_hf(kind):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minillm.config import MiniLLMConfig
    from minillm.layers import MiniLLMRotaryEmbedding

    cfg = LlamaConfig(
        **{**SMALL, "max_position_embeddings": 32},
        num_hidden_layers=1,
        rope_parameters={"rope_type": kind, "factor": 4.0, "rope_theta": 10000.0},
    )
    ours_cfg = MiniLLMConfig(
        vocab_size=97,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_scaling={"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": 32},
    )
    rope = MiniLLMRotaryEmbedding(ours_cfg)
    seq = 100  # beyond the original 32 positions
    hf_inv, _ = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq)
    pos = torch.arange(seq)[None]
    cos, _ = rope(pos)
    expected = torch.outer(torch.arange(seq).float(), hf_inv.float())
    torch.testing.assert_close(cos[0], torch.cat((expected, expected), -1).cos(), atol=1e-5, rtol=0)
