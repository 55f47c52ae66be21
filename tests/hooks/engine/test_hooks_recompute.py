"""Activation checkpointing: calls re-run during backward are kept with the call they repeat.

Every test compares a checkpointed model with the same model (same weights) run plainly: the
forward records, per-call output gradients, parameter gradients, routing and attention records
must be the same, and the parameter gradients the ones autograd put in ``.grad``.
"""

from __future__ import annotations

import functools
import math
import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hooks
from minillm import MiniLLM, load_preset
from tests.families import FAMILIES

MODES = [True, False]  # use_reentrant


def run(model, *args, backward=True, **capture_kw):
    """Capture one forward (+ backward of the output's sum or ``.loss``)."""
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF: "use_cache=True is incompatible", deprecations
        with hooks.capture(model, **capture_kw) as tr:
            out = model(*args[:-1], **args[-1]) if isinstance(args[-1], dict) else model(*args)
            if backward:
                loss = out.loss if hasattr(out, "loss") else out
                loss = loss if loss.dim() == 0 else loss.sum()
                loss.backward()
    return tr


def assert_same_capture(plain, ckpt, model=None, atol=1e-6, skip_grads=()):
    """Same calls, same per-call output gradients, same parameter gradients (output gradients
    whose path starts with one of ``skip_grads`` are not compared)."""
    assert [r.key for r in ckpt.forward] == [r.key for r in plain.forward]
    assert [(r.parent, r.depth) for r in ckpt.forward] == [
        (r.parent, r.depth) for r in plain.forward
    ]
    for a, b in zip(plain.forward, ckpt.forward, strict=True):
        assert [t.shape for t in a.outputs] == [t.shape for t in b.outputs]
        for ta, tb in zip(a.outputs, b.outputs, strict=True):
            assert ta.stats.mean == pytest.approx(tb.stats.mean, abs=atol), a.key
    g_plain = {g.key: g for g in plain.backward}
    g_ckpt = {g.key: g for g in ckpt.backward}
    if skip_grads:
        g_plain = {k: g for k, g in g_plain.items() if not k[2].startswith(skip_grads)}
        g_ckpt = {k: g for k, g in g_ckpt.items() if not k[2].startswith(skip_grads)}
    assert set(g_ckpt) == set(g_plain)
    for key, g in g_plain.items():
        h = g_ckpt[key]
        assert h.forward_index == g.forward_index and h.shape == g.shape
        for stat in ("mean", "std", "l2", "abs_max"):
            assert getattr(h.stats, stat) == pytest.approx(getattr(g.stats, stat), abs=atol), key
    assert set(ckpt.params) == set(plain.params)
    for name, p in plain.params.items():
        q = ckpt.params[name]
        assert q.status == p.status, name
        if p.grad_norm is not None:
            assert q.grad_norm == pytest.approx(p.grad_norm, rel=1e-5, abs=atol), name
    if model is not None:  # and they are the gradients autograd accumulated
        for name, p in model.named_parameters():
            if p.grad is not None:
                ref = p.grad.double().norm().item()
                assert ckpt.params[name].grad_norm == pytest.approx(ref, rel=1e-5, abs=1e-9)


