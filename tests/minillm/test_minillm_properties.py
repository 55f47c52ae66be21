"""Properties of the model checked against independent computations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from minillm import ByteTokenizer, CharTokenizer, MiniLLM, MiniLLMConfig, load_preset
from minillm.attention import MiniLLMAttention
from minillm.layers import MiniLLMRMSNorm, MiniLLMRotaryEmbedding, apply_rotary_pos_emb, repeat_kv
from minillm.moe import MiniLLMSparseMoeBlock, route

TINY = dict(
    vocab_size=61,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)


def tiny(**kw) -> MiniLLM:
    return MiniLLM(MiniLLMConfig(**{**TINY, **kw}))


def test_rmsnorm_matches_formula_in_fp32_for_bf16_input():
    norm = MiniLLMRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
    x = torch.randn(3, 5, 16) * 1e3
    expected = norm.weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)
    out_bf16 = norm.bfloat16()(x.bfloat16())  # 1e3-scale squares would lose bits in bf16
    assert out_bf16.dtype == torch.bfloat16 and torch.isfinite(out_bf16).all()
    torch.testing.assert_close(out_bf16.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_dispatch_moe_equals_dense_reference(kv_heads):
    cfg = MiniLLMConfig(**{**TINY, "num_key_value_heads": kv_heads}, intermediate_size=48)
    block = MiniLLMSparseMoeBlock(cfg).double()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 7, 32, dtype=torch.float64, requires_grad=True)
    y, logits = block(x)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref, logits_ref = block.forward_dense_reference(x_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(logits, logits_ref)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *block.parameters()], g)
    grads_ref = torch.autograd.grad(y_ref, [x_ref, *block.parameters()], g)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_route_weights_renormalised_and_match_manual_topk():
    logits = torch.randn(10, 6)
    w, ids, probs = route(logits, 3)
    p = torch.softmax(logits, -1)
    manual_ids = p.argsort(-1, descending=True)[:, :3]
    assert torch.equal(ids, manual_ids)
    torch.testing.assert_close(
        w, p.gather(1, manual_ids) / p.gather(1, manual_ids).sum(-1, keepdim=True)
    )
    torch.testing.assert_close(w.sum(-1), torch.ones(10))


@pytest.mark.parametrize(
    "preset",
    [
        dict(),
        dict(position_embedding="learned"),
        dict(num_local_experts=0),
        dict(attn_implementation="eager"),
    ],
)
def test_causality(preset):
    model = tiny(**preset).eval()
    ids = torch.randint(0, 61, (2, 20))
    t = 11
    changed = ids.clone()
    changed[:, t + 1 :] = torch.randint(0, 61, (2, 20 - t - 1))
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=1e-6, rtol=0)
    assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().max() > 1e-4


def test_rope_scores_depend_only_on_relative_position():
    cfg = MiniLLMConfig(**TINY)
    rope = MiniLLMRotaryEmbedding(cfg)
    q = torch.randn(1, 1, 1, cfg.head_dim)
    k = torch.randn(1, 1, 1, cfg.head_dim)

    def score(m, n):
        cos_m, sin_m = rope(torch.tensor([[m]]))
        cos_n, sin_n = rope(torch.tensor([[n]]))
        qr, _ = apply_rotary_pos_emb(q, q, cos_m, sin_m)
        _, kr = apply_rotary_pos_emb(k, k, cos_n, sin_n)
        return (qr * kr).sum().item()

    for delta in (0, 1, 5, 17):
        values = [score(m + delta, m) for m in (0, 3, 20, 40)]
        assert max(values) - min(values) < 1e-4, values
    assert abs(score(5, 0) - score(0, 5)) > 1e-4  # direction matters


def test_rope_halves_equal_interleaved_after_permutation():
    """Meta's interleaved complex pairs == HF halves once q/k rows are permuted (NOTES #7)."""
    dh, pos = 8, 7
    cfg = MiniLLMConfig(
        hidden_size=16, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16
    )
    rope = MiniLLMRotaryEmbedding(cfg)
    x = torch.randn(dh)
    # Meta: complex pairs (x[2i], x[2i+1]) rotated by pos * theta_i.
    theta = 10000.0 ** (-torch.arange(0, dh, 2).float() / dh)
    xc = torch.view_as_complex(x.view(-1, 2).contiguous())
    meta = torch.view_as_real(xc * torch.polar(torch.ones(dh // 2), pos * theta)).flatten()
    perm = torch.cat((torch.arange(0, dh, 2), torch.arange(1, dh, 2)))  # interleaved -> halves
    cos, sin = rope(torch.tensor([[pos]]))
    ours, _ = apply_rotary_pos_emb(x[perm].view(1, 1, 1, dh), x[perm].view(1, 1, 1, dh), cos, sin)
    torch.testing.assert_close(ours.flatten(), meta[perm], atol=1e-5, rtol=0)


def test_gqa_grouping_is_h_div_n_rep():
    cfg = MiniLLMConfig(
        **{**TINY, "num_attention_heads": 4, "num_key_value_heads": 2}, attn_implementation="eager"
    )
    attn = MiniLLMAttention(cfg, 0)
    attn.return_attn_weights = True
    x = torch.randn(1, 6, 32)
    _, w, _ = attn(x)
    # Recompute each query head against an explicitly chosen KV head, no repeat helper.
    q = attn.q_proj(x).view(1, 6, 4, 8).transpose(1, 2)
    k = attn.k_proj(x).view(1, 6, 2, 8).transpose(1, 2)
    mask = torch.ones(6, 6).tril().bool()
    for h in range(4):
        kv = h // 2
        assert attn.kv_head_of(h) == kv
        s = (q[0, h] @ k[0, kv].T) / math.sqrt(8)
        expected = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
        torch.testing.assert_close(w[0, h], expected, atol=1e-6, rtol=0)
    # repeat_kv maps like repeat_interleave, not repeat
    kv = torch.randn(2, 3, 5, 4)
    assert torch.equal(repeat_kv(kv, 2), kv.repeat_interleave(2, dim=1))
    assert not torch.equal(repeat_kv(kv, 2), kv.repeat(1, 2, 1, 1))


def test_sdpa_and_eager_paths_agree_and_weights_sum_to_one():
    torch.manual_seed(1)
    model = tiny().eval()
    ids = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        a = model(ids)
        b = model(ids, output_attentions=True)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)
    for w in b.attentions:
        assert w.shape == (2, 4, 12, 12)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 12))
        assert torch.all(w.triu(1) == 0)


