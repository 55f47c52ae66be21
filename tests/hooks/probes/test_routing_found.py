"""Routing of an MoE of one's own, found from what it computes (hooks.probes.routing_ops): a
router ``switch`` and experts ``ffns`` called one by one, its own softmax/topk in its forward,
get the routing records of the same weights under the names that already work (``gate`` +
``experts`` called with (hidden, ids, weights); minillm's block), checked against torch.topk on
the router's logits by hand; a captured step changes nothing the model computes (RNG, buffers,
parameters, bit-equal gradients); minillm's named blocks pay no watch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hooks
from hooks.tensors.walk import named_modules
from minillm.moe import MiniLLMMLP

D, E, K, V = 16, 4, 2, 50

#: rule -> (weights, ids) from (N, E) logits, the block's own computation
RULES = {
    # Mixtral: softmax over E in fp32, top-k, renormalised
    "mixtral": lambda lg: _renorm(*torch.softmax(lg.float(), dim=-1).topk(K, dim=-1)),
    # softmax over E, the top-k probabilities as they are (Switch, Qwen-MoE without norm)
    "raw": lambda lg: F.softmax(lg, dim=-1).topk(K, dim=-1),
    # top-k logits, then a softmax over those k (Mistral's reference MoE)
    "topk_softmax": lambda lg: _soft(*torch.topk(lg, K, dim=-1)),
    # sigmoid scores, top-k, renormalised, scaled (DeepSeek-V3 without bias or groups)
    "sigmoid": lambda lg: _scaled(*torch.sigmoid(lg).topk(K, dim=-1)),
}


def _renorm(w, ids):
    return w / w.sum(-1, keepdim=True), ids


def _soft(top, ids):
    return F.softmax(top, dim=-1), ids


def _scaled(w, ids):
    w = w / w.sum(-1, keepdim=True)
    return w * 2.5, ids


def dispatch(flat, w, ids, ffns):
    """Each expert on its tokens, weighted and added back per token."""
    out = torch.zeros_like(flat)
    for e, ffn in enumerate(ffns):
        rows, slot = torch.where(ids == e)
        if rows.numel():
            out = out.index_add(0, rows, ffn(flat[rows]) * w[rows, slot, None].to(flat.dtype))
    return out


class OwnMoE(nn.Module):
    """Names of its own: router ``switch``, experts ``ffns`` (called one by one); a buffer
    its forward updates (the load per expert)."""

    def __init__(self, rule: str = "mixtral") -> None:
        super().__init__()
        self.rule = rule
        self.switch = nn.Linear(D, E, bias=False)
        self.ffns = nn.ModuleList(MiniLLMMLP(D, 2 * D) for _ in range(E))
        self.register_buffer("load", torch.zeros(E, dtype=torch.long))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        w, ids = RULES[self.rule](self.switch(flat))
        self.load += torch.bincount(ids.reshape(-1), minlength=E)
        return dispatch(flat, w, ids, self.ffns).view_as(x)


class Experts(nn.Module):
    """Experts called as ``experts(hidden, top_k_index, top_k_weights)`` (transformers 5)."""

    def __init__(self, ffns: nn.ModuleList) -> None:
        super().__init__()
        self.num_experts = len(ffns)
        self.ffns = ffns

    def forward(self, hidden, top_k_index, top_k_weights):
        return dispatch(hidden, top_k_weights, top_k_index, self.ffns)


class NamedMoE(nn.Module):
    """The same block under the names that already work: ``gate`` and ``experts``."""

    def __init__(self, own: OwnMoE) -> None:
        super().__init__()
        self.rule = own.rule
        self.gate = copy.deepcopy(own.switch)
        self.experts = Experts(copy.deepcopy(own.ffns))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        w, ids = RULES[self.rule](self.gate(flat))
        return self.experts(flat, ids, w).view_as(x)


class OwnLM(nn.Module):
    """Embedding, dropout, two residual layers of (LayerNorm, MoE), a head."""

    def __init__(self, moe=OwnMoE) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.drop = nn.Dropout(0.2)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(2))
        self.moes = nn.ModuleList(moe() for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.drop(self.emb(ids))
        for norm, moe in zip(self.norms, self.moes, strict=True):
            x = x + self.drop(moe(norm(x)))
        return self.head(x)


def capture_block(block, x):
    with torch.no_grad(), hooks.capture(block) as tr:
        block(x)
    return tr


def by_hand(rule: str, logits: torch.Tensor):
    """The reference: torch.topk on the router's logits, with the rule written out."""
    if rule == "sigmoid":
        scores = torch.sigmoid(logits.float())
        w, ids = torch.topk(scores, K, dim=-1)
        return ids, w / w.sum(-1, keepdim=True) * 2.5, None
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, K, dim=-1)
    if rule != "raw":
        w = w / w.sum(-1, keepdim=True)
    return ids, w, probs


