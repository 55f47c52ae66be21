"""hooks.capture on small generic nn.Modules: records, gradients, options, memory.

References are computed independently: a second forward without hooks with ``retain_grad``
on the intermediate tensors, and torch's own reductions.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref

import pytest
import torch
from torch import nn

import hooks
from hooks.engine.capture import Capture


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    return a == pytest.approx(b, rel=rel, abs=1e-7)


def assert_stats(st: hooks.TensorStats, x: torch.Tensor) -> None:
    x = x.detach().double()
    assert st.numel == x.numel()
    assert close(st.mean, x.mean().item())
    assert close(st.std, x.std().item())
    assert close(st.min, x.min().item()) and close(st.max, x.max().item())
    assert close(st.l2, torch.linalg.vector_norm(x).item())
    assert close(st.zero_frac, (x == 0).double().mean().item())


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def test_module_called_twice_gets_two_records_with_their_own_stats():
    torch.manual_seed(0)
    m = Twice()
    x = torch.randn(4, 6)
    with hooks.capture(m) as tr:
        m(x)
    lin = tr.calls("lin")
    assert [r.call_index for r in lin] == [0, 1]
    assert [r.module for r in tr.forward] == ["", "lin", "lin"]
    assert tr.forward[0].module_type == "Twice" and lin[0].module_type == "Linear"
    assert lin[0].parent == 0 and lin[0].depth == 1
    # references without hooks
    h1 = m.lin(x)
    h2 = m.lin(torch.tanh(h1))
    assert_stats(lin[0].outputs[0].stats, h1)
    assert_stats(lin[1].outputs[0].stats, h2)
    assert_stats(lin[1].inputs[0].stats, torch.tanh(h1))
    assert lin[1].inputs[0].path == "args[0]" and lin[1].outputs[0].path == "out"
    assert lin[1].outputs[0].shape == [4, 6] and lin[1].outputs[0].dtype == "float32"
    # end order: the inner calls finish before the root
    assert tr.forward[0].end_order == 2 and lin[0].end_order == 0


class KwOnly(nn.Module):
    def forward(self, *, x, scale: float = 1.0, extra=None):
        return {"y": x * scale, "z": [x.sum(), extra]}


def test_kwargs_only_call_and_dict_list_outputs():
    m = KwOnly()
    x = torch.randn(3, 5)
    e = torch.randn(2)
    with hooks.capture(m) as tr:
        m(x=x, scale=2.0, extra=e)
    (rec,) = tr.forward
    assert [t.path for t in rec.inputs] == ["kwargs.x", "kwargs.extra"]
    assert_stats(rec.inputs[0].stats, x)
    assert [t.path for t in rec.outputs] == ["out.y", "out.z[0]", "out.z[1]"]
    assert_stats(rec.output("out.y").stats, x * 2.0)
    assert rec.output("out.z[0]").shape == []
    assert rec.output("out.z[1]").stats == rec.inputs[1].stats  # the same tensor object


@dataclasses.dataclass
class Out:
    a: torch.Tensor
    b: tuple


class DataOut(nn.Module):
    def forward(self, x):
        return Out(a=x + 1, b=(x * 2, "label", 3))


def test_dataclass_outputs_and_non_tensor_parts_are_said():
    with hooks.capture(DataOut()) as tr:
        DataOut()(torch.ones(2))
    assert tr.forward == []  # a fresh module instance: the captured one never ran
    m = DataOut()
    with hooks.capture(m) as tr:
        m(torch.ones(2))
    rec = tr.forward[0]
    assert [t.path for t in rec.outputs] == ["out.a", "out.b[0]"]
    assert rec.outputs[0].stats.mean == 2.0 and rec.outputs[1].stats.mean == 2.0


class NonTensor(nn.Module):
    def forward(self, x):
        return int(x.numel())


def test_non_tensor_output_is_noted_not_skipped_silently():
    m = nn.Sequential(nn.Linear(2, 2))
    m.add_module("count", NonTensor())
    m.forward = lambda x: (m[0](x), m.count(x))  # type: ignore[method-assign]
    with hooks.capture(m) as tr:
        m(torch.randn(1, 2))
    rec = tr.call("count")
    assert rec.outputs == []
    assert any("non-tensor output (int)" in n for n in rec.notes)


def reference_relu_grads(lin0, lin1, x):
    """Autograd's gradients w.r.t. the pre-ReLU and post-ReLU tensors, no in-place, no hooks."""
    h = lin0(x)
    h.retain_grad()
    r = torch.relu(h)
    r.retain_grad()
    y = lin1(r)
    y.retain_grad()
    (y.square().sum()).backward()
    return h, r, y


