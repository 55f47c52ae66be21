"""Pilot tests of the step view and the views on top of it, on a trace of the ``tiny`` preset.

Expected values come from the trace's records or are recomputed independently (torch's own
``bincount`` for tokens per expert, row sums of the probabilities, ``named_parameters()``), never
from the widgets under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from textual.app import App
from textual.widgets import DataTable, Static

from tests.conftest import wait_until
from tests.models import tiny_workload
from tui import messages
from tui.app import make_step_app
from tui.commands.capturing import capture_step
from tui.screens.attention import AttentionScreen
from tui.screens.gradients import GradientsScreen
from tui.screens.help import HelpScreen
from tui.screens.router import RouterScreen
from tui.screens.step import StepScreen
from tui.widgets import fmt
from tui.widgets.call_details import CallDetails

SIZE = (80, 24)


@pytest.fixture(scope="module")
def tiny():
    """(trace, model) of one captured step of the tiny preset."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        workload = tiny_workload()
        trace = capture_step(workload, attention=True)
    finally:
        torch.set_num_threads(threads)
    return trace, workload.model


def status(app) -> str:
    return str(app.screen.query_one("#status", Static).render())


def hint(app) -> str:
    return str(app.screen.query_one("#hint", Static).render())


async def test_next_prev_follow_execution_order(tiny):
    trace, _ = tiny
    seen: list[messages.Moved] = []
    app = make_step_app(trace)
    async with app.run_test(size=SIZE, message_hook=lambda m: seen.append(m)) as pilot:
        step = app.screen
        assert isinstance(step, StepScreen)
        assert status(app) == f"forward · call 1/{len(trace.forward)} · <root>"
        await pilot.press("n", "n", "right", "j")
        want = trace.forward[4]
        assert step.stepper.index == 4
        assert status(app) == f"forward · call 5/{len(trace.forward)} · {want.module}"
        assert step.query_one("#tree").cursor_node.data == want.module
        await pilot.press("p", "left")
        assert step.stepper.current is trace.forward[2]
        await pilot.press("k", "k", "k")
        assert step.stepper.index == 0
        assert hint(app) == "already at the first call"
    unique = {id(m): m for m in seen if isinstance(m, messages.Moved)}  # posted, then bubbled
    moved = [m.index for m in unique.values()]
    assert moved == [0, 1, 2, 3, 4, 3, 2, 1, 0]  # the last k did not move


async def test_keys_act_in_the_order_typed_whatever_has_focus(tiny):
    """Every key of the step view is a priority binding: one the focused tree saw first would
    run after later priority keys (`t n n` typed at once ended at call 1), and the tree took
    Home for its own scrolling."""
    trace, _ = tiny
    assert all(b.priority for b in StepScreen.BINDINGS)
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        step = app.screen
        assert step.focused is step.query_one("#tree")
        await pilot.press("n", "n", "n", "home")
        assert step.stepper.index == 0
        await pilot.press("n", "n", "t", "n")
        assert step.stepper.index == 1


async def test_layer_keys_jump_to_decoder_layers(tiny):
    trace, _ = tiny
    first = {f"model.layers.{i}": next(r.index for r in trace.forward
                                       if r.module == f"model.layers.{i}") for i in (0, 1)}
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        step = app.screen
        await pilot.press("N")
        assert step.stepper.index == first["model.layers.0"]
        await pilot.press("n", "n", "pagedown")
        assert step.stepper.index == first["model.layers.1"]
        await pilot.press("n", "P")
        assert step.stepper.index == first["model.layers.1"]
        await pilot.press("left_square_bracket")
        assert step.stepper.index == first["model.layers.0"]


async def test_backward_steps_in_autograd_order_and_shows_gradient(tiny):
    trace, _ = tiny
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        step = app.screen
        await pilot.press("b")
        assert step.stepper.direction == "backward"
        assert status(app).startswith(f"backward · grad 1/{len(trace.backward)} · ")
        await pilot.press("n", "n", "n", "n")
        g = trace.backward[4]
        assert step.stepper.current is g
        text = str(step.query_one("#details", CallDetails).text)
        assert "∇ grad" in text
        assert fmt.sci(g.stats.l2) in text  # the gradient's own statistics are shown
        await pilot.press("b")  # back to the forward call of this gradient
        assert step.stepper.direction == "forward"
        assert step.stepper.index == g.forward_index