# -- torch.utils.checkpoint on small models ------------------------------------------------------
class Outer(nn.Module):
    """checkpoint() around a submodule call (the submodule's own hooks are inside the region)."""

    def __init__(self, ckpt: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.ckpt = ckpt

    def forward(self, x):
        if self.ckpt is None:
            h = self.inner(x)
        else:
            h = checkpoint(self.inner, x, use_reentrant=self.ckpt)
        return self.head(h)


@pytest.mark.parametrize("reentrant", MODES)
def test_checkpointed_submodule_is_recorded_once_with_its_gradients(reentrant):
    x = torch.randn(3, 4, requires_grad=True)
    plain = Outer(None)
    tr_plain = run(plain, x)
    model = Outer(reentrant)
    tr = run(model, x)
    assert len(tr.forward) == len(tr_plain.forward) == 6
    assert_same_capture(tr_plain, tr, model)
    assert [r.recomputed for r in tr.forward] == [0, 1, 1, 1, 1, 0]
    assert "recomputed during backward" in tr.call("inner.0").notes[0]
    assert any(n.kind == "recomputed" for n in tr.notes)
    # reentrant checkpointing ran the region under no_grad: its gradients came from the re-run
    assert not any(n.kind in ("no_grad", "recompute_differs") for n in tr.notes), tr.notes
    assert all(t.requires_grad for r in tr.forward for t in r.outputs)


class Shared(nn.Module):
    """One block called five times: three checkpointed regions of one call each, then one region
    calling it twice. Each call's output gradient differs, so a call matched to the wrong
    original would show up as a gradient on the wrong record."""

    def __init__(self, ckpt: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.ckpt = ckpt

    def _region(self, fn, x):
        return fn(x) if self.ckpt is None else checkpoint(fn, x, use_reentrant=self.ckpt)

    def forward(self, x):
        for _ in range(3):
            x = self._region(self.block, x) * 1.5
        x = self._region(lambda y: self.block(self.block(y) * 0.5), x)
        return (x * torch.arange(4.0)).sum()


@pytest.mark.parametrize("reentrant", MODES)
def test_a_module_called_in_several_regions_keeps_each_call_apart(reentrant):
    x = torch.randn(2, 4, requires_grad=True)
    tr_plain = run(Shared(None), x)
    model = Shared(reentrant)
    tr = run(model, x)
    assert [r.call_index for r in tr.calls("block")] == [0, 1, 2, 3, 4]
    assert_same_capture(tr_plain, tr, model)
    assert all(r.recomputed == 1 for r in tr.calls("block.0"))
    # the gradients really differ per call (so the comparison above can tell calls apart)
    norms = [g.stats.l2 for g in tr_plain.backward if g.module == "block"]
    assert len(set(round(n, 6) for n in norms)) == 5


def test_recomputation_that_differs_from_the_forward_is_said():
    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.drop = nn.Dropout(0.5)
            self.out = nn.Linear(8, 8)

        def forward(self, x):
            f = lambda y: self.out(self.drop(self.lin(y)))  # noqa: E731
            return checkpoint(f, x, use_reentrant=False, preserve_rng_state=False).sum()

    torch.manual_seed(0)
    model = Drop().train()
    x = torch.randn(16, 8, requires_grad=True)
    tr = run(model, x)
    assert len(tr.forward) == 4 and tr.call("drop").recomputed == 1
    notes = [n for n in tr.notes if n.kind == "recompute_differs"]
    assert notes and notes[0].module == "drop"
    assert any("differs from this call's" in n for n in tr.call("drop").notes)
    # with the RNG state preserved (the default) the re-run is exact: nothing is said
    model.forward = lambda x: checkpoint(
        lambda y: model.out(model.drop(model.lin(y))), x, use_reentrant=False
    ).sum()
    tr = run(model, x)
    assert tr.call("drop").recomputed == 1
    assert not any(n.kind == "recompute_differs" for n in tr.notes)


def test_recomputed_count_survives_save_and_load(tmp_path):
    x = torch.randn(3, 4, requires_grad=True)
    tr = run(Outer(False), x)
    tr.save(tmp_path / "t.mdbtrace")
    back = hooks.Trace.load(tmp_path / "t.mdbtrace")
    assert [r.recomputed for r in back.forward] == [r.recomputed for r in tr.forward]


# -- minillm with checkpointed decoder layers: routing and attention records -----------------------
def checkpoint_layers(model: MiniLLM, reentrant: bool, around_call: bool) -> MiniLLM:
    """Checkpoint every decoder layer: its ``forward`` (HF's way: the layer's hooks stay outside
    the region) or its whole ``__call__`` (the layer's hooks inside)."""
    for layer in model.model.layers:
        inner = layer.__call__ if around_call else layer.forward

        def wrapped(hidden_states, _inner=inner, **kw):
            fn = functools.partial(_inner, **kw)
            return checkpoint(fn, hidden_states, use_reentrant=reentrant)

        if around_call:
            model.model.layers._modules[str(layer.layer_idx)] = _CallWrapper(layer, wrapped)
        else:
            layer.forward = wrapped
    return model


class _CallWrapper(nn.Module):
    """Stands in for a layer in the ModuleList and checkpoints the layer's whole call."""

    def __init__(self, layer: nn.Module, fn) -> None:
        super().__init__()
        self.layer = layer
        self._fn = fn

    def forward(self, hidden_states, **kw):
        return self._fn(hidden_states, **kw)


def tiny_moe() -> MiniLLM:
    torch.manual_seed(0)
    return MiniLLM(load_preset("tiny")).train()


@pytest.mark.parametrize("reentrant", MODES)
def test_minillm_checkpointed_layers_give_the_plain_routing_and_attention(reentrant):
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    plain = tiny_moe()
    tr_plain = run(plain, batch, attention=True)
    model = checkpoint_layers(tiny_moe(), reentrant, around_call=False)
    tr = run(model, batch, attention=True)
    # The router logits and the attention weights (asked for by the probe) are used inside the
    # layer and also returned by it. Reentrant checkpointing returns them as separate outputs
    # of its autograd Function, so the layer's out[1]/out[2] only get the gradient from outside
    # the layer (the aux loss; nothing for the weights): the part from inside exists only in
    # the re-run of the layer's body, and is recorded on mlp.gate / self_attn, which were re-run.
    skip = ("out[1]", "out[2]", "out.router_logits", "out.attentions") if reentrant else ()
    assert_same_capture(tr_plain, tr, model, skip_grads=skip)
    assert any(r.recomputed for r in tr.forward)
    assert len(tr.routing) == len(tr_plain.routing) == 2
    for a, b in zip(tr_plain.routing, tr.routing, strict=True):
        assert (a.module, a.call_index) == (b.module, b.call_index)
        assert torch.equal(a.top_k_ids, b.top_k_ids)
        torch.testing.assert_close(a.top_k_weights, b.top_k_weights, atol=1e-6, rtol=0)
        assert a.aux_loss == pytest.approx(b.aux_loss, abs=1e-6)
    assert [(a.module, a.call_index) for a in tr.attention] == [
        (a.module, a.call_index) for a in tr_plain.attention
    ]
    assert len(tr.attention) == 2
    for a, b in zip(tr_plain.attention, tr.attention, strict=True):
        torch.testing.assert_close(a.probs, b.probs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("reentrant", MODES)
def test_minillm_layer_call_inside_the_region(reentrant):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids}
    tr_plain = run(tiny_moe(), batch)
    model = checkpoint_layers(tiny_moe(), reentrant, around_call=True)
    tr = run(model, batch)
    # the wrapper adds one module level; the layers' records are the plain ones, one level down
    def plain_name(name):
        return re.sub(r"^(model\.layers\.\d+)\.layer(?=\.|$)", r"\1", name)

    plain = [(r.module, r.call_index) for r in tr_plain.forward if ".layers." in r.module]
    ckpt = [(plain_name(r.module), r.call_index) for r in tr.forward
            if ".layers." in r.module and r.module_type != "_CallWrapper"]
    assert ckpt == plain
    assert all(r.recomputed == 1 for r in tr.forward if r.module.endswith(".layer"))
    assert len(tr.routing) == 2 and not any(n.kind == "no_grad" and ".layers." in (n.module or "")
                                            for n in tr.notes)
    for name, p in model.named_parameters():
        key = plain_name(name)
        assert tr.params[name].grad_norm == pytest.approx(tr_plain.params[key].grad_norm,
                                                          rel=1e-5)
        assert tr.params[name].grad_norm == pytest.approx(p.grad.double().norm().item(),
                                                          rel=1e-5)


# -- HF gradient checkpointing ---------------------------------------------------------------------
def hf(family: str, reentrant: bool | None):
    pytest.importorskip("transformers")
    model, batch = FAMILIES[family].build()
    model.train()
    if reentrant is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the v5 name is activation_...
            if reentrant is False:
                model.gradient_checkpointing_enable()  # transformers 5: non-reentrant
            else:
                model.gradient_checkpointing_enable({"use_reentrant": True})
    return model, batch


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_llama_gradient_checkpointing_equals_plain(reentrant):
    model, batch = hf("llama", None)
    tr_plain = run(model, batch, attention=True)
    model, batch = hf("llama", reentrant)
    tr = run(model, batch, attention=True)
    assert len(tr.forward) == len(tr_plain.forward) == 32
    assert_same_capture(tr_plain, tr, model)
    # one attention record per layer (the attention view read "layer 0 (1/4)" for 2 layers)
    assert [(a.module, a.call_index) for a in tr.attention] == [
        ("model.layers.0.self_attn", 0), ("model.layers.1.self_attn", 0)]
    for a, b in zip(tr_plain.attention, tr.attention, strict=True):
        torch.testing.assert_close(a.probs, b.probs, atol=1e-6, rtol=0)
    assert sum(r.recomputed for r in tr.forward) == 24  # 2 layers x 12 modules below the layer
    assert all(r.recomputed == 0 for r in tr.forward if r.module.count(".") <= 2)


def test_hf_mixtral_gradient_checkpointing_equals_plain():
    model, batch = hf("mixtral", None)
    tr_plain = run(model, batch)
    model, batch = hf("mixtral", False)
    tr = run(model, batch)
    assert_same_capture(tr_plain, tr, model)
    assert len(tr.routing) == len(tr_plain.routing) == 2
    for a, b in zip(tr_plain.routing, tr.routing, strict=True):
        assert (a.module, a.call_index) == (b.module, b.call_index)
        assert torch.equal(a.top_k_ids, b.top_k_ids)


def test_hf_mixtral_reentrant_checkpointing_records_what_autograd_computed():
    """With reentrant checkpointing HF Mixtral's router logits are recorded by a hook inside the
    no_grad region, so its aux loss has no gradient and the parameter gradients differ from the
    plain model's (HF's behaviour, checked here without mdb). The capture still has the plain
    model's calls, and the gradients it shows are the ones autograd computed."""
    model, batch = hf("mixtral", True)
    out = model(**batch)
    assert not out.aux_loss.requires_grad
    tr_plain = run(*hf("mixtral", None))
    model, batch = hf("mixtral", True)
    tr = run(model, batch)
    assert [r.key for r in tr.forward] == [r.key for r in tr_plain.forward]
    assert len(tr.routing) == 2
    for name, p in model.named_parameters():
        if p.grad is not None:
            ref = p.grad.double().norm().item()
            assert tr.params[name].grad_norm == pytest.approx(ref, rel=1e-5, abs=1e-9)
    assert math.isclose(sum(1 for g in tr.backward if g.module == "model.layers.0.mlp.experts"),
                        1)


def test_hf_checkpointed_summary_table_equals_plain():
    pytest.importorskip("rich")
    from rich.console import Console

    from tui.commands.summary import build_table

    def render(tr):
        import dataclasses

        # the memory columns differ, as they should: checkpointing saves less for backward
        tr = dataclasses.replace(tr, memory=None)
        console = Console(width=160, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
        console.print(build_table(tr))
        return console.export_text()

    model, batch = hf("llama", None)
    plain = render(run(model, batch))
    model, batch = hf("llama", False)
    assert render(run(model, batch)) == plain
