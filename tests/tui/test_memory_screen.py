"""``m`` in the step view (Pilot): the module tree with bytes per kind, its rows against the
model's own parameter bytes, Enter opening a module's first call; a trace without a memory
record says why."""

from __future__ import annotations

import argparse

import pytest
from textual.widgets import DataTable, Static

from tui.app import make_step_app
from tui.commands.capturing import capture_step
from tui.screens.memory import MemoryScreen
from tui.screens.step import StepScreen

SIZE = (120, 32)


@pytest.fixture(scope="module")
def step():
    from tui.commands.options import add_model_arguments
    from tui.commands.workload import build_workload

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    workload = build_workload(parser.parse_args(["--preset", "tiny", "--seq-len", "12"]))
    return capture_step(workload, attention=False), workload


async def test_m_shows_the_tree_and_enter_opens_the_module(step):
    from hooks.whatif.memory_fit import human_bytes

    trace, workload = step
    model = workload.model
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("m")
        screen = app.screen
        assert isinstance(screen, MemoryScreen)
        table = screen.query_one("#memory-table", DataTable)
        assert table.row_count == len(list(model.named_modules()))
        root = table.get_row_at(0)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        assert root[0].plain == "(root)" and root[2].plain == human_bytes(params)
        assert "peak" in str(screen.query_one("#memory-peak", Static).render())
        i = screen.names.index("model.layers.1.self_attn")
        table.move_cursor(row=i)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, StepScreen)
        assert app.screen.stepper.module == "model.layers.1.self_attn"


async def test_at_80x24_every_column_fits_and_an_empty_kind_is_left_out(step):
    """No horizontal scrolling at 80 columns: the module column gives way to the numbers. The
    step was captured without an optimizer: no optimizer column (the totals say 0 B)."""
    trace, _ = step
    app = make_step_app(trace)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("m")
        await pilot.pause()
        table = app.screen.query_one("#memory-table", DataTable)
        keys = [c.key.value for c in table.ordered_columns]
        assert keys == ["module", "most", "param", "grad", "saved", "retained", "total"]
        assert table.virtual_size.width <= table.scrollable_content_region.width
        peak = str(app.screen.query_one("#memory-peak", Static).render())
        assert "optimizer state 0 B" in peak


async def test_a_trace_without_memory_says_so(step):
    import dataclasses

    trace, _ = step
    old = dataclasses.replace(trace, memory=None)
    app = make_step_app(old)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("m")
        screen = app.screen
        assert isinstance(screen, MemoryScreen)
        assert "not available" in str(screen.query_one("#title", Static).render())
        assert "older mdb" in str(screen.query_one("#hint", Static).render())
