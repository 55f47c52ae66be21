"""Edits (hooks.engine.edits): each edit against an independent reference — the same model with its
weights edited in a copy (zeroed expert outputs, zeroed o_proj input columns), a router whose
logit E is made -inf by patching torch's linear, the source input's own run for patching."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hooks
from hooks.engine.edits import Edit, parse_edit
from tests import families
from tests.zoo import batch_for, dead_expert, tiny

TOL = 1e-5


def _forward(model, batch, edits=None, sources=None, backward=False):
    """(loss, logits, trace) of one step of ``model`` on the dict ``batch``."""
    with hooks.capture(model, edits=edits, sources=sources) as trace:
        out = model(**batch)
        if backward:
            out.loss.backward()
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), out.logits.detach(), trace


def _plain(model, batch):
    with torch.no_grad():
        out = model(**batch)
    return out.loss, out.logits


def _close(a, b):
    assert torch.allclose(a, b, rtol=TOL, atol=TOL), float((a - b).abs().max())


def _hf(builder):
    pytest.importorskip("transformers")
    return getattr(families, builder)()


def _moe_mlp(model):
    return model.model.layers[1].mlp


# -- grammar ------------------------------------------------------------------------------------
def test_parse_round_trips_and_refuses_bad_specs_in_one_line():
    e = parse_edit("zero model.layers.1.self_attn head=3")
    assert e == Edit("zero", "model.layers.1.self_attn", head=3)
    for spec in ("patch model.layers.0 from=clean pos=2:5", "scale m by=0.5", "drop m expert=2",
                 "mean m"):
        assert parse_edit(parse_edit(spec).spec) == parse_edit(spec)
    for bad in ("", "frob m", "zero", "zero m head=x", "zero m head=1 expert=2", "scale m",
                "scale m by=nan", "drop m", "patch m", "zero m by=2", "zero m head=-1",
                "patch m from=a pos=x"):
        with pytest.raises(ValueError) as err:
            parse_edit(bad)
        assert "\n" not in str(err.value)


def test_specs_are_checked_against_the_model_before_anything_runs():
    model, batch = tiny(), batch_for(tiny())
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    bad = {"zero model.layers.9": "no module matches",
           "zero model.layers.1.self_attn head=4": "4 heads",
           "zero model.layers.1.mlp expert=4": "4 experts",
           "zero model.layers.1.self_attn expert=0": "MoE block",
           "zero model.layers.1.input_layernorm head=0": "attention",
           "zero model.layers": "container",
           "zero  ": "name the module",
           "": "empty",
           "patch model.layers.0 from=clean": "no source batch"}
    for spec, words in bad.items():
        with pytest.raises(ValueError, match=words) as err:
            hooks.capture(model, edits=[spec])
        assert "\n" not in str(err.value)
    assert not calls  # nothing ran
    hooked = [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert hooked == [model]  # only the test's own hook: no edit hook was left behind
    model(**batch)
    assert calls == [1]


# -- zero expert E = expert E's output weights zeroed -----------------------------------------
def _zero_expert_weights(model, e):
    ref = copy.deepcopy(model)
    experts = _moe_mlp(ref).experts
    with torch.no_grad():
        if isinstance(experts, nn.ModuleList):
            experts[e].down_proj.weight.zero_()
        else:
            experts.down_proj[e].zero_()
    return ref


@pytest.mark.parametrize("builder", ["minillm", "hf_mixtral", "hf_qwen3_moe"])
def test_zero_expert_equals_its_output_weights_zeroed(builder):
    if builder == "minillm":
        model = tiny()
        batch = batch_for(model)
    else:
        model, batch = _hf(builder)
    e = 1
    loss, logits, trace = _forward(model, batch, [f"zero model.layers.1.mlp expert={e}"],
                                   backward=True)
    ref_loss, ref_logits = _plain(_zero_expert_weights(model, e), batch)
    base_loss, _ = _plain(model, batch)
    _close(loss, ref_loss)
    _close(logits, ref_logits)
    assert abs(float(loss - base_loss)) > 1e-6  # the expert had tokens: the edit mattered
    (rec,) = trace.edits
    assert rec.applied and rec.reached_loss is True and rec.note is None


# -- zero head H = o_proj's input columns of head H zeroed ------------------------------------
def _attn(model, layer):
    if hasattr(model, "transformer"):  # GPT-2
        return f"transformer.h.{layer}.attn", model.transformer.h[layer].attn, "c_proj"
    return f"model.layers.{layer}.self_attn", model.model.layers[layer].self_attn, "o_proj"


@pytest.mark.parametrize("builder", ["minillm", "hf_llama", "hf_gpt2"])
def test_zero_head_equals_its_output_projection_columns_zeroed(builder):
    if builder == "minillm":
        model = tiny()
        batch = batch_for(model)
        assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    else:
        model, batch = _hf(builder)
    h, layer = 3, 1
    name, attn, proj = _attn(model, layer)
    loss, logits, trace = _forward(model, batch, [f"zero {name} head={h}"])
    ref = copy.deepcopy(model)
    _, ref_attn, _ = _attn(ref, layer)
    p = getattr(ref_attn, proj)
    heads = 4
    with torch.no_grad():
        if isinstance(p, nn.Linear):
            dh = p.in_features // heads
            p.weight[:, h * dh:(h + 1) * dh] = 0
        else:  # transformers Conv1D: weight (in, out)
            dh = p.weight.shape[0] // heads
            p.weight[h * dh:(h + 1) * dh, :] = 0
    ref_loss, ref_logits = _plain(ref, batch)
    _close(loss, ref_loss)
    _close(logits, ref_logits)
    assert not torch.allclose(logits, _plain(model, batch)[1], atol=1e-6)
    assert trace.edits[0].hooked == f"{name}.{proj}"


# -- drop expert E = a router whose logit E is -inf --------------------------------------------
@pytest.mark.parametrize("builder", ["minillm", "hf_mixtral", "hf_qwen3_moe"])
def test_drop_expert_equals_a_router_whose_logit_is_minus_inf(builder, monkeypatch):
    if builder == "minillm":
        model = tiny()
        batch = batch_for(model)
    else:
        model, batch = _hf(builder)
    e = 1
    loss, logits, trace = _forward(model, batch, [f"drop model.layers.1.mlp expert={e}"])
    assert trace.routing and all(not bool((r.top_k_ids == e).any()) for r in trace.routing
                                 if r.module == "model.layers.1.mlp")
    gate_w = _moe_mlp(model).gate.weight
    linear = F.linear

    def minus_inf_row(x, w, b=None):
        out = linear(x, w, b)
        if w is gate_w:
            out = out.clone()
            out[..., e] = -math.inf
        return out

    base_loss, _ = _plain(model, batch)
    monkeypatch.setattr(torch.nn.functional, "linear", minus_inf_row)
    ref_loss, ref_logits = _plain(model, batch)
    monkeypatch.undo()
    _close(loss, ref_loss)
    _close(logits, ref_logits)
    assert abs(float(loss - base_loss)) > 1e-6


# -- patch ------------------------------------------------------------------------------------
def test_patch_from_the_same_input_changes_nothing_exactly():
    model = tiny()
    batch = batch_for(model)
    loss, logits, _ = _forward(model, batch)
    for spec in ("patch model.layers.0 from=same", "patch model.layers.1.mlp from=same pos=3"):
        l2, g2, trace = _forward(model, batch, [spec], {"same": batch["input_ids"]})
        assert torch.equal(l2, loss) and torch.equal(g2, logits)
        assert any(n.kind == "edit" and "changed nothing" in n.message for n in trace.notes)


@pytest.mark.parametrize("builder", ["minillm", "hf_llama"])
def test_patching_a_layer_output_makes_the_rest_equal_the_source_run(builder):
    if builder == "minillm":
        model = tiny()
        batch = batch_for(model)
    else:
        model, batch = _hf(builder)
    ids = batch["input_ids"]
    other = torch.randint(3, 100, ids.shape, generator=torch.Generator().manual_seed(7))
    _, logits_other = _plain(model, {**batch, "input_ids": other, "labels": other})
    _, logits, trace = _forward(model, batch, ["patch model.layers.0 from=clean"],
                                {"clean": {"input_ids": other}})
    _close(logits, logits_other)
    assert trace.edits[0].applied
    # only some positions: those take the source's values, the others keep their own
    _, part, _ = _forward(model, batch, ["patch model.layers.0 from=clean pos=0:4"],
                          {"clean": {"input_ids": other}})
    base = _plain(model, batch)[1]
    assert torch.allclose(part[:, 0], logits_other[:, 0], atol=TOL)  # causal: pos 0 is its own
    assert not torch.allclose(part[:, -1], base[:, -1], atol=1e-6)  # later positions see them


# -- scale, mean, zero ------------------------------------------------------------------------
def test_scale_mean_and_zero_replace_the_output_as_said():
    model = tiny()
    batch = batch_for(model)
    seen = {}
    mlp = model.model.layers[0].mlp

    def after(m, a, out):
        seen["x"] = (out[0] if isinstance(out, tuple) else out).detach().clone()

    h = mlp.register_forward_hook(after)  # registered before the edits: runs after them
    try:
        _forward(model, batch)
        x = seen["x"]
        _forward(model, batch, ["scale model.layers.0.mlp by=0.25"])
        assert torch.allclose(seen["x"], 0.25 * x, atol=1e-7)
        _forward(model, batch, ["mean model.layers.0.mlp"])
        assert torch.allclose(seen["x"], x.mean(dim=(0, 1), keepdim=True).expand_as(x),
                              atol=1e-6)
        _forward(model, batch, ["zero model.layers.0.mlp"])
        assert torch.count_nonzero(seen["x"]) == 0
    finally:
        h.remove()


# -- edits that change nothing are said -------------------------------------------------------
def test_an_edit_whose_expert_gets_no_tokens_is_a_note():
    from tests.zoo import DEAD_EXPERT, DEAD_LAYER

    model, batch = dead_expert()
    spec = f"zero model.layers.{DEAD_LAYER}.mlp expert={DEAD_EXPERT}"
    drop = f"drop model.layers.{DEAD_LAYER}.mlp expert={DEAD_EXPERT}"
    loss, _, trace = _forward(model, batch, [spec, drop])
    rec, rec_drop = trace.edits
    assert rec.calls == 0 and not rec.applied and "no tokens" in rec.note
    assert rec_drop.calls == 1 and not rec_drop.applied and "no token's top k" in rec_drop.note
    assert {n.message.split(":")[0] for n in trace.notes if n.kind == "edit"} == {spec, drop}
    assert torch.equal(loss, _plain(model, batch)[0])


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.used = nn.Linear(8, 16)
        self.side = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)

    def forward(self, input_ids, labels=None):
        h = self.emb(input_ids)
        self.side(h)  # computed, then thrown away
        logits = self.used(h)
        loss = F.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))
        return type("Out", (), {"loss": loss, "logits": logits})()


def test_an_edit_that_never_runs_or_never_reaches_the_loss_is_a_note():
    torch.manual_seed(0)
    model = _Unused()
    ids = torch.randint(0, 16, (2, 5))
    batch = {"input_ids": ids, "labels": ids}
    _, _, trace = _forward(model, batch, ["zero never", "scale side by=2", "scale used by=2"],
                           backward=True)
    never, side, used = trace.edits
    assert never.calls == 0 and "never called" in never.note
    assert side.applied and side.reached_loss is False and "did not reach the loss" in side.note
    assert used.applied and used.reached_loss is True and used.note is None
    edit_notes = [n.module for n in trace.notes if n.kind == "edit"]
    assert edit_notes == ["never", "side"]


# -- saved with the trace ---------------------------------------------------------------------
def test_trace_edits_are_saved_and_old_traces_still_load(tmp_path):
    model = tiny()
    batch = batch_for(model)
    _, _, trace = _forward(model, batch, ["zero model.layers.0.self_attn head=1"])
    back = hooks.Trace.load(trace.save(tmp_path / "t.mdbtrace"))
    assert back.edits == trace.edits and back.edits[0].applied
    doc = trace.to_dict()
    del doc["edits"]  # a trace written before edits existed
    assert hooks.Trace.from_dict(doc, trace.all_tensors()).edits == []


# -- re-running a captured step (the step view's e) -------------------------------------------
def test_rerun_edited_patches_from_the_rolled_batch_and_leaves_the_gradients_alone():
    from hooks.whatif.rerun import rerun_edited

    model = tiny()
    batch = batch_for(model)
    with hooks.capture(model) as a:
        model(**batch).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    b = rerun_edited(a, ["patch model.layers.0 from=rolled"])
    assert b.edits[0].applied and b.meta["edits"] == ["patch model.layers.0 from=rolled"]
    # the rest of the forward is the rolled batch's own run (each row takes the next's)
    with torch.no_grad():
        ref = model(input_ids=torch.roll(batch["input_ids"], 1, dims=0)).logits
    head = b.call("lm_head").outputs[0].stats
    assert abs(head.mean - float(ref.mean())) < TOL and abs(head.std - float(ref.std())) < TOL
    for n, p in model.named_parameters():  # the step's .grad as they were
        assert torch.equal(p.grad, grads[n]) if n in grads else p.grad is None
    # the unedited re-run is the step itself: no statistic differs
    assert a.diff(rerun_edited(a, ["scale model.layers.0 by=1"])).is_zero()


def test_edits_on_a_step_that_every_skips_are_said_not_applied():
    model = tiny()
    batch = batch_for(model)
    with hooks.capture(model, edits=["zero model.layers.0.mlp"], step=3, every=2) as trace:
        loss = model(**batch).loss
    assert not trace.captured and torch.equal(loss, _plain(model, batch)[0])
    assert [n.kind for n in trace.notes] == ["edit"] and "not applied" in trace.notes[0].message


def test_an_expert_is_named_by_its_block_or_by_its_experts_list():
    model = tiny()
    batch = batch_for(model)
    by_block, _, _ = _forward(model, batch, ["zero model.layers.1.mlp expert=1"])
    by_list, _, trace = _forward(model, batch, ["zero model.layers.1.mlp.experts expert=1"])
    assert torch.equal(by_block, by_list)
    assert trace.edits[0].hooked == "model.layers.1.mlp.experts.1"
