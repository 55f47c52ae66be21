"""The step view's `/` search box and its help screen, as a newcomer meets them: Ctrl-C cancels
the search (as Esc, as in less and vim) and a second Ctrl-C quits; a key's description that does
not fit the help box continues under the description column, not at column 0.

Expected descriptions come from the screens' own ``Binding`` objects, never from the widget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from textual.app import App
from textual.binding import Binding
from textual.geometry import Region

import tui
from tests.models import tiny_workload
from tui.app import make_step_app
from tui.commands.capturing import capture_step
from tui.screens.base import key_label
from tui.screens.help import HelpScreen
from tui.screens.search import SearchScreen
from tui.screens.step import StepScreen


@pytest.fixture(scope="module")
def trace():
    """One captured step of the tiny preset."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return capture_step(tiny_workload())
    finally:
        torch.set_num_threads(threads)


async def test_ctrl_c_in_the_search_box_cancels_then_quits(trace):
    app = make_step_app(trace)
    async with app.run_test(size=(80, 24)) as pilot:
        step = app.screen
        assert isinstance(step, StepScreen)
        before = step.stepper.current
        await pilot.press("slash", "l", "a", "y")
        assert isinstance(app.screen, SearchScreen)
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert app.screen is step  # cancelled, as Esc: back in the step view, nowhere else
        assert step.stepper.current is before
        assert app.is_running
        await pilot.press("ctrl+c")  # what Ctrl-C does in the step view: quit
        await pilot.pause()
        assert not app.is_running
    assert app.return_code in (0, None)


class _HelpApp(App[None]):
    """The step view's help alone, with mdb's style sheet (no trace needed)."""

    CSS_PATH = str(Path(tui.__file__).parent / "app.tcss")

    def on_mount(self) -> None:
        self.push_screen(HelpScreen(StepScreen.help_text()))


def _rendered(widget) -> list[str]:
    width = widget.region.width
    return ["".join(seg.text for seg in strip).rstrip()
            for strip in widget.render_lines(Region(0, 0, width, widget.virtual_size.height))]


def _descriptions() -> dict[str, list[str]]:
    """Keys as the help writes them -> the descriptions of the bindings with those keys."""
    out: dict[str, list[str]] = {}
    for _title, bindings in StepScreen.help_sections():
        for b in bindings:
            if isinstance(b, Binding):
                keys = " ".join(key_label(k.strip()) for k in b.key.split(","))
                out.setdefault(keys, []).append(" ".join((b.tooltip or b.description).split()))
    return out


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_help_descriptions_wrap_under_their_column(size):
    expected = _descriptions()
    app = _HelpApp()
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        widget = app.screen.query_one("#help-text")
        lines = _rendered(widget)
        width = widget.region.width
    assert width >= 60
    column = 2 + 16 + 1  # two spaces, the keys column, one space
    rows: list[tuple[str, str]] = []  # (keys, description as read across its lines)
    wrapped = 0
    for line in lines:
        assert len(line) <= width
        if line.startswith(" " * column):  # a description continued under its column
            assert rows, line
            assert line[column] != " ", line
            rows[-1] = (rows[-1][0], rows[-1][1] + " " + line.strip())
            wrapped += 1
        elif line.startswith("  "):
            assert line[2] != " " and line[column - 1] == " " and line[column] != " ", line
            rows.append((line[2:column].strip(), line[column:].strip()))
        # else the intro, a section title or a blank line (a description continued at column 0
        # would be one too, and leave its row incomplete: caught below)
    assert wrapped >= 3  # at 72 columns several descriptions need a second line
    assert len(rows) == sum(len(v) for v in expected.values())
    for keys, text in rows:
        assert text in expected[keys], (keys, text)