def test_gqa_with_kv_heads_equal_heads_is_mha():
    cfg = MiniLLMConfig(**{**TINY, "num_key_value_heads": 4})
    attn = MiniLLMAttention(cfg, 0)
    x = torch.randn(2, 9, 32)
    out, _, _ = attn(x)
    mha = torch.nn.MultiheadAttention(32, 4, bias=False, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        )
        mha.out_proj.weight.copy_(attn.o_proj.weight)
    ref, _ = mha(x, x, x, attn_mask=torch.ones(9, 9).triu(1).bool(), need_weights=False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)  # no RoPE passed: plain MHA


@pytest.mark.parametrize(
    "kw", [dict(), dict(position_embedding="learned"), dict(num_local_experts=0)]
)
def test_kv_cache_logits_equal_uncached(kw):
    model = tiny(**kw).eval()
    ids = torch.randint(0, 61, (2, 16))
    p = 10
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :p], use_cache=True)
        torch.testing.assert_close(out.logits, full[:, :p], atol=1e-5, rtol=0)
        past = out.past_key_values
        for j in range(p, 13):  # one token at a time
            step = model(ids[:, j : j + 1], past_key_values=past, use_cache=True)
            torch.testing.assert_close(step.logits[:, 0], full[:, j], atol=1e-5, rtol=0)
            past = step.past_key_values
        chunk = model(ids[:, 13:], past_key_values=past, use_cache=True)  # several at once
        torch.testing.assert_close(chunk.logits, full[:, 13:], atol=1e-5, rtol=0)


def test_generate_with_cache_equals_recomputation():
    model = tiny()
    prompt = torch.randint(0, 61, (2, 5))
    greedy_cached = model.generate(prompt, 20, use_cache=True)
    greedy_full = model.generate(prompt, 20, use_cache=False)
    assert torch.equal(greedy_cached, greedy_full)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    s1 = model.generate(prompt, 20, temperature=0.8, top_k=5, generator=g1)
    s2 = model.generate(prompt, 20, temperature=0.8, top_k=5, generator=g2, use_cache=False)
    assert torch.equal(s1, s2) and s1.shape == (2, 25)
    assert model.training  # mode restored


def test_too_long_sequence_raises():
    model = tiny()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate(torch.zeros(1, 60, dtype=torch.long), 10)


def test_tied_head_survives_to_and_state_dict_round_trip():
    model = tiny()
    assert model.weights_tied
    model = model.to(torch.float64)
    assert model.weights_tied and model.lm_head.weight.dtype == torch.float64
    other = tiny().double()
    other.load_state_dict(model.state_dict())
    assert other.weights_tied
    torch.testing.assert_close(other.lm_head.weight, model.model.embed_tokens.weight)
    assert len({id(p) for p in other.parameters()}) == len(list(other.parameters()))


def test_untied_config_has_separate_head():
    model = tiny(tie_word_embeddings=False)
    assert not model.weights_tied
    assert model.num_parameters() == tiny().num_parameters() + 61 * 32


def test_dense_and_learned_variants_have_expected_modules():
    dense = tiny(num_local_experts=0)
    assert not hasattr(dense.model.layers[0].mlp, "gate") and hasattr(
        dense.model.layers[0].mlp, "gate_proj"
    )
    learned = tiny(position_embedding="learned")
    assert learned.model.embed_positions.weight.shape == (64, 32)
    assert not hasattr(learned.model, "rotary_emb")


def test_tokenizers_round_trip():
    text = "人工智能 hello\n\tworld"
    byte = ByteTokenizer()
    assert byte.decode(byte.encode(text)) == text and max(byte.encode(text)) < 256
    char = CharTokenizer.from_text(text)
    assert char.decode(char.encode(text)) == text and char.vocab_size == len(set(text))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        char.encode("z")
    assert byte.token_strings(byte.encode("a\n")) == ["a", "\\n"]


def test_presets_load_and_default_counts():
    cfg = load_preset("default")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (1000, 256, 768)
    assert MiniLLM(cfg).num_parameters() == 19_796_224  # == HF Mixtral of the same config
    with pytest.raises(ValueError, match="unknown preset"):
        load_preset("nope")


def test_learned_positions_train_step_has_position_grad():
    model = tiny(position_embedding="learned")
    ids = torch.randint(0, 61, (2, 10))
    model(ids, labels=ids).loss.backward()
    g = model.model.embed_positions.weight.grad
    assert g[:10].abs().sum() > 0 and g[10:].abs().sum() == 0


def test_cross_entropy_matches_manual_shift():
    model = tiny()
    ids = torch.randint(0, 61, (2, 10))
    labels = ids.clone()
    labels[0, 4] = -100
    out = model(ids, labels=labels)
    manual = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, 61), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.ce_loss, manual)
    torch.testing.assert_close(out.loss, out.ce_loss + out.aux_loss)
