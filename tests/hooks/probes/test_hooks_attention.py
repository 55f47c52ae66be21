"""Attention probabilities read from the model's own calls, on the families of the zoo.

References, all independent of mdb's code: HF's eager attention with ``output_attentions=True``
on the same weights (the same model switched to ``config._attn_implementation = "eager"``),
nanoGPT's hand-written softmax against its flash path, ``nn.MultiheadAttention`` with
``need_weights=True``, and masks written out by hand.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as sdpa_alias

import hooks
import hooks.probes.attention as attention
from tests.conftest import SAMPLES
from tests.families import FAMILIES, nanogpt

DENSE = ["llama", "mistral", "qwen3", "gemma", "phi3", "gpt2", "bert"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "granite_moe"]


def build(name):
    return hooks.from_factory(FAMILIES[name].build())


def captured(model, batch, loss_fn=None, backward=True, **kw):
    kw.setdefault("attention", True)
    with hooks.capture(model, **kw) as tr:
        out = batch.call(model)
        if backward:
            hooks.select_loss(out, loss_fn, batch).loss.backward()
    return tr, out


def eager_attentions(model, batch):
    """HF's eager attention weights on the same weights, by layer."""
    model.config._attn_implementation = "eager"
    for m in model.modules():  # T5/BERT keep a config per sub-model
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = "eager"
    with torch.no_grad():
        return model(*batch.args, **batch.kwargs, output_attentions=True)


@pytest.mark.parametrize("family", DENSE + MOE)
def test_probs_equal_hf_eager_output_attentions(family):
    pytest.importorskip("transformers")
    model, batch, loss_fn = build(family)
    tr, out = captured(model, batch, loss_fn)
    ref = eager_attentions(model, batch).attentions
    assert len(tr.attention) == len(ref) == model.config.num_hidden_layers
    for a, w in zip(tr.attention, ref, strict=True):
        assert a.probs.shape == w.shape
        err = (a.probs - w.float()).abs().max().item()
        assert err < 1e-4, f"{a.module}: max |Δ| = {err:.2e}"
    # GQA from the call's shapes: query heads vs distinct KV heads
    cfg = model.config
    h = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or h
    if family not in ("gpt_oss",):  # eager path: the softmax sees no keys
        assert {(a.num_heads, a.num_kv_heads) for a in tr.attention} == {(h, hkv)}
    assert not [n for n in tr.notes if n.kind == "attention"]


def test_t5_encoder_decoder_and_cross_attention_equal_hf_eager():
    pytest.importorskip("transformers")
    model, batch, loss_fn = build("t5")
    tr, _ = captured(model, batch, loss_fn)
    ref = eager_attentions(model, batch)
    by_name = {a.module: a for a in tr.attention}
    n = model.config.num_layers
    expect = {}
    for i in range(n):
        expect[f"encoder.block.{i}.layer.0.SelfAttention"] = ref.encoder_attentions[i]
        expect[f"decoder.block.{i}.layer.0.SelfAttention"] = ref.decoder_attentions[i]
        expect[f"decoder.block.{i}.layer.1.EncDecAttention"] = ref.cross_attentions[i]
    assert set(by_name) == set(expect)
    for name, w in expect.items():
        torch.testing.assert_close(by_name[name].probs, w.float(), rtol=1e-4, atol=1e-5)


def test_mistral_sliding_window_mask_is_recorded():
    pytest.importorskip("transformers")
    model, batch, _ = build("mistral")
    tr, _ = captured(model, batch, backward=False)
    t = batch.kwargs["input_ids"].shape[1]
    i = torch.arange(t)
    window = model.config.sliding_window
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    for a in tr.attention:
        assert torch.equal(a.mask.expand_as(a.probs), keep.expand_as(a.probs))
        assert torch.all(a.probs[~keep.expand_as(a.probs)] == 0)
        # K/V were repeated to H heads before the call: found from the data
        assert (a.num_kv_heads, a.kv_detail) == (model.config.num_key_value_heads, "repeated")


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_q_norm_k_norm_models_are_exact(family):
    """The old q_proj/k_proj recomputation was off by 0.53 / 0.73 here (q_norm, k_norm)."""
    pytest.importorskip("transformers")
    model, batch, _ = build(family)
    tr, _ = captured(model, batch, backward=False)
    ref = eager_attentions(model, batch).attentions
    for a, w in zip(tr.attention, ref, strict=True):
        torch.testing.assert_close(a.probs, w.float(), rtol=1e-5, atol=1e-6)