async def test_details_show_shapes_stats_and_params(tiny):
    trace, _ = tiny
    call = trace.call("model.layers.0.self_attn.q_proj")
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        app.screen.jump(call.module)
        await pilot.pause()
        text = str(app.screen.query_one("#details", CallDetails).text)
        out = call.outputs[0]
        assert fmt.shape(out.shape) in text and out.dtype in text
        assert fmt.shape(call.inputs[0].shape) in text
        for value in (out.stats.mean, out.stats.std, out.stats.min, out.stats.max):
            assert fmt.sci(value) in text
        p = trace.params["model.layers.0.self_attn.q_proj.weight"]
        assert fmt.sci(p.grad_norm) in text and fmt.sci(p.ratio) in text
        assert "✓ ok" in text


async def test_details_pane_draws_and_scrolls_its_text(tiny):
    """The details pane draws its own lines (a Line API widget): what is on screen is the
    record's text wrapped to the pane's width (Rich's own wrapping, the reference), the pane
    scrolls over exactly those lines, and a key repaints it without a layout pass."""
    from rich.console import Console

    trace, _ = tiny
    call = trace.call("model.layers.0.self_attn.q_proj")  # statistics and parameters: long
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        screen.jump(call.module)
        await pilot.pause()
        details = screen.query_one("#details", CallDetails)
        width = details.scrollable_content_region.width
        lines = [line.plain.rstrip() for line in
                 details.text.wrap(Console(width=width), width, no_wrap=False)]
        assert details.virtual_size.height == len(lines) > details.size.height
        assert details.max_scroll_y == len(lines) - details.size.height

        def shown() -> list[str]:
            region = details.scrollable_content_region
            return [strip.text[region.x:region.right].rstrip() for strip in
                    screen._compositor.render_strips()[region.y:region.bottom]]

        assert shown() == lines[:details.size.height]
        await pilot.press("J")
        await pilot.pause()
        down = min(3, len(lines) - details.size.height)  # J scrolls 3 lines, to the end
        assert details.scroll_y == down and shown() == lines[down:down + details.size.height]
        layouts = []
        refresh_layout = screen._refresh_layout
        screen._refresh_layout = lambda *a, **k: (layouts.append(1), refresh_layout(*a, **k))
        await pilot.press("n", "n", "p")
        await pilot.pause()
        assert details.scroll_y == 0 and not layouts
        assert shown()[0].startswith(screen.stepper.call.module)


async def test_footer_keys_are_the_screens_and_kept_across_views(tiny):
    """The footer shows the screen's shown bindings (one key per action, from Textual's
    ``active_bindings``), and coming back from a view reuses the keys on show (MdbFooter:
    composed again only when they change) — while the too-small guard, which changes them,
    still redraws them."""
    from textual.widgets._footer import FooterKey

    trace, _ = tiny
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        step = app.screen

        def expected() -> list[tuple[str, bool]]:
            seen: dict[str, tuple[str, bool]] = {}
            for _, binding, enabled, _ in step.active_bindings.values():
                if binding.show:
                    seen.setdefault(binding.action, (binding.description, enabled))
            return list(seen.values())

        keys = list(step.query(FooterKey))
        assert [(k.description, not k.has_class("-disabled")) for k in keys] == expected()
        await pilot.press("r")
        await pilot.pause()
        assert isinstance(app.screen, RouterScreen)
        await pilot.press("s")
        await pilot.pause()
        assert app.screen is step and list(step.query(FooterKey)) == keys  # the same widgets
        def shown() -> list[tuple[str, bool]]:
            return [(k.description, not k.has_class("-disabled")) for k in step.query(FooterKey)]

        # the footer follows the bindings on a later refresh: waited for, however loaded
        await pilot.resize_terminal(70, 20)  # too small: the keys change (quitting only)
        await wait_until(pilot, lambda: shown() == expected() and len(shown()) < len(keys))
        await pilot.resize_terminal(*SIZE)
        await wait_until(pilot, lambda: shown() == expected()
                         == [(k.description, True) for k in keys])


