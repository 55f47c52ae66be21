"""The router view's tables updated in place from one layer to the next (issue 25): the cells,
the cursor and the column widths are those of a table built afresh for that layer.

Expected values come from the trace's routing records (``top_k_ids``, ``top_k_weights``) and from
a ``DataTable`` filled the ordinary way (``add_column``/``add_row``), never from ``refill``.
"""

from __future__ import annotations

import pytest
import torch
from textual.app import App
from textual.widgets import DataTable

from tests.models import tiny_workload
from tui.app import make_step_app
from tui.commands.capturing import capture_step
from tui.screens.router import RouterScreen, refill

SIZE = (80, 24)


@pytest.fixture(scope="module")
def trace():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return capture_step(tiny_workload(), attention=False)
    finally:
        torch.set_num_threads(threads)


def _cells(table: DataTable) -> list[list[str]]:
    return [[str(c) for c in table.get_row_at(n)] for n in range(table.row_count)]


async def test_back_and_forth_shows_each_layers_routing_with_cursor_home(trace):
    assert len(trace.routing) >= 2
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("r")
        screen = app.screen
        assert isinstance(screen, RouterScreen)
        tokens = screen.query_one("#tokens", DataTable)
        for _ in range(3):
            tokens.move_cursor(row=5)
            await pilot.press("N")
            rec = trace.routing[1]
            assert screen.record is rec and tokens.cursor_coordinate == (0, 0)
            got = [[int(c) for c in row[2::2]] for row in _cells(tokens)]
            assert got == rec.top_k_ids.tolist()
            await pilot.press("P")
            rec = trace.routing[0]
            got = torch.tensor([[float(c) for c in row[3::2]] for row in _cells(tokens)])
            torch.testing.assert_close(got, rec.top_k_weights.float(), atol=0.005, rtol=0)
            assert [[int(c) for c in row[2::2]] for row in _cells(tokens)] == \
                rec.top_k_ids.tolist()


class _Tables(App):
    def compose(self):
        yield DataTable(id="a")
        yield DataTable(id="b")


def _plain(table: DataTable, rows: list[list[str]]) -> None:
    table.clear(columns=True)
    for label in ("x", "y"):
        table.add_column(label, key=label)
    for n, row in enumerate(rows):
        table.add_row(*row, key=str(n))


@pytest.mark.parametrize("second", [[["1", "22"], ["3", "44"]],      # same widths: in place
                                    [["1", "22222"], ["3", "4"]]])   # wider: rebuilt
async def test_refill_matches_a_table_built_afresh(second):
    app = _Tables()
    async with app.run_test(size=(40, 12)) as pilot:
        a, b = app.query_one("#a", DataTable), app.query_one("#b", DataTable)
        refill(a, ["x", "y"], ["x", "y"], [["9", "88"], ["7", "66"]])
        await pilot.pause()
        a.move_cursor(row=1)
        refill(a, ["x", "y"], ["x", "y"], second)
        _plain(b, second)
        await pilot.pause()
        assert _cells(a) == second == _cells(b)
        assert a.cursor_coordinate == b.cursor_coordinate == (0, 0)
        assert [c.get_render_width(a) for c in a.ordered_columns] == \
            [c.get_render_width(b) for c in b.ordered_columns]