def test_gpt_oss_sink_column_is_dropped_as_the_model_does():
    pytest.importorskip("transformers")
    model, batch, _ = build("gpt_oss")
    tr, _ = captured(model, batch, backward=False)
    for a in tr.attention:
        assert a.source == "softmax" and "attention sink" in a.note
        assert bool((a.probs.sum(-1) < 1).all())


def test_nanogpt_flash_equals_its_hand_written_softmax():
    flash, (x, y) = nanogpt(flash=True)
    eager, _ = nanogpt(flash=False)
    eager.load_state_dict(flash.state_dict())
    trs = []
    for model in (flash, eager):
        tr, _ = captured(model, hooks.Batch(args=(x, y)))
        trs.append(tr)
    a_flash, a_eager = trs[0].attention, trs[1].attention
    assert [a.source for a in a_flash] == ["sdpa", "sdpa"]
    assert [a.source for a in a_eager] == ["softmax", "softmax"]
    t = x.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for a, b in zip(a_flash, a_eager, strict=True):
        assert a.module == b.module
        torch.testing.assert_close(a.probs, b.probs, rtol=1e-5, atol=1e-6)
        for rec in (a, b):  # the causal mask, recorded both ways
            assert torch.equal(rec.mask.expand_as(rec.probs), causal.expand_as(rec.probs))


def test_transformer_encoder_equals_multihead_attention_need_weights():
    model, batch, _ = build("transformer_encoder")
    inputs = {}
    handles = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, k, i=i: inputs.setdefault(i, (a, dict(k))), with_kwargs=True)
        for i, layer in enumerate(model.encoder.layers)]
    tr, _ = captured(model, batch)
    for h in handles:
        h.remove()
    assert [a.module for a in tr.attention] == ["encoder.layers.0.self_attn",
                                                 "encoder.layers.1.self_attn"]
    for i, a in enumerate(tr.attention):
        args, kw = inputs[i]
        kw.update(need_weights=True, average_attn_weights=False)
        with torch.no_grad():
            _, w = model.encoder.layers[i].self_attn(*args, **kw)
        torch.testing.assert_close(a.probs, w, rtol=1e-5, atol=1e-6)


def test_multihead_attention_need_weights_path_is_read_from_its_softmax():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)  # True = not allowed (MHA's convention)
    with hooks.capture(mha, attention=True) as tr:
        _, w = mha(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)
    (a,) = tr.attention
    assert a.source == "softmax" and a.probs.shape == (2, 4, 5, 5)
    torch.testing.assert_close(a.probs, w.detach())
    assert torch.equal(a.mask.expand_as(a.probs), (~mask).expand_as(a.probs))


