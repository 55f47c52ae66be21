"""Masking is not a non-finite origin (issue 35, item 3): the ``-inf`` a mask fill writes into
attention scores, which a softmax then takes, is not "the first op creating non-finite values";
a fully masked row's NaN still is, at the softmax (or the hand-written softmax's ``x - max``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hooks
from hooks.trace.ops import OpTrace


class _Attn(nn.Module):
    """A newcomer's attention (fused qkv, heads in ``self.h``, the causal mask written with
    ``masked_fill(..., -inf)``); ``how`` picks another common way of writing the same mask."""

    def __init__(self, d: int = 16, h: int = 2, how: str = "masked_fill") -> None:
        super().__init__()
        self.h, self.how = h, how
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def _mask(self, att: torch.Tensor, T: int) -> torch.Tensor:
        upper = torch.ones(T, T, dtype=torch.bool).triu(1)
        if self.how == "masked_fill":
            return att.masked_fill(upper, float("-inf"))
        if self.how == "where":
            return torch.where(upper, float("-inf"), att)
        if self.how == "full_triu":
            return att + torch.full((T, T), float("-inf")).triu(1)
        if self.how == "finfo_half":  # HF's finfo.min mask, overflowing to -inf in fp16
            low = torch.finfo(torch.float16).min
            return (att.half() - 100.0 + torch.full((T, T), low, dtype=torch.float16).triu(1))
        if self.how == "first_key_too":  # query 0 then sees no key: a fully masked row
            upper[:, 0] = True
            return att.masked_fill(upper, float("-inf"))
        raise ValueError(self.how)

    def forward(self, x: torch.Tensor, handwritten: bool = False) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        att = self._mask((q @ k.transpose(-1, -2)) / math.sqrt(D // self.h), T).float()
        if handwritten:
            e = (att - att.amax(-1, keepdim=True)).exp()
            p = e / e.sum(-1, keepdim=True)
        else:
            p = att.softmax(-1)
        y = p @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class _Model(nn.Module):
    def __init__(self, how: str = "masked_fill", handwritten: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, 16)
        self.attn = _Attn(how=how)
        self.handwritten = handwritten

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.attn(self.tok(idx), self.handwritten)


def _ops(how: str, handwritten: bool = False) -> OpTrace:
    torch.manual_seed(0)
    model = _Model(how, handwritten)
    with hooks.capture(model, grads=False) as trace:
        model(torch.randint(0, 11, (2, 5)))
    ot = trace.ops("attn", 0)
    assert ot.diverged == ""
    return ot


#: The test's own count of the -inf the first creator writes: B=2, H=2 and the T(T-1)/2 = 10
#: masked positions of T=5; ``torch.full`` writes all T*T = 25 before ``triu`` keeps 10.
_MINUS_INF = {"masked_fill": 40, "where": 40, "full_triu": 25, "finfo_half": 40}


@pytest.mark.parametrize("how", sorted(_MINUS_INF))
@pytest.mark.parametrize("handwritten", [False, True])
def test_a_causal_mask_fill_is_masking_not_the_first_nonfinite_op(how, handwritten):
    ot = _ops(how, handwritten)
    creators = [op for op in ot.ops if op.created("inf")]
    assert creators and creators[0].outputs[0].stats.inf_count == _MINUS_INF[how]
    assert creators[0].index in ot.masking()
    assert ot.first_nonfinite() is None
    assert ot.nonfinite_sentence().startswith("no op created non-finite values; masking: #"
                                              f"{creators[0].index} ")


def test_the_newcomers_model_names_no_op_on_its_causal_fill():
    ot = _ops("masked_fill")
    fill = next(op for op in ot.ops if op.short_op == "Tensor.masked_fill")
    assert fill.mask_fill and fill.index in ot.masking()
    assert "Tensor.masked_fill" in ot.nonfinite_sentence()
    assert "first op creating" not in ot.nonfinite_sentence()


def test_a_fully_masked_row_is_still_an_origin_at_the_softmax():
    ot = _ops("first_key_too")
    first = ot.first_nonfinite()
    assert first is not None and first.short_op == "Tensor.softmax"
    # the test's own look at the kept scores: query 0's row is all -inf, every head and batch
    scores = first.kept["args[0]"]
    assert bool(torch.isneginf(scores[:, :, 0, :]).all())
    assert first.outputs[0].stats.nan_count == 2 * 2 * 5


def test_a_fully_masked_row_of_a_handwritten_softmax_is_an_origin_at_x_minus_max():
    ot = _ops("first_key_too", handwritten=True)
    first = ot.first_nonfinite()
    assert first is not None and first.short_op == "Tensor.sub"  # -inf - (-inf) = NaN


class _NoSoftmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.masked_fill(x < 0, float("-inf"))
        return y.sum(-1)  # no softmax takes it: a -inf that reaches the output


def test_a_minus_inf_fill_that_no_softmax_takes_is_still_an_origin():
    torch.manual_seed(0)
    model = _NoSoftmax()
    with hooks.capture(model, grads=False) as trace:
        model(torch.randn(3, 4))
    ot = trace.ops("", 0)
    assert ot.masking() == set()
    assert ot.first_nonfinite().short_op == "Tensor.masked_fill"


def test_sources_and_mask_fill_survive_a_save():
    ot = _ops("full_triu")
    back = OpTrace.from_dict(ot.to_dict())
    assert [o.sources for o in back.ops] == [o.sources for o in ot.ops]
    assert back.masking() == ot.masking() != set()
    assert back.first_nonfinite() is None


def test_sdpa_with_a_float_minus_inf_mask_is_masking():
    class M(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            T = q.shape[-2]
            mask = torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1),
                                                 float("-inf"))
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    torch.manual_seed(0)
    model = M()
    with hooks.capture(model, grads=False) as trace:
        model(torch.randn(1, 2, 4, 8))
    ot = trace.ops("", 0)
    assert ot.first_nonfinite() is None and len(ot.masking()) == 1


class _CausalMask(nn.Module):
    """A module of its own that returns the causal mask of -inf (added to the scores)."""

    def forward(self, T: int, first_key_too: bool) -> torch.Tensor:
        mask = torch.full((T, T), float("-inf")).triu(1)
        if first_key_too:  # query 0 then sees no key at all: its row's softmax is NaN
            mask[:, 0] = float("-inf")
        return mask


class _MaskedAttn(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(x.shape[-1]) + mask
        return att.softmax(-1) @ v


class _WithMaskModule(nn.Module):
    def __init__(self, first_key_too: bool) -> None:
        super().__init__()
        self.first_key_too = first_key_too
        self.tok = nn.Embedding(11, 16)
        self.mask = _CausalMask()
        self.attn = _MaskedAttn()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.attn(self.tok(idx), self.mask(idx.shape[1], self.first_key_too))


@pytest.mark.parametrize("first_key_too", [False, True])
def test_a_mask_module_is_not_the_nan_origin(first_key_too):
    """The module that returns the -inf mask was the first non-finite call, and so the origin
    even of a NaN made later by a fully masked row; now the NaN's creator is named, and a mask
    alone is no origin."""
    from hooks.nonfinite.origin import trace_origin

    torch.manual_seed(0)
    model = _WithMaskModule(first_key_too)
    with hooks.capture(model, grads=False) as trace:
        out = model(torch.randint(0, 11, (2, 5)))
    assert trace.first_nonfinite("forward").module == "mask"  # the -inf, first to finish
    origin = trace_origin(trace)
    if first_key_too:
        # the test's own look: query 0's output row is NaN, every other row finite
        assert bool(torch.isnan(out[:, 0]).all()) and bool(torch.isfinite(out[:, 1:]).all())
        assert origin.module == "attn" and origin.direction == "forward"
        assert "held no NaN" in origin.detail
    else:
        assert bool(torch.isfinite(out).all()) and origin is None