async def test_tree_selection_jumps_to_first_call(tiny):
    trace, _ = tiny
    target = "model.layers.1.mlp.gate"
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        tree = app.screen.query_one("#tree")
        tree.focus()
        node = tree.nodes_by_name[target]
        tree.move_cursor(node)
        await pilot.press("enter")
        assert app.screen.stepper.current is trace.call(target, 0)


async def test_search_jumps_to_module(tiny):
    trace, _ = tiny
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("slash")
        await pilot.press(*"layers.1 gate")
        await pilot.press("enter")
        assert isinstance(app.screen, StepScreen)
        assert app.screen.stepper.module == "model.layers.1.mlp.gate"
        await pilot.press("slash", "escape")  # Esc cancels
        assert app.screen.stepper.module == "model.layers.1.mlp.gate"
        await pilot.press("slash", "enter")  # so does Enter on an empty query
        assert isinstance(app.screen, StepScreen)


async def test_nan_model_opens_at_first_nonfinite(tiny):
    workload = tiny_workload()
    bad = "model.layers.1.self_attn.o_proj"
    with torch.no_grad():
        workload.model.get_submodule(bad).weight[0, 0] = float("nan")
    trace = capture_step(workload, attention=True)
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.screen.stepper.direction == "forward"
        assert app.screen.stepper.module == bad
        assert "non-finite" in hint(app)
        await pilot.press("t", "f")
        assert app.screen.stepper.module == bad


async def test_router_table_matches_trace(tiny):
    trace, _ = tiny
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("r")
        for rec in trace.routing:
            screen = app.screen
            assert isinstance(screen, RouterScreen)
            assert screen.record is rec
            tokens = screen.query_one("#tokens", DataTable)
            assert tokens.row_count == rec.top_k_ids.shape[0]
            for n in range(tokens.row_count):
                row = tokens.get_row_at(n)
                assert str(row[1]) == trace.meta["tokens"][n][:6]
                experts = [int(row[2 + 2 * j]) for j in range(rec.top_k)]
                weights = [float(row[3 + 2 * j]) for j in range(rec.top_k)]
                assert experts == rec.top_k_ids[n].tolist()
                assert weights == pytest.approx(rec.top_k_weights[n].tolist(), abs=0.005)
            counts = torch.bincount(rec.top_k_ids.reshape(-1), minlength=rec.num_experts)
            table = screen.query_one("#experts", DataTable)
            assert [int(table.get_row_at(e)[1]) for e in range(rec.num_experts)] == \
                counts.tolist()
            summary = str(screen.query_one("#router-summary", Static).render())
            assert f"{rec.aux_loss:.4f}" in summary
            assert fmt.sci(trace.meta["aux_loss"]) in summary
            await pilot.press("N")
        assert "no more MoE layers" in hint(app)
        await pilot.press("s")
        assert isinstance(app.screen, StepScreen)


async def test_attention_grid_rows_sum_to_one_and_heads_share_kv(tiny):
    trace, _ = tiny
    cfg = trace.meta["config"]
    group = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("a")
        screen = app.screen
        assert isinstance(screen, AttentionScreen)
        for head in range(cfg["num_attention_heads"]):
            assert screen.head == head
            expect = trace.attention[0].probs[0, head]
            assert torch.tensor(screen.matrix) == pytest.approx(expect)
            for row in screen.matrix:
                assert math.fsum(row) == pytest.approx(1.0, abs=1e-5)
            kv = str(screen.query_one("#kv", Static).render())
            assert f"reads KV head {head // group} " in kv
            await pilot.press("l")
        await pilot.press("N")
        assert screen.record is trace.attention[1]
        grid = str(screen.query_one("#grid-keys", Static).render())
        assert grid.splitlines()[0].strip().startswith("".join(
            t[:1] for t in trace.meta["tokens"][:4]))
        b = trace.attention[1].probs.shape[0]
        title = str(screen.query_one("#title", Static).render())
        assert f"sequence 1/{b} ·" in title  # counted from 1, as the lens counts (issue 35)
        await pilot.press("x")  # second sequence of the batch
        assert screen.matrix == trace.attention[1].probs[1, screen.head].tolist()
        assert f"sequence 2/{b} ·" in str(screen.query_one("#title", Static).render())


