"""The three smoke tests of the tutorial minillm was built from ("seed 000"): A, the shapes, the
first loss and the router's gradient; B, the attention parameters of MHA against GQA; C, overfit
a short text. Its numbers are corrected where they were wrong (the first loss is near ln V only
with N(0, 0.02) init; the cross-entropy, not the total loss with the aux term, goes to ~0)."""

from __future__ import annotations

import math

import torch

from minillm import CharTokenizer, MiniLLM, MiniLLMConfig, load_preset
from minillm.attention import MiniLLMAttention
from tests.conftest import SAMPLES


def test_a_shapes_loss_and_router_gradient():
    cfg = MiniLLMConfig(vocab_size=1000, max_position_embeddings=128)
    model = MiniLLM(cfg)
    idx = torch.randint(0, 1000, (2, 64))
    out = model(idx, labels=torch.randint(0, 1000, (2, 64)))
    assert tuple(out.logits.shape) == (2, 64, 1000)
    out.loss.backward()
    router_grad = model.model.layers[0].mlp.gate.weight.grad
    assert router_grad is not None and router_grad.norm().item() > 0
    # NOTES #1: with N(0, 0.02) init the first loss is within 0.3 of ln(V) (the seed's own
    # init gives ~248).
    assert abs(out.ce_loss.item() - math.log(1000)) < 0.3


def test_first_loss_near_ln_v_for_every_preset():
    for name in ("default", "mha", "mqa", "dense", "learned-pos", "seed-test-c"):
        cfg = load_preset(name)
        model = MiniLLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (4, 64))
        ce = model(ids, labels=ids).ce_loss.item()
        assert abs(ce - math.log(cfg.vocab_size)) < 0.3, (name, ce)


def _attn_params(n_kv: int) -> int:
    cfg = MiniLLMConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=n_kv)
    return sum(p.numel() for p in MiniLLMAttention(cfg, 0).parameters())


def test_b_mha_vs_gqa_parameter_count():
    # 4 projections of 512x512 = 1,048,576; GQA with 2 KV heads: q,o 512x512 + k,v 512x128.
    assert _attn_params(8) == 4 * 512 * 512 == 1_048_576
    assert _attn_params(2) == 2 * 512 * 512 + 2 * 512 * 128 == 655_360


def test_c_overfit_seed_sentence():
    text = (SAMPLES / "overfit_zh.txt").read_text(encoding="utf-8").strip()
    assert text == "人工智能正在改变世界。" * 6
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    cfg = load_preset("seed-test-c", vocab_size=tok.vocab_size)
    model = MiniLLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.tensor([tok.encode(text)])
    ce = []
    for _ in range(300):  # "within 300 steps": stop as soon as the claim holds
        out = model(data, labels=data)
        ce.append(out.ce_loss.item())
        if ce[-1] < 0.05:
            break
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert abs(ce[0] - math.log(tok.vocab_size)) < 0.3
    assert ce[-1] < 0.05, f"cross-entropy {ce[-1]:.4f} after {len(ce)} steps"
    # The total floors at the aux loss: ~coef per MoE layer when balanced (NOTES #2).
    assert 0.5 * 0.01 * 4 < out.aux_loss.item() < 0.01 * 4 * 4
