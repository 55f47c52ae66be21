"""``hooks.tensors.norms`` and ``hooks.doctor.verdicts``: the total gradient norm against torch's
own ``get_total_norm``/``clip_grad_norm_``, the gradient verdicts on gradients whose size is known
analytically, and the hot/dead expert rule the doctor and the router view share."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hooks
from hooks.doctor.verdicts import (
    MAX_LOAD_RATIO,
    VANISHING_RATIO,
    expert_loads,
    grad_total_norm,
    hot_ratio,
    param_verdict,
    rows_by_module,
)
from hooks.tensors.norms import combine_norms, total_norm


# -- the total norm ---------------------------------------------------------------------------
def test_combine_norms_is_torchs_total_norm():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g, dtype=torch.float64) * 10 ** e
               for s, e in (((3, 4), -3), ((7,), 0), ((2, 2, 2), 2), ((1,), -8))]
    ref = float(torch.nn.utils.get_total_norm(tensors))
    assert combine_norms(float(t.norm()) for t in tensors) == pytest.approx(ref, rel=1e-12)
    assert combine_norms([]) == 0.0 and combine_norms([0.0, 0.0]) == 0.0


def test_combine_norms_propagates_nan_and_inf_and_does_not_overflow():
    assert math.isnan(combine_norms([1.0, math.nan, math.inf]))  # NaN wins, as in torch
    assert combine_norms([1.0, math.inf]) == math.inf
    # squares of 1e200 overflow float64; the scaled sum does not
    assert combine_norms([3e200, 4e200]) == pytest.approx(5e200, rel=1e-12)
    assert float(torch.nn.utils.get_total_norm(
        [torch.tensor([3e200], dtype=torch.float64), torch.tensor([4e200], dtype=torch.float64)]
    )) == math.inf  # what the unscaled sum gives


def test_total_norm_nan_anywhere_is_nan():
    # an Inf in one tensor and a NaN in a later one: NaN, as get_total_norm gives
    ts = [torch.tensor([1.0, math.inf]), torch.tensor([math.nan])]
    assert math.isnan(total_norm(ts)) and math.isnan(float(torch.nn.utils.get_total_norm(ts)))


def _tiny():
    from minillm import MiniLLM, load_preset

    torch.manual_seed(0)
    model = MiniLLM(load_preset("tiny"))
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    return model, ids


def test_grad_total_norm_of_a_capture_is_clip_grad_norms():
    model, ids = _tiny()
    with hooks.capture(model, attention=False) as trace:
        model(ids, labels=ids).loss.backward()
    ref = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=math.inf))
    total = grad_total_norm(trace.params.values())
    assert total.norm == pytest.approx(ref, rel=1e-5)
    assert total.counted == sum(1 for p in model.parameters() if p.grad is not None)
    assert total.nonfinite == 0
    # an L1-style plain sum of the norms is far from it (the mutation this test catches)
    assert sum(p.grad_norm for p in trace.params.values() if p.grad_norm) > 1.5 * ref


def test_grad_total_norm_with_a_nan_gradient_is_nan_like_the_trainers():
    from hooks.train.trainer import total_norm as trainer_norm

    model, ids = _tiny()
    with hooks.capture(model, attention=False) as trace:
        out = model(ids, labels=ids)
        (out.loss + model.model.norm.weight[0] * math.nan).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = grad_total_norm(trace.params.values())
    assert math.isnan(total.norm) and total.nonfinite >= 1
    assert math.isnan(trainer_norm(grads)) and math.isnan(float(
        torch.nn.utils.get_total_norm(grads)))


# -- gradient verdicts on gradients of known size --------------------------------------------
N, D = 128, 16


class Routed(nn.Module):
    """``a`` sees all N rows, ``b`` one row, ``c`` all rows under a tiny scale, ``d`` none.

    With x = 1 and every weight 1 (‖w‖ = √D), ∂loss/∂W is s·rows in every entry, so
    ‖g‖ = s·rows·√D and ‖g‖/‖w‖ = s·rows exactly."""

    def __init__(self, s: float, s_c: float) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(D, 1, bias=False) for _ in range(4))
        for lin in (self.a, self.b, self.c, self.d):
            nn.init.ones_(lin.weight)
        self.s, self.s_c = s, s_c

    def forward(self, x):
        return (self.s * (self.a(x).sum() + self.b(x[:1]).sum())
                + self.s_c * self.c(x).sum())


def test_few_tokens_is_told_from_vanishing():
    model = Routed(s=1e-6, s_c=1e-10)
    x = torch.ones(N, D)
    with hooks.capture(model) as trace:
        model(x).backward()
    ratio = {n: float(p.grad.norm() / p.detach().norm()) for n, p in model.named_parameters()
             if p.grad is not None}
    # the analytic reference, and the torch numbers agree with it
    assert ratio["a.weight"] == pytest.approx(1e-6 * N, rel=1e-5)
    assert ratio["b.weight"] == pytest.approx(1e-6, rel=1e-5)
    assert ratio["b.weight"] < VANISHING_RATIO
    assert ratio["c.weight"] == pytest.approx(1e-10 * N, rel=1e-5)
    rows, batch_rows = rows_by_module(trace)
    assert (rows["a"], rows["b"], rows["c"], rows["d"], batch_rows) == (N, 1, N, 0, N)
    verdict = {n: param_verdict(p, rows.get(n.rsplit(".", 1)[0]), batch_rows)
               for n, p in trace.params.items()}
    # b: 1e-6 < 1e-5 as a total, but 1e-6 per row reached × N rows is 1.3e-4: few tokens
    assert verdict == {"a.weight": "ok", "b.weight": "few", "c.weight": "vanishing",
                       "d.weight": "unused"}
    # without the rows, b is judged on its total alone
    assert param_verdict(trace.params["b.weight"]) == "vanishing"
    assert param_verdict(trace.params["d.weight"]) == "none"


def test_exploding_and_nan_verdicts():
    model = Routed(s=1e3, s_c=1.0)
    x = torch.ones(N, D)
    with hooks.capture(model) as trace:
        model(x).backward()
    rows, batch_rows = rows_by_module(trace)
    # ‖g‖/‖w‖ of a = 1e3·128 > 10
    assert param_verdict(trace.params["a.weight"], rows["a"], batch_rows) == "exploding"
    model = Routed(s=1.0, s_c=math.nan)  # ∂loss/∂c = NaN·x
    with hooks.capture(model) as trace:
        model(x).backward()
    assert param_verdict(trace.params["c.weight"]) == "nan"


# -- experts ----------------------------------------------------------------------------------
def test_expert_loads_flags_hot_and_dead():
    # E=8, top-2, N=100: expert 0 has 80 of the 200 picks = 40% = 3.2× 1/E (hot), 7 none
    counts = [80, 30, 30, 20, 20, 10, 10, 0]
    loads = expert_loads(counts, 100, 2)
    assert [x.flag for x in loads] == ["hot"] + ["ok"] * 6 + ["dead"]
    assert loads[0].share == pytest.approx(0.4) and loads[0].ratio == pytest.approx(3.2)
    assert loads[0].token_frac == pytest.approx(0.8)  # 80 of 100 tokens chose it
    assert hot_ratio(8, 2) == MAX_LOAD_RATIO
    # just under the ratio: not hot
    assert expert_loads([74, 26, 25, 25, 25, 25] + [0, 0], 100, 2)[0].flag == "ok"


def test_an_expert_every_token_chose_is_hot_where_e_over_k_is_small():
    # E=4, top-2: the largest possible ratio is E/k = 2 < MAX_LOAD_RATIO
    loads = expert_loads([50, 30, 20, 0], 50, 2)
    assert hot_ratio(4, 2) == 2.0
    assert [x.flag for x in loads] == ["hot", "ok", "ok", "dead"]
    assert [x.flag for x in expert_loads([40, 30, 20, 10], 50, 2)] == ["ok"] * 4


# -- KV heads -----------------------------------------------------------------------------------
@pytest.mark.parametrize("h, hkv", [(8, 2), (8, 1), (6, 3), (4, 4)])
def test_kv_groups_are_sdpas_enable_gqa_grouping(h, hkv):
    """What SDPA computes under ``enable_gqa``: KV head g's values are the constant g, so each
    query head's output says which KV head it read."""
    from hooks.probes.attention import kv_groups

    b, t, d = 1, 3, 4
    q = torch.randn(b, h, t, d)
    k = torch.randn(b, hkv, t, d)
    v = torch.arange(hkv, dtype=torch.float32).view(1, hkv, 1, 1).expand(b, hkv, t, d)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    read = [round(float(out[0, head, 0, 0])) for head in range(h)]
    assert kv_groups(h, hkv) == read
    assert kv_groups(8, 3) is None and kv_groups(8, None) is None