def test_inplace_relu_captures_without_error_and_gradients_equal_autograd():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    x = torch.randn(6, 5)
    with hooks.capture(model) as tr:
        y = model(x)
        y.square().sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    h, r, y_ref = reference_relu_grads(model[0], model[2], x)
    # forward: the Linear's output was summarised before ReLU overwrote it in place
    assert_stats(tr.call("0").outputs[0].stats, h)
    assert_stats(tr.call("1").outputs[0].stats, r)
    # backward: one record per output, values equal autograd's
    by_module = {g.module: g for g in tr.backward}
    assert_stats(by_module["2"].stats, y_ref.grad)
    assert_stats(by_module["1"].stats, r.grad)
    assert_stats(by_module["0"].stats, h.grad)
    # autograd order: from the loss back to the input
    assert [g.module for g in tr.backward] == ["", "2", "1", "0"] or [
        g.module for g in tr.backward
    ] == ["2", "", "1", "0"]
    # the capture changed no gradient
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=0, atol=0)
    assert tr.params["0.weight"].grad_norm == pytest.approx(got["0.weight"].norm().item(), rel=1e-5)


def test_embedding_without_input_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 2))
    ids = torch.tensor([[1, 2, 3], [4, 5, 10]])
    with hooks.capture(model) as tr:
        model(ids).sum().backward()
    emb = tr.call("0")
    assert emb.inputs[0].dtype == "int64" and not emb.inputs[0].requires_grad
    assert_stats(emb.inputs[0].stats, ids)
    (g,) = tr.grads("0")
    e = model[0](ids)
    e.retain_grad()
    model[1](e).sum().backward()
    assert_stats(g.stats, e.grad)
    assert tr.params["0.weight"].status == "ok"
    assert not [n for n in tr.notes if n.kind == "hook_error"]


def test_model_output_and_gradients_bitwise_unchanged():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(7, 9), nn.GELU(), nn.LayerNorm(9), nn.Linear(9, 4))
    x = torch.randn(5, 7)
    y0 = model(x)
    y0.pow(2).mean().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with hooks.capture(model, keep_bytes=1 << 20):
        y1 = model(x)
        y1.pow(2).mean().backward()
    assert torch.equal(y0, y1)
    for a, p in zip(ref, model.parameters(), strict=True):
        assert torch.equal(a, p.grad)


def test_hooks_removed_on_exit_also_when_body_raises():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    with pytest.raises(RuntimeError, match="boom"), hooks.capture(model) as tr:
        model(torch.randn(1, 2))
        raise RuntimeError("boom")
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    for p in model.parameters():
        assert not p._post_accumulate_grad_hooks
    n = len(tr.forward)
    model(torch.randn(1, 2)).sum().backward()  # after exit: nothing more is recorded
    assert len(tr.forward) == n and tr.backward == []


def test_backward_after_exit_is_not_recorded():
    model = nn.Linear(3, 3)
    with hooks.capture(model) as tr:
        y = model(torch.randn(2, 3))
    y.sum().backward()
    assert tr.backward == [] and tr.params == {}
    assert any(n.kind == "no_backward" for n in tr.notes)


