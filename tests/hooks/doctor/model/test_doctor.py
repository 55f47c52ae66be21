"""``hooks.doctor.model``: every check against the zoo of broken models, the correct minillm and HF
models, plus the helpers each check rests on, against independent references."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from hooks.doctor.model import (
    CHECKS,
    CheckResult,
    DoctorOptions,
    Target,
    resolve_only,
    run_checks,
)
from hooks.doctor.model.attention import relative_position_violation
from hooks.doctor.model.moe import routing_stats
from hooks.doctor.model.registry import Check
from tests import zoo

ALL_KEYS = ["init-loss", "causality", "rope", "gqa", "grad-flow", "routing", "nonfinite",
            "tied", "numerics", "overfit", "init", "shapes", "loss-terms", "hooks", "padding",
            "batch", "cache", "attn-impl", "packing"]


pytestmark = pytest.mark.usefixtures("one_thread")


def by_key(results):
    return {r.key: r for r in results}


def test_registry_has_the_ten_checks_in_order():
    assert [c.key for c in CHECKS] == ALL_KEYS
    assert [c.id for c in CHECKS] == [*range(1, 15), *range(21, 26)]
    assert [c.key for c in CHECKS if c.slow] == ["overfit"]


def test_resolve_only_accepts_numbers_keys_and_commas():
    assert resolve_only(None) is None
    assert resolve_only("1,gqa, 8") == {1, 4, 8}
    assert resolve_only([2, "ROPE"]) == {2, 3}
    with pytest.raises(ValueError, match="unknown check 'bogus'.*1=init-loss"):
        resolve_only("1,bogus")
    with pytest.raises(ValueError, match="unknown check '15'"):
        resolve_only("15")
    assert resolve_only("init,shapes,loss-terms,hooks") == {11, 12, 13, 14}
    assert resolve_only("padding,packing") == {21, 25}


# -- the zoo -----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", sorted(zoo.EXPECTED))
def test_zoo_variant_fails_exactly_its_check(variant):
    must_fail, inherent, module = zoo.EXPECTED[variant]
    model, batch = zoo.BUILDERS[variant]()
    results = by_key(run_checks(model, batch))
    failing = {k for k, r in results.items() if r.failed}
    assert failing == must_fail | set(inherent), {k: results[k].evidence for k in failing}
    assert not any(r.status == "error" for r in results.values())
    for key in must_fail:
        assert results[key].module == module
        assert results[key].hint  # a failure always says where to look
    assert results["overfit"].status == "skip"


def test_correct_tiny_passes_every_check():
    model, batch = zoo.correct()
    results = run_checks(model, batch)
    na = {"packing": "n/a"}  # minillm's forward takes no position_ids
    assert {r.key: r.status for r in results} == {
        k: ("skip" if k == "overfit" else na.get(k, "pass")) for k in ALL_KEYS}


def test_gqa_repeat_names_the_modulo_mapping():
    model, batch = zoo.gqa_repeat()
    r = by_key(run_checks(model, batch, only="gqa"))["gqa"]
    # tiny: H=4, Hkv=2, n_rep=2 -> KV head 0 should serve query heads {0, 1}; repeat gives {0, 2}
    layer = r.data["layers"]["model.layers.0.self_attn"]
    assert layer["expected"] == [[0, 1], [2, 3]]
    assert layer["k_proj"] == [[h for h in range(4) if h % 2 == g] for g in range(2)]
    assert "`repeat`" in r.evidence


def test_causal_mask_dropped_reports_the_leak_at_position_zero():
    model, batch = zoo.no_causal_mask()
    r = by_key(run_checks(model, batch, only="causality"))["causality"]
    assert r.data["first_leaking_position"] == 0
    # the leak measured independently: change the second half, look at the first half
    ids = batch["input_ids"][:2]
    other = ids.clone()
    other[:, 32:] = (other[:, 32:] + 1) % 256
    with torch.no_grad():
        a, b = model(ids).logits, model(other).logits
    assert float((a[:, :32] - b[:, :32]).abs().max()) > 1e-3


def test_std1_init_loss_matches_an_independent_cross_entropy():
    model, batch = zoo.std1_tied_init()
    r = by_key(run_checks(model, batch, only="init-loss"))["init-loss"]
    g = torch.Generator().manual_seed(DoctorOptions().seed + 1)
    rnd = torch.randint(0, 256, (4, 64), generator=g)
    with torch.no_grad():
        logits = model(rnd).logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), rnd[:, 1:].reshape(-1))
    assert r.data["loss"] == pytest.approx(float(ce), rel=1e-5)
    assert r.data["ln_v"] == pytest.approx(math.log(256))
    assert r.data["ratio"] > 1.5


def test_dead_expert_is_the_one_pushed_down():
    model, batch = zoo.dead_expert()
    r = by_key(run_checks(model, batch, only="routing"))["routing"]
    layer = r.data["layers"][f"model.layers.{zoo.DEAD_LAYER}.mlp"]
    assert layer["dead"] == [zoo.DEAD_EXPERT]
    assert layer["counts"][zoo.DEAD_EXPERT] == 0
    assert sum(layer["counts"]) == layer["tokens"] * layer["top_k"]


def test_nan_layer_is_located():
    model, batch = zoo.nan_layer()
    results = by_key(run_checks(model, batch))
    assert results["nonfinite"].module == zoo.NAN_MODULE
    assert "NaNRMSNorm" in results["nonfinite"].evidence
    # inherent: NaN activations give NaN gradients; checks needing finite logits skip
    assert results["grad-flow"].status == "fail" and "non-finite" in results["grad-flow"].evidence
    assert results["init-loss"].status == "skip" and results["causality"].status == "skip"


def test_untied_head_keeps_equal_values_but_separate_storage():
    model, batch = zoo.untied_by_assign()
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    r = by_key(run_checks(model, batch, only="tied"))["tied"]
    assert r.data["equal_values"] is True and r.data["same_parameter"] is False
    assert r.data["unique_parameters"] == sum(1 for _ in model.parameters())


def test_overfit_passes_for_minillm_and_fails_when_the_body_is_frozen():
    opts = DoctorOptions(overfit_steps=80)
    for variant, expect in (("correct", "pass"), ("frozen_body", "fail")):
        model, batch = zoo.BUILDERS[variant]()
        ids = batch["input_ids"][:1, :24]
        before = {k: v.clone() for k, v in model.state_dict().items()}
        r = by_key(run_checks(model, {"input_ids": ids, "labels": ids}, overfit=True,
                              only="overfit", options=opts))["overfit"]
        assert r.status == expect, r.evidence
        # trained a copy: the model given is untouched
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k
    # the frozen body's other checks do not fail: frozen tensors are not "broken"
    model, batch = zoo.frozen_body()
    failing = {r.key for r in run_checks(model, batch) if r.failed}
    assert failing == set()


# -- other models ------------------------------------------------------------------------------
@pytest.mark.parametrize("changes,not_applicable", [
    (dict(num_local_experts=0), {"routing"}),                     # dense
    (dict(position_embedding="learned"), {"rope"}),               # no RoPE
    (dict(num_key_value_heads=4), {"gqa"}),                       # MHA: no grouping to test
    (dict(num_key_value_heads=1), set()),                         # MQA
    (dict(tie_word_embeddings=False), set()),
    (dict(attn_implementation="eager"), set()),
])
def test_minillm_variants_pass_or_say_why_not(changes, not_applicable):
    model = zoo.tiny(**changes)
    results = run_checks(model, zoo.batch_for(model))
    got = {r.key: r.status for r in results if r.key != "overfit"}
    # packing: minillm's forward takes no position_ids
    assert {k for k, s in got.items() if s == "n/a"} == not_applicable | {"packing"}, got
    assert all(s in ("pass", "n/a") for s in got.values()), got
    assert all(r.evidence for r in results if r.status == "n/a")


transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def _hf(kind: str, tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    if kind == "mixtral":
        cfg = MixtralConfig(**SMALL, num_hidden_layers=2, num_local_experts=4,
                            num_experts_per_tok=2, tie_word_embeddings=tie)
        return MixtralForCausalLM(cfg)
    return LlamaForCausalLM(LlamaConfig(**SMALL, num_hidden_layers=2, tie_word_embeddings=tie))


@pytest.mark.parametrize("kind,tie", [("mixtral", False), ("llama", True)])
def test_hf_models_have_no_failure(kind, tie):
    model = _hf(kind, tie)
    ids = torch.randint(0, 97, (2, 32))
    results = by_key(run_checks(model, {"input_ids": ids, "labels": ids}))
    assert not any(r.failed for r in results.values()), {
        k: r.evidence for k, r in results.items() if r.failed}
    assert results["gqa"].status == "pass" and results["causality"].status == "pass"
    assert results["routing"].status == ("pass" if kind == "mixtral" else "n/a")
    # HF computes RoPE on the fly and accepts inputs past max_position_embeddings by design:
    # nothing to warn about; relative positions measured over all 64 positions
    assert results["rope"].status == "pass" and results["rope"].data["tested_length"] == 64
    assert "accepted" not in results["rope"].evidence
    assert not any(r.status == "warn" for r in results.values()), {
        k: r.evidence for k, r in results.items() if r.status == "warn"}
    assert results["tied"].data["same_parameter"] is tie
    if kind == "mixtral":
        assert "aux_loss reaches all 2 router" in results["grad-flow"].evidence


def test_hf_mixtral_routing_counts_match_its_own_router():
    model = _hf("mixtral", False).eval()
    ids = torch.randint(0, 97, (2, 32))
    r = by_key(run_checks(model, ids, only="routing",
                          options=DoctorOptions(routing_batches=1)))["routing"]
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    for i, logits in enumerate(out.router_logits):
        top = torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1).indices
        expect = torch.bincount(top.reshape(-1), minlength=4).tolist()
        assert r.data["layers"][f"model.layers.{i}.mlp"]["counts"] == expect


# -- isolation, state, records -----------------------------------------------------------------
def test_a_crashing_check_is_reported_and_the_others_run(monkeypatch):
    def boom(target, options):
        raise RuntimeError("kaputt\nsecond line")

    patched = [Check(2, "causality", "Causality", boom) if c.key == "causality" else c
               for c in CHECKS]
    monkeypatch.setattr("hooks.doctor.model.runner.CHECKS", patched)
    model, batch = zoo.correct()
    results = by_key(run_checks(model, batch, only="1,2,8"))
    assert results["causality"].status == "error"
    assert results["causality"].evidence == "RuntimeError: kaputt second line"
    assert results["init-loss"].status == "pass" and results["tied"].status == "pass"


class _Refuses(torch.nn.Module):
    """Raises inside its forward for batches of more than 2 rows (a user's limit)."""

    def forward(self, x):
        if x.shape[0] > 2:
            raise ValueError(f"a batch of {x.shape[0]} rows is too large")
        return x


def test_an_exception_raised_by_the_model_is_a_skip_naming_the_module():
    model, batch = zoo.correct()
    mlp = model.model.layers[1].mlp
    mlp.add_module("limit", _Refuses())
    inner = mlp.forward
    mlp.forward = lambda x, *a, **k: inner(mlp.limit(x), *a, **k)
    results = by_key(run_checks(model, batch, only="init-loss,tied"))
    r = results["init-loss"]  # runs 4 rows of random tokens
    assert r.status == "skip", r.evidence
    assert "the model raised ValueError: a batch of 4 rows is too large" in r.evidence
    assert "inside model.layers.1.mlp.limit (_Refuses)" in r.evidence
    assert results["tied"].status == "pass"


def test_an_exception_in_mdb_code_is_an_error(monkeypatch):
    from hooks.doctor.model.target import fmt

    monkeypatch.setattr(Target, "vocab_size", property(lambda self: fmt("not a number")))
    model, batch = zoo.correct()
    r = by_key(run_checks(model, batch, only="causality"))["causality"]
    assert r.status == "error", r.evidence
    assert r.evidence.startswith("ValueError: could not convert string to float")
    assert "a bug in mdb" in r.hint


def test_run_checks_leaves_weights_grads_and_modes_as_they_were():
    model, batch = zoo.correct()
    model.train()
    model.model.layers[0].eval()
    marker = torch.full_like(model.model.norm.weight, 3.0)
    model.model.norm.weight.grad = marker.clone()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = {n: m.training for n, m in model.named_modules()}
    run_checks(model, batch)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert torch.equal(model.model.norm.weight.grad, marker)
    assert all(p.grad is None for n, p in model.named_parameters() if n != "model.norm.weight")
    assert not any(m.return_attn_weights for m in model.modules()
                   if hasattr(m, "return_attn_weights"))


def test_results_are_strict_json_and_round_trip():
    model, batch = zoo.nan_layer()
    results = run_checks(model, batch)
    text = json.dumps([r.to_dict() for r in results], allow_nan=False)
    back = [CheckResult.from_dict(d) for d in json.loads(text)]
    assert [(r.id, r.status, r.module, r.evidence) for r in back] == [
        (r.id, r.status, r.module, r.evidence) for r in results]
    with pytest.raises(ValueError, match="status must be one of"):
        CheckResult(1, "x", "x", "maybe", "")


def test_a_model_without_token_ids_is_not_a_sequence_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    results = by_key(run_checks(model, torch.randn(3, 4)))
    for key in ("init-loss", "causality", "rope", "gqa", "routing", "tied", "numerics"):
        assert results[key].status == "n/a", key
    assert "not a sequence model" in results["causality"].evidence
    assert results["grad-flow"].status == "pass"   # the output's mean is differentiated
    assert "the model returned no loss" in results["grad-flow"].evidence  # and it says so
    assert results["nonfinite"].status == "pass"
    assert not any(r.status == "error" for r in results.values()), {
        k: r.evidence for k, r in results.items() if r.status == "error"}


def test_target_runs_other_ids_with_mask_positions_and_labels_rewritten():
    seen = {}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(11, 3)
            self.head = torch.nn.Linear(3, 11)

        def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None):
            seen.update(ids=input_ids, mask=attention_mask, pos=position_ids, labels=labels)
            return SimpleNamespace(logits=self.head(self.emb(input_ids)))

    ids = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.zeros(2, 5, dtype=torch.long)
    t = Target.from_any(Model(), {"input_ids": ids, "attention_mask": mask,
                                  "position_ids": torch.arange(5).expand(2, 5), "labels": ids})
    new = torch.ones(1, 3, dtype=torch.long)
    t.run(t.batch_with(ids=new))
    assert torch.equal(seen["ids"], new) and torch.equal(seen["labels"], new)
    assert torch.equal(seen["pos"], torch.arange(3).expand(1, 3))
    assert torch.equal(seen["mask"], torch.ones(1, 3, dtype=torch.long))
    t.run(t.batch_with(ids=new, targets="drop"))
    assert seen["labels"] is None
    assert t.vocab_size == 11  # no config: the logits' last dimension
    assert t.kind.kind == "decoder" and t.kind.source == "targets"