class AliasAttention(nn.Module):
    """Calls SDPA through a name imported with ``from torch.nn.functional import ...``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        return sdpa_alias(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)


def test_sdpa_imported_by_name_is_seen():
    torch.manual_seed(0)
    m = AliasAttention()
    x = torch.randn(1, 6, 8)
    with hooks.capture(m, attention=True) as tr:
        m(x)
    (a,) = tr.attention
    q, k, _ = m.qkv(x).view(1, 6, 3, 2, 4).permute(2, 0, 3, 1, 4)
    ref = torch.softmax((q @ k.transpose(-1, -2) / 2.0).masked_fill(
        ~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf")), dim=-1)
    torch.testing.assert_close(a.probs, ref.detach())
    assert sdpa_alias is F.scaled_dot_product_attention  # restored


def test_float_mask_fully_masked_rows_and_scale():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 5, 8)
    mask = torch.zeros(2, 1, 4, 5)
    mask[:, :, :, 3:] = torch.finfo(torch.float32).min  # HF-style padding
    mask[1, :, 0, :] = float("-inf")  # a row with no key at all
    probs, keep = attention.sdpa_probs(q, k, mask, scale=0.3)
    ref = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + mask, dim=-1)
    ref[1, :, 0] = 0.0  # SDPA's safe softmax: 0, not NaN
    torch.testing.assert_close(probs, ref)
    out = F.scaled_dot_product_attention(q, k, torch.eye(5)[None, None].expand(2, 3, 5, 5),
                                         attn_mask=mask, scale=0.3)
    torch.testing.assert_close(out, probs)  # V = identity: the output is the probabilities
    assert torch.equal(keep.expand(2, 3, 4, 5), (mask > -1e30).expand(2, 3, 4, 5))


def test_gqa_from_the_call_shapes_and_repeated_heads():
    q, k = torch.randn(1, 6, 3, 4), torch.randn(1, 2, 3, 4)
    assert attention.kv_heads(q, k, True) == (6, 2, "enable_gqa")
    rep = k.repeat_interleave(3, dim=1)
    assert attention.kv_heads(q, rep, False) == (6, 2, "repeated")
    assert attention.kv_heads(q, torch.randn(1, 6, 3, 4), False) == (6, 6, "heads")
    probs, _ = attention.sdpa_probs(q, k, enable_gqa=True)
    torch.testing.assert_close(probs, attention.sdpa_probs(q, rep)[0])


def test_nothing_left_installed_also_when_the_body_raises():
    model, (x, y) = nanogpt()
    originals = (F.scaled_dot_product_attention, torch.softmax)
    with pytest.raises(RuntimeError, match="boom"):
        with hooks.capture(model, attention=True):
            assert attention.installed()
            model(x, y)
            raise RuntimeError("boom")
    assert (F.scaled_dot_product_attention, torch.softmax) == originals
    assert "softmax" not in torch.Tensor.__dict__ and not attention.installed()
    with hooks.capture(model) as tr:  # not requested: nothing swapped, nothing recorded
        assert not attention.installed()
        model(x, y)
    assert tr.attention == [] and not [n for n in tr.notes if n.kind == "attention"]


def test_a_function_patched_before_the_capture_still_runs(monkeypatch):
    calls = []
    theirs = F.scaled_dot_product_attention

    def user_wrapper(*a, **k):
        calls.append(1)
        return theirs(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", user_wrapper)
    model, (x, y) = nanogpt()
    with hooks.capture(model, attention=True) as tr:
        model(x, y)
    assert len(calls) == 2 and len(tr.attention) == 2
    assert F.scaled_dot_product_attention is user_wrapper


def test_nested_captures_share_and_restore_the_interceptors():
    model, (x, y) = nanogpt()
    other, _ = nanogpt()
    with hooks.capture(model, attention=True) as outer:
        with hooks.capture(other, attention=True) as inner:
            other(x, y)
        assert attention.installed()
        model(x, y)
    assert not attention.installed()
    assert len(outer.attention) == len(inner.attention) == 2
    assert {a.module for a in outer.attention} == {"transformer.h.0.attn", "transformer.h.1.attn"}


def test_budget_cuts_calls_and_says_so():
    model, (x, y) = nanogpt()
    one = 2 * 4 * 16 * 16 * 4  # B·H·T·S fp32 of one call
    tr, _ = captured(model, hooks.Batch(args=(x, y)), attention_bytes=one + 300)
    assert len(tr.attention) == 1
    (note,) = [n for n in tr.notes if n.kind == "attention"]
    assert "1 call(s) not kept" in note.message and "transformer.h.1.attn" in note.message
    assert f"attention_bytes={one + 300:,}" in note.message


def test_attention_patterns_select_modules():
    model, (x, y) = nanogpt()
    tr, _ = captured(model, hooks.Batch(args=(x, y)), attention=["transformer.h.1.*"])
    assert [a.module for a in tr.attention] == ["transformer.h.1.attn"]


def test_capture_changes_no_output():
    model, (x, y) = nanogpt(flash=False)
    ref, _ = model(x, y)
    tr, (logits, _) = captured(model, hooks.Batch(args=(x, y)), backward=False)
    assert torch.equal(logits, ref)


class Hidden(nn.Module):
    """Attention through an op mdb does not intercept (a manual exp-normalise)."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(4, 4)

    def forward(self, x):
        s = self.q_proj(x) @ x.transpose(-1, -2)
        e = s.exp()
        return (e / e.sum(-1, keepdim=True)) @ x


