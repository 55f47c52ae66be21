"""Pilot test: the step-into screen shows an op's notes (what the per-op tensor cap left out)."""

from __future__ import annotations

import torch
from textual.widgets import DataTable
from torch import nn

import hooks
import hooks.tensors.walk
import hooks.trace.ops
from tests.conftest import wait_until
from tests.tui.test_tui_ops import SIZE, _text
from tui.app import make_step_app
from tui.screens.ops import OpsScreen
from tui.screens.step import StepScreen


class Splitter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 12)

    def forward(self, x):
        return torch.stack(self.lin(x).unbind(-1), 0).sum(0)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.split = Splitter()

    def forward(self, x):
        return self.split(x) * 2


async def test_the_detail_pane_says_how_many_outputs_the_cap_left_out():
    torch.manual_seed(0)
    model = Outer()
    with hooks.capture(model) as trace:
        model(torch.randn(2, 4))
    cap = min(hooks.trace.ops.MAX_OP_TENSORS, hooks.tensors.walk.MAX_TENSORS)
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))
        await pilot.press("slash")
        await pilot.press(*"split", "enter")
        await wait_until(pilot, lambda: app.screen.stepper.module == "split")
        await pilot.press("i")
        await wait_until(pilot, lambda: isinstance(app.screen, OpsScreen)
                         and app.screen.optrace is not None)
        table = app.screen.query_one("#ops", DataTable)
        names = [str(table.get_row_at(r)[1]) for r in range(table.row_count)]
        row = names.index("Tensor.unbind")
        await pilot.press(*["n"] * (row - table.cursor_row))
        assert table.cursor_row == row

        def shown() -> str:
            return " ".join(_text(app, "#op-detail").split())

        await wait_until(pilot, lambda: "unbind" in shown())
        assert (f"• outputs: {cap} tensor(s) recorded, {12 - cap} not recorded (the first "
                f"left out: out[{cap}])") in shown()
