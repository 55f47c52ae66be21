"""SVG snapshots of the main views at 80×24 (pytest-textual-snapshot), on the tiny preset, and
beside them what those views must say, checked against the model itself (its gradients, its
router's logits, its attention module) rather than against a picture.

Update after an intended change with ``pytest tests/tui/test_tui_snapshots.py --snapshot-update``
and look at the SVGs in ``tests/tui/__snapshots__/`` before committing them.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from textual.widgets import DataTable, Static

from tui.app import make_step_app
from tui.commands.capturing import capture_step
from tui.commands.options import add_model_arguments
from tui.commands.workload import build_workload
from tui.widgets import fmt


@pytest.fixture(scope="module")
def captured():
    """(workload, trace): the model keeps the captured step's ``.grad``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reductions in one fixed order: the same digits every run
    try:
        parser = argparse.ArgumentParser()
        add_model_arguments(parser)
        args = parser.parse_args(["--preset", "tiny", "--seq-len", "16", "--seed", "0"])
        workload = build_workload(args)
        return workload, capture_step(workload, attention=True)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trace(captured):
    return captured[1]


@pytest.mark.parametrize(
    "keys",
    [
        pytest.param(("n",) * 13, id="step-forward"),
        pytest.param(("b", "n", "n", "n", "n", "n", "n", "n", "n"), id="step-backward"),
        pytest.param(("r",), id="router"),
        pytest.param(("a", "l"), id="attention"),
        pytest.param(("g",), id="gradients"),
        pytest.param(("question_mark",), id="help"),
    ],
)
def test_view_snapshot(snap_compare, trace, keys):
    assert snap_compare(make_step_app(trace), press=keys, terminal_size=(80, 24))


def test_too_small_snapshot(snap_compare, trace):
    assert snap_compare(make_step_app(trace), terminal_size=(70, 20))


# -- what the snapshotted views say, against the model ----------------------------------------
def _text(screen, wid: str) -> str:
    return " ".join(str(screen.query_one(wid, Static).render()).split())


async def test_gradients_view_total_is_clip_grad_norms(captured):
    from tui.screens.gradients import GradientsScreen

    workload, trace = captured
    model = workload.model
    ref = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=math.inf))
    app = make_step_app(trace)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("g")
        screen = app.screen
        assert isinstance(screen, GradientsScreen)
        assert screen.total.norm == pytest.approx(ref, rel=1e-5)
        assert f"total ‖g‖ {fmt.sci(ref)}" in _text(screen, "#title")
        table = screen.query_one("#grads", DataTable)
        # one row per parameter of the model (tied once), its ‖g‖ the model's own
        params = dict(model.named_parameters())
        assert table.row_count == len(params)
        for key in list(params)[:5]:
            row = table.get_row(key)
            assert row[2] == fmt.sci(float(params[key].grad.norm()))


async def test_router_view_counts_are_the_models_top_k(captured):
    from tui.screens.router import RouterScreen

    workload, trace = captured
    model, ids = workload.model, workload.input_ids
    logits = []
    gate = model.model.layers[0].mlp.gate
    handle = gate.register_forward_hook(lambda m, a, out: logits.append(out.detach()))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    k = model.config.num_experts_per_tok
    top = torch.topk(logits[0], k, dim=-1).indices
    picks = torch.bincount(top.reshape(-1), minlength=model.config.num_local_experts)
    app = make_step_app(trace)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("r")
        screen = app.screen
        assert isinstance(screen, RouterScreen) and screen.record.layer == 0
        experts = screen.query_one("#experts", DataTable)
        n = ids.numel()
        for e, c in enumerate(picks.tolist()):
            row = experts.get_row(str(e))
            # "tok": tokens that chose e (distinct experts per token: = its picks)
            assert row[1] == str(c)
            # "picks": its share of the N·k top-k assignments
            assert row[2] == fmt.pct(c / (n * k))
        summary = _text(screen, "#router-summary")
        assert f"of N={n}" in summary and f"N·k = {n * k}" in summary


async def test_attention_view_kv_head_is_the_models(captured):
    from tui.screens.attention import AttentionScreen

    workload, trace = captured
    attn = workload.model.model.layers[0].self_attn
    app = make_step_app(trace)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("a")
        screen = app.screen
        assert isinstance(screen, AttentionScreen)
        for head in range(attn.num_heads):
            line = _text(screen, "#kv")
            mine = attn.kv_head_of(head)
            sharers = [h for h in range(attn.num_heads) if attn.kv_head_of(h) == mine]
            assert f"query head {head} reads KV head {mine} of {attn.num_key_value_heads}" in line
            assert line.endswith("heads " + " ".join(map(str, sharers)))
            await pilot.press("l")