# -- helpers vs independent references ---------------------------------------------------------
def _causal_softmax(scores_HTT):
    t = scores_HTT.shape[-1]
    keep = torch.ones(t, t, dtype=torch.bool).tril()
    return torch.softmax(scores_HTT.masked_fill(~keep, float("-inf")), dim=-1)


def test_relative_position_violation_zero_for_toeplitz_scores():
    g = torch.Generator().manual_seed(0)
    t = 40
    f = torch.randn(2, 2 * t, generator=g, dtype=torch.float64)  # score = f[h, i - j + t]
    i = torch.arange(t)
    scores = f[:, (i[:, None] - i[None, :] + t)]                  # (H, T, T), depends on i-j
    viol, signal, compared = relative_position_violation(_causal_softmax(scores), 8)
    assert viol < 1e-9 and signal > 0.1
    assert compared == 2 * sum(t - d for d in range(1, 9))
    absolute = scores + 0.5 * torch.randn(2, t, 1, generator=g, dtype=torch.float64) \
        * i[None, None, :].double() / t                           # key-position dependent
    viol2, _, _ = relative_position_violation(_causal_softmax(absolute), 8)
    assert viol2 > 1e-2


def test_routing_stats_against_bincount_and_categorical_entropy():
    g = torch.Generator().manual_seed(0)
    recs = []
    for _ in range(3):
        logits = torch.randn(50, 6, generator=g)
        probs = torch.softmax(logits, -1)
        ids = torch.topk(probs, 2, dim=-1).indices
        recs.append(SimpleNamespace(module="blk", num_experts=6, top_k=2, router_probs=probs,
                                    top_k_ids=ids))
    s = routing_stats(recs)["blk"]
    all_ids = torch.cat([r.top_k_ids for r in recs])
    assert s["counts"] == torch.bincount(all_ids.reshape(-1), minlength=6).tolist()
    all_p = torch.cat([r.router_probs for r in recs])
    ent = torch.distributions.Categorical(probs=all_p).entropy().mean() / math.log(6)
    assert s["entropy"] == pytest.approx(float(ent), rel=1e-5)
    assert s["tokens"] == 150