def test_include_exclude_by_pattern_and_type():
    model = nn.Sequential(
        nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    )
    x = torch.randn(1, 2)
    with hooks.capture(model, include=["0"]) as tr:
        model(x)
    assert [r.module for r in tr.forward] == ["0", "0.0", "0.1"]
    with hooks.capture(model, exclude=[nn.ReLU, "1"]) as tr:
        model(x)
    assert [r.module for r in tr.forward] == ["", "0", "0.0"]
    with hooks.capture(model, include=["Linear"]) as tr:
        model(x)
    assert [r.module for r in tr.forward] == ["0.0", "1.0"]
    with hooks.capture(model, include=["*.1"]) as tr:
        model(x)
    assert [r.module for r in tr.forward] == ["0.1", "1.1"]


def test_every_n_steps_captures_only_sampled_steps_and_attaches_nothing_otherwise():
    model = nn.Linear(2, 2)
    captured = []
    for step in range(7):
        with hooks.capture(model, step=step, every=3) as tr:
            assert bool(model._forward_hooks) == (step % 3 == 0)
            model(torch.randn(1, 2)).sum().backward()
        captured.append(tr.captured)
        assert tr.step == step
        assert (len(tr.forward) > 0) == tr.captured
    assert captured == [True, False, False, True, False, False, True]
    with pytest.raises(ValueError):
        hooks.capture(model, every=0)


def test_keep_bytes_keeps_full_tensors_until_budget_and_says_so():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    budget = 3 * 8 * 4 + 3 * 8 * 4  # the root output does not fit after these two
    with hooks.capture(model, keep_bytes=budget) as tr:
        model(x).sum().backward()
    h = model[0](x)
    kept = tr.call("0").outputs[0].kept
    assert kept is not None and torch.equal(tr.tensors[kept], h.detach())
    assert torch.equal(tr.tensors[tr.call("1").outputs[0].kept], torch.tanh(h).detach())
    assert tr.call("2").outputs[0].kept is None
    assert tr.kept_bytes <= budget
    assert any(n.kind == "budget" for n in tr.notes)
    with hooks.capture(model) as tr:  # default: statistics only
        model(x)
    assert tr.tensors == {} and all(t.kept is None for r in tr.forward for t in r.outputs)


class PartlyFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(3, 3)
        self.zeroed = nn.Linear(3, 3, bias=False)
        self.side = nn.Linear(3, 3)

    def forward(self, x):
        with torch.no_grad():
            s = self.side(x)
        return self.a(self.frozen(x)) + 0.0 * self.zeroed(x) + s


def test_param_statuses_and_no_grad_module_noted():
    torch.manual_seed(0)
    m = PartlyFrozen()
    with hooks.capture(m) as tr:
        m(torch.randn(2, 3)).sum().backward()
    p = tr.params
    assert p["a.weight"].status == "ok"
    assert p["a.weight"].grad_norm == pytest.approx(m.a.weight.grad.norm().item(), rel=1e-5)
    assert p["a.weight"].grad_abs_max == pytest.approx(m.a.weight.grad.abs().max().item())
    assert p["a.weight"].weight_norm == pytest.approx(m.a.weight.norm().item(), rel=1e-5)
    assert p["a.weight"].ratio == pytest.approx(
        m.a.weight.grad.norm().item() / m.a.weight.norm().item(), rel=1e-5
    )
    assert p["frozen.weight"].status == "frozen"
    assert p["unused.weight"].status == "none" and p["unused.weight"].grad_norm is None
    assert p["zeroed.weight"].status == "zero"
    assert p["side.weight"].status == "none"
    assert any(n.kind == "no_grad" and n.module == "side" for n in tr.notes)
    # a gradient left over from before the capture is "stale", not fresh
    m.unused(torch.randn(1, 3)).sum().backward()
    with hooks.capture(m) as tr:
        m(torch.randn(2, 3)).sum().backward()
    assert tr.params["unused.weight"].status == "stale"


