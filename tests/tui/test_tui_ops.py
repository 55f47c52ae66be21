"""Pilot tests of stepping into a call (``i`` in the step view, :class:`OpsScreen`)."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from textual.widgets import DataTable, Static

from tests.conftest import wait_until
from tests.hooks.trace.test_ops import CASES, _capture, _line_of, _user_gpt
from tui.app import make_step_app
from tui.screens.ops import OpsScreen
from tui.screens.step import StepScreen

SIZE = (80, 24)


def _text(app, sel: str) -> str:
    """What a Static shows, as plain text (Rich renderables rendered at the screen's width)."""
    from rich.console import Console

    console = Console(width=SIZE[0], record=True, file=io.StringIO())
    console.print(app.screen.query_one(sel, Static).content)
    return console.export_text()


async def test_i_steps_into_the_nan_call_f_finds_the_softmax_u_steps_out():
    model, (idx, tgt) = _user_gpt().nanogpt_nan()
    trace = _capture(model, idx, tgt)
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))
        assert app.screen.stepper.module == "h.1.attn"  # opened at the first non-finite call
        await pilot.press("i")
        await wait_until(pilot, lambda: isinstance(app.screen, OpsScreen)
                         and app.screen.optrace is not None)
        table = app.screen.query_one("#ops", DataTable)
        ot = trace.op_traces[("h.1.attn", 0)]
        assert table.row_count == len(ot.ops) == 22
        first = ot.first_nonfinite()
        assert table.cursor_row == first.index  # the cursor starts at the op that made NaN
        line = _line_of(Path(CASES), "F.softmax(att, dim=-1)")
        detail = _text(app, "#op-detail")
        assert f"user_gpt.py:{line}" in detail and "all -inf (32 of 32)" in detail
        await pilot.press("p", "p")
        assert table.cursor_row == first.index - 2
        await pilot.press("f")
        assert table.cursor_row == first.index
        await pilot.press("u")
        assert isinstance(app.screen, StepScreen)


async def test_a_loaded_trace_says_why_there_are_no_ops(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    trace = _capture(model, torch.randn(2, 3))
    trace.save(tmp_path / "t.mdbtrace")
    from hooks import Trace

    app = make_step_app(Trace.load(tmp_path / "t.mdbtrace"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))
        await pilot.press("i")
        await wait_until(pilot, lambda: isinstance(app.screen, OpsScreen)
                         and "not recorded" in _text(app, "#ops-status"))
        assert "loaded from disk" in _text(app, "#ops-status")


async def test_the_where_column_names_the_models_line_that_called_a_linear():
    """Stepping into the user's attention: ``self.qkv(x)`` and ``self.proj(y)`` (nn.Linear)
    are placed at those lines of user_gpt.py, not at torch's ``linear.py``."""
    model, (idx, tgt) = _user_gpt().nanogpt_tuple()
    trace = _capture(model, idx, tgt, backward=False)
    app = make_step_app(trace)
    qkv = _line_of(Path(CASES), "self.qkv(x).split(D, dim=2)")
    proj = _line_of(Path(CASES), "return self.proj(y)")
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))
        await pilot.press("slash")
        await pilot.press(*"h.0.attn", "enter")
        await wait_until(pilot, lambda: app.screen.stepper.module == "h.0.attn")
        await pilot.press("i")
        await wait_until(pilot, lambda: isinstance(app.screen, OpsScreen)
                         and app.screen.optrace is not None)
        table = app.screen.query_one("#ops", DataTable)
        rows = [[str(c) for c in table.get_row_at(r)] for r in range(table.row_count)]
        linear = [r for r in rows if r[1] == "linear"]
        assert [r[2] for r in linear] == [f"user_gpt.py:{qkv}", f"user_gpt.py:{proj}"]
        assert not any("linear.py" in r[2] for r in rows)


async def test_stepping_into_a_causal_masked_attention_names_no_nonfinite_origin():
    """Issue 35: the newcomer's ``masked_fill(causal, -inf)`` was named the first op creating
    non-finite values; it is masking, which the header says instead."""
    from tests.hooks.trace.test_ops_masking import _Model

    torch.manual_seed(0)
    model = _Model()
    trace = _capture(model, torch.randint(0, 11, (2, 5)), backward=False)
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))
        assert app.screen.stepper.jump_module("attn")
        await pilot.press("i")
        await wait_until(pilot, lambda: isinstance(app.screen, OpsScreen)
                         and app.screen.optrace is not None)
        status = _text(app, "#ops-status")
        assert "first op creating" not in status
        assert "masking" in status and "Tensor.masked_fill" in status
        # the whole sentence is on the screen at 80 columns, wrapped (never cut)
        ot = trace.op_traces[("attn", 0)]
        assert len(ot.nonfinite_sentence()) > 78
        assert app.screen.query_one("#ops-status").size.height >= 2