# -- the doctor's gradient-flow check uses the same verdicts -----------------------------------
@pytest.mark.parametrize("scale, status", [(1e6, "warn"), (1e-9, "pass")])
def test_grad_flow_judges_gradients_as_the_gradients_view(scale, status):
    from types import SimpleNamespace

    from hooks.doctor.model import run_checks
    from hooks.doctor.verdicts import EXPLODING_NORM, EXPLODING_RATIO

    model, ids = _tiny()
    # the reference: the model's own gradients of the same loss, by hand
    (model(ids, labels=ids).loss * scale).backward()
    norm = {n: (float(p.grad.norm()), float(p.detach().norm()))
            for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    workload = SimpleNamespace(model=model, batch=hooks.Batch.of({"input_ids": ids,
                                                                  "labels": ids}),
                               loss_fn=lambda out, batch: out.loss * scale)
    r = {x.key: x for x in run_checks(workload, only="grad-flow")}["grad-flow"]
    assert r.status == status
    if scale > 1:
        want = sorted(n for n, (g, w) in norm.items()
                      if g > EXPLODING_NORM or (w and g / w > EXPLODING_RATIO))
        assert want and sorted(r.data["exploding"]) == want
        assert f"{len(want)} exploding" in r.evidence and r.module is not None
    else:
        assert r.data["exploding"] == [] and len(r.data["vanishing"]) > 0
        # every tensor clearly under the threshold is listed (or explained by few tokens)
        clear = {n for n, (g, w) in norm.items() if w and g / w < VANISHING_RATIO * 1e-2}
        assert clear and set(r.data["vanishing"]) | set(r.data["few_tokens"]) >= clear
        assert "under the vanishing threshold" in r.evidence


def test_routing_record_loads_count_a_token_once_per_expert():
    """The router view's counts, below the UI: picks per expert are the record's, tokens count a
    token that picked an expert twice once (a Python loop is the reference)."""
    from types import SimpleNamespace

    import torch

    from hooks.doctor.verdicts import routing_record_loads

    ids = torch.tensor([[0, 0], [1, 2], [2, 1], [3, 3]])
    rec = SimpleNamespace(top_k_ids=ids, tokens_per_expert=torch.bincount(ids.flatten(),
                                                                          minlength=5),
                          num_experts=5, top_k=2)
    loads = routing_record_loads(rec)
    picks = [sum(row.count(e) for row in ids.tolist()) for e in range(5)]
    tokens = [sum(e in row for row in ids.tolist()) for e in range(5)]
    assert [x.assignments for x in loads] == picks == [2, 2, 2, 2, 0]
    assert [x.tokens for x in loads] == tokens == [1, 2, 2, 1, 0]
    assert [x.flag for x in loads][-1] == "dead"


def test_aux_total_says_whether_the_model_total_is_coef_times_the_layers():
    from types import SimpleNamespace

    from hooks.doctor.verdicts import aux_total, model_layer_aux

    layers = [SimpleNamespace(aux_loss=1.25), SimpleNamespace(aux_loss=0.75)]
    meta = {"aux_loss": 0.02, "config": {"router_aux_loss_coef": 0.01}}
    a = aux_total(layers, meta)
    assert (a.total, a.coef, a.layer_sum, a.consistent) == (0.02, 0.01, 2.0, True)
    assert aux_total(layers, {**meta, "aux_loss": 0.03}).consistent is False
    assert aux_total(layers, {"aux_loss": 0.02}).consistent is None  # no coefficient
    assert aux_total([SimpleNamespace(aux_loss=None)], meta).layer_sum is None
    assert aux_total(layers, {}) is None
    assert model_layer_aux({"aux_losses": [1.2, 0.8]}, 2, 1) == 0.8
    assert model_layer_aux({"aux_losses": [1.2]}, 2, 1) is None  # not one per layer