async def test_gradients_view_lists_every_parameter(tiny):
    trace, model = tiny
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g")
        screen = app.screen
        assert isinstance(screen, GradientsScreen)
        table = screen.query_one("#grads", DataTable)
        keys = [str(k.value) for k in table.rows]
        assert keys == [name for name, _ in model.named_parameters()]
        for name, p in model.named_parameters():
            row = table.get_row(name)
            assert row[2] == fmt.sci(torch.linalg.vector_norm(p.grad).item())
        await pilot.press("enter")  # opens the first parameter's module in the step view
        assert isinstance(app.screen, StepScreen)
        assert app.screen.stepper.module == "model.embed_tokens"


async def test_view_switching_help_and_quit(tiny):
    trace, _ = tiny
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("r", "a")
        assert isinstance(app.screen, AttentionScreen)
        await pilot.press("g", "escape")
        assert isinstance(app.screen, StepScreen)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = str(app.screen.query_one("#help-text", Static).render())
        for key in ("next call", "router view", "first NaN/Inf", "find a module"):
            assert key in text
        await pilot.press("q")
        assert isinstance(app.screen, StepScreen)
        await pilot.press("d")
        assert "mdb doctor" in str(app.screen.query_one("#nodoctor-text", Static).render())
        await pilot.press("d")
        await pilot.press("r", "q")
    assert app.return_code == 0


async def test_jump_message_selects_module(tiny):
    trace, _ = tiny
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g")
        app.post_message(messages.JumpToModule("model.layers.1.mlp"))
        await pilot.pause()
        assert isinstance(app.screen, StepScreen)
        assert app.screen.stepper.current is trace.call("model.layers.1.mlp")


async def test_too_small_terminal_then_resize(tiny):
    trace, _ = tiny
    app = make_step_app(trace)
    async with app.run_test(size=(60, 20)) as pilot:
        await pilot.pause()
        assert app.screen.has_class("-too-small")
        text = str(app.screen.query_one("#too-small", Static).render())
        assert "terminal too small (60×20), need 80×24" in text
        await pilot.resize_terminal(100, 30)
        await pilot.pause()
        assert not app.screen.has_class("-too-small")
        await pilot.press("n")
        assert app.screen.stepper.index == 1


class _Host(App):
    """Another app (like the live screen) that opens a trace in the step view."""

    def __init__(self, trace) -> None:
        super().__init__()
        self.trace = trace

    def on_mount(self) -> None:
        self.push_screen(StepScreen(self.trace, embedded=True))


async def test_step_screen_embeds_in_another_app(tiny):
    trace, _ = tiny
    app = _Host(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, StepScreen)
        await pilot.press("n", "r", "q")  # q from a view: back through the step view
        assert not isinstance(app.screen, StepScreen)
        assert app.is_running


async def test_doctor_results_open_and_jump(tiny):
    trace, _ = tiny
    from hooks.doctor.model.result import CheckResult
    from tui.screens.doctor import DoctorScreen

    results = [CheckResult(id=1, key="demo", name="demo check", status="fail",
                           evidence="made up for the test", module="model.layers.1.mlp.gate")]
    app = make_step_app(trace, doctor_results=results)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("d")
        assert isinstance(app.screen, DoctorScreen)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, StepScreen)
        assert app.screen.stepper.current is trace.call("model.layers.1.mlp.gate")


async def test_reopened_views_follow_the_step_view_layer(tiny):
    trace, _ = tiny
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("r")
        first = app.screen
        assert first.record is trace.routing[0]
        await pilot.press("s", "N", "N", "r")  # now in layer 1
        assert app.screen is first  # the same (cached) view, moved to the new layer
        assert app.screen.record is trace.routing[1]
        assert int(app.screen.query_one("#tokens", DataTable).get_row_at(0)[2]) == \
            trace.routing[1].top_k_ids[0, 0].item()
        await pilot.press("a")
        assert app.screen.record is trace.attention[1]


