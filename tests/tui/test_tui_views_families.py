"""The router and attention views on models other than minillm (HF MoE families, a user's GPT
with a fully masked row), at 80×24.

Expected values come from the models' configs, their input ids and the trace's records, never
from the widgets under test.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from textual.widgets import DataTable, Static

import hooks
from tests.conftest import SAMPLES
from tests.hooks.probes.test_hooks_routing import OneHotBlock
from tui.app import make_step_app
from tui.commands.capturing import capture_step
from tui.commands.workload import load_user_workload
from tui.screens.attention import AttentionScreen
from tui.screens.router import RouterScreen

SIZE = (80, 24)


def trace_of(spec: str):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        workload = load_user_workload(spec)
        return capture_step(workload, attention=True), workload
    finally:
        torch.set_num_threads(threads)


def text(screen, wid: str) -> str:
    return str(screen.query_one(wid, Static).render())


async def test_router_view_labels_the_rule_and_the_aux_loss_of_qwen3_moe():
    pytest.importorskip("transformers")
    trace, workload = trace_of("tests.families:hf_qwen3_moe")
    cfg = workload.model.config
    ids = workload.input_ids.reshape(-1).tolist()
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("r")
        screen = app.screen
        assert isinstance(screen, RouterScreen)
        rec = screen.record
        summary = " ".join(text(screen, "#router-summary").split())
        norm = "renormalised" if cfg.norm_topk_prob else "not renormalised"
        assert f"rule: softmax over all E, top-{cfg.num_experts_per_tok}, {norm}" in summary
        assert f"what {rec.module}.experts received" in summary
        assert f"layer aux loss {rec.aux_loss:.4f}" in summary
        tokens = screen.query_one("#tokens", DataTable)
        assert [str(tokens.get_row_at(n)[1]) for n in range(4)] == [str(i) for i in ids[:4]]


async def test_router_view_of_deepseek_v3_says_why_there_is_no_aux_loss():
    pytest.importorskip("transformers")
    trace, workload = trace_of("tests.families:hf_deepseek_v3")
    cfg = workload.model.config
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("r")
        summary = " ".join(text(app.screen, "#router-summary").split())
        assert "sigmoid per expert + bias on the choice" in summary
        assert f"({cfg.topk_group} of {cfg.n_group} groups)" in summary
        assert f"×{cfg.routed_scaling_factor:g}" in summary
        assert "aux loss not shown" in summary and "layer aux loss" not in summary


async def test_attention_header_lists_hf_ids_with_separators_and_gqa_from_the_call():
    pytest.importorskip("transformers")
    trace, workload = trace_of("tests.families:hf_qwen3_moe")
    cfg = workload.model.config
    ids = workload.input_ids[0].tolist()
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("a")
        screen = app.screen
        assert isinstance(screen, AttentionScreen)
        grid = text(screen, "#grid-keys").splitlines() + text(screen, "#grid").splitlines()
        assert grid[0] == "keys " + " ".join(str(i) for i in ids)
        assert grid[2].split("│")[0].split() == ["0", str(ids[0])]
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        await pilot.press("l")
        kv = text(screen, "#kv")
        assert kv.startswith("SDPA call · GQA: query head 1 reads KV head ")
        assert f"KV head {1 // group} of {cfg.num_key_value_heads} (enable_gqa)" in kv


async def test_attention_view_shows_the_fully_masked_nan_row_of_user_gpt():
    path = SAMPLES / "user_gpt.py"
    trace, workload = trace_of(f"{path}:nanogpt_nan")
    t = workload.input_ids.shape[1]
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("a")
        screen = app.screen
        while screen.record.layer != 1:
            await pilot.press("N")
        grid = text(screen, "#grid").splitlines()
        rows = [line for line in grid if "│" in line]
        assert len(rows) == t
        assert rows[0].split("│")[1] == "!" * t and "NaN: no key to attend to" in rows[0]
        assert all("!" not in r for r in rows[1:])
        assert rows[1].split("│")[1][0] == " "  # key 0 is masked for every query: blank
        assert "' ' masked" in text(screen, "#legend")
        await pilot.press("P")
        assert "!" not in text(screen, "#grid")


async def test_router_view_names_moe_blocks_it_could_not_read():
    torch.manual_seed(0)
    model = torch.nn.Sequential(OneHotBlock())
    with hooks.capture(model) as trace:
        model(torch.randn(4, 8))
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("r")
        assert "1 MoE block(s), no routing recorded" in text(app.screen, "#title")
        summary = " ".join(text(app.screen, "#router-summary").split())
        assert summary.startswith("0: MoE block (OneHotBlock) ran 1×, routing not recorded")


@pytest.mark.parametrize("attention", [False, True])
async def test_attention_view_says_why_nothing_was_recorded(attention):
    from tests.hooks.probes.test_hooks_attention import Hidden

    model = torch.nn.Sequential(Hidden())
    with hooks.capture(model, attention=attention) as trace:
        model(torch.randn(2, 3, 4))
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("a")
        grid = " ".join(text(app.screen, "#grid").split())
        if attention:
            (note,) = [n for n in trace.notes if n.kind == "attention"]
            assert grid == " ".join(textwrap.fill(note.message, 76).split())
            assert "0 (Hidden) ran but called neither" in grid
        else:
            assert "captured without attention probabilities" in grid


async def test_step_title_of_a_tuple_returning_model_shows_its_own_loss_and_j_scrolls():
    """nanoGPT returns ``(logits, loss)``: the title names ``out[1]`` and shows the model's
    cross-entropy (computed here independently); J/K scroll the details pane."""
    from tests.families import nanogpt
    from tui.screens.step import CallDetails, StepScreen

    trace, _ = trace_of("tests.families:nanogpt")
    model, (x, y) = nanogpt()
    with torch.no_grad():
        logits, _ = model(x, y)
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                               y.reshape(-1))
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        assert isinstance(screen, StepScreen)
        title = text(screen, "#title-loss")
        assert title.startswith("loss = out[1] = ")
        assert float(title.removeprefix("loss = out[1] = ").split()[0]) == pytest.approx(
            float(ce), rel=1e-3)
        details = screen.query_one("#details", CallDetails)
        if details.max_scroll_y == 0:  # make the pane overflow: a call with parameters
            await pilot.press("n", "n")
        assert details.max_scroll_y > 0
        await pilot.press("J")
        await pilot.pause()
        assert details.scroll_y > 0
        await pilot.press("K")
        await pilot.pause()
        assert details.scroll_y == 0


def _screen_lines(app) -> list[str]:
    """The terminal's lines as the user sees them (the composited screen, as plain text)."""
    return [strip.text for strip in app.screen._compositor.render_strips()]


