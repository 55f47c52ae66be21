"""Attention in the captures of ``run.watch`` (hooks.run): the attention view of a step recorded
without it says how a ``hooks.run`` user records it, and that way records it."""

from __future__ import annotations

import io

import pytest
import torch
from textual.widgets import Static

import hooks
from tests.conftest import REPO
from tests.families import nanogpt
from tui.app import make_step_app
from tui.commands.step import load_run_trace
from tui.screens.attention import AttentionScreen

pytestmark = pytest.mark.usefixtures("one_thread")
SIZE = (80, 24)


def _text(app, sel: str) -> str:
    from rich.console import Console

    console = Console(width=SIZE[0], record=True, file=io.StringIO())
    console.print(app.screen.query_one(sel, Static).content)
    return console.export_text()


def _loop(db, name: str, **watch) -> None:
    model, (x, y) = nanogpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hooks.run(name, db=db) as run:
        run.watch(model, every=2, **watch)
        for _ in range(2):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.log(loss=loss)


async def test_a_watched_step_without_attention_names_the_run_watch_option(tmp_path):
    db = tmp_path / "r.sqlite"
    _loop(db, "plain")
    app = make_step_app(load_run_trace("plain@2", str(db)))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("a")
        assert isinstance(app.screen, AttentionScreen)
        shown = " ".join(_text(app, "#grid").split())
        assert "run.watch(model, every=50, attention=True)" in shown
        assert "step 2 of run plain" in shown and "64 MiB" in shown
        assert "--no-attention" not in shown  # mdb capture's option: not the user's


async def test_run_watch_with_attention_true_shows_the_attention_grid(tmp_path):
    db = tmp_path / "r.sqlite"
    _loop(db, "att", attention=True)
    trace = load_run_trace("att@2", str(db))
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("a")
        title = _text(app, "#title")
        assert "attention · layer 0 (1/2)" in title
        rows = [line for line in _text(app, "#grid").splitlines() if "│" in line]
        assert len(rows) >= 10 and rows[0].split("│")[1].strip()  # query 0 sees key 0


def test_the_own_loop_guide_documents_the_run_watch_attention_option():
    guide = (REPO / "docs" / "own-loop.md").read_text(encoding="utf-8")
    assert "run.watch(model, every=50, attention=True)" in guide
