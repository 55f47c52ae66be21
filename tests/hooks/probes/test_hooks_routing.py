"""Routing read from what each MoE block hands its experts, on the MoE families of the zoo.

References, all independent of mdb's code: the arguments the experts module received (the
test's own forward pre-hook), the logits the router returned (the test's own forward hook), the
config's rule (``norm_topk_prob``, ``routed_scaling_factor``, ``n_group``/``topk_group``) and
HF's ``load_balancing_loss_func``.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import hooks
from tests.families import FAMILIES

pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "granite_moe"]


def build(name):
    return hooks.from_factory(FAMILIES[name].build())


def spy_experts(model):
    """Per MoE block, the (ids, weights) its experts module received and the router's logits."""
    got: dict[str, list] = {}
    logits: dict[str, list] = {}
    handles = []
    for name, m in model.named_modules():
        experts = getattr(m, "experts", None)
        if not isinstance(experts, nn.Module) or isinstance(experts, nn.ModuleList):
            continue

        def pre(mod, args, name=name):
            got.setdefault(name, []).append((args[1].detach().clone(), args[2].detach().clone()))

        handles.append(experts.register_forward_pre_hook(pre))
        router_name = "gate" if hasattr(m, "gate") else "router"

        def post(mod, args, out, name=name):
            logits.setdefault(name, []).append(out[0].detach().clone())

        handles.append(getattr(m, router_name).register_forward_hook(post))
    return got, logits, handles


def run(name, **kw):
    model, batch, loss_fn = build(name)
    got, logits, handles = spy_experts(model)
    try:
        with hooks.capture(model, **kw) as tr:
            out = batch.call(model)
            hooks.select_loss(out, loss_fn, batch).loss.backward()
    finally:
        for h in handles:
            h.remove()
    return model, tr, got, logits


@pytest.mark.parametrize("family", MOE)
def test_recorded_ids_and_weights_are_the_experts_arguments(family):
    model, tr, got, logits = run(family)
    assert got, "the test's own spy saw no experts call"
    assert sorted({r.module for r in tr.routing}) == sorted(got)
    assert not [n for n in tr.notes if n.kind == "routing"]
    for r in tr.routing:
        ids, weights = got[r.module][r.call_index]
        assert r.source == "experts"
        assert torch.equal(r.top_k_ids, ids.long())
        assert torch.equal(r.top_k_weights, weights.float())
        assert r.top_k == ids.shape[1] and r.top_k_ids.shape[0] == 2 * 16
        e = r.num_experts
        assert r.tokens_per_expert.tolist() == torch.bincount(ids.reshape(-1), minlength=e).tolist()
        # the router's own logits, as it returned them
        assert r.router.rpartition(".")[2] in ("gate", "router")
        torch.testing.assert_close(r.router_logits, logits[r.module][r.call_index].float(),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss",
                                    "granite_moe"])
def test_softmax_routers_get_probs_and_hf_aux_loss(family):
    model, tr, got, logits = run(family)
    cfg = model.config
    expect_norm = getattr(cfg, "norm_topk_prob", True)
    for r in tr.routing:
        lg = logits[r.module][r.call_index]
        assert r.scoring == "softmax" and r.normalized is expect_norm and r.scale is None
        assert not r.score_bias and r.groups is None
        torch.testing.assert_close(r.router_probs, torch.softmax(lg.float(), dim=-1))
        hf_one = load_balancing_loss_func((lg,), r.num_experts, r.top_k)
        assert r.aux_loss * r.top_k == pytest.approx(hf_one.item(), rel=1e-5)
        assert r.aux_loss_reason() == ""
    # the renormalised rule is the softmax over the k chosen logits: said in the text
    if expect_norm:
        assert "softmax over the k chosen logits" in tr.routing[0].rule_text()


