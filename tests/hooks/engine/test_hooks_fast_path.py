"""PyTorch fast paths that forward hooks turn off: said in a note exactly when they apply.

``nn.TransformerEncoderLayer`` runs one fused kernel (``torch._transformer_encoder_layer_fwd``)
in inference, but not while any of its modules has forward hooks. Whether the kernel ran is
measured here by counting its calls (``torch._transformer_encoder_layer_fwd`` is looked up at
call time); the capture's note must appear exactly when it ran without the capture.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

import hooks

D, H = 16, 4


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts of the fused kernels PyTorch's fast paths run."""
    calls = {"layer": 0, "mha": 0}
    layer_fwd, mha_fwd = torch._transformer_encoder_layer_fwd, torch._native_multi_head_attention

    def layer(*a, **k):
        calls["layer"] += 1
        return layer_fwd(*a, **k)

    def mha(*a, **k):
        calls["mha"] += 1
        return mha_fwd(*a, **k)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", layer)
    monkeypatch.setattr(torch, "_native_multi_head_attention", mha)
    return calls


def make_layer(**kw):
    torch.manual_seed(0)
    args = dict(d_model=D, nhead=H, dim_feedforward=32, dropout=0.0, batch_first=True)
    args.update(kw)
    return nn.TransformerEncoderLayer(**args)


X = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0))
PAD = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])

# (name, layer kwargs, train mode, grad enabled, call kwargs, input)
CASES = [
    ("eval, no_grad", {}, False, False, {}, X),
    ("eval, no_grad, padding mask", {}, False, False, {"src_key_padding_mask": PAD}, X),
    ("eval, no_grad, causal mask", {}, False, False,
     {"src_mask": nn.Transformer.generate_square_subsequent_mask(5), "is_causal": True}, X),
    ("eval, grad enabled", {}, False, True, {}, X),
    ("training", {}, True, False, {}, X),
    ("odd heads", {"nhead": 1}, False, False, {}, X),
    ("batch_first=False", {"batch_first": False}, False, False, {}, X),
    ("different norm eps", {}, False, False, {}, X),
    ("other activation", {"activation": torch.tanh}, False, False, {}, X),
    ("bias=False", {"bias": False}, False, False, {}, X),
    ("unbatched input", {}, False, False, {}, X[0]),
    ("fast path disabled", {}, False, False, {}, X),
]


FAST = {"eval, no_grad", "eval, no_grad, padding mask", "eval, no_grad, causal mask"}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_note_exactly_when_the_fused_kernel_would_have_run(case, kernel_calls):
    name, kw, train, grad, call_kw, x = case
    layer = make_layer(**kw).train(train)
    if name == "different norm eps":
        layer.norm2.eps = 1e-3
    fast = contextlib.nullcontext()
    if name == "fast path disabled":
        prev = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        fast = contextlib.ExitStack()
        fast.callback(torch.backends.mha.set_fastpath_enabled, prev)
    with fast, torch.set_grad_enabled(grad):
        ref = layer(x, **call_kw)
        ran = kernel_calls["layer"]
        with hooks.capture(layer) as tr:
            out = layer(x, **call_kw)
    assert kernel_calls["layer"] == ran  # the hooks turned it off (or it was off anyway)
    notes = [n for n in tr.notes if n.kind == "fast_path"]
    assert len(notes) == (1 if ran else 0), (name, ran, tr.notes)
    assert ran == (name in FAST), name  # what PyTorch 2.x does; the note follows it either way
    if ran:
        assert notes[0].module == "" and "1 call(s)" in notes[0].message
        # the standard path computes the same function
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert [r.module for r in tr.forward][:2] == ["", "self_attn"]


def test_expected_cases_do_take_the_fast_path(kernel_calls):
    """The grid above is not vacuous: the fused kernel runs in the plain eval/no_grad cases."""
    layer = make_layer().eval()
    with torch.no_grad():
        layer(X)
        layer(X, src_key_padding_mask=PAD)
    assert kernel_calls["layer"] == 2


def test_encoder_stack_with_padding_runs_nested_and_is_said(kernel_calls):
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(make_layer(), 2, enable_nested_tensor=True).eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are in prototype stage"
        ref = enc(X, src_key_padding_mask=PAD)
        assert kernel_calls["layer"] == 2
        with hooks.capture(enc) as tr:
            out = enc(X, src_key_padding_mask=PAD)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert sorted(n.module for n in tr.notes if n.kind == "fast_path") == ["layers.0", "layers.1"]
    assert not any(n.kind == "hook_error" for n in tr.notes), tr.notes
    # the layers' nested inputs and outputs are said, not summarised
    rec = tr.call("layers.0")
    assert rec.outputs == [] and any("nested tensor" in n for n in rec.notes)


def test_layer_with_hooks_before_the_capture_gets_no_note(kernel_calls):
    layer = make_layer().eval()
    handle = layer.register_forward_hook(lambda *a: None)
    try:
        with torch.no_grad(), hooks.capture(layer) as tr:
            layer(X)
    finally:
        handle.remove()
    assert not any(n.kind == "fast_path" for n in tr.notes)


def test_multihead_attention_fast_path_is_not_changed_by_the_hooks(kernel_calls):
    """``nn.MultiheadAttention`` does not look at hooks: its fused kernel runs with them too."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(D, H, batch_first=True).eval()
    with torch.no_grad():
        ref, _ = mha(X, X, X, need_weights=False)
        assert kernel_calls["mha"] == 1
        with hooks.capture(mha) as tr:
            out, _ = mha(X, X, X, need_weights=False)
    assert kernel_calls["mha"] == 2
    torch.testing.assert_close(out, ref)
    assert not any(n.kind == "fast_path" for n in tr.notes)
