"""The attention view lists a hybrid model's layers that compute no attention probabilities
(issue 22 §4): HF LaraMini's layer 0 is a Gated DeltaNet, layer 1 softmax attention."""

from __future__ import annotations

import pytest
import torch
from textual.widgets import Static

import hooks
from tests.hooks.probes.test_attention_families import _build, _ids
from tui.app import make_step_app
from tui.screens.attention import AttentionScreen, NoProbabilities

pytest.importorskip("transformers")


@pytest.mark.slow  # about 10 s: a Gated DeltaNet's reference kernel, forward and backward
async def test_the_attention_view_says_which_layer_has_no_probabilities():
    model = _build("lara_mini")
    ids = _ids()
    with hooks.capture(model, attention=True) as trace:
        model(input_ids=ids, labels=ids).loss.backward()
    app = make_step_app(trace)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("a")
        screen = app.screen
        assert isinstance(screen, AttentionScreen)
        assert [type(r).__name__ for r in screen.records] == ["NoProbabilities",
                                                              "AttentionRecord"]
        screen.position = 0
        screen.show()
        title = str(screen.query_one("#title", Static).render())
        assert title.startswith("attention · layer 0 (1/2) · model.layers.0 · no probabilities")
        grid = str(screen.query_one("#grid", Static).render())
        assert "linear attention layer (LaraMiniGatedDeltaNet" in grid
        await pilot.press("l")
        assert "no heads to show" in str(screen.query_one("#hint", Static).render())
        await pilot.press("N")
        assert not isinstance(screen.record, NoProbabilities)
        assert "layer 1 (2/2)" in str(screen.query_one("#title", Static).render())
        assert torch.allclose(screen.record.probs.sum(-1), torch.ones(2, 4, 8))
