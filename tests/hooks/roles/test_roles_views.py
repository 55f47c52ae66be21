"""Every view reads the same roles: the doctor's GQA check on grouped KV heads under names of
their own (``to_query``/``to_key``/``to_value``/``mix``), its routing check on an MoE of one's own
(``scorer`` + ``ffns``, recorded from the block's own topk), the edit form's offers, and
``mdb diff --edit`` on the newcomer's model whose head edit failed before (issue 35)."""

from __future__ import annotations

from pathlib import Path

from hooks.doctor.model import run_checks
from hooks.engine.edits import edit_options
from tests.hooks.roles import own_models as om
from tui.cli import main

OWN = Path(om.__file__)


def _by_key(results):
    return {r.key: r for r in results}


def test_the_doctor_checks_gqa_on_kv_heads_it_found_by_tracing():
    model, ids = om.separate_qkv()
    res = _by_key(run_checks(model, ids, only=["gqa"]))["gqa"]
    assert res.status == "pass", res.evidence
    assert "to_key" in res.evidence and "H=4, Hkv=2" in res.evidence


def test_the_doctor_checks_the_routing_of_an_moe_of_ones_own():
    import torch

    model, ids = om.own_moe()
    scores = []
    h = model.blocks[0].mlp.scorer.register_forward_hook(lambda m, a, out: scores.append(out))
    with torch.no_grad():
        model(ids)
    h.remove()
    res = _by_key(run_checks(model, ids, only=["routing"]))["routing"]
    assert res.status == "pass" and "2 MoE layer(s)" in res.evidence, res.evidence
    # the load of the model's own batch: its scorer's top-2 by hand
    pick = torch.softmax(scores[0], dim=-1).topk(2, dim=-1).indices
    assert res.data["own_batch"]["blocks.0.mlp"] == torch.bincount(pick.reshape(-1),
                                                                   minlength=4).tolist()


def test_the_edit_form_offers_head_and_expert_edits_on_traced_roles():
    model, _ = om.own_moe()
    assert "zero blocks.0.attn head=0" in edit_options(model, "blocks.0.attn")
    assert "drop blocks.1.mlp expert=0" in edit_options(model, "blocks.1.mlp")
    assert not any("head=" in o for o in edit_options(model, "blocks.0.ln1"))


def test_mdb_diff_zeroes_a_head_of_the_newcomers_attn(capsys):
    assert main(["diff", "--model", f"{OWN}:newcomer", "--edit", "zero blocks.1.attn head=2",
                 "--json"]) == 0
    assert "blocks.1.attn" in capsys.readouterr().out


def test_routing_is_recorded_from_declared_experts_of_another_name():
    import torch

    import hooks

    model, ids = om.bank_moe()
    with torch.no_grad(), hooks.capture(model) as plain:
        model(ids)
    # no child named experts: found from what it computes (scorer's topk beside a 3-D bank)
    assert [r.module for r in plain.routing] == ["blocks.0.mlp", "blocks.1.mlp"]
    hooks.roles(model, router="blocks.*.mlp.scorer", experts="blocks.*.mlp.bank")
    scores = []
    h = model.blocks[1].mlp.scorer.register_forward_hook(lambda m, a, out: scores.append(out))
    with torch.no_grad(), hooks.capture(model) as trace:
        model(ids)
    h.remove()
    assert [r.module for r in trace.routing] == ["blocks.0.mlp", "blocks.1.mlp"]
    rec = trace.routing[1]
    p = torch.softmax(scores[0], dim=-1)  # the reference: the scorer's own logits, by hand
    w, pick = p.topk(2, dim=-1)
    assert torch.equal(rec.top_k_ids.sort(-1).values, pick.sort(-1).values)
    assert rec.router == "blocks.1.mlp.scorer"
    assert torch.allclose(rec.router_probs, p, rtol=1e-5, atol=1e-6)
    for a, b in zip(plain.routing, trace.routing, strict=True):  # declared or found: the same
        assert (a.router, a.source) == (b.router, b.source) == (b.router, "experts")
        assert torch.equal(a.top_k_ids, b.top_k_ids)
        assert torch.equal(a.top_k_weights, b.top_k_weights)