def test_attention_computed_some_other_way_is_named():
    m = nn.Sequential(Hidden())
    with hooks.capture(m, attention=True) as tr:
        m(torch.randn(2, 3, 4))
    assert tr.attention == []
    (note,) = [n for n in tr.notes if n.kind == "attention"]
    assert "0 (Hidden)" in note.message and "neither" in note.message


def test_checkpoint_recomputation_is_not_recorded_twice():
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, _ = nanogpt()

        def forward(self, x, y):
            for blk in self.inner.transformer.h:
                blk.forward = (lambda b: lambda h: checkpoint(type(b).forward, b, h,
                                                              use_reentrant=False))(blk)
            return self.inner(x, y)

    m = Ckpt()
    _, (x, y) = nanogpt()
    with hooks.capture(m, attention=True) as tr:
        m(x, y)[1].backward()
    assert len(tr.attention) == 2


def test_user_gpt_nan_case_row_zero_of_layer_one_is_nan_and_fully_masked():
    path = SAMPLES / "user_gpt.py"
    sys.path.insert(0, str(path.parent))
    try:
        import user_gpt
    finally:
        sys.path.remove(str(path.parent))
    model, (idx, tgt) = user_gpt.nanogpt_nan()
    with hooks.capture(model, attention=True) as tr:
        model(idx, tgt)
    a0, a1 = tr.attention
    assert a1.module == "h.1.attn" and a1.source == "softmax"
    assert torch.isnan(a1.probs[:, :, 0]).all() and not torch.isnan(a1.probs[:, :, 1:]).any()
    assert not a1.mask[..., 0, :].any()  # query 0 sees no key
    assert not torch.isnan(a0.probs).any()
    torch.testing.assert_close(a0.probs.sum(-1), torch.ones(2, 4, 32))
    assert math.isclose(float(a1.probs[0, 0, 1, 1]), 1.0)  # query 1 sees only key 1


def test_attention_round_trips_and_old_traces_load(tmp_path):
    import json

    model, batch, loss_fn = build("mistral")
    tr, _ = captured(model, batch, loss_fn)
    back = hooks.Trace.load(tr.save(tmp_path / "t.mdbtrace"))
    for a, b in zip(tr.attention, back.attention, strict=True):
        for f in ("module", "call_index", "source", "num_heads", "num_kv_heads", "kv_detail",
                  "dropout", "note"):
            assert getattr(a, f) == getattr(b, f), f
        assert torch.equal(a.probs, b.probs) and torch.equal(a.mask, b.mask)
    # a trace of an older mdb: no mask, no KV heads
    d = tmp_path / "t.mdbtrace"
    data = json.loads((d / "trace.json").read_text())
    for a in data["attention"]:
        for f in ("num_heads", "num_kv_heads", "kv_detail", "dropout", "note"):
            del a[f]
    (d / "trace.json").write_text(json.dumps(data))
    from safetensors.torch import load_file, save_file

    tensors = {k: v for k, v in load_file(str(d / "tensors.safetensors")).items()
               if not k.endswith("/mask")}
    save_file(tensors, str(d / "tensors.safetensors"))
    old = hooks.Trace.load(d)
    assert [a.mask for a in old.attention] == [None, None]
    assert old.attention[0].num_kv_heads is None and old.attention[0].kv_detail == ""
    torch.testing.assert_close(old.attention[0].probs, tr.attention[0].probs)
