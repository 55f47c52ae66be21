"""``hooks.precision_diff`` on models of the test's own, each with one classic low-precision
mistake (and the same model without it), and the precision cases of
../shared/cases/loop_bugs.md: N15 (RMSNorm's sum of squares in fp16, x = 300 in 64 dims), N14
(RoPE angles in bf16 up to position 4,096), N17 (a naive softmax's exp overflowing in fp16),
N30 (an fp16 epsilon that rounds to 0)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hooks.whatif.precision import FACTOR, precision_diff

D, V, T = 64, 32, 8


class NaiveRMSNorm(nn.Module):
    """Squares in the input dtype (the mistake) unless ``fp32``."""

    def __init__(self, d: int, eps: float = 1e-6, fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps
        self.fp32 = fp32

    def forward(self, x):
        h = x.float() if self.fp32 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class NormNet(nn.Module):
    """Embeddings of a few hundred (|x| = 300), a linear map near identity, the norm, a head."""

    def __init__(self, fp32_norm: bool = False, eps: float = 1e-6, scale: float = 300.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        with torch.no_grad():
            self.embed.weight.copy_(scale * torch.sign(torch.randn(V, D)))
        self.proj = nn.Linear(D, D, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(D) + 0.01 * torch.randn(D, D))
        self.norm = NaiveRMSNorm(D, eps=eps, fp32=fp32_norm)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids, labels):
        logits = self.head(self.norm(self.proj(self.embed(ids))))
        return F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1))


def _batch(t: int = T):
    ids = torch.randint(0, V, (2, t), generator=torch.Generator().manual_seed(1))
    return {"ids": ids, "labels": ids}


def test_a_norm_that_squares_in_fp16_is_named_first():
    # N15: x = 300 in 64 dims; fp16's x² = 90000 > 65504 is inf, rsqrt(inf) = 0, output 0
    x = torch.full((D,), 300.0, dtype=torch.float16)
    assert torch.isinf(x.pow(2)).all() and NaiveRMSNorm(D)(x).abs().max() == 0
    pd = precision_diff(NormNet(), _batch(), torch.float16)
    div = pd.first_divergent
    assert div is not None and (div.direction, div.module) == ("forward", "norm")
    assert div.error > 0.9 * div.scale  # the fp16 output is ~0 where fp32's is ~1
    assert "a norm that squares in fp16" in div.cause and "x²" in div.cause
    assert pd.how == "cast" and pd.tolerance == FACTOR * 2**-10
    assert "16 × eps(float16)" in pd.threshold_text
    # the embedding and the projection before it stayed within tolerance
    before = {d.module: d for d in pd.diff.forward if d.module in ("embed", "proj")}
    assert set(before) == {"embed", "proj"}
    assert before["proj"].max_abs_diff > 0  # fp16 rounded it, within what fp16 explains
    for d in before.values():
        assert d.max_abs_diff is not None and d.max_abs_diff <= pd.tolerance * d.scale


def test_the_same_model_with_the_norm_in_fp32_names_nothing_beyond_tolerance():
    pd = precision_diff(NormNet(fp32_norm=True), _batch(), "float16")
    assert pd.first_divergent is None, pd.first_divergent.describe()
    assert pd.first_nonfinite is None
    assert math.isclose(pd.loss["fp32"], pd.loss["float16"], rel_tol=1e-2)
    assert "none beyond tolerance" in "\n".join(pd.lines())


def test_bf16_keeps_the_naive_norm_finite_and_within_tolerance():
    # bf16 has fp32's range: the same naive norm does not overflow
    pd = precision_diff(NormNet(), _batch(), "bfloat16")
    assert pd.first_nonfinite is None
    assert pd.first_divergent is None or pd.first_divergent.module != "norm"


def test_an_fp16_epsilon_that_rounds_to_0_is_named():
    # N30: float16(1e-8) == 0; a row of zeros then gives 0 · rsqrt(0) = NaN
    assert float(torch.tensor(1e-8, dtype=torch.float16)) == 0.0
    model = NormNet(eps=1e-8, scale=1.0)
    with torch.no_grad():
        model.embed.weight[3] = 0.0
    batch = _batch()
    batch["ids"][0, 2] = 3
    pd = precision_diff(model, batch, torch.float16)
    bad = pd.first_nonfinite
    assert bad is not None and (bad.direction, bad.module) == ("forward", "norm")
    assert "rounds to 0 in float16" in bad.cause
    assert any("rounds to 0 in float16: norm (1e-08)" in n for n in pd.notes)


class Rotary(nn.Module):
    """cos/sin of position · θ computed in the dtype of its buffer (the mistake, once cast)."""

    def __init__(self, dh: int = 8) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dh, 2).float() / dh))

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], dtype=self.inv_freq.dtype)
        angles = pos[:, None] * self.inv_freq[None, :]
        return torch.cos(angles), torch.sin(angles)


class RopeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, 8)
        self.rotary = Rotary()

    def forward(self, ids):
        x = self.embed(ids)
        cos, sin = self.rotary(ids)
        x1, x2 = x[..., :4], x[..., 4:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).pow(2).mean()


def test_rope_angles_in_bf16_are_named():
    # N14: bf16 holds an angle of 4,000 rad to ±8 rad; positions up to 4,096
    assert abs(float(torch.tensor(4000.0, dtype=torch.bfloat16)) - 4000.0) <= 16
    ids = torch.randint(0, V, (1, 4096), generator=torch.Generator().manual_seed(0))
    pd = precision_diff(RopeNet(), ids, "bfloat16")
    div = pd.first_divergent
    assert div is not None and div.module == "rotary"
    assert "RoPE angles computed in bfloat16" in div.cause


class NaiveSoftmaxNet(nn.Module):
    """Attention scores of about 20 through exp(s) / Σ exp(s) (no max subtracted)."""

    def __init__(self, score: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.attn = NaiveAttention(score)

    def forward(self, ids):
        return self.attn(self.embed(ids)).pow(2).mean()


class NaiveAttention(nn.Module):
    def __init__(self, score: float) -> None:
        super().__init__()
        self.score = score

    def forward(self, x):
        s = torch.tanh(x @ x.transpose(-1, -2)) * self.score  # (B, T, T) up to ±score
        e = torch.exp(s)
        return (e / e.sum(-1, keepdim=True)) @ x


def test_a_naive_softmax_over_large_scores_in_fp16_is_named():
    # N17 in half precision: exp overflows fp16 above ln(65504) ≈ 11.1
    assert torch.isinf(torch.exp(torch.tensor(20.0, dtype=torch.float16)))
    pd = precision_diff(NaiveSoftmaxNet(20.0), _batch()["ids"], torch.float16)
    bad = pd.first_nonfinite
    assert bad is not None and bad.module == "attn"
    assert "a softmax over scores up to" in bad.cause
    assert "exp overflows" in bad.cause
    # the same scores kept under 11 stay finite in fp16
    assert precision_diff(NaiveSoftmaxNet(8.0), _batch()["ids"], "float16").first_nonfinite \
        is None


def test_autocast_is_said_and_leaves_the_model_untouched():
    model = NormNet(fp32_norm=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pd = precision_diff(model, _batch(), "bfloat16", how="autocast")
    assert pd.how == "autocast" and "autocast" in pd.lines()[0]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_bad_dtype_and_how_are_one_line_value_errors():
    for kwargs in ({"dtype": "float64"}, {"dtype": "bf16", "how": "amp"}):
        with pytest.raises(ValueError) as exc:
            precision_diff(NormNet(), _batch(), **kwargs)
        assert "\n" not in str(exc.value)
