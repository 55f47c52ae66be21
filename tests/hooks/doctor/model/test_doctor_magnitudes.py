"""Issue 34, families 2 (magnitudes) and 3 (gradient paths): each check against a buggy model of
``tests/magnitude_models.py`` beside the same code fixed, expected values computed here with
plain torch."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from hooks.doctor.model import Target, run_checks
from hooks.doctor.model.param_roles import param_roles
from tests import magnitude_models as mm
from tests import zoo
from tests.models import batch_for, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def one(model, batch, key):
    (r,) = run_checks(model, batch, only=key)
    assert r.key == key
    return r


# -- roles -------------------------------------------------------------------------------------
def test_param_roles_read_llama2c_names():
    model, batch = mm.llama2c()
    roles = {r.name: r.role for r in param_roles(Target(model, batch))}
    assert roles["tok_embeddings.weight"] == "embedding"  # tied: the embedding registers it first
    assert [roles[f"layers.1.attention.{n}.weight"] for n in ("wq", "wk", "wv", "wo")] == [
        "q", "k", "v", "attn_out"]
    assert [roles[f"layers.1.feed_forward.{n}.weight"] for n in ("w1", "w3", "w2")] == [
        "mlp_in", "mlp_in", "mlp_out"]
    assert roles["layers.0.ffn_norm.weight"] == roles["norm.weight"] == "norm"


# -- init report -------------------------------------------------------------------------------
def test_init_report_names_llama2c_579_scaling_w3_instead_of_w2():
    bug = one(*mm.llama2c(scaled=("w3", "wo")), "init")
    assert bug.status == "fail" and bug.module == "layers.0.feed_forward.w3"
    assert "w3.weight (mlp_in" in bug.evidence and "w2.weight (mlp_out)" in bug.evidence
    assert "llama2.c #579" in bug.hint
    model, batch = mm.llama2c(scaled=("w3", "wo"))
    w3 = model.layers[0].feed_forward.w3.weight
    std = float(w3.detach().std())
    assert bug.data["weights"]["layers.0.feed_forward.w3.weight"][1] == pytest.approx(std, rel=1e-5)
    assert std == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.05)  # what llama2.c wrote
    fixed = one(*mm.llama2c(), "init")
    assert fixed.status == "pass", fixed.evidence
    assert fixed.data["roles"]["mlp_out"]["median_std"] == pytest.approx(0.02 / math.sqrt(8),
                                                                          rel=0.05)


def test_init_report_sets_each_role_against_the_declared_range():
    model, batch = tiny(), None
    batch = batch_for(model)
    ok = one(model, batch, "init")
    assert ok.status == "pass" and ok.data["initializer_range"] == 0.02
    q = torch.cat([layer.self_attn.q_proj.weight.detach().reshape(-1)
                   for layer in model.model.layers])
    assert ok.data["roles"]["q"]["median_std"] == pytest.approx(statistics.median(
        float(layer.self_attn.q_proj.weight.detach().std()) for layer in model.model.layers),
        rel=1e-5)
    assert float(q.std()) == pytest.approx(0.02, rel=0.1)
    # the residual stream's std after each block, as a forward hook of the test reads it
    seen = []
    hs = [layer.register_forward_hook(lambda m, a, o: seen.append(float(o[0].float().std())
                                                                   if isinstance(o, tuple)
                                                                   else float(o.float().std())))
          for layer in model.model.layers]
    with torch.no_grad():
        model(**batch)
    for h in hs:
        h.remove()
    assert [v for _, v in ok.data["residual_std"]] == pytest.approx(seen, rel=1e-5)
    bad = one(*zoo.std1_tied_init(), "init")  # nn.Embedding's N(0, 1) with a tied head
    assert bad.status == "fail" and bad.module == "model.embed_tokens"
    assert "×50" in bad.evidence or "×49" in bad.evidence or "×51" in bad.evidence


# -- check 1 knows a trained model -------------------------------------------------------------
def _trained(steps: int = 150):
    torch.manual_seed(0)
    model = tiny()
    batch = batch_for(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), batch


def test_init_loss_is_not_judged_on_a_trained_model_and_still_fails_a_broken_fresh_one():
    model, batch = _trained()
    with torch.no_grad():
        own = float(model(**batch).loss)
    assert own < 0.5 * math.log(model.config.vocab_size)  # it has learnt its batch
    r = one(model, batch, "init-loss")
    assert r.status == "n/a" and "trained" in r.evidence and "norm parameters moved" in r.evidence
    # the other direction: a fresh model with a too-wide init fails, trained-looking or not
    bad = one(*zoo.std1_tied_init(), "init-loss")
    assert bad.status == "fail"
    fresh = one(*zoo.correct(), "init-loss")
    assert fresh.status == "pass"


def test_init_report_of_a_trained_model_gives_no_verdict():
    model, batch = _trained(40)
    r = one(model, batch, "init")
    assert r.status == "pass" and r.evidence.startswith("trained model, init not judged")


# -- what the shapes promise -------------------------------------------------------------------
def test_shapes_names_a_qk_norm_taken_across_heads():
    bug = one(*mm.llama2c(qk_norm="across"), "shapes")
    assert bug.status == "fail" and bug.module == "layers.0.attention.k_norm"  # the first
    assert "per-head RMS" in bug.evidence
    # plain torch: per-head RMS of an across-heads RMSNorm of random (2, 3, H=4, Dh=16) values
    x = torch.randn(2, 3, 4, 16, generator=torch.Generator().manual_seed(0)) * torch.tensor(
        [0.5, 1.0, 2.0, 4.0])[:, None]
    y = mm.RMSNorm(16, across=True)(x)
    assert float((y.pow(2).mean(-1).sqrt() - 1).abs().max()) > 0.05  # what the check tests
    fixed = one(*mm.llama2c(qk_norm="head"), "shapes")
    assert fixed.status == "pass" and "per-head RMS within" in fixed.evidence


def test_shapes_counts_the_channels_rope_rotates_against_partial_rotary_factor():
    args = mm.ModelArgs(partial_rotary_factor=0.5)
    want = int(args.dim // args.n_heads * 0.5)
    bug = one(*mm.llama2c(a=args, rope_all=True), "shapes")
    assert bug.status == "fail" and bug.module == "rotary_emb"
    assert f"rotates {2 * want} channels" in bug.evidence and f"asks for {want}" in bug.evidence
    fixed = one(*mm.llama2c(a=args), "shapes")
    assert fixed.status == "pass" and f"rotates {want} of {2 * want}" in fixed.evidence


def test_shapes_router_rows_must_sum_to_one():
    bug = one(*mm.router_softmax(wrong=True), "shapes")
    assert bug.status == "fail" and bug.module == "model.layers.0.mlp"
    assert "must sum to 1" in bug.evidence and "dim=0" in bug.hint
    fixed = one(*mm.router_softmax(wrong=False), "shapes")
    assert fixed.status == "pass" and "rows sum to 1" in fixed.evidence


def test_shapes_aux_loss_must_not_be_negative():
    model, batch = mm.negative_aux(False)
    with torch.no_grad():
        aux = float(model.train()(**batch).aux_loss)
    assert aux > 0
    bug = one(*mm.negative_aux(True), "shapes")
    assert bug.status == "fail" and f"aux_loss = {-aux:.3g}" in bug.evidence
    assert one(*mm.negative_aux(False), "shapes").status == "pass"


# -- gradient per loss term --------------------------------------------------------------------
def _router_lm_relative(model, batch) -> float:
    """‖∂ce/∂router‖/‖router‖, by plain autograd."""
    gate = model.model.layers[0].mlp.gate.weight
    out = model.train()(**batch)
    (g,) = torch.autograd.grad(out.ce_loss, [gate])
    return float(g.norm() / gate.detach().norm())


def test_loss_terms_names_a_top1_router_the_lm_term_cannot_reach():
    model, batch = mm.top1_renormalised()
    rel = _router_lm_relative(model, batch)
    assert rel < 1e-6  # p / p = 1: the LM loss does not depend on the router
    bug = one(*mm.top1_renormalised(), "loss-terms")
    assert bug.status == "fail" and bug.module == "model.layers.0.mlp.gate"
    assert "top-1" in bug.evidence and "only the aux loss trains the router" in bug.evidence
    assert bug.data["router_lm"]["relative"] == pytest.approx(rel, rel=0.5, abs=1e-9)
    model, batch = mm.top1_switch()
    assert _router_lm_relative(model, batch) > 1e-4
    fixed = one(*mm.top1_switch(), "loss-terms")
    assert fixed.status == "pass", fixed.evidence
    assert fixed.data["terms"]["aux_loss"] == pytest.approx(
        float(model(**batch).aux_loss), rel=1e-5)


def test_an_aux_loss_switched_off_by_its_coefficient_is_not_detached():
    model, batch = mm.aux_coef_zero()
    gate = model.model.layers[0].mlp.gate.weight
    (g,) = torch.autograd.grad(model.train()(**batch).aux_loss, [gate])
    assert float(g.abs().max()) == 0  # coefficient 0: the aux term reaches nothing
    flow = one(*mm.aux_coef_zero(), "grad-flow")
    assert flow.status == "pass" and "router_aux_loss_coef = 0" in flow.evidence
    terms = one(*mm.aux_coef_zero(), "loss-terms")
    assert terms.status == "pass" and "off: router_aux_loss_coef = 0" in terms.evidence
    detached = one(*zoo.aux_detached(), "grad-flow")  # a real cut still fails
    assert detached.status == "fail"


# -- parameters meant to go without a gradient -------------------------------------------------
def test_a_declared_kv_sharing_layer_warns_and_an_undeclared_one_fails():
    ok = one(*mm.llama2c(kv_shared=True), "grad-flow")
    assert ok.status == "warn" and "is_kv_shared_layer = True" in ok.evidence
    assert {n for n, _ in ok.data["unused_by_design"]} == {
        "layers.3.attention.wk.weight", "layers.3.attention.wv.weight"}
    bug = one(*mm.llama2c(kv_shared=True, declare=False), "grad-flow")
    assert bug.status == "fail" and "never ran" in bug.evidence


# -- the user's own hooks ----------------------------------------------------------------------
def _with_grad_hook(model):
    model.tok_embeddings.weight.register_hook(lambda g: g.clamp(-1, 1))  # clip per tensor
    return model


def test_hooks_names_a_gradient_hook_that_fires_twice_under_reentrant_checkpointing():
    model, batch = mm.llama2c(checkpoint_head="reentrant")
    bug = one(_with_grad_hook(model), batch, "hooks")
    assert bug.status == "fail" and bug.module == "tok_embeddings"
    assert "arrives 2 times" in bug.evidence and "<lambda>" in bug.evidence
    assert "#81296" in bug.hint
    model, batch = mm.llama2c(checkpoint_head="non-reentrant")
    fixed = one(_with_grad_hook(model), batch, "hooks")
    assert fixed.status == "pass" and "1 with gradient hooks" in fixed.evidence


def _steer(module, args, out):
    return out + 1.0  # an activation-steering hook: it changes the block's output


def test_hooks_names_a_forward_hook_added_after_torch_compile():
    model, batch = mm.llama2c()
    compiled = torch.compile(model, backend="eager")
    before = compiled(*batch)[1]  # a training step's forward
    model.layers[1].register_forward_hook(_steer)  # after compile: the compiled code skips it
    assert torch.equal(compiled(*batch)[1], before)  # pytorch #117265, on this torch
    assert not torch.equal(model(*batch)[1], before)  # the eager forward runs it
    bug = one(compiled, batch, "hooks")
    assert bug.status == "fail" and bug.module == "layers.1" and "_steer" in bug.evidence
    torch._dynamo.reset()
    model, batch = mm.llama2c()
    model.layers[1].register_forward_hook(_steer)  # before compile: traced in
    fixed = one(torch.compile(model, backend="eager"), batch, "hooks")
    assert fixed.status == "pass" and "matches its eager forward" in fixed.evidence
    torch._dynamo.reset()


# -- each check alone, and the fixed models draw nothing -----------------------------------------
@pytest.mark.parametrize("factory", [mm.llama2c, mm.top1_switch, lambda: mm.router_softmax(False),
                                     lambda: mm.llama2c(qk_norm="head")])
def test_the_fixed_models_pass_every_new_check(factory):
    model, batch = factory()
    res = {r.key: r for r in run_checks(model, batch, only="init,shapes,loss-terms,hooks")}
    assert [k for k, r in res.items() if r.status in ("warn", "fail", "error")] == [], {
        k: r.evidence for k, r in res.items()}


@pytest.mark.parametrize("key", ["init", "shapes", "loss-terms", "hooks"])
def test_each_new_check_runs_alone_from_the_command_line(key, capsys, monkeypatch):
    import json

    from tui.cli import main

    monkeypatch.delenv("COLUMNS", raising=False)
    rc = main(["doctor", "--preset", "tiny", "--only", key, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and [r["key"] for r in doc["results"]] == [key]
    assert doc["results"][0]["status"] == "pass", doc["results"][0]["evidence"]


@pytest.mark.parametrize("bug", sorted(mm.PAIRS))
def test_each_bug_is_named_by_its_own_check_and_its_fix_draws_nothing(bug):
    buggy, fixed, must_fail, module = mm.PAIRS[bug]
    res = {r.key: r for r in run_checks(*buggy())}
    assert {k for k, r in res.items() if r.failed} == must_fail, {
        k: r.evidence for k, r in res.items() if r.status != "pass"}
    for key in must_fail:
        assert res[key].module == module and res[key].hint
    ok = {r.key: r for r in run_checks(*fixed())}
    bad = {k: r.evidence for k, r in ok.items() if r.status in ("fail", "error")
           or (r.status == "warn" and bug != "kv_sharing_undeclared")}
    assert bad == {}
    if bug == "kv_sharing_undeclared":  # the declared twin: a warning quoting the declaration
        assert ok["grad-flow"].status == "warn" and "is_kv_shared_layer" in ok["grad-flow"].evidence


def test_split_loss_scales_each_term_by_its_declared_coefficient():
    from types import SimpleNamespace

    from hooks.doctor.model.loss_terms import split_loss

    class Cfg:
        router_aux_loss_coef = 0.02
        router_z_loss_coef = 0.001

    model = torch.nn.Linear(2, 2)
    model.config = Cfg()
    lm, aux, z = torch.tensor(3.0), torch.tensor(1.5), torch.tensor(4.0)
    total = lm + 0.02 * aux + 0.001 * z  # how an HF MoE model sums them
    out = SimpleNamespace(loss=total, aux_loss=aux, z_loss=z)
    comps, how = split_loss(Target(model), out, total)
    assert float(comps["lm"]) == pytest.approx(3.0)
    assert float(comps["aux_loss"]) == pytest.approx(0.03)
    assert float(comps["z_loss"]) == pytest.approx(0.004)
    assert "router_aux_loss_coef" in how and "router_z_loss_coef" in how


def test_component_fit_reads_each_terms_factor_from_synthetic_gradients():
    from hooks.doctor.loop.components import component_accumulation_findings

    g = torch.Generator().manual_seed(0)
    k, p = 4, 50
    lm = [torch.randn(p, generator=g) for _ in range(k)]
    aux = [0.01 * torch.randn(p, generator=g) for _ in range(k)]
    tokens = [10, 10, 10, 10]
    per = [a + b for a, b in zip(lm, aux, strict=True)]  # replayed: LM mean + aux, scale 1
    parts = [(b, 1.0) for b in aux]
    summed_aux = sum(x / k for x in lm) + sum(aux)  # aux added whole on each micro-batch
    (f,) = component_accumulation_findings(1, summed_aux, per, parts, tokens)
    assert f["detail"]["lm_factor"] == pytest.approx(1.0, rel=1e-6)
    assert f["detail"]["aux_factor"] == pytest.approx(4.0, rel=1e-6)
    fine = sum(x / k for x in lm) + sum(x / k for x in aux)
    assert component_accumulation_findings(1, fine, per, parts, tokens) == []
