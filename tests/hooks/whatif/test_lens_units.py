"""``hooks.logit_lens``'s post-processing and its last-layer check, each against an independent
reference: HF Granite's own logits (``logits_scaling`` divides them: a lens that multiplied
would be off by s²), and the check's bound in units of the dtype's ulp (``torch.finfo``): a
few ulps of difference (another kernel for the same matmul) get no note, a thousand do.
Both breaks (× for ÷, the bound ×100) survived every test before these."""

from __future__ import annotations

import pytest
import torch

from hooks.whatif.lens import logit_lens
from tests import families
from tests.zoo import batch_for, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

EPS32 = torch.finfo(torch.float32).eps


def test_granite_logits_scaling_divides_as_the_model_does():
    pytest.importorskip("transformers")
    s = 8.0
    model = families._hf("Granite", **families._DECODER, logits_scaling=s,
                         embedding_multiplier=2.0, residual_multiplier=0.5,
                         attention_multiplier=0.25)
    batch = {"input_ids": families.ids()}
    with torch.no_grad():
        ref = model(**batch).logits
        unscaled = model.lm_head(model.model(**batch).last_hidden_state)
    torch.testing.assert_close(ref * s, unscaled)  # the model divides: ÷ is what it declares
    lens = logit_lens(model, batch)
    assert lens.post == "÷ logits_scaling 8"
    scale = float(ref.abs().max())
    torch.testing.assert_close(lens.logits(-1), ref, atol=4 * EPS32 * scale, rtol=0)
    assert lens.last_layer_error <= 4 * EPS32 * scale
    assert lens.notes == []


def _scaled_by(factor: float):
    """A tiny minillm whose forward multiplies its logits by ``factor`` after the head,
    undeclared (what the check exists to notice), its batch and its unscaled logits."""
    from minillm import MiniLLM

    class Scaled(MiniLLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * factor
            return out

    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.mul_(16)  # logits past 1: the bound is relative to them
    batch = batch_for(model, b=1, t=8)
    with torch.no_grad():
        plain = model(**batch).logits
    model.__class__ = Scaled
    return model, batch, plain


@pytest.mark.parametrize("ulps, noted", [(0, False), (4, False), (1000, True)])
def test_the_last_layer_check_tells_a_few_ulps_from_a_real_difference(ulps, noted):
    factor = 1.0 + ulps * EPS32
    model, batch, plain = _scaled_by(factor)
    lens = logit_lens(model, batch)
    want = float((plain * factor - plain).abs().max())  # what the lens misses
    assert lens.last_layer_error == pytest.approx(want, rel=0.05, abs=EPS32)
    scale = float(plain.abs().max())
    assert scale > 2.0
    if noted:
        assert want > 100 * EPS32 * scale  # well past a few ulps
        assert len(lens.notes) == 1 and "differs from the model's logits" in lens.notes[0]
    else:
        assert lens.notes == []