async def test_attention_key_tokens_stay_in_place_while_j_scrolls_the_rows():
    """Issue 35: the header of key tokens scrolled away on ``j``."""
    import html
    import re

    trace = capture_step(tiny_workload(seq_len=100), attention=True)  # wider and taller than 80×24
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("a")
        screen = app.screen
        assert isinstance(screen, AttentionScreen)
        keys = screen.query_one("#grid-keys", Static)
        first = str(keys.render()).splitlines()[-1].strip()
        assert first.startswith("".join(t[:1] for t in trace.meta["tokens"][:4]))
        before = keys.region
        scroll = screen.query_one("#grid-scroll")
        for _ in range(6):
            await pilot.press("j")
        await wait_until(pilot, lambda: scroll.scroll_y > 0)
        assert keys.region == before and before.height > 0
        shown = "".join(html.unescape(t) for t in re.findall(
            r"<text [^>]*>([^<]*)</text>", app.export_screenshot()))
        assert first[:60].replace(" ", "\u00a0") in shown or first[:60] in shown
        scroll.scroll_to(x=20, animate=False)  # the keys follow the columns sideways
        await wait_until(pilot, lambda: screen.query_one("#grid-keys-scroll").scroll_x == 20)


def _shown(app) -> str:
    """The screen's text as drawn (the screenshot's text runs, one line per row), spaces
    normalised."""
    import html
    import re

    svg = app.export_screenshot()
    rows: dict[str, list[str]] = {}
    for y, t in re.findall(r'<text [^>]*y="([\d.]+)"[^>]*>([^<]*)</text>', svg):
        rows.setdefault(y, []).append(html.unescape(t).replace("\u00a0", " "))
    return "\n".join("".join(parts) for _, parts in sorted(rows.items(),
                                                           key=lambda kv: float(kv[0])))


async def test_the_step_views_header_fits_80_columns_whole(tiny):
    """Issue 35: the header was cut to ``19.8M par…`` beside the loss at 80 columns; the loss
    now goes under the description when both do not fit one line."""
    trace, _ = tiny
    trace.meta["description"] = "minillm default · 19.8M params · 2×64 of alice.txt"
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))
        await pilot.pause()
        shown = _shown(app)
        assert "minillm default · 19.8M params · 2×64 of alice.txt" in shown
        assert fmt.loss_line(trace.meta) in shown
        assert "…" not in shown.splitlines()[0] + shown.splitlines()[1]


async def test_a_long_hint_wraps_whole(tiny):
    """Issue 35: ``L`` cut the lens's error at 80 columns with no way to read it whole."""
    trace, _ = tiny
    app = make_step_app(trace)
    words = [f"word{i}" for i in range(40)]  # about 280 columns
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))
        app.screen.hint("ValueError: " + " ".join(words))
        await pilot.pause()
        shown = " ".join(_shown(app).split())
        assert "ValueError: " + " ".join(words) in shown
        app.screen.hint("short again")
        await pilot.pause()
        assert app.screen.query_one("#hint").size.height == 1


@pytest.mark.parametrize("width", [30, 38, 52, None])
def test_the_parameter_table_fits_its_pane_without_wrapping(tiny, width):
    """Issue 35: the what-if A|B view (two panes at 80 columns) wrapped the ‖g‖/‖w‖ column;
    the table now fits the pane, its numbers whole (the test's own sci() of each norm)."""
    from tui.screens.stepper import Stepper
    from tui.widgets.call_details import params_table

    trace, model = tiny
    module = "model.layers.0.self_attn.q_proj"
    params = Stepper(trace).params_of(module)
    lines = params_table(params, width=width).plain.splitlines()
    assert "‖g‖/‖w‖" in lines[0]
    if width is not None:
        assert max(len(line) for line in lines) <= width
    p = model.get_submodule(module).weight
    norm = torch.linalg.vector_norm(p.grad).item()
    assert fmt.sci(norm) in lines[1]
    assert fmt.sci(norm / torch.linalg.vector_norm(p).item()) in lines[1]
