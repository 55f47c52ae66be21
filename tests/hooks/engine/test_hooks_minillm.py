"""hooks.capture on minillm: hand-counted records, routing and attention probes, NaN origin."""

from __future__ import annotations

import collections

import pytest
import torch

import hooks
from minillm import MiniLLM, load_preset


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = load_preset("tiny")
    model = MiniLLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    return cfg, model, ids


def experts_used(router_logits_NE: torch.Tensor, k: int) -> set[int]:
    """Experts that received at least one token: top-k of the logits (independent of hooks)."""
    return set(torch.topk(router_logits_NE, k, dim=-1).indices.reshape(-1).tolist())


def test_one_record_per_call_of_every_module_matches_hand_count(tiny):
    cfg, model, ids = tiny
    with hooks.capture(model) as tr:
        out = model(ids, labels=ids)
        out.loss.backward()
    model.zero_grad(set_to_none=True)
    k = cfg.num_experts_per_tok
    used = [experts_used(logits, k) for logits in out.router_logits]
    # root, model, embed_tokens, rotary_emb, [per layer: layer, input_layernorm, self_attn,
    # q/k/v/o_proj, post_attention_layernorm, mlp, gate, and per expert that got tokens: the
    # expert + gate/up/down_proj], norm, lm_head
    expected = 4 + sum(10 + 4 * len(u) for u in used) + 2
    assert len(tr.forward) == expected
    counts = collections.Counter(r.module for r in tr.forward)
    assert set(counts.values()) == {1}  # every module is called once per forward
    for layer, u in enumerate(used):
        for e in range(cfg.num_local_experts):
            name = f"model.layers.{layer}.mlp.experts.{e}"
            assert (name in counts) == (e in u)
    assert [r.module for r in tr.forward[:4]] == [
        "",
        "model",
        "model.embed_tokens",
        "model.rotary_emb",
    ]
    assert tr.forward[-1].module == "lm_head"
    # a second forward inside the same capture doubles every count, with call_index 1
    with hooks.capture(model) as tr2:
        model(ids)
        model(ids)
    assert len(tr2.forward) == 2 * len([r for r in tr.forward])
    assert {r.call_index for r in tr2.forward if r.module == "lm_head"} == {0, 1}


def test_forward_stats_equal_the_models_tensors(tiny):
    cfg, model, ids = tiny
    with hooks.capture(model) as tr:
        out = model(ids)
    logits = out.logits.detach().double()
    st = tr.call("lm_head").outputs[0].stats
    assert st.mean == pytest.approx(logits.mean().item(), rel=1e-5)
    assert st.std == pytest.approx(logits.std().item(), rel=1e-5)
    assert st.abs_max == pytest.approx(logits.abs().max().item(), rel=1e-6)
    root = tr.call("")
    assert root.output("out.logits").stats == st  # the same tensor, summarised once
    assert tr.modules[0].module_type == "MiniLLM"
    assert tr.modules[0].total_params == model.num_parameters()


def test_backward_records_equal_autograd_grads(tiny):
    cfg, model, ids = tiny
    acts = {}

    def keep(name):
        def hook(m, a, o):
            t = o[0] if isinstance(o, tuple) else o
            t.retain_grad()
            acts[name] = t

        return hook

    names = ["model.norm", "model.layers.1.mlp", "model.layers.0.self_attn.q_proj"]
    handles = [model.get_submodule(n).register_forward_hook(keep(n)) for n in names]
    with hooks.capture(model) as tr:
        model(ids, labels=ids).loss.backward()
    for h in handles:
        h.remove()
    for n in names:
        recs = [g for g in tr.grads(n) if g.output in ("out", "out[0]")]
        assert len(recs) == 1, n
        ref = acts[n].grad.double()
        assert recs[0].stats.l2 == pytest.approx(torch.linalg.vector_norm(ref).item(), rel=1e-5)
        assert recs[0].stats.max == pytest.approx(ref.max().item(), rel=1e-5)
    # every parameter of the (MoE, tied) model has a gradient record
    assert set(tr.params) == {n for n, _ in model.named_parameters()}
    p = tr.params["model.layers.0.mlp.gate.weight"]
    g = model.get_submodule("model.layers.0.mlp.gate").weight.grad
    assert p.status == "ok" and p.grad_norm == pytest.approx(g.norm().item(), rel=1e-5)
    model.zero_grad(set_to_none=True)


