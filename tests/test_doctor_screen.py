"""``DoctorScreen``: the results table, the detail panel, and jumping to a finding's module."""

from __future__ import annotations

import pytest
import torch
from textual.app import App
from textual.widgets import DataTable, Static

from hooks.checks import CheckResult
from tui import messages
from tui.screens.doctor import DoctorScreen, summary_line

RESULTS = [
    CheckResult(1, "init-loss", "Initial loss vs ln(V)", "pass", "loss 5.5 vs ln(V) 5.5",
                module="lm_head"),
    CheckResult(4, "gqa", "GQA head grouping", "fail", "KV head 0 -> heads [0, 2]",
                "use repeat_interleave", module="model.layers.0.self_attn"),
    CheckResult(6, "routing", "MoE routing health", "warn", "load ×3.5", "check aux"),
    CheckResult(10, "overfit", "Overfit one batch", "skip", "not run"),
]


class Host(App):
    """Pushes the doctor screen and records what comes back."""

    def __init__(self, results):
        super().__init__()
        self.results = results
        self.dismissed: list = []
        self.jumps: list = []

    def on_mount(self) -> None:
        self.push_screen(DoctorScreen(self.results, title="test"), self.dismissed.append)

    def on_jump_to_module(self, message: messages.JumpToModule) -> None:
        self.jumps.append(message)


def test_na_rows_are_listed_dim_and_counted():
    rows = [r.to_dict() for r in RESULTS] + [
        CheckResult(2, "causality", "Causality", "n/a", "a bidirectional encoder by design")
        .to_dict()]
    assert summary_line(rows) == "5 checks · 1 pass · 1 n/a · 1 skip · 1 warn · 1 fail"
    from tui.screens.doctor import JUMPABLE, STATUS_STYLE

    assert STATUS_STYLE["n/a"] == "dim" and "n/a" not in JUMPABLE


async def test_an_na_row_shows_its_reason_and_does_not_jump():
    rows = [CheckResult(2, "causality", "Causality (no look-ahead)", "n/a",
                        "a bidirectional encoder by design (HF BertForMaskedLM)")]
    app = Host(rows)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        table = app.screen.query_one("#doctor-table", DataTable)
        assert str(table.get_row_at(0)[2]) == "n/a"
        detail = str(app.screen.query_one("#doctor-detail", Static).render())
        assert "n/a" in detail and "bidirectional encoder by design" in detail
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, DoctorScreen) and app.jumps == []


def test_summary_line_counts_statuses():
    expect = "4 checks · 1 pass · 1 skip · 1 warn · 1 fail"
    assert summary_line([r.to_dict() for r in RESULTS]) == expect


async def test_table_lists_every_result_and_starts_on_the_first_failure():
    app = Host(RESULTS)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, DoctorScreen)
        table = screen.query_one("#doctor-table", DataTable)
        assert table.row_count == 4
        assert [str(table.get_row_at(i)[2]) for i in range(4)] == ["pass", "fail", "warn", "skip"]
        assert table.cursor_row == 1
        detail = str(screen.query_one("#doctor-detail", Static).render())
        assert "KV head 0 -> heads [0, 2]" in detail and "use repeat_interleave" in detail
        assert "model.layers.0.self_attn" in detail


async def test_enter_on_a_failure_posts_the_jump_and_dismisses():
    app = Host(RESULTS)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()
        assert app.dismissed == ["model.layers.0.self_attn"]
        assert len(app.jumps) == 1
        msg = app.jumps[0]
        assert isinstance(msg, DoctorScreen.JumpToModule)
        assert isinstance(msg, messages.JumpToModule)
        assert msg.module == "model.layers.0.self_attn" and msg.call_index == 0
        assert not isinstance(app.screen, DoctorScreen)


async def test_enter_on_a_pass_or_a_finding_without_module_stays():
    app = Host(RESULTS)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        await pilot.press("up", "enter")          # row 0: pass
        await pilot.press("down", "down", "enter")  # row 2: warn without a module
        await pilot.pause()
        assert isinstance(app.screen, DoctorScreen)
        assert app.dismissed == [] and app.jumps == []
        await pilot.press("escape")
        await pilot.pause()
        assert app.dismissed == [None]


async def test_accepts_json_dicts():
    app = Host([r.to_dict() for r in RESULTS])
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        assert app.screen.query_one("#doctor-table", DataTable).row_count == 4


@pytest.fixture
def tiny_trace_and_results():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        import hooks
        from hooks.checks import run_checks
        from tests import zoo
        from tui.commands._common import Workload, capture_step

        model, batch = zoo.gqa_repeat()
        results = run_checks(model, batch, only="gqa,tied")
        trace = capture_step(Workload(model=model, batch=hooks.Batch.of(batch)),
                             attention=False)
        yield trace, results
    finally:
        torch.set_num_threads(n)


async def test_step_app_d_then_enter_selects_the_module(tiny_trace_and_results):
    from tui.app import make_step_app
    from tui.screens.step import StepScreen

    trace, results = tiny_trace_and_results
    assert [r.status for r in results] == ["fail", "pass"]
    app = make_step_app(trace, doctor_results=results)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        await pilot.press("d")
        await pilot.pause()
        assert isinstance(app.screen, DoctorScreen)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, StepScreen)
        assert app.screen.stepper.call.module == "model.layers.0.self_attn"


async def test_doctor_app_opens_on_the_doctor_view(tiny_trace_and_results):
    from tui.commands.doctor import make_doctor_app
    from tui.screens.step import StepScreen

    trace, results = tiny_trace_and_results
    app = make_doctor_app(trace, results, title="t")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, DoctorScreen)
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, StepScreen)
        await pilot.press("d")
        await pilot.pause()
        assert isinstance(app.screen, DoctorScreen)
