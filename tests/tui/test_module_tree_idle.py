"""The module tree says why a module has no call (issue 35): an MoE expert that got no tokens
reads ``no tokens``, not its child count (``6 [3]`` read like a count); a container
(``ModuleList``) still shows its children, ``experts [3]``."""

from __future__ import annotations

import torch
from torch import nn

import hooks
from tui.widgets.module_tree import ModuleTree


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_proj(x) * self.up_proj(x))


class _Moe(nn.Module):
    """Every token goes to expert 0; experts 1 and 2 get none (the test's own routing)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(_Expert() for _ in range(3))
        self.unused = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[0](x)


def test_an_expert_without_tokens_says_so_and_a_container_counts_its_children():
    torch.manual_seed(0)
    model = _Moe()
    with hooks.capture(model) as trace:
        model(torch.randn(2, 4)).sum().backward()
    tree = ModuleTree(trace)
    assert tree.labels["experts.1"].plain == "1 no tokens"
    assert tree.labels["experts.2"].plain == "2 no tokens"
    assert tree.labels["experts"].plain == "experts [3]"  # a ModuleList: never called itself
    assert tree.labels["unused"].plain == "unused not called"  # not "unused [2]"
    assert tree.labels["experts.0"].plain.startswith("0 ")
    assert "no tokens" not in tree.labels["experts.0"].plain
