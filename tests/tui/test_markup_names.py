"""Names the user chose are shown as typed: a module called ``[/]`` or ``x[bold]y`` (any
``nn.ModuleDict`` key) is not Rich markup. A str cell of a Textual ``DataTable`` or an
``OptionList`` prompt is read as markup, so the gradients view raised ``MarkupError`` on
``d.[/].bias`` and the search box would have too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hooks
from tests.conftest import wait_until
from tui.app import make_step_app
from tui.screens.gradients import GradientsScreen
from tui.screens.search import SearchScreen

NAMES = ("[/]", "x[bold]y")


class Bracketed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.d = nn.ModuleDict({NAMES[0]: nn.Linear(16, 16), NAMES[1]: nn.Linear(16, 50)})

    def forward(self, ids):
        return self.d[NAMES[1]](self.d[NAMES[0]](self.emb(ids)))


@pytest.fixture(scope="module")
def trace():
    torch.manual_seed(0)
    model = Bracketed()
    ids = torch.randint(0, 50, (2, 8))
    with hooks.capture(model) as tr:
        model(ids).float().pow(2).mean().backward()
    return tr


@pytest.mark.asyncio
async def test_gradients_view_and_search_show_bracketed_names_as_typed(trace):
    app = make_step_app(trace)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("g")
        await wait_until(pilot, lambda: isinstance(app.screen, GradientsScreen))
        await pilot.pause()
        shot = app.export_screenshot()
        for name in NAMES:  # the weight rows of both layers, the brackets kept
            assert name.replace("[", "&#91;") in shot or name in shot, name
        await pilot.press("s")
        await pilot.press("slash")
        await wait_until(pilot, lambda: isinstance(app.screen, SearchScreen))
        await pilot.press(*"bold")
        await pilot.pause()
        results = app.screen.query_one("#search-results")
        assert [str(results.get_option_at_index(i).prompt)
                for i in range(results.option_count)] == [f"d.{NAMES[1]}"]
        await pilot.press("enter")
        await wait_until(pilot, lambda: not isinstance(app.screen, SearchScreen))
        assert app.is_running
