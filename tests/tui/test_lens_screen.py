"""``L`` in the step view (Pilot): the logit lens grid of the step's own batch, computed in a
worker; its last layer's row against the model's own logits computed here, Enter's top k
against their softmax; a trace loaded from disk says why it has no lens."""

from __future__ import annotations

import argparse

import pytest
import torch
from textual.widgets import DataTable, Static

from tui.app import make_step_app
from tui.commands.capturing import capture_step
from tui.screens.lens import LensScreen
from tui.screens.step import StepScreen

SIZE = (100, 30)
SEQ = 12


@pytest.fixture(scope="module")
def step():
    """(trace, workload) of ``mdb step --preset tiny --seq-len 12``."""
    from tui.commands.options import add_model_arguments
    from tui.commands.workload import build_workload

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    workload = build_workload(parser.parse_args(["--preset", "tiny", "--seq-len", str(SEQ)]))
    return capture_step(workload, attention=False), workload


def _text(widget) -> str:
    return str(widget.render())


async def test_L_opens_the_grid_and_enter_shows_a_cells_top_k(step):
    trace, workload = step
    ids = workload.batch.ids(workload.model)
    with torch.no_grad():
        probs = torch.softmax(workload.model(ids).logits.double(), -1)  # (B, T, V)
    labels = dict(zip(ids.reshape(-1).tolist(), trace.meta["tokens"], strict=True))
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        assert isinstance(app.screen, StepScreen)
        await pilot.press("L")
        screen = app.screen
        assert isinstance(screen, LensScreen)
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert screen.lens is not None
        assert "model.norm → lm_head" in _text(screen.query_one("#title", Static))
        grid = screen.query_one("#lens-grid", DataTable)
        assert grid.row_count == 2 and len(grid.columns) == SEQ + 1
        last = grid.get_row_at(1)
        for t in range(SEQ):
            want = int(probs[0, t].argmax())
            shown = last[t + 1].plain
            assert labels.get(want, f"#{want}").startswith(shown.rstrip("…"))
        grid.move_cursor(row=1, column=5)  # the last layer, position 4
        await pilot.press("enter")
        detail = _text(screen.query_one("#lens-detail", Static))
        assert detail.startswith("model.layers.1 · position 4")
        top = probs[0, 4].topk(5)
        for i, p in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert f"{labels.get(i, f'#{i}')} {p:.3f}" in detail
        await pilot.press("x")
        assert "sequence 2/2" in _text(screen.query_one("#status", Static))
        await pilot.press("s")
        assert isinstance(app.screen, StepScreen)


async def test_a_trace_from_disk_has_no_lens_and_says_why(step, tmp_path):
    from hooks import Trace

    trace, _ = step
    trace.save(tmp_path / "t.mdbtrace")
    app = make_step_app(Trace.load(tmp_path / "t.mdbtrace"))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("L")
        await pilot.pause()
        assert isinstance(app.screen, LensScreen)
        assert "loaded from disk" in _text(app.screen.query_one("#hint", Static))
        assert "mdb lens" in _text(app.screen.query_one("#hint", Static))


async def test_m_shows_the_mid_block_lens_and_enter_the_logit_attribution(step):
    """The mid-block grid against the model's own second norm input (a hook of the test's own)
    read through its final norm and head; the attribution's logit against the model's logit."""
    trace, workload = step
    model = workload.model
    ids = workload.batch.ids(model)
    mids = []
    hs = [b.post_attention_layernorm.register_forward_pre_hook(
        lambda m, a: mids.append(a[0].detach())) for b in model.model.layers]
    with torch.no_grad():
        logits = model(ids).logits
        mid_probs = [torch.softmax(model.lm_head(model.model.norm(m)).double(), -1)
                     for m in mids]
    for h in hs:
        h.remove()
    labels = dict(zip(ids.reshape(-1).tolist(), trace.meta["tokens"], strict=True))
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("L")
        screen = app.screen
        await app.workers.wait_for_complete()
        await pilot.pause()
        await pilot.press("m")
        await pilot.pause()
        assert "mid-block" in _text(screen.query_one("#status", Static))
        grid = screen.query_one("#lens-grid", DataTable)
        for layer in range(2):
            cells = grid.get_row_at(layer)
            for t in range(SEQ):
                want = int(mid_probs[layer][0, t].argmax())
                assert labels.get(want, f"#{want}").startswith(cells[t + 1].plain.rstrip("…"))
        grid.move_cursor(row=1, column=4)  # layer 1 (mid), position 3
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        tok = int(mid_probs[1][0, 3].argmax())
        dla = _text(screen.query_one("#lens-dla", Static))
        assert dla.startswith("direct logit attribution to") and "position 3" in dla
        assert f"logit {float(logits[0, 3, tok]):+.3f}" in dla
        assert "layers.0 attn" in dla and "heads: " in dla
        await pilot.press("m")
        assert "block outputs" in _text(screen.query_one("#status", Static))
