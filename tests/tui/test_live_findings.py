"""``mdb watch`` shows the training-loop doctor's findings of a run (``LoopFindings``), the
errors first, and nothing for a run without findings."""

from __future__ import annotations

import pytest
import torch

from hooks.store.store import RunStore
from tests.conftest import drawn, wait_until
from tests.loop_models import TinyLM, batches, run_loop

pytestmark = pytest.mark.usefixtures("one_thread")


def _decays_everything(run):
    torch.manual_seed(0)
    m = TinyLM()
    o = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    run.watch(m, every=1, optimizer=o)
    for b in batches(2):
        m(**b)[1].backward()
        o.step()
        o.zero_grad()
        run.log(loss=1.0)


@pytest.mark.asyncio
async def test_watch_shows_the_loop_findings(tmp_path):
    from tui.live_app import make_watch_app
    from tui.screens.live_findings import LoopFindings

    db = tmp_path / "w.sqlite"
    found = run_loop(db, _decays_everything, name="wd")
    run_loop(db, lambda run: run.log(loss=1.0), name="clean")
    assert [f.detail["severity"] for f in found] == ["error", "warning"]
    with RunStore(db) as store:
        app = make_watch_app(store, store.run("wd"))
        async with app.run_test(size=(100, 30)) as pilot:
            widget = app.live.query_one(LoopFindings)
            await wait_until(pilot, lambda: len(widget.findings) == 2)
            assert widget.display
            lines = widget.text().plain.splitlines()
            assert lines[0].startswith("✗ loop: weight decay 0.1 on 4 norm weight(s)")
            assert lines[1].startswith("⚠ loop: weight decay 0.1 on embedding(s)")
        app = make_watch_app(store, store.run("clean"))
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_until(pilot, lambda: app.live.polls >= 1)
            await drawn(pilot, app.live)  # the first read shown: no finding in it
            widget = app.live.query_one(LoopFindings)
            assert not widget.display and widget.findings == []


@pytest.mark.asyncio
async def test_a_loop_finding_wraps_whole_at_80_columns_and_f_opens_them_all(tmp_path):
    """Issue 35: a loop finding was cut at 80 columns, with no key to read it whole."""
    import html
    import re

    from tui.live_app import make_watch_app
    from tui.screens.live_findings import FindingsScreen, LoopFindings

    db = tmp_path / "w.sqlite"
    found = run_loop(db, _decays_everything, name="wd")
    with RunStore(db) as store:
        app = make_watch_app(store, store.run("wd"))
        async with app.run_test(size=(80, 24)) as pilot:
            widget = app.live.query_one(LoopFindings)
            await wait_until(pilot, lambda: len(widget.findings) == 2)
            await drawn(pilot, app.live)
            first = next(f for f in found if f.detail["severity"] == "error")
            assert len(f"✗ loop: {first.line}") > 78  # longer than the line
            drawn_text = " ".join(
                html.unescape(t).replace("\u00a0", " ")
                for t in re.findall(r"<text [^>]*>([^<]*)</text>", app.export_screenshot()))
            words = " ".join(drawn_text.split())
            assert " ".join(f"loop: {first.line}".split()) in words  # wrapped, whole
            await pilot.press("f")
            await wait_until(pilot, lambda: isinstance(app.screen, FindingsScreen))
            full = str(app.screen.query_one("#findings-all").render())
            for f in found:
                assert " ".join(f.line.split()) in " ".join(full.split())
            await pilot.press("f")
            await wait_until(pilot, lambda: not isinstance(app.screen, FindingsScreen))
