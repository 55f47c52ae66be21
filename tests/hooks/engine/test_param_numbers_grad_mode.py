"""A parameter's gradient numbers, read in its post-accumulate-grad hook, against torch's own
reductions: in the usual backward (the hook runs in no-grad mode, where the gradient and weight
are read without detaching them) and under ``create_graph=True`` (grad mode on: detached, so
reading them adds nothing to the graph)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hooks


@pytest.mark.parametrize("create_graph", [False, True])
def test_parameter_numbers_match_torch_in_either_grad_mode(create_graph):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(4, 6)
    with hooks.capture(m) as tr:
        m(x).square().sum().backward(create_graph=create_graph)
    for name, p in m.named_parameters():
        g, w = p.grad.detach().double(), p.detach().double()
        rec = tr.params[name]
        assert rec.status == "ok"
        assert rec.grad_norm == pytest.approx(float(g.norm()), rel=1e-6)
        assert rec.grad_abs_max == pytest.approx(float(g.abs().max()), rel=1e-6)
        assert rec.weight_norm == pytest.approx(float(w.norm()), rel=1e-6)
        # with create_graph the gradient carries its own graph; the capture's reads add none
        assert (p.grad.grad_fn is not None) == create_graph
