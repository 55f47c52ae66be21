"""The doctor's invariance checks (21-25): each named bug of ``tests/invariance_models.py`` fails
its check with the first module where the two runs part, the same code fixed passes, and correct
HF families and minillm draw no failure. The largest difference is recomputed here with plain
torch (the model run by hand on the row alone and on the transformed input) and the tolerance
from ``torch.finfo``, never taken from the code under test."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from hooks.doctor.model import resolve_only, run_checks
from hooks.doctor.model.invariance_compare import tolerance_of
from tests import families
from tests.invariance_models import PaddedLM, TinyLM, batch

pytestmark = pytest.mark.usefixtures("one_thread")

HAS_HF = importlib.util.find_spec("transformers") is not None
KEYS = ["padding", "batch", "cache", "attn-impl", "packing"]
FACTOR = 16  # the rule of hooks.whatif.precision: 16 × eps(dtype) × max |reference|


def one(model, key: str, ids: torch.Tensor | None = None):
    return run_checks(model, {"input_ids": batch() if ids is None else ids}, only=key)[0]


def tol(ref: torch.Tensor) -> float:
    return FACTOR * torch.finfo(torch.float32).eps * float(ref.abs().max())


@torch.no_grad()
def padded_gap(model) -> tuple[float, float]:
    """(max |Δ|, tolerance) of the last row alone against it left- and right-padded by T // 4,
    by hand."""
    row = batch()[-1:]
    n, p = row.shape[1], max(1, row.shape[1] // 4)
    ref = model(row).logits[0]
    pad = torch.zeros(1, p, dtype=row.dtype)
    ids = torch.cat([torch.cat([pad, row], 1), torch.cat([row, pad], 1)])
    mask = torch.ones_like(ids)
    mask[0, :p], mask[1, n:] = 0, 0
    out = model(ids, attention_mask=mask).logits
    gap = max(float((out[0, p:] - ref).abs().max()), float((out[1, :n] - ref).abs().max()))
    return gap, tol(ref)


@torch.no_grad()
def batch_gap(model) -> tuple[float, float]:
    ids = batch()
    ref = model(ids[-1:]).logits[0]
    return float((model(ids).logits[-1] - ref).abs().max()), tol(ref)


@torch.no_grad()
def cache_gap(model) -> tuple[float, float]:
    """use_cache=False against use_cache=True and against a prefix + 2 tokens one at a time."""
    row = batch()[-1:]
    n = row.shape[1]
    ref = model(row).logits[0]
    full = model(row, use_cache=True).logits[0]
    out = model(row[:, :n - 2], use_cache=True)
    steps = [out.logits[0]]
    for i in (n - 2, n - 1):
        out = model(row[:, i:i + 1], past_key_values=out.past_key_values, use_cache=True)
        steps.append(out.logits[0])
    inc = torch.cat(steps)
    return max(float((full - ref).abs().max()), float((inc - ref).abs().max())), tol(ref)


@torch.no_grad()
def impl_gap(model) -> tuple[float, float]:
    row = batch()[-1:]
    attns = [m for m in model.modules() if hasattr(m, "attn_implementation")]
    for m in attns:
        m.attn_implementation = "eager"
    ref = model(row).logits[0]
    for m in attns:
        m.attn_implementation = "sdpa"
    return float((model(row).logits[0] - ref).abs().max()), tol(ref)


@torch.no_grad()
def packing_gap(model) -> tuple[float, float]:
    """The row alone against it packed after 6 other tokens, position_ids restarting at 0 (the
    other document's tokens are whatever the check drew: this row's logits must not care)."""
    row = batch()[-1:]
    n, m = row.shape[1], row.shape[1] // 2
    ref = model(row, position_ids=torch.arange(n)[None]).logits[0]
    other = batch(1, m, seed=7)
    pos = torch.cat([torch.arange(m), torch.arange(n)])[None]
    out = model(torch.cat([other, row], 1), position_ids=pos).logits[0, m:]
    return float((out - ref).abs().max()), tol(ref)


#: check key -> (model class, bug, extra constructor args, module where the runs part first,
#: the hand-made measurement)
CASES = {
    "padding-positions": ("padding", PaddedLM, "shared_positions",
                          dict(learned_positions=True), "rotary_emb", padded_gap),
    "padding-mask": ("padding", PaddedLM, "mask_ignored", {}, "layers.0.attn", padded_gap),
    "batch-norm": ("batch", TinyLM, "batch_norm", {}, "layers.0.norm1", batch_gap),
    "cache-kv-sharing": ("cache", TinyLM, "kv_in_cache", dict(share_kv=True), "layers.1.attn",
                         cache_gap),
    "cache-positions": ("cache", TinyLM, "cache_positions", {}, "rotary_emb", cache_gap),
    "attn-impl-scale": ("attn-impl", TinyLM, "eager_scale", {}, "layers.0.attn", impl_gap),
    "packing-doc-mask": ("packing", TinyLM, "no_doc_mask", {}, "layers.0.attn", packing_gap),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_named_bug_fails_at_its_module_and_the_fixed_code_passes(case):
    key, cls, bug, kw, module, measure = CASES[case]
    buggy, fixed = cls({bug}, **kw).eval(), cls(set(), **kw).eval()
    gap, limit = measure(buggy)
    assert gap > 100 * limit, "the bug must show by hand first"
    res = one(buggy, key)
    assert res.status == "fail", res.evidence
    assert res.module == module, res.evidence
    assert res.data["parting"]["origin"] == module
    reported = max(g["max_abs"] for g in res.data["gaps"].values())
    if key != "packing":  # the check draws its own other document
        assert math.isclose(reported, gap, rel_tol=1e-4), (reported, gap)
    assert res.hint
    ok_gap, ok_limit = measure(fixed)
    assert ok_gap <= ok_limit
    res = one(fixed, key)
    assert res.status == "pass", res.evidence
    assert max(g["max_abs"] for g in res.data["gaps"].values()) <= ok_limit


def test_the_cause_is_named_from_where_the_runs_part():
    res = one(PaddedLM({"shared_positions"}, learned_positions=True).eval(), "padding")
    assert "position_ids" in res.hint and "nnsight #672" in res.hint
    res = one(PaddedLM({"mask_ignored"}).eval(), "padding")
    assert "attention_mask" in res.hint and "unsloth #3699" in res.hint
    res = one(TinyLM({"kv_in_cache"}, share_kv=True).eval(), "cache")
    assert "transformers #45242" in res.hint
    assert "use_cache=True run" in res.evidence
    res = one(TinyLM({"cache_positions"}).eval(), "cache")
    assert "incremental token" in res.evidence and "cached length" in res.hint


def test_each_invariance_runs_alone_with_only():
    assert resolve_only(",".join(KEYS)) == {21, 22, 23, 24, 25}
    res = run_checks(TinyLM().eval(), {"input_ids": batch()}, only="cache,packing")
    assert [r.key for r in res] == ["cache", "packing"]


def test_the_tolerance_comes_from_the_dtype():
    assert tolerance_of(TinyLM()).eps == torch.finfo(torch.float32).eps
    assert tolerance_of(TinyLM().to(torch.bfloat16)).eps == 2.0**-7
    assert tolerance_of(TinyLM().to(torch.float16)).eps == 2.0**-10


def test_a_check_that_does_not_apply_says_why():
    model, b = families.nanogpt()
    res = {r.key: r for r in run_checks(model, b, only=KEYS)}
    assert res["padding"].status == "n/a" and "attention_mask" in res["padding"].evidence
    assert res["cache"].status == "n/a" and "cache" in res["cache"].evidence
    assert res["packing"].status == "n/a" and "position_ids" in res["packing"].evidence
    assert res["batch"].status == "pass"
    model, b = families.lstm()
    res = run_checks(model, b, only="attn-impl")[0]
    assert res.status == "n/a" and "attn_implementation" in res.evidence


def _qwen2():
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=families.V, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    x = families.ids()
    return model, {"input_ids": x, "labels": x}


HF = {"llama": families.hf_llama, "mistral": families.hf_mistral, "qwen2": _qwen2,
      "mixtral": families.hf_mixtral, "gpt2": families.hf_gpt2}


@pytest.mark.parametrize("name", sorted(HF))
def test_correct_hf_families_pass_every_invariance(name):
    if not HAS_HF:
        pytest.skip("needs transformers")
    model, b = HF[name]()
    res = {r.key: r for r in run_checks(model, b, only=KEYS)}
    assert {k: r.status for k, r in res.items()} == dict.fromkeys(KEYS, "pass"), {
        k: r.evidence for k, r in res.items()}


def test_minillm_passes_and_packing_does_not_apply():
    from minillm import MiniLLM, load_preset

    torch.manual_seed(0)
    model = MiniLLM(load_preset("tiny")).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 24),
                        generator=torch.Generator().manual_seed(0))
    res = {r.key: r for r in run_checks(model, {"input_ids": ids, "labels": ids}, only=KEYS)}
    assert {k: r.status for k, r in res.items()} == {
        "padding": "pass", "batch": "pass", "cache": "pass", "attn-impl": "pass",
        "packing": "n/a"}, {k: r.evidence for k, r in res.items()}


def test_a_bf16_model_is_judged_with_bf16_tolerance():
    """In bf16 the tolerance is 16 × 2⁻⁷ of the reference's largest |logit| (torch.finfo): the
    fixed model's rounding stays within it, the ignored padding mask does not."""
    bad = PaddedLM({"mask_ignored"}).eval().to(torch.bfloat16)
    good = PaddedLM(set()).eval().to(torch.bfloat16)
    gap, _ = padded_gap(bad)
    res = one(bad, "padding")
    row_ref = bad(batch()[-1:]).logits.detach().float()
    limit = FACTOR * torch.finfo(torch.bfloat16).eps * float(row_ref.abs().max())
    assert gap > limit and res.status == "fail" and "eps(bfloat16)" in res.evidence
    assert res.module == "layers.0.attn"
    ok_gap, _ = padded_gap(good)
    assert ok_gap <= limit
    assert one(good, "padding").status == "pass"