def test_a_wrapped_model_without_config_is_checked_without_false_failures():
    model, batch = zoo.correct()

    class Wrapper(torch.nn.Module):  # a user's model: no .config, own forward signature
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, labels=None):
            return self.inner(input_ids, labels=labels)

    results = by_key(run_checks(Wrapper(model), batch))
    assert not any(r.failed or r.status == "warn" for r in results.values()), {
        k: r.evidence for k, r in results.items() if r.status != "pass"}
    assert "no max_position_embeddings" in results["rope"].evidence
    assert results["causality"].data["kind"] == "decoder"  # labels == input_ids say so
    assert results["gqa"].module == "inner.model.layers.0.self_attn"


def test_routing_says_which_tokens_and_the_experts_idle_on_the_models_own_batch():
    """Issue 35: the routing row did not say its tokens were random, and passed "no dead
    experts" while the step's own batch left experts without a token. One repeated token: every
    position of layer 0 feeds its router the same vector (attention over equal values returns
    that value), so the own batch reaches only top_k of its experts; random tokens reach all."""
    model = zoo.tiny()
    ids = torch.full((2, zoo.SEQ), 7)
    r = by_key(run_checks(model, {"input_ids": ids, "labels": ids}, only="routing"))["routing"]
    block = "model.layers.0.mlp"
    # the test's own routing of the own batch: layer 0's router logits, top-k, counted
    seen = {}
    mlp = model.model.layers[0].mlp
    handle = mlp.gate.register_forward_hook(lambda m, a, out: seen.setdefault("logits", out))
    with torch.no_grad():
        model.eval()
        model(ids)
    handle.remove()
    k, e = model.config.num_experts_per_tok, model.config.num_local_experts
    top = torch.topk(seen["logits"].float().softmax(-1), k, dim=-1).indices
    expect = torch.bincount(top.reshape(-1), minlength=e).tolist()
    assert r.data["own_batch"][block] == expect
    assert sorted(c > 0 for c in expect).count(False) == e - k  # idle experts exist
    assert r.status == "warn" and "got no token of the model's own batch" in r.evidence
    assert f"the model's own batch (2×{zoo.SEQ})" in r.evidence
    assert "random tokens" in r.evidence