@pytest.mark.parametrize("rule", list(RULES))
def test_an_moe_of_ones_own_gets_the_records_of_the_same_weights_under_hf_names(rule):
    torch.manual_seed(0)
    own = OwnMoE(rule)
    named = NamedMoE(own)
    x = torch.randn(3, 5, D)
    (mine,) = capture_block(own, x).routing
    (ref,) = capture_block(named, x).routing
    assert (mine.source, ref.source) == ("topk", "experts")
    assert (mine.router, ref.router) == ("switch", "gate")
    # the independent reference: torch.topk on the router's logits, by hand
    logits = x.reshape(-1, D) @ own.switch.weight.detach().T
    ids, w, probs = by_hand(rule, logits)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    for r in (mine, ref):
        assert torch.equal(r.top_k_ids, ids)
        torch.testing.assert_close(r.top_k_weights, w, rtol=1e-5, atol=1e-6)
        assert torch.equal(r.tokens_per_expert, counts)
        assert (r.num_experts, r.top_k, r.module, r.call_index) == (E, K, "", 0)
        torch.testing.assert_close(r.router_logits, logits, rtol=1e-5, atol=1e-6)
        assert r.normalized == (rule != "raw")
        if probs is None:
            assert r.scoring == "sigmoid" and r.scale == pytest.approx(2.5)
            assert r.aux_loss is None and r.router_probs is None
        else:
            assert r.scoring == "softmax"
            torch.testing.assert_close(r.router_probs, probs, rtol=1e-5, atol=1e-7)
            f = counts.float() / counts.sum()
            assert r.aux_loss == pytest.approx(float(E * (f * probs.mean(0)).sum()), rel=1e-5)
    for f in ("top_k_ids", "top_k_weights", "tokens_per_expert", "router_logits"):
        assert torch.equal(getattr(mine, f), getattr(ref, f)), f
    assert (mine.scoring, mine.normalized, mine.scale, mine.aux_loss) == \
        (ref.scoring, ref.normalized, ref.scale, ref.aux_loss)


def test_the_same_records_as_minillms_block_with_the_same_weights():
    from minillm.config import MiniLLMConfig
    from minillm.moe import MiniLLMSparseMoeBlock

    torch.manual_seed(0)
    own = OwnMoE("mixtral")
    cfg = MiniLLMConfig(hidden_size=D, intermediate_size=2 * D, num_local_experts=E,
                        num_experts_per_tok=K)
    block = MiniLLMSparseMoeBlock(cfg)
    block.gate.load_state_dict(own.switch.state_dict())
    block.experts.load_state_dict(own.ffns.state_dict())
    x = torch.randn(2, 6, D)
    (mine,) = capture_block(own, x).routing
    (ref,) = capture_block(block, x).routing
    assert ref.source == "recomputed" and mine.source == "topk"
    for f in ("top_k_ids", "top_k_weights", "tokens_per_expert", "router_probs",
              "router_logits"):
        assert torch.equal(getattr(mine, f), getattr(ref, f)), f
    assert mine.aux_loss == ref.aux_loss
    torch.testing.assert_close(own(x), block(x)[0])


def _step(model, ids, seed, capture):
    torch.manual_seed(seed)
    model.train()
    if capture:
        with hooks.capture(model) as tr:
            F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    else:
        tr = None
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    return tr, torch.get_rng_state()


def test_a_captured_step_changes_nothing_the_model_computes():
    torch.manual_seed(0)
    plain = OwnLM()
    watched = copy.deepcopy(plain)
    ids = torch.randint(0, V, (2, 12))
    _, rng_plain = _step(plain, ids, 7, capture=False)
    depth = torch._C._len_torch_function_stack()
    tr, rng_watched = _step(watched, ids, 7, capture=True)
    assert [r.module for r in tr.routing] == ["moes.0", "moes.1"]
    assert all(r.source == "topk" for r in tr.routing)
    assert torch.equal(rng_plain, rng_watched)
    assert torch._C._len_torch_function_stack() == depth  # the watch's mode is gone
    assert torch.is_grad_enabled()
    for (n, a), (_, b) in zip(plain.named_parameters(), watched.named_parameters(), strict=True):
        assert torch.equal(a, b), n
        assert torch.equal(a.grad, b.grad), n  # bit-equal gradients
    for (n, a), (_, b) in zip(plain.named_buffers(), watched.named_buffers(), strict=True):
        assert torch.equal(a, b), n
    assert [m.training for m in plain.modules()] == [m.training for m in watched.modules()]
    # the load the model counted itself equals the load the records show
    for moe, rec in zip(watched.moes, tr.routing, strict=True):
        assert torch.equal(moe.load, rec.tokens_per_expert)