class NoPositionIds(torch.nn.Module):
    """HF GPT-2 behind a forward that takes no ``position_ids``: GPT-2 then uses one position
    vector ``arange(T)`` for every row (nnsight #672), so a left-padded row's real tokens get
    positions shifted by its pads in the learned table ``wpe``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                          use_cache=use_cache)


def test_hf_gpt2_without_position_ids_fails_padding_at_its_position_table():
    if not HAS_HF:
        pytest.skip("needs transformers")
    model, b = families.hf_gpt2()
    ids = b["input_ids"]
    row, n, p = ids[-1:], ids.shape[1], ids.shape[1] // 4
    with torch.no_grad():  # by hand: the left-padded row, GPT-2 given no position_ids
        ref = model(input_ids=row, use_cache=False).logits[0]
        left = torch.cat([torch.zeros(1, p, dtype=row.dtype), row], 1)
        mask = torch.cat([torch.zeros(1, p), torch.ones(1, n)], 1).long()
        out = model(input_ids=left, attention_mask=mask, use_cache=False).logits[0, p:]
    gap = float((out - ref).abs().max())
    assert gap > 100 * tol(ref)
    res = run_checks(NoPositionIds(model), {"input_ids": ids}, only="padding")[0]
    assert res.status == "fail" and res.module == "inner.transformer.wpe", res.evidence
    assert res.data["gaps"]["left-padded row"]["max_abs"] == pytest.approx(gap, rel=1e-4)
    assert "nnsight #672" in res.hint
    assert run_checks(model, b, only="padding")[0].status == "pass"  # given position_ids


def test_nanogpt_flash_flag_switches_eager_and_sdpa():
    """nanoGPT's ``flash`` flag picks SDPA or its hand-written softmax: correct, they agree;
    with the hand-written path's 1/√Dh scale dropped, the check fails in the attention."""
    model, b = families.nanogpt()
    res = run_checks(model, b, only="attn-impl")[0]
    assert res.status == "pass" and "flash" in res.evidence, res.evidence
    assert all(blk.attn.flash for blk in model.transformer.h)  # restored
    base = type(model.transformer.h[0].attn)

    class NoScale(base):
        def forward(self, x):
            if self.flash:
                return super().forward(x)
            bsz, t, d = x.shape
            q, k, v = self.c_attn(x).split(d, dim=2)
            q, k, v = (z.view(bsz, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)).masked_fill(self.bias[:, :, :t, :t] == 0,
                                                         float("-inf"))  # the bug: no scale
            y = att.softmax(-1) @ v
            return self.c_proj(y.transpose(1, 2).reshape(bsz, t, d))

    for blk in model.transformer.h:
        blk.attn.__class__ = NoScale
    idx = b[0][-1:]
    with torch.no_grad():
        sdpa = model(idx)[0]
        for blk in model.transformer.h:
            blk.attn.flash = False
        eager = model(idx)[0]
        for blk in model.transformer.h:
            blk.attn.flash = True
    gap = float((sdpa - eager).abs().max())
    assert gap > 100 * tol(eager)
    res = run_checks(model, b, only="attn-impl")[0]
    assert res.status == "fail" and res.module == "transformer.h.0.attn", res.evidence
