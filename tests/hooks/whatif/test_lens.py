"""``hooks.logit_lens`` against references computed here: the model's own logits at the last
layer, and the argmax of a hand-written final norm and head applied to a middle layer's hidden
state (HF ``output_hidden_states``, or a forward hook of the test's own on minillm)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hooks.whatif.lens import logit_lens
from tests import families
from tests.zoo import batch_for, tiny

pytest.importorskip("transformers")


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False):
    x = x.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * ((1 + weight.detach().double()) if plus_one else weight.detach().double())


def _hf_hidden(model, batch, layer: int) -> torch.Tensor:
    """The output of decoder layer ``layer`` (not the last: HF's last entry is normed)."""
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    return out.hidden_states[layer + 1]


@pytest.mark.parametrize("family", ["hf_llama", "hf_qwen3", "hf_gpt2"])
def test_last_layer_equals_the_models_logits_on_hf(family):
    model, batch = getattr(families, family)()
    with torch.no_grad():
        ref = model(**batch).logits
    lens = logit_lens(model, batch)
    assert lens.num_layers == 2
    got = lens.logits(-1)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref.float(), atol=1e-5, rtol=0)
    assert lens.last_layer_error is not None and lens.last_layer_error <= 1e-5
    assert lens.notes == []


def test_last_layer_equals_the_models_logits_on_minillm():
    model = tiny()
    batch = batch_for(model, b=2, t=16)
    with torch.no_grad():
        ref = model(**batch).logits
    lens = logit_lens(model, batch)
    assert lens.layers == ["model.layers.0", "model.layers.1"]
    assert (lens.norm, lens.head) == ("model.norm", "lm_head")
    torch.testing.assert_close(lens.logits(1), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["hf_llama", "hf_qwen3"])
def test_a_middle_layers_top1_is_argmax_of_norm_then_head_on_hf(family):
    model, batch = getattr(families, family)()
    h = _hf_hidden(model, batch, 0)
    normed = _rms(h, model.model.norm.weight, model.config.rms_norm_eps)
    ref_logits = normed @ model.lm_head.weight.detach().double().T
    lens = logit_lens(model, batch, k=3)
    torch.testing.assert_close(lens.logits(0).double(), ref_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(lens.top_ids[0, :, :, 0], ref_logits.argmax(-1))
    p = torch.softmax(ref_logits, -1)
    top = lens.top(0, 5, row=1)
    assert [t.id for t in top] == p[1, 5].topk(3).indices.tolist()
    assert [t.prob for t in top] == pytest.approx(p[1, 5].topk(3).values.tolist(), abs=1e-6)


def test_a_middle_layers_top1_on_gpt2_uses_ln_f():
    model, batch = families.hf_gpt2()
    h = _hf_hidden(model, batch, 0).double()
    ln = model.transformer.ln_f
    w, bias = ln.weight.detach().double(), ln.bias.detach().double()
    normed = F.layer_norm(h, (h.shape[-1],), w, bias, ln.eps)
    ref = normed @ model.lm_head.weight.detach().double().T
    lens = logit_lens(model, batch)
    assert lens.norm == "transformer.ln_f"
    assert torch.equal(lens.top_ids[0, :, :, 0], ref.argmax(-1))


def test_a_middle_layers_top1_on_minillm_from_a_hook_of_the_test():
    model = tiny()
    batch = batch_for(model, b=2, t=16)
    seen = {}

    def keep(module, args, out):
        seen.setdefault("h", out[0].detach())

    handle = model.model.layers[0].register_forward_hook(keep)
    with torch.no_grad():
        model(**batch)
    handle.remove()
    normed = _rms(seen["h"], model.model.norm.weight, model.config.rms_norm_eps)
    ref = normed @ model.lm_head.weight.detach().double().T
    lens = logit_lens(model, batch)
    assert torch.equal(lens.top_ids[0, :, :, 0], ref.argmax(-1))
    texts, probs = lens.table(row=0)
    assert len(texts) == 2 and len(texts[0]) == 16
    assert texts[0][0] == f"#{int(ref[0, 0].argmax())}"  # no tokenizer: the id
    assert probs[0, 0] == pytest.approx(float(torch.softmax(ref[0, 0], -1).max()), abs=1e-6)


def test_gemma2_soft_capping_is_applied_once_at_the_end():
    model = families._hf("Gemma2", **families._DECODER, head_dim=16,
                         final_logit_softcapping=3.0)
    batch = {"input_ids": families.ids()}
    with torch.no_grad():
        ref = model(**batch).logits
    assert float(ref.abs().max()) <= 3.0  # the cap is active: without it the lens would differ
    lens = logit_lens(model, batch)
    assert "soft-cap 3" in lens.post
    torch.testing.assert_close(lens.logits(-1), ref, atol=1e-5, rtol=0)


def test_cohere_logit_scale_is_applied():
    model = families._hf("Cohere", **families._DECODER, logit_scale=0.25)
    batch = {"input_ids": families.ids()}
    with torch.no_grad():
        ref = model(**batch).logits
    lens = logit_lens(model, batch)
    assert lens.post == "× logit_scale 0.25"
    torch.testing.assert_close(lens.logits(-1), ref, atol=1e-5, rtol=0)


def test_top_k_beyond_the_kept_k_and_the_tokenizer_text():
    from minillm import ByteTokenizer

    model = tiny()
    batch = batch_for(model, b=1, t=8)
    lens = logit_lens(model, batch, k=2, tokenizer=ByteTokenizer())
    p = torch.softmax(lens.logits(1)[0, 3].double(), -1)
    top = lens.top(1, 3, k=6)
    assert [t.id for t in top] == p.topk(6).indices.tolist()
    assert top[0].text == ByteTokenizer().token_strings([top[0].id])[0]


def test_bad_input_is_one_line_value_error():
    model = tiny()
    batch = batch_for(model, b=1, t=8)
    lens = logit_lens(model, batch)
    for call in (lambda: lens.logits(2), lambda: lens.top(0, 8), lambda: lens.top(0, 0, k=0),
                 lambda: logit_lens(model, batch, k=0)):
        with pytest.raises(ValueError) as exc:
            call()
        assert "\n" not in str(exc.value)
    t5, t5_batch = families.hf_t5()
    with pytest.raises(ValueError, match="encoder-decoder"):
        logit_lens(t5, t5_batch)
    bert, bert_batch = families.hf_bert()
    with pytest.raises(ValueError, match="no final norm"):
        logit_lens(bert, bert_batch)


def test_a_model_that_changes_its_logits_after_the_head_gets_a_note():
    from minillm import MiniLLM

    class Doubled(MiniLLM):  # does something after its head that it does not declare
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    model = tiny()
    model.__class__ = Doubled
    batch = batch_for(model, b=1, t=8)
    with torch.no_grad():
        ref = model(**batch).logits
    lens = logit_lens(model, batch)
    assert lens.last_layer_error == pytest.approx(float((ref / 2).abs().max()), rel=1e-5)
    assert len(lens.notes) == 1 and "differs from the model's logits" in lens.notes[0]