class Classifier(nn.Module):
    """E layers in a ModuleList and a Linear of E outputs, but no topk: not an MoE block."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(E))
        self.head = nn.Linear(D, E)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x).softmax(-1)


def test_a_candidate_that_runs_no_topk_records_and_says_nothing():
    from hooks.probes.routing_ops import found_blocks

    torch.manual_seed(0)
    model = Classifier()
    assert [b for b, _, _ in found_blocks(named_modules(model))] == [""]
    x = torch.randn(4, D)
    with hooks.capture(model) as tr:
        y = model(x)
    assert tr.routing == [] and not [n for n in tr.notes if n.kind == "routing"]
    assert torch.equal(y, model(x))


class ConstantMoE(OwnMoE):
    """Routes by topk, then applies equal weights of its own: the values are never read."""

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, ids = torch.softmax(self.switch(flat), dim=-1).topk(K, dim=-1)
        return dispatch(flat, torch.full(ids.shape, 1 / K), ids, self.ffns).view_as(x)


def test_weights_not_computed_from_the_topk_are_not_claimed():
    torch.manual_seed(0)
    tr = capture_block(ConstantMoE(), torch.randn(6, D))
    assert tr.routing == []
    (note,) = [n for n in tr.notes if n.kind == "routing"]
    assert note.module == "" and "topk (k=2) over switch's scores ran" in note.message
    assert "hooks.register_probe" in note.message


class ListMoE(OwnMoE):
    """Named ``gate``/``experts`` but the experts an nn.ModuleList called one by one, and no
    probe registered for the class: read from its topk too (a note before)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = self.switch
        del self.switch
        self.experts = self.ffns
        del self.ffns

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        w, ids = RULES["mixtral"](self.gate(flat))
        return dispatch(flat, w, ids, self.experts).view_as(x)


def test_a_named_list_of_experts_is_read_from_the_blocks_topk():
    torch.manual_seed(0)
    block = ListMoE()
    x = torch.randn(6, D)
    (r,) = capture_block(block, x).routing
    ids, w, _ = by_hand("mixtral", x @ block.gate.weight.detach().T)
    assert r.router == "gate" and r.source == "topk"
    assert torch.equal(r.top_k_ids, ids)
    torch.testing.assert_close(r.top_k_weights, w)


def test_minillm_blocks_are_found_by_name_and_watch_nothing():
    from minillm import MiniLLM, load_preset

    cfg = load_preset("tiny")
    torch.manual_seed(0)
    model = MiniLLM(cfg)
    depths = []
    for layer in model.model.layers:
        for ex in layer.mlp.experts:
            ex.register_forward_pre_hook(
                lambda m, a: depths.append(torch._C._len_torch_function_stack()))
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    with hooks.capture(model) as tr:
        model(ids, labels=ids).loss.backward()
    assert depths and set(depths) == {0}  # no mode while its experts ran
    assert {r.source for r in tr.routing} == {"recomputed"}


def test_what_is_found_is_cached_until_the_modules_change():
    from hooks.probes.routing_ops import found_blocks

    torch.manual_seed(0)
    model = OwnLM()
    first = found_blocks(named_modules(model))
    assert [b for b, _, _ in first] == ["moes.0", "moes.1"]
    assert [(x, e) for _, x, e in first] == [("moes.0.ffns", E), ("moes.1.ffns", E)]
    assert found_blocks(named_modules(model)) is first  # no second walk
    model.moes[1] = nn.Linear(D, D)
    assert [b for b, _, _ in found_blocks(named_modules(model))] == ["moes.0"]


class DeviceMoE(OwnMoE):
    """Its forward enters a TorchFunctionMode of its own (``torch.device``) around the router."""

    def forward(self, x):
        depth = torch._C._len_torch_function_stack()
        with torch.device("cpu"):
            flat = x.reshape(-1, x.shape[-1])
            w, ids = RULES["mixtral"](self.switch(flat))
        self.depths.append((depth, torch._C._len_torch_function_stack()))
        return dispatch(flat, w, ids, self.ffns).view_as(x)


class Seen(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_modes_the_block_and_its_users_enter_are_left_as_they_leave_them():
    torch.manual_seed(0)
    block = DeviceMoE()
    block.depths = []
    seen = Seen()  # a user's mode entered and left by hooks of their own on the block
    block.register_forward_pre_hook(lambda m, a: [seen.__enter__()] and None)
    block.register_forward_hook(lambda m, a, o: seen.__exit__(None, None, None))
    x = torch.randn(6, D)
    base = torch._C._len_torch_function_stack()
    tr = capture_block(block, x)
    (r,) = tr.routing
    ids, w, _ = by_hand("mixtral", x @ block.switch.weight.detach().T)
    assert torch.equal(r.top_k_ids, ids)
    assert block.depths == [(base + 2, base + 2)]  # the user's mode and the watch's, both left
    assert torch._C._len_torch_function_stack() == base and seen.ops > 0
    assert not [n for n in tr.notes if n.kind == "routing"]


def test_a_users_probe_that_records_the_routing_is_not_doubled():
    from hooks.probes.routing import routing_record

    class MyRouting(hooks.Probe):
        name = "mine"

        def on_forward(self, ctx, name, call_index, module, args, kwargs, output):
            logits = module.switch(args[0].reshape(-1, D))
            w, ids = RULES["mixtral"](logits)
            ctx.add_routing(routing_record(name, "switch", call_index, ids, w, logits_NE=logits,
                                           source="router"))

    probe = hooks.register_probe(OwnMoE, MyRouting())
    try:
        torch.manual_seed(0)
        tr = capture_block(OwnMoE(), torch.randn(6, D))
    finally:
        hooks.unregister_probe(probe)
    assert [(r.module, r.source) for r in tr.routing] == [("", "router")]
