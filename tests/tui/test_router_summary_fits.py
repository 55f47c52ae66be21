"""The router view's summary is readable to its last line at 80×24 and at 120×40 (a newcomer's
test found its last line, "… gate's logits (block's rule)", cut at 80×24).

What is on screen is read from Textual's compositor (the cells drawn), and must hold every word
of the summary in order, without scrolling; the facts it must carry are computed here from the
model's inputs and the trace (the pads of the mask, the router's name, the layer's aux loss),
not taken from the view.
"""

from __future__ import annotations

import pytest
import torch
from textual.widgets import DataTable, Static

import hooks
from minillm import MiniLLM, load_preset
from tests.models import tiny_workload
from tui.app import make_step_app
from tui.commands.capturing import capture_step
from tui.commands.workload import Workload
from tui.screens.router import RouterScreen


def _capture(workload):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return capture_step(workload, attention=False)
    finally:
        torch.set_num_threads(threads)


def _padded_forced():
    """tiny minillm, a batch with 12 pads of 64 tokens, routers forced onto experts 0 and 1
    (both hot, 2 and 3 without tokens): the longest summary the view writes for minillm."""
    torch.manual_seed(0)
    model = MiniLLM(load_preset("tiny"))
    bias = torch.tensor([4.0, 3.0, 0.0, -4.0])
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, a, out: out * 0 + bias)
    ids = torch.randint(0, 256, (2, 32))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[0, :12] = 0
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask}
    return Workload(model=model, batch=hooks.Batch.of(batch), config=model.config.to_dict())


@pytest.fixture(scope="module", params=["tiny", "padded-forced"])
def case(request):
    """(trace, facts each layer's summary must state beside its own)."""
    if request.param == "tiny":
        return _capture(tiny_workload()), []
    return _capture(_padded_forced()), ["padded batch: 12 of 64 tokens are pads",
                                        "▲ expert 0:", "▲ expert 1:", "✗ no tokens: expert 2, 3"]


def _words(text: str) -> str:
    return " ".join(text.split())


def _on_screen(screen, widget) -> str:
    """The cells drawn in ``widget``'s columns, over the rows of the screen it spans."""
    region = widget.content_region
    rows = screen._compositor.render_strips()[region.y:region.bottom]
    return "\n".join(strip.text[region.x:region.right] for strip in rows)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_every_line_of_the_summary_is_on_screen(case, size):
    trace, facts = case
    app = make_step_app(trace)
    async with app.run_test(size=size) as pilot:
        await pilot.press("r")
        screen = app.screen
        assert isinstance(screen, RouterScreen)
        for position, rec in enumerate(trace.routing):
            await pilot.pause()
            assert screen.position == position
            summary = screen.query_one("#router-summary", Static)
            text = _words(str(summary.render()))
            for fact in facts + [f"layer aux loss {rec.aux_loss:.4f}", f"{rec.router}'s logits"]:
                assert fact in text
            # above the hint and footer lines, every word drawn, in order, nothing scrolled
            assert summary.content_region.bottom <= size[1] - 2
            assert text in _words(_on_screen(screen, summary))
            experts = screen.query_one("#experts", DataTable)
            assert experts.row_count == rec.num_experts
            if size == (120, 40):  # room for all: every expert's row shown, none scrolled
                assert experts.max_scroll_y == 0
                assert experts.size.height == rec.num_experts + 1
            await pilot.press("N")