def test_deepseek_v3_sigmoid_bias_groups_scale_no_aux_loss():
    model, batch, loss_fn = build("deepseek_v3")
    cfg = model.config
    # a bias that changes the choice, so that "+ bias" is tested, not assumed
    gate = model.get_submodule("model.layers.1.mlp.gate")
    gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, cfg.n_routed_experts))
    got, logits, handles = spy_experts(model)
    with hooks.capture(model) as tr:
        hooks.select_loss(batch.call(model), loss_fn, batch).loss.backward()
    for h in handles:
        h.remove()
    (r,) = tr.routing  # layer 0 is dense (first_k_dense_replace=1)
    ids, weights = got["model.layers.1.mlp"][0]
    assert r.module == "model.layers.1.mlp" and r.router == "model.layers.1.mlp.gate"
    assert torch.equal(r.top_k_ids, ids) and torch.equal(r.top_k_weights, weights.float())
    assert r.scoring == "sigmoid" and r.score_bias
    assert r.groups == [cfg.n_group, cfg.topk_group] and r.group_score == "top2_sum"
    assert r.normalized is cfg.norm_topk_prob
    assert r.scale == pytest.approx(cfg.routed_scaling_factor)
    assert r.router_probs is None and r.aux_loss is None
    assert "sigmoid" in r.aux_loss_reason()
    torch.testing.assert_close(r.router_scores, torch.sigmoid(logits["model.layers.1.mlp"][0]))
    # the chosen experts lie in topk_group groups of the n_group groups
    per = cfg.n_routed_experts // cfg.n_group
    assert all(len(set((row // per).tolist())) <= cfg.topk_group for row in r.top_k_ids)
    assert r.rule_text() == ("sigmoid per expert + bias on the choice, group-limited top-2 "
                             "(1 of 2 groups), renormalised, ×2.5")


class Experts(nn.Module):
    """Fused experts called as ``experts(hidden, top_k_index, top_k_weights)`` (HF v5)."""

    def __init__(self, e, d):
        super().__init__()
        self.num_experts = e
        self.w = nn.Parameter(torch.randn(e, d, d) * 0.1)

    def forward(self, x, ids, weights):
        y = torch.einsum("nd,nkde->nke", x, self.w[ids])
        return (y * weights[..., None]).sum(1)


class OddBlock(nn.Module):
    """Top-2 by logit, but equal weights 1/2: no softmax or sigmoid rule reproduces them."""

    def __init__(self, e=4, d=8):
        super().__init__()
        self.gate = nn.Linear(d, e, bias=False)
        self.experts = Experts(e, d)

    def forward(self, x):
        x = x.reshape(-1, x.shape[-1])
        ids = self.gate(x).topk(2, dim=-1).indices
        return self.experts(x, ids, torch.full(ids.shape, 0.5))


class TupleGate(nn.Linear):
    """A router returning ``(logits, top-2 ids)``: the block passes those very ids on."""

    def forward(self, x):
        logits = super().forward(x)
        return logits, logits.topk(2, dim=-1).indices


class OwnedOddBlock(OddBlock):
    def __init__(self, e=4, d=8):
        super().__init__(e, d)
        self.gate = TupleGate(d, e, bias=False)

    def forward(self, x):
        x = x.reshape(-1, x.shape[-1])
        logits, ids = self.gate(x)
        return self.experts(x, ids, torch.full(ids.shape, 0.5))


class OneHotBlock(OddBlock):
    """NLLB-style: the experts get a one-hot (N, E) mask and (N, E) probabilities."""

    def forward(self, x):
        x = x.reshape(-1, x.shape[-1])
        probs = self.gate(x).softmax(-1)
        mask = torch.nn.functional.one_hot(probs.argmax(-1), 4)
        return self.experts(x, mask, probs)


class ListBlock(nn.Module):
    """Experts in an nn.ModuleList, called one by one; returns only y: nothing to read."""

    def __init__(self, e=4, d=8):
        super().__init__()
        self.gate = nn.Linear(d, e, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(e))

    def forward(self, x):
        w = self.gate(x).softmax(-1)
        return sum(w[..., i:i + 1] * ex(x) for i, ex in enumerate(self.experts))


def test_unknown_rule_keeps_ids_and_weights_but_shows_no_probs_or_aux():
    torch.manual_seed(0)
    block = OddBlock()
    x = torch.randn(6, 8)
    with hooks.capture(block) as tr:
        block(x)
    (r,) = tr.routing
    assert r.scoring == "unknown" and r.router_probs is None and r.aux_loss is None
    assert torch.equal(r.top_k_ids, block.gate(x).topk(2, dim=-1).indices)
    assert torch.all(r.top_k_weights == 0.5)
    # the gate's (N, E) output reproduces nothing, so it is not claimed as the router's logits
    assert r.router == "" and r.router_logits is None and "not identified" in r.note
    # a gate that returned the very ids the experts got is the router, rule or no rule
    owned = OwnedOddBlock()
    with hooks.capture(owned) as tr:
        owned(x)
    (r,) = tr.routing
    assert r.router == "gate" and r.scoring == "unknown" and "no known rule" in r.note
    torch.testing.assert_close(r.router_logits, owned.gate(x)[0], rtol=0, atol=0)
    assert r.aux_loss_reason() == "the router's rule is unknown"


def test_blocks_that_cannot_be_read_are_named_in_a_note():
    torch.manual_seed(0)
    model = nn.Sequential(OneHotBlock(), ListBlock())
    with hooks.capture(model) as tr:
        model(torch.randn(6, 8))
    assert tr.routing == []
    notes = {n.module: n.message for n in tr.notes if n.kind == "routing"}
    assert set(notes) == {"0", "1"}
    assert "OneHotBlock" in notes["0"] and "repeats ids within a token" in notes["0"]
    assert "ModuleList" in notes["1"] and "hooks.register_probe" in notes["1"]


def test_a_user_probe_for_its_own_block_still_runs():
    class MyProbe(hooks.Probe):
        name = "mine"

        def on_forward(self, ctx, name, call_index, module, args, kwargs, output):
            ctx.add_extra(hooks.ProbeRecord("mine", name, call_index, {"n": len(module.experts)}))

    probe = hooks.register_probe(ListBlock, MyProbe())
    try:
        block = ListBlock()
        with hooks.capture(block) as tr:
            block(torch.randn(3, 8))
    finally:
        hooks.unregister_probe(probe)
    assert [(e.probe, e.values) for e in tr.extras] == [("mine", {"n": 4})]


def test_routing_round_trips_and_old_traces_load(tmp_path):
    _, tr, _, _ = run("deepseek_v3")
    back = hooks.Trace.load(tr.save(tmp_path / "t.mdbtrace"))
    (a,), (b,) = tr.routing, back.routing
    for f in ("module", "router", "scoring", "normalized", "scale", "score_bias", "groups",
              "group_score", "aux_loss", "source", "note"):
        assert getattr(a, f) == getattr(b, f), f
    assert b.router_probs is None
    for f in ("top_k_ids", "top_k_weights", "router_logits", "router_scores"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    # a trace of an older mdb: no rule fields, router_probs always present
    _, old, _, _ = run("mixtral")
    d = tmp_path / "old.mdbtrace"
    old.save(d)
    data = json.loads((d / "trace.json").read_text())
    for r in data["routing"]:
        for f in ("source", "scoring", "normalized", "scale", "score_bias", "groups",
                  "group_score", "note"):
            del r[f]
    (d / "trace.json").write_text(json.dumps(data))
    loaded = hooks.Trace.load(d)
    r = loaded.routing[0]
    assert (r.scoring, r.normalized, r.source) == ("softmax", True, "recomputed")
    assert r.aux_loss == pytest.approx(old.routing[0].aux_loss)
    assert torch.equal(r.router_probs, old.routing[0].router_probs)


def test_minillm_block_is_recomputed_once_and_noted_nowhere():
    from minillm import MiniLLM, load_preset

    cfg = load_preset("tiny")
    torch.manual_seed(0)
    model = MiniLLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    with hooks.capture(model) as tr:
        out = model(ids, labels=ids)
    assert len(tr.routing) == cfg.num_hidden_layers
    assert all(r.source == "recomputed" and r.scoring == "softmax" for r in tr.routing)
    assert not [n for n in tr.notes if n.kind == "routing"]
    assert [r.aux_loss for r in tr.routing] == pytest.approx(out.aux_losses.tolist(), rel=1e-5)
