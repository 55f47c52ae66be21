"""The step view's ``d`` key runs the doctor's checks on demand on the live model."""

from __future__ import annotations

import torch
from textual.widgets import DataTable

from hooks.doctor.model import run_checks
from tests.models import tiny_workload
from tui.app import MdbApp
from tui.commands.capturing import capture_step
from tui.commands.step import run_doctor
from tui.screens.doctor import DoctorScreen
from tui.screens.step import StepScreen


async def test_d_runs_the_checks_and_lists_what_run_checks_returns():
    torch.set_num_threads(1)
    workload = tiny_workload()
    trace = capture_step(workload, attention=True)
    expected = [(r.key, r.status) for r in run_checks(workload)]  # the reference: a direct run
    app = MdbApp(trace, doctor_runner=lambda on_result: run_doctor(workload, on_result))
    async with app.run_test(size=(80, 24)) as pilot:
        assert isinstance(app.screen, StepScreen)
        await pilot.press("d")
        screen = app.screen
        assert isinstance(screen, DoctorScreen)
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert not screen.running
        assert [(r["key"], r["status"]) for r in screen.rows] == expected
        table = screen.query_one("#doctor-table", DataTable)
        assert table.row_count == len(expected)
        await pilot.press("d")  # closes; pressing again shows the same results, not a re-run
        await pilot.press("d")
        assert app.screen is screen and len(screen.rows) == len(expected)