def test_nan_in_weight_located_at_first_nonfinite_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    with torch.no_grad():
        model[2].weight[1, 3] = float("nan")
    with hooks.capture(model) as tr:
        model(torch.randn(2, 4)).sum().backward()
    hit = tr.first_nonfinite()
    assert (hit.module, hit.call_index, hit.tensor) == ("2", 0, "out")
    assert hit.stats.nan_count == 2  # column 1 of both rows
    assert "2" in hit.describe() and "NaN" in hit.describe()
    bwd = tr.first_nonfinite("backward")
    assert bwd is not None and bwd.direction == "backward"
    finite = nn.Linear(2, 2)
    with hooks.capture(finite) as tr:
        finite(torch.randn(1, 2)).sum().backward()
    assert tr.first_nonfinite() is None and tr.first_nonfinite("backward") is None
    with pytest.raises(ValueError):
        tr.first_nonfinite("sideways")


def test_module_infos_counts_own_and_total_params_with_tying():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, nn.Sequential(nn.Linear(4, 4), nn.ReLU()), head)
    with hooks.capture(model) as tr:
        pass
    info = {m.name: m for m in tr.modules}
    assert [m.name for m in tr.modules] == [n for n, _ in model.named_modules()]
    assert info[""].total_params == 40 + 20
    assert info["0"].own_params == 40 and info["2"].own_params == 40
    assert info["1"].total_params == 20 and info["1"].own_params == 0
    assert info["1.0"].depth == 2 and info[""].depth == 0


def _odd_sharing() -> nn.Module:
    """A parameter registered three times (two under one parent), and a module reachable
    under two names."""
    shared = nn.Parameter(torch.zeros(7))
    inner = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    inner[0].tied, inner[1].tied = shared, shared
    model = nn.Sequential(inner, nn.Linear(2, 5), nn.Sequential(nn.Linear(5, 5)))
    model[1].tied = shared
    model[2].again = inner[1]
    return model


@pytest.mark.parametrize("build", ["minillm", "gpt2", "odd"])
def test_module_infos_totals_equal_torchs_own_parameters_count(build):
    """Every module's total is ``sum(p.numel() for p in module.parameters())``: torch walks
    the subtree and counts a tied parameter once (the reference), with tying within a layer,
    across the model (GPT-2's wte/lm_head) and a module reached under two names."""
    from hooks.trace.modules import module_infos

    if build == "minillm":
        from minillm import MiniLLM, load_preset

        model = MiniLLM(load_preset("tiny"))
    elif build == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                           n_positions=16, bos_token_id=0, eos_token_id=0))
    else:
        model = _odd_sharing()
    infos = module_infos(model)
    assert [m.name for m in infos] == [n for n, _ in model.named_modules()]
    for info, (_, module) in zip(infos, model.named_modules(), strict=True):
        assert info.total_params == sum(p.numel() for p in module.parameters()), info.name
        own = sum(p.numel() for p in module.parameters(recurse=False))
        assert info.own_params == own, info.name


def test_compiled_model_is_said():
    model = nn.Linear(2, 2)
    compiled = torch.compile(model)
    with hooks.capture(compiled) as tr:
        pass
    assert any(n.kind == "compiled" for n in tr.notes)


@pytest.mark.parametrize("memory", [False, True])
def test_stats_only_trace_holds_no_reference_to_activations(memory):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    refs: list[weakref.ref] = []
    spy = model[1].register_forward_hook(lambda m, a, o: refs.append(weakref.ref(o)))
    with hooks.capture(model, memory=memory) as tr:
        y = model(torch.randn(4, 8))  # the graph (and the tanh output it saves) stays alive
    spy.remove()
    # alive through y's graph; memory accounting's saved-tensor hooks keep a detached alias
    # of its storage instead (hooks.engine.memory), so the object itself may go
    assert refs[0]() is not None or memory
    del y
    assert refs[0]() is None, "the trace kept an activation alive"
    # and with backward inside the capture
    spy = model[1].register_forward_hook(lambda m, a, o: refs.append(weakref.ref(o)))
    with hooks.capture(model, memory=memory) as tr2:
        y = model(torch.randn(4, 8))
        y.sum().backward(retain_graph=True)
    spy.remove()
    assert refs[1]() is not None or memory
    del y
    assert refs[1]() is None, "the trace kept an activation alive"
    assert len(tr.forward) == 4 and len(tr2.backward) > 0  # the traces themselves are intact


