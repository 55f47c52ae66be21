"""Dynamic-NTK RoPE with the KV cache, and HF dynamic-NTK models converted past their length.

Dynamic NTK (HF ``rope_type = "dynamic"``) rotates every position with a base that grows with
the sequence length S once S passes the original length L. A cached decode therefore cannot
reuse anything past L (every hidden state after the first attention layer changes with S); the
model recomputes from the ids its cache carries. The reference everywhere is full recomputation
(the same model called on the whole sequence without a cache) and, for ``from_hf``, HF's own
forward.
"""

from __future__ import annotations

import pytest
import torch

from minillm import MiniLLM, MiniLLMConfig

L = 8  # original length


def _model(impl: str = "sdpa", layers: int = 2, **kw) -> MiniLLM:
    torch.manual_seed(0)
    cfg = MiniLLMConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=kw.pop("experts", 0), num_experts_per_tok=2,
        max_position_embeddings=64, attn_implementation=impl,
        # large weights: logits of order 1, so a wrong rotation shows (the default 0.02 init
        # gives logits of order 1e-2, where the old cache's error was only ~1e-4)
        initializer_range=0.2,
        rope_scaling={"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": L},
        **kw,
    )
    return MiniLLM(cfg).eval()


def _plain(model: MiniLLM) -> MiniLLM:
    """The same weights with unscaled RoPE (to show that the scaling is active past L)."""
    cfg = model.config.replace(rope_scaling=None)
    other = MiniLLM(cfg).eval()
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("experts", [0, 4])
def test_cached_decode_equals_recomputation_past_the_original_length(impl, experts):
    model = _model(impl, experts=experts)
    ids = torch.randint(0, 61, (2, 20))
    with torch.no_grad():
        out = model(ids[:, :6], use_cache=True)
        past = out.past_key_values
        for j in range(6, 17):  # one token at a time, across L and far past it
            full = model(ids[:, : j + 1])
            step = model(ids[:, j : j + 1], past_key_values=past, use_cache=True)
            torch.testing.assert_close(step.logits[:, 0], full.logits[:, -1], atol=1e-5, rtol=0)
            # the router saw the same token (the aux loss of the step is that token's)
            for r_step, r_full in zip(step.router_logits, full.router_logits, strict=True):
                torch.testing.assert_close(r_step, r_full.view(2, j + 1, -1)[:, -1], atol=1e-5,
                                           rtol=0)
            past = step.past_key_values
        chunk = model(ids[:, 17:], past_key_values=past, use_cache=True)  # several at once
        full = model(ids)
        torch.testing.assert_close(chunk.logits, full.logits[:, 17:], atol=1e-5, rtol=0)
        # the scaling is active past L (a sequence longer than L rotates every position with
        # the grown base), and changes nothing up to L
        plain = _plain(model)
        assert (plain(ids).logits - full.logits).abs().max() > 1e-2
        torch.testing.assert_close(plain(ids[:, :L]).logits, model(ids[:, :L]).logits,
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_cached_decode_with_attention_mask_equals_recomputation(impl):
    model = _model(impl)
    ids = torch.randint(1, 61, (3, 18))
    mask = torch.ones(3, 18, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[2, :7] = 0  # this row stays within L for a while, then passes it
    with torch.no_grad():
        past = model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True).past_key_values
        for j in range(5, 18):
            full = model(ids[:, : j + 1], attention_mask=mask[:, : j + 1]).logits[:, -1]
            step = model(ids[:, j : j + 1], attention_mask=mask[:, : j + 1], past_key_values=past,
                         use_cache=True)
            torch.testing.assert_close(step.logits[:, 0], full, atol=1e-5, rtol=0)
            past = step.past_key_values


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_padded_rows_past_the_length_equal_each_row_alone(impl):
    """The base is each row's own: a padded row gives the logits it gives unpadded."""
    model = _model(impl)
    ids = torch.randint(1, 61, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0  # row 1 has 11 real tokens, row 0 has 16
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        alone0 = model(ids[:1]).logits
        alone1 = model(ids[1:, 5:]).logits
    torch.testing.assert_close(batch[0], alone0[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch[1, 5:], alone1[0], atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_greedy_generate_with_cache_equals_recomputation_on_20_seeds(impl):
    model = _model(impl)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, 61, (2, 4), generator=g)
        cached = model.generate(prompt, 20, use_cache=True)
        full = model.generate(prompt, 20, use_cache=False)
        assert torch.equal(cached, full), seed


def test_generate_with_padded_prompts_past_the_length():
    model = _model()
    prompt = torch.randint(1, 61, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    cached = model.generate(prompt, 14, attention_mask=mask, use_cache=True)
    full = model.generate(prompt, 14, attention_mask=mask, use_cache=False)
    assert torch.equal(cached, full)
    alone = model.generate(prompt[:1, 2:], 14)  # the padded row, generated alone
    assert torch.equal(cached[0, 2:], alone[0])


def test_a_cache_without_ids_is_refused_past_the_length():
    model = _model()
    ids = torch.randint(0, 61, (1, 10))
    with torch.no_grad():
        past = model(ids[:, :9], use_cache=True).past_key_values
        assert torch.equal(past.input_ids, ids[:, :9])
        plain = tuple(past)  # the pairs alone: the ids to recompute from are gone
        with pytest.raises(ValueError, match="cannot be reused"):
            model(ids[:, 9:], past_key_values=plain, use_cache=True)
        # within L a plain tuple still works (nothing depends on the length there)
        short = tuple(model(ids[:, :4], use_cache=True).past_key_values)
        step = model(ids[:, 4:5], past_key_values=short).logits[:, 0]
        torch.testing.assert_close(step, model(ids[:, :5]).logits[:, -1], atol=1e-5, rtol=0)


def test_other_position_schemes_still_use_the_cache():
    """Only dynamic NTK recomputes: a plain or linear RoPE decode feeds one token."""
    for scaling in (None, {"rope_type": "linear", "factor": 2.0}):
        torch.manual_seed(0)
        cfg = MiniLLMConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=0,
                            max_position_embeddings=64, rope_scaling=scaling)
        model = MiniLLM(cfg).eval()
        seen = []
        hook = model.model.layers[0].register_forward_hook(
            lambda m, i, o, seen=seen: seen.append(i[0].shape[1]))
        ids = torch.randint(0, 61, (1, 20))
        with torch.no_grad():
            past = model(ids[:, :15], use_cache=True).past_key_values
            model(ids[:, 15:16], past_key_values=past)
        hook.remove()
        assert seen == [15, 1]


# -- HF dynamic-NTK Llama converted -------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def _hf_dynamic(factor: float = 2.0, hf_max: int = 16, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=hf_max, num_hidden_layers=layers,
                      initializer_range=0.2,
                      rope_parameters={"rope_type": "dynamic", "factor": factor,
                                       "rope_theta": 10000.0})
    return LlamaForCausalLM(cfg).eval()


def test_from_hf_dynamic_accepts_inputs_past_the_length_and_matches_hf():
    hf = _hf_dynamic()
    ours = MiniLLM.from_hf(hf).eval()
    assert ours.config.original_max_position_embeddings == 16
    assert ours.config.max_position_embeddings == 32  # 16 x factor 2
    # HF's dynamic rotary is stateful (its base only grows until the length drops below the
    # original): a fresh HF model per length gives HF's answer for that length alone
    for s in (12, 16, 17, 24, 32):
        hf_fresh = _hf_dynamic()
        ids = torch.randint(0, 97, (2, s), generator=torch.Generator().manual_seed(s))
        with torch.no_grad():
            expected = hf_fresh(input_ids=ids).logits
            got = ours(ids).logits
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    # past L the base differs from unscaled RoPE: the comparison above is not vacuous
    with torch.no_grad():
        plain = _plain(ours)(ids).logits
    assert (plain[:, 16:] - got[:, 16:]).abs().max() > 1e-2


def test_from_hf_dynamic_longer_limit_and_cached_decode():
    hf = _hf_dynamic()
    ours = MiniLLM.from_hf(hf, max_position_embeddings=80).eval()
    assert ours.config.max_position_embeddings == 80
    ids = torch.randint(0, 97, (1, 70))
    with torch.no_grad():
        expected = _hf_dynamic()(input_ids=ids).logits
        full = ours(ids).logits
        torch.testing.assert_close(full, expected, atol=1e-4, rtol=0)
        past = ours(ids[:, :14], use_cache=True).past_key_values
        for j in range(14, 20):
            step = ours(ids[:, j : j + 1], past_key_values=past, use_cache=True)
            ref = ours(ids[:, : j + 1]).logits[:, -1]
            torch.testing.assert_close(step.logits[:, 0], ref, atol=1e-5, rtol=0)
            past = step.past_key_values


def test_from_hf_linear_keeps_hf_length():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, num_hidden_layers=1,
                      rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    hf = LlamaForCausalLM(cfg).eval()
    ours = MiniLLM.from_hf(hf).eval()
    assert ours.config.max_position_embeddings == 64
    ids = torch.randint(0, 97, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(input_ids=ids).logits, atol=1e-4, rtol=0)
