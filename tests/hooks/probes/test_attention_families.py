"""Attention capture on the families issue 22 §4 brought in, against HF eager
``output_attentions`` of the same model: BART-style eager attention that folds the heads into
the batch ((B·H, T, S): XGLM, TrOCR, MVP), and hybrids whose other layers mix positions without
a softmax (Gated DeltaNet, MiniMax's lightning attention, Nemotron-H's Mamba2, RWKV), said by
layer."""

from __future__ import annotations

import pytest
import torch

import hooks

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=128, hidden_size=64, d_model=64, num_hidden_layers=2, num_layers=2,
             decoder_layers=2, num_attention_heads=4, decoder_attention_heads=4,
             intermediate_size=96, ffn_dim=96, decoder_ffn_dim=96, num_key_value_heads=2,
             max_position_embeddings=64)


def _build(family: str, **extra):
    config = transformers.AutoConfig.for_model(family)
    for k, v in {**SMALL, **extra}.items():
        if hasattr(config, k):
            setattr(config, k, v)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager").eval()


def _ids():
    return torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))


def _captured(model, ids):
    with hooks.capture(model, attention=True, grads=False) as trace, torch.no_grad():
        model(input_ids=ids)
    return trace


@pytest.mark.parametrize("family", ["xglm", "trocr", "mvp"])
def test_bart_style_heads_in_the_batch_equal_hf_eager_output_attentions(family):
    model = _build(family)
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids, output_attentions=True).attentions
    trace = _captured(model, ids)
    assert len(trace.attention) == len(ref) == 2
    for rec, want in zip(trace.attention, ref, strict=True):
        assert rec.probs.shape == want.shape == (2, 4, 8, 8)
        torch.testing.assert_close(rec.probs, want.float(), atol=1e-6, rtol=0)
        assert rec.layer in (0, 1) and "(B·H, T, S) = (8, 8, 8)" in rec.note
        assert rec.mask is not None and not bool(rec.mask[0, 0, 0, 1])  # causal: key 1 masked
    assert not [n for n in trace.notes if n.kind == "attention"]


@pytest.mark.parametrize("family, kind, where", [
    ("lara_mini", "linear attention", "model.layers.0"),  # Gated DeltaNet, then attention
    ("minimax", "linear attention", "model.layers.1"),  # lightning attention after softmax
    ("nemotron_h", "state-space", "model.layers.0"),  # Mamba2, MoE, attention, MLP
])
def test_hybrids_record_their_softmax_layers_and_say_which_layers_have_none(family, kind, where):
    model = _build(family)
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids, output_attentions=True).attentions
    trace = _captured(model, ids)
    (rec,) = trace.attention
    want = next(a for a in ref if a is not None and a.shape == rec.probs.shape)
    torch.testing.assert_close(rec.probs, want.float(), atol=1e-6, rtol=0)
    notes = [n for n in trace.notes if n.kind == "attention"]
    assert [n.module for n in notes] == [where]
    assert notes[0].message.startswith(f"no attention probabilities: a {kind} layer")
    assert "flash-attn" not in " ".join(n.message for n in notes)


def test_rwkv_says_each_block_has_no_attention_probabilities():
    model = _build("rwkv", attention_hidden_size=64, context_length=64)
    trace = _captured(model, _ids())
    assert trace.attention == []
    notes = [n for n in trace.notes if n.kind == "attention"]
    assert [n.module for n in notes] == ["rwkv.blocks.0", "rwkv.blocks.1"]
    assert all("a RWKV layer (RwkvBlock" in n.message for n in notes)


def test_cpmant_records_its_prompt_positions_too_and_the_rest_equals_hf():
    # CPM-Ant prepends config.prompt_length prompt positions; HF's output_attentions crops them
    model = _build("cpmant")
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids, output_attentions=True).attentions
    trace = _captured(model, ids)
    p = model.config.prompt_length
    assert len(trace.attention) == len(ref) == 2
    for rec, want in zip(trace.attention, ref, strict=True):
        assert rec.probs.shape == (2, 4, p + 8, p + 8)
        torch.testing.assert_close(rec.probs[:, :, p:, p:], want.float(), atol=1e-6, rtol=0)
        assert rec.layer in (0, 1)