def _live_tensors() -> int:
    gc.collect()
    kinds = (torch.Tensor, nn.Parameter)
    return sum(1 for o in gc.get_objects() if type(o) in kinds)


def test_thousand_steps_with_every_n_keep_memory_flat():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    counts = []
    sampled = 0
    for step in range(1000):
        opt.zero_grad(set_to_none=True)
        with hooks.capture(model, step=step, every=50) as tr:
            model(x).square().mean().backward()
        opt.step()
        sampled += tr.captured
        if step in (99, 999):
            counts.append(_live_tensors())
    assert sampled == 20
    assert counts[1] <= counts[0], f"live tensors grew from {counts[0]} to {counts[1]}"
    for m in model.modules():
        assert not m._forward_hooks


class Gate(nn.Module):
    def __init__(self, d_in: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, 3)

    def forward(self, x):
        return torch.sigmoid(self.proj(x))


class GateProbe(hooks.Probe):
    name = "gate-open"

    def on_forward(self, ctx, name, call_index, module, args, kwargs, output):
        ctx.add_extra(
            hooks.ProbeRecord(
                self.name,
                name,
                call_index,
                values={"open_frac": (output > 0.5).float().mean().item()},
                tensors={"gates": output.detach().clone()},
            )
        )


class BrokenProbe(hooks.Probe):
    name = "broken"

    def on_forward(self, ctx, name, call_index, module, args, kwargs, output):
        raise ValueError("nope")


def test_user_probe_registered_per_type_and_saved(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(Gate(), nn.Linear(3, 4), Gate())  # both gates take 4 features
    probe = hooks.register_probe(Gate, GateProbe())
    broken = hooks.register_probe("Gate", BrokenProbe())
    try:
        x = torch.randn(5, 4)
        with hooks.capture(model) as tr:
            y = model(x)
    finally:
        hooks.unregister_probe(probe)
        hooks.unregister_probe(broken)
    assert [(e.probe, e.module, e.call_index) for e in tr.extras] == [
        ("gate-open", "0", 0),
        ("gate-open", "2", 0),
    ]
    g0 = model[0](x)
    assert tr.extras[0].values["open_frac"] == pytest.approx((g0 > 0.5).float().mean().item())
    torch.testing.assert_close(tr.extras[1].tensors["gates"], y)
    # a failing probe never breaks the forward: it becomes a note
    assert any(n.kind == "probe" and "nope" in n.message for n in tr.notes)
    back = hooks.Trace.load(tr.save(tmp_path / "p"))
    assert back.extras[1].values == tr.extras[1].values
    torch.testing.assert_close(back.extras[1].tensors["gates"], y)
    # unregistered: the next capture runs no user probe
    with hooks.capture(model) as tr2:
        model(x)
    assert tr2.extras == []


def test_inference_mode_capture_records_forward_only():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    x = torch.randn(2, 3)
    with torch.inference_mode(), hooks.capture(model) as tr:
        y = model(x)
    assert [r.module for r in tr.forward] == ["", "0", "1"]
    assert_stats(tr.call("1").outputs[0].stats, y)
    assert tr.backward == [] and any(n.kind == "no_backward" for n in tr.notes)


def test_activation_checkpointing_recompute_is_marked():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False).sum()

    model = Outer()
    with hooks.capture(model) as tr:
        model(torch.randn(2, 4)).backward()
    (call,) = tr.calls("inner.0")  # the re-run is kept with the call, not added (more in
    assert call.recomputed == 1  # tests/hooks/engine/test_hooks_recompute.py)
    assert "recomputed during backward" in call.notes[0]
    assert tr.params["inner.0.weight"].status == "ok"


class ViewsAndInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Identity()
        self.c = nn.Identity()

    def forward(self, x):
        h = self.a(x)
        self.b(h.reshape(-1))  # a view of the same memory: same statistics
        h.mul_(2.0)  # in place: the view's statistics are stale now
        return self.c(h.reshape(-1))


def test_cached_statistics_follow_views_and_in_place_changes():
    torch.manual_seed(0)
    m = ViewsAndInPlace()
    x = torch.randn(3, 4)
    with torch.no_grad(), hooks.capture(m) as tr:
        m(x)
    h = m.a(x).detach()
    assert_stats(tr.call("b").inputs[0].stats, h)
    assert tr.call("b").inputs[0].stats is tr.call("a").outputs[0].stats
    assert_stats(tr.call("c").inputs[0].stats, 2.0 * h)
    assert_stats(tr.call("a").outputs[0].stats, h)  # summarised before the in-place change


# -- statistics on the worker thread (Capture.background): exact, or not recorded ---------------
class WrittenAfterHook(nn.Module):
    """``a``'s output is doubled in place by the parent after ``a``'s forward hook ran."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(128, 128)
        self.b = nn.Linear(128, 128)

    def forward(self, x):
        h = self.a(x)
        keep = self.b(x)
        h.mul_(2.0)
        return h + keep


def test_output_written_in_place_after_its_hook_is_exact_or_not_recorded(monkeypatch):
    from hooks.tensors.stats import _shared_worker

    monkeypatch.setattr(Capture, "background", True)  # whatever the cores
    torch.manual_seed(0)
    m = WrittenAfterHook()
    x = torch.randn(64, 128)  # 8192 elements per tensor: summarised on the worker
    with torch.no_grad():
        a_out, b_out = m.a(x), m.b(x)  # the values the modules returned
    gate = threading.Event()  # hold the worker until the forward has written h
    _shared_worker().put(lambda _: gate.wait(10), None, urgent=True)
    with torch.no_grad(), hooks.capture(m) as tr:
        m(x)
        gate.set()
    assert tr.call("a").outputs[0].stats is None  # never the doubled values
    assert_stats(tr.call("b").outputs[0].stats, b_out)
    (note,) = [n for n in tr.notes if n.kind == "modified_in_place"]
    assert "1 tensor(s)" in note.message and "a#0 out" in note.message
    # the same capture with the statistics taken in the hooks: a's output as returned
    monkeypatch.setattr(Capture, "background", False)
    with torch.no_grad(), hooks.capture(m) as tr2:
        m(x)
    assert_stats(tr2.call("a").outputs[0].stats, a_out)
    assert not [n for n in tr2.notes if n.kind == "modified_in_place"]


def test_a_distributed_job_takes_its_statistics_in_the_hooks(monkeypatch, tmp_path):
    """In a torch.distributed job (DDP writes averaged gradients into .grad while its
    collectives run) the worker is never used, even when forced: a's output is recorded as
    a returned it, though the parent doubles it in place after the hook."""
    import torch.distributed as dist

    from hooks.tensors.stats import _shared_worker

    monkeypatch.setattr(Capture, "background", True)
    torch.manual_seed(0)
    m = WrittenAfterHook()
    x = torch.randn(64, 128)
    with torch.no_grad():
        a_out = m.a(x)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    gate = threading.Event()  # a worker in use would read a's output after the doubling
    try:
        _shared_worker().put(lambda _: gate.wait(10), None, urgent=True)
        with torch.no_grad(), hooks.capture(m) as tr:
            m(x)
            gate.set()
    finally:
        gate.set()
        dist.destroy_process_group()
    assert_stats(tr.call("a").outputs[0].stats, a_out)
    assert not [n for n in tr.notes if n.kind == "modified_in_place"]


def test_in_place_module_inputs_are_read_before_it_runs(monkeypatch):
    monkeypatch.setattr(Capture, "background", True)
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(128, 128), nn.ReLU(inplace=True), nn.Linear(128, 64))
    x = torch.randn(64, 128)
    with torch.no_grad():
        pre = m[0](x)  # what ReLU(inplace=True) overwrites
    with hooks.capture(m) as tr:
        m(x).square().mean().backward()
    assert_stats(tr.call("0").outputs[0].stats, pre)
    assert_stats(tr.call("1").inputs[0].stats, pre)
    assert_stats(tr.call("1").outputs[0].stats, pre.clamp_min(0))
    assert not [n for n in tr.notes if n.kind == "modified_in_place"]


def test_parameter_records_are_those_after_backward_when_the_optimizer_runs_inside(monkeypatch):
    monkeypatch.setattr(Capture, "background", True)
    torch.manual_seed(2)
    m = nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 64))
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    x = torch.randn(64, 128)
    with hooks.capture(m) as tr:
        m(x).square().mean().backward()
        ref = {n: (torch.linalg.vector_norm(p.grad).item(), p.grad.abs().max().item(),
                   torch.linalg.vector_norm(p).item()) for n, p in m.named_parameters()}
        opt.step()  # weights written in place
        opt.zero_grad(set_to_none=False)  # gradients zeroed in place
    assert set(tr.params) == set(ref)
    for name, (g, gmax, w) in ref.items():
        rec = tr.params[name]
        assert rec.status == "ok"
        assert close(rec.grad_norm, g) and close(rec.grad_abs_max, gmax), name
        assert close(rec.weight_norm, w), name


def test_gc_threshold_raised_while_recording_and_restored_after():
    import gc

    before = gc.get_threshold()
    m = nn.Linear(4, 4)
    with hooks.capture(m):
        during = gc.get_threshold()
        m(torch.randn(2, 4)).sum().backward()
    assert during[0] >= 20_000 and during[1:] == before[1:]
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), hooks.capture(m):  # restored when the body raises too
        raise RuntimeError("boom")
    assert gc.get_threshold() == before


def test_the_worker_is_used_by_default_only_while_torch_leaves_a_core_free(monkeypatch):
    import os

    from hooks.engine.env import core_left

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not core_left()  # the model's threads take both cores: statistics in the hooks
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert core_left()


def test_statistics_are_taken_in_the_hooks_unless_the_worker_is_asked_for():
    assert Capture.background is False


def test_optimizer_in_backward_leaves_the_parameter_records_of_backward(monkeypatch):
    """A post-accumulate-grad hook of the user's (after mdb's) steps the optimizer and zeroes
    the gradient in place: the records are the gradient and weight backward produced."""
    monkeypatch.setattr(Capture, "background", True)
    torch.manual_seed(0)
    m = nn.Linear(64, 64)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    seen = {}

    def step(p, name):
        seen[name] = (torch.linalg.vector_norm(p.grad).item(), p.grad.abs().max().item(),
                      torch.linalg.vector_norm(p.detach()).item())
        opt.step()
        opt.zero_grad(set_to_none=False)

    with hooks.capture(m) as tr:
        hs = [p.register_post_accumulate_grad_hook(lambda p, n=n: step(p, n))
              for n, p in m.named_parameters()]
        m(torch.randn(8, 64)).pow(2).sum().backward()
    for h in hs:
        h.remove()
    for name, (g, gmax, w) in seen.items():
        rec = tr.params[name]
        assert rec.status == "ok"
        assert rec.grad_norm == pytest.approx(g, rel=1e-5)
        assert rec.grad_abs_max == pytest.approx(gmax, rel=1e-6)
        assert rec.weight_norm == pytest.approx(w, rel=1e-5)


class _RaisesOnce(torch.autograd.Function):
    fail = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _RaisesOnce.fail:
            _RaisesOnce.fail = False
            raise RuntimeError("boom")
        return g


def test_a_backward_that_raised_does_not_keep_the_next_from_being_drained(monkeypatch):
    monkeypatch.setattr(Capture, "background", True)
    _RaisesOnce.fail = True
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(a=nn.Linear(128, 128), b=nn.Linear(128, 128)))
    x = torch.randn(64, 128)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def loss():
        return m["a"](x).sum() + _RaisesOnce.apply(m["b"](x)).sum()

    with hooks.capture(m) as tr:
        with pytest.raises(RuntimeError, match="boom"):
            loss().backward()
        opt.zero_grad(set_to_none=True)
        loss().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        out_grad = torch.ones(64, 128)  # d loss / d b(x): every gradient of the sum is 1
        opt.step()
        opt.zero_grad(set_to_none=False)  # in place, before the capture ends
    for name, g in grads.items():
        assert tr.params[name].grad_norm == pytest.approx(
            torch.linalg.vector_norm(g).item(), rel=1e-5)
    last = [g for g in tr.backward if g.module == "b"][-1]
    assert last.stats is not None  # drained at the end of its backward, not dropped at exit
    assert_stats(last.stats, out_grad)


def test_the_worker_holds_a_bounded_number_of_unread_tensors(monkeypatch):
    """A long no_grad loop the worker falls behind on: the batch waits for it once the
    tensors it holds pass MAX_PENDING_BYTES, so they are let go."""
    import hooks.tensors.stats as stats
    from hooks.tensors.stats import StatsBatch, _shared_worker

    monkeypatch.setattr(stats, "MAX_PENDING_BYTES", 1 << 20)
    batch = StatsBatch(background=True)
    alive = []
    gate = threading.Event()  # the worker is held until the batch passes its bound
    _shared_worker().put(lambda _: gate.wait(10), None, urgent=True)
    threading.Timer(0.5, gate.set).start()
    xs = []
    for _ in range(40):
        x = torch.randn(256, 256)  # 256 KiB each: 10 MiB in all
        xs.append(x.clone())
        alive.append(weakref.ref(x))
        batch.add(x)
        del x
        assert sum(r() is not None for r in alive) <= 5
    out = batch.finalize()
    for st, x in zip(out, xs, strict=True):
        assert_stats(st, x)


def test_gc_threshold_is_restored_when_captures_stop_out_of_order():
    before = gc.get_threshold()
    a, b = hooks.capture(nn.Linear(2, 2)), hooks.capture(nn.Linear(2, 2))
    a.start()
    b.start()
    assert gc.get_threshold()[0] >= 20_000
    a.stop()
    b.stop()
    assert gc.get_threshold() == before


def test_a_dropped_output_is_said_on_its_call_and_a_nan_origin_is_hedged(monkeypatch):
    """With the worker, a's output (log of negatives: NaN) is doubled in place after its hook
    and not recorded: its call says so, and the trace says the NaN's origin may be earlier
    than the module it names."""
    from hooks.tensors.stats import _shared_worker

    class LogThenScale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Identity(), nn.Identity()

        def forward(self, x):
            h = self.a(torch.log(x))  # NaN where x < 0
            out = self.b(h * 1.0)
            h.mul_(2.0)
            return out

    monkeypatch.setattr(Capture, "background", True)
    x = torch.randn(64, 64)
    gate = threading.Event()
    _shared_worker().put(lambda _: gate.wait(10), None, urgent=True)
    m = LogThenScale()
    with torch.no_grad(), hooks.capture(m) as tr:
        m(x)
        gate.set()
    assert tr.call("a").outputs[0].stats is None
    assert any("not recorded: written in place" in n for n in tr.call("a").notes)
    assert {"modified_in_place", "nonfinite_origin"} <= {n.kind for n in tr.notes}