def test_routing_probe_equals_recomputation_from_captured_router_logits(tiny):
    cfg, model, ids = tiny
    with hooks.capture(model, keep_bytes=1 << 22) as tr:
        out = model(ids, labels=ids)
    assert [r.module for r in tr.routing] == [
        f"model.layers.{i}.mlp" for i in range(cfg.num_hidden_layers)
    ]
    for i, r in enumerate(tr.routing):
        gate_out = tr.call(f"model.layers.{i}.mlp.gate").outputs[0]
        logits = tr.tensors[gate_out.kept].double()  # the router logits as captured
        torch.testing.assert_close(logits, out.router_logits[i].detach().double())
        probs = torch.softmax(logits, dim=-1)
        top_w, top_i = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        n, e = logits.shape
        assert r.top_k_ids.shape == (n, cfg.num_experts_per_tok)
        assert torch.equal(r.top_k_ids, top_i)
        torch.testing.assert_close(r.top_k_weights.double(), top_w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r.router_probs.double(), probs, rtol=1e-5, atol=1e-6)
        counts = torch.bincount(top_i.reshape(-1), minlength=e)
        assert r.tokens_per_expert.tolist() == counts.tolist()
        assert int(r.tokens_per_expert.sum()) == n * cfg.num_experts_per_tok
        # Switch loss per layer: E * sum_e f_e P_e, f_e = count_e / (N k)
        aux = e * (counts.double() / (n * cfg.num_experts_per_tok) * probs.mean(0)).sum()
        assert r.aux_loss == pytest.approx(aux.item(), rel=1e-5)
        assert (r.layer, r.router, r.num_experts, r.top_k) == (
            i,
            f"model.layers.{i}.mlp.gate",
            e,
            2,
        )
    # the model's aux loss is coef * the sum over layers
    total = cfg.router_aux_loss_coef * sum(r.aux_loss for r in tr.routing)
    assert total == pytest.approx(out.aux_loss.item(), rel=1e-5)
    assert [r.aux_loss for r in tr.routing] == pytest.approx(out.aux_losses.tolist(), rel=1e-5)


def test_dense_model_has_no_routing():
    torch.manual_seed(0)
    model = MiniLLM(load_preset("tiny", num_local_experts=0))
    with hooks.capture(model) as tr:
        model(torch.randint(0, 256, (1, 8)))
    assert tr.routing == []
    assert any(r.module_type == "MiniLLMMLP" for r in tr.forward)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_attention_probs_only_when_requested_and_path_unchanged(tiny, impl):
    cfg, model, ids = tiny
    for layer in model.model.layers:
        layer.self_attn.attn_implementation = impl
    with hooks.capture(model) as tr:
        ref_logits = model(ids).logits
    assert tr.attention == []
    assert all(not layer.self_attn.return_attn_weights for layer in model.model.layers)
    with hooks.capture(model, attention=["model.layers.1.*"]) as tr:
        logits = model(ids).logits
    assert [a.module for a in tr.attention] == ["model.layers.1.self_attn"]
    assert all(not layer.self_attn.return_attn_weights for layer in model.model.layers)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)  # the model's own path ran
    (a,) = tr.attention
    b, t = ids.shape
    assert a.probs.shape == (b, cfg.num_attention_heads, t, t)
    assert a.source == {"sdpa": "sdpa", "eager": "softmax"}[impl]
    torch.testing.assert_close(a.probs.sum(-1), torch.ones(b, cfg.num_attention_heads, t))
    assert torch.all(a.probs.triu(diagonal=1) == 0)  # causal
    # independent reference: the model's own output_attentions
    ref = model(ids, output_attentions=True).attentions[1]
    torch.testing.assert_close(a.probs, ref.detach().float())


def test_nan_in_one_experts_weight_located_at_that_experts_first_call(tiny):
    cfg, model, ids = tiny
    with torch.no_grad():
        out = model(ids)
    layer = 1
    expert = sorted(experts_used(out.router_logits[layer], cfg.num_experts_per_tok))[-1]
    w = model.get_submodule(f"model.layers.{layer}.mlp.experts.{expert}.up_proj").weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w[3, 0] = float("nan")
        with hooks.capture(model) as tr:
            model(ids, labels=ids).loss.backward()
    finally:
        with torch.no_grad():
            w.copy_(saved)
        model.zero_grad(set_to_none=True)
    hit = tr.first_nonfinite()
    assert hit is not None
    assert hit.module == f"model.layers.{layer}.mlp.experts.{expert}.up_proj"
    assert hit.call_index == 0 and hit.module_type == "Linear"
    assert hit.stats.nan_count > 0
    # everything before it (in completion order) was finite
    before = [r for r in tr.forward if r.end_order < tr.forward[hit.index].end_order]
    assert all(t.stats.finite for r in before for t in r.outputs)
    assert tr.first_nonfinite("backward") is not None


def test_default_config_trace_is_small(tmp_path):
    torch.manual_seed(0)
    cfg = load_preset("default")
    model = MiniLLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4, 128))
    with hooks.capture(model) as tr:
        model(ids, labels=ids).loss.backward()
    path = tr.save(tmp_path / "t.mdbtrace")
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 5_000_000, size
    assert len(tr.routing) == cfg.num_hidden_layers
