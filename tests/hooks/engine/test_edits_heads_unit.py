"""``zero … head=h`` (hooks.engine.edit_apply) for every head, not only the last: the output
projection's input as the projection receives it must be the unedited input with exactly the
columns ``[h·Dh, (h+1)·Dh)`` zeroed (the reference is the slice written out by hand), and the
edit's ``changed`` count must look at head h's own columns, first and last included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hooks
from tests.zoo import batch_for, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def _o_proj_inputs(model, batch, edits=None):
    """The inputs o_proj of every layer received, in call order, under ``edits``. A plain
    forward pre-hook (appended) runs after the edit's own (prepended) one, so it sees the
    edited input."""
    seen = []
    handles = [layer.self_attn.o_proj.register_forward_pre_hook(
        lambda mod, args: seen.append(args[0].detach().clone()))
        for layer in model.model.layers]
    try:
        with torch.no_grad(), hooks.capture(model, edits=edits) as trace:
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return seen, trace


def test_zero_head_zeroes_exactly_its_own_columns_for_every_head():
    model = tiny()
    batch = batch_for(model)
    heads = model.config.num_attention_heads
    dh = model.model.layers[1].self_attn.o_proj.in_features // heads
    (plain0, plain1), _ = _o_proj_inputs(model, batch)
    for h in range(heads):
        edit = f"zero model.layers.1.self_attn head={h}"
        (got0, got1), trace = _o_proj_inputs(model, batch, [edit])
        assert torch.equal(got0, plain0)  # layer 0 untouched
        want = plain1.clone()
        want[..., h * dh:(h + 1) * dh] = 0
        assert torch.equal(got1, want), f"head={h}"
        assert bool(plain1[..., h * dh:(h + 1) * dh].ne(0).any())
        assert trace.edits[0].changed == 1 and trace.edits[0].note is None


# -- the changed count, on an attention module whose o_proj input the test writes ----------
class _Attention(nn.Module):
    num_heads = 4

    def __init__(self) -> None:
        super().__init__()
        self.o_proj = nn.Linear(8, 3)  # H=4, Dh=2

    def forward(self, x):
        return self.o_proj(x)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()

    def forward(self, x):
        return self.attn(x)


def _applied(x: torch.Tensor, h: int):
    net = _Net()
    with torch.no_grad(), hooks.capture(net, edits=[f"zero attn head={h}"]) as trace:
        net(x)
    return trace.edits[0]


@pytest.mark.parametrize("h", range(4))
@pytest.mark.parametrize("col", [0, 1])  # head h's first and last column (Dh=2)
def test_a_head_with_one_nonzero_column_is_changed(h, col):
    x = torch.zeros(2, 8)
    x[:, 2 * h + col] = 1.0
    rec = _applied(x, h)
    assert rec.calls == 1 and rec.changed == 1 and rec.note is None


@pytest.mark.parametrize("h", range(4))
def test_a_head_whose_columns_are_zero_is_said_to_change_nothing(h):
    x = torch.ones(2, 8)
    x[:, 2 * h:2 * h + 2] = 0.0  # every other head nonzero
    rec = _applied(x, h)
    assert rec.calls == 1 and rec.changed == 0
    assert "changed nothing" in rec.note