@pytest.mark.parametrize("size", [SIZE, (120, 30)])
async def test_step_view_of_an_hf_model_keeps_output_columns_apart_and_roots_on_the_logits(size):
    """HF Mixtral returns loss, aux_loss, logits, router_logits: at the root call the output
    statistics have one heading per column, apart, and the root node shows the logits' shape
    (the output), never the loss's ``()``."""
    pytest.importorskip("transformers")
    trace, workload = trace_of(f"{SAMPLES / 'user_models.py'}:hf_mixtral")
    with torch.no_grad():
        logits = "×".join(map(str, workload.batch.call(workload.model).logits.shape))
    app = make_step_app(trace)
    async with app.run_test(size=size) as pilot:
        await pilot.press("t")  # the first record: the root call
        await pilot.pause()
        lines = _screen_lines(app)
        pane = [line.split("▕", 1)[1] for line in lines if "▕" in line]
        # the tables' headings in order (as many tables as the pane's width needs)
        heads = [h for p in pane if p.split()[:1] == ["stat"] for h in p.split()[1:]]
        assert heads[:3] == ["loss", "aux_loss", "logits"]  # then the rest
        root = next(line for line in lines if "▕" in line and "MixtralForCausalLM" in
                    line.split("▕")[0])
        tree_part = root.split("▕")[0]
        assert "()" not in tree_part
        if size[0] >= 120:
            assert logits in tree_part
        else:
            assert tree_part.rstrip().endswith("…")  # the shape does not fit: left out
        await pilot.press("n")  # model: last_hidden_state and the two router_logits
        await pilot.pause()
        # every table of the pane (those below the screen too): one heading per column, apart
        from tui.widgets.call_details import CallDetails

        text = app.screen.query_one("#details", CallDetails).text.plain
        heads = [h for line in text.splitlines() if line.split()[:1] == ["stat"]
                 for h in line.split()[1:]]
        assert heads[:3] == ["last_hidden_state", "router_logits[0]", "router_logits[1]"]
