"""``DoctorScreen``: the results table, the detail panel, and jumping to a finding's module."""

from __future__ import annotations

import pytest
import torch
from textual.app import App
from textual.widgets import DataTable, Static

from hooks.doctor.model import CheckResult
from tui import messages
from tui.screens.doctor import DoctorScreen, summary_line
from tui.screens.doctor_evidence import EvidenceScreen

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
        await pilot.press("enter")  # its evidence in full; nothing to jump to
        await pilot.pause()
        assert isinstance(app.screen, EvidenceScreen) and app.jumps == []
        assert "bidirectional encoder by design" in str(
            app.screen.query_one("#evidence", Static).render())
        await pilot.press("enter")  # names no module: Enter does nothing
        await pilot.pause()
        assert isinstance(app.screen, EvidenceScreen) and app.jumps == []
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, DoctorScreen)


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


async def test_enter_on_a_pass_or_a_finding_without_module_opens_its_evidence():
    app = Host(RESULTS)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        await pilot.press("up", "enter")          # row 0: pass
        await pilot.pause()
        assert isinstance(app.screen, EvidenceScreen)
        assert "loss 5.5 vs ln(V) 5.5" in str(app.screen.query_one("#evidence").render())
        await pilot.press("escape")
        await pilot.press("down", "down", "enter")  # row 2: warn without a module
        await pilot.pause()
        assert isinstance(app.screen, EvidenceScreen)
        assert "load ×3.5" in str(app.screen.query_one("#evidence").render())
        await pilot.press("escape")
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
        from hooks.doctor.model import run_checks
        from tests import zoo
        from tui.commands.capturing import capture_step
        from tui.commands.workload import Workload

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


async def test_doctor_tui_enter_on_a_passing_row_opens_its_evidence_then_its_module(
        tiny_trace_and_results):
    """`mdb doctor --tui`: Enter on a passing check shows what it measured (its evidence and
    numbers), and Enter there opens the module it measured in the step view."""
    from tui.commands.doctor import make_doctor_app
    from tui.screens.step import StepScreen

    trace, results = tiny_trace_and_results
    tied = results[1].to_dict()
    assert tied["status"] == "pass" and tied["module"] and tied["data"]
    app = make_doctor_app(trace, results, title="t")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, DoctorScreen)
        detail = str(app.screen.query_one("#doctor-detail", Static).render())
        await pilot.press("down")  # the first failure, then the passing tied-weights row
        await pilot.pause()
        detail = str(app.screen.query_one("#doctor-detail", Static).render())
        assert "Enter: the evidence in full" in detail
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, EvidenceScreen)
        shown = str(app.screen.query_one("#evidence", Static).render())
        assert tied["evidence"] in " ".join(shown.split()) or tied["evidence"][:40] in shown
        assert "measured" in shown and f"module: {tied['module']}" in shown
        first_key = next(iter(tied["data"]))
        assert f"{first_key}:" in shown
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, StepScreen)
        assert app.screen.stepper.call.module == tied["module"]


# -- keys, as in the step debugger's other views ----------------------------------------------
def _footer(screen) -> dict[str, str]:
    from textual.widgets._footer import FooterKey

    return {k.description: k.key_display for k in screen.query(FooterKey)}


async def test_the_footer_lists_the_keys_from_the_first_frame():
    app = Host(RESULTS)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        keys = _footer(app.screen)
        assert {"jump", "step", "keys", "quit"} <= set(keys)
        assert keys["quit"] == "q" and keys["keys"] == "?"


async def test_question_mark_lists_the_doctor_keys():
    from tui.screens.help import HelpScreen

    app = Host(RESULTS)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert "doctor view" in app.screen.text and "quit mdb" in app.screen.text
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, DoctorScreen)


async def test_q_quits_mdb_doctor_tui_and_s_returns_to_the_step_view(tiny_trace_and_results):
    from tui.commands.doctor import make_doctor_app
    from tui.screens.router import RouterScreen
    from tui.screens.step import StepScreen

    trace, results = tiny_trace_and_results
    app = make_doctor_app(trace, results, title="mdb doctor · tiny")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, DoctorScreen)
        title = str(app.screen.query_one("#doctor-title", Static).render())
        assert title.startswith("mdb doctor · 2 checks · 1 pass · 1 fail")  # before it is cut
        await pilot.press("question_mark")
        await pilot.pause()
        assert "step view" in app.screen.text  # the step view's keys follow the doctor's
        await pilot.press("escape", "s")
        await pilot.pause()
        assert isinstance(app.screen, StepScreen)
        await pilot.press("d", "r")
        await pilot.pause()
        assert isinstance(app.screen, RouterScreen)
        await pilot.press("d", "q")
        await pilot.pause()
        assert app.return_code == 0 and not app.is_running


async def test_the_doctor_view_keeps_the_too_small_guard(tiny_trace_and_results):
    from tui.commands.doctor import make_doctor_app

    trace, results = tiny_trace_and_results
    app = make_doctor_app(trace, results)
    async with app.run_test(size=(70, 20)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, DoctorScreen) and screen.has_class("-too-small")
        assert "terminal too small (70×20)" in str(screen.query_one("#too-small").render())
        await pilot.press("s", "enter")  # ignored while too small
        await pilot.pause()
        assert app.screen is screen
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running


async def test_d_on_a_saved_trace_says_how_to_run_the_checks(tiny_trace_and_results):
    from tui.app import make_step_app
    from tui.screens.doctor_slot import NoDoctorScreen

    trace, _ = tiny_trace_and_results
    trace.meta["description"] = "minillm tiny · 113k params · 2×16 of alice.txt"
    app = make_step_app(trace)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("d")
        await pilot.pause()
        assert isinstance(app.screen, NoDoctorScreen)
        text = " ".join(str(app.screen.query_one("#nodoctor-text", Static).render()).split())
        assert "mdb doctor --preset tiny --tui" in text and "mdb step --preset tiny" in text
