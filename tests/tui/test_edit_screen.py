"""Pilot tests of ``e`` in the step view: the edit form, the re-run in a worker, the what-if diff
view (A = the step as is, B = edited), going back and editing again on top.

Expected values are recomputed independently: the edited step's loss from a plain forward of
the same model with the head's o_proj input columns zeroed in a copy; the first row against
the largest relative change computed from the two traces' own statistics."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from textual.widgets import DataTable, Input, Static

from tests.conftest import wait_until
from tui.app import make_step_app
from tui.commands.capturing import capture_step
from tui.commands.options import add_model_arguments
from tui.commands.workload import build_workload
from tui.screens.edit_diff import EditDiffScreen
from tui.screens.edit_form import EditFormScreen
from tui.screens.step import StepScreen

SIZE = (100, 30)
ATTN = "model.layers.1.self_attn"


@pytest.fixture(scope="module")
def step():
    """(trace, workload) of one captured step of the tiny preset, T=16."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        parser = argparse.ArgumentParser()
        add_model_arguments(parser)
        workload = build_workload(parser.parse_args(["--preset", "tiny", "--seq-len", "16"]))
        trace = capture_step(workload, attention=False)
    finally:
        torch.set_num_threads(threads)
    return trace, workload


def _text(app, sel: str) -> str:
    return str(app.screen.query_one(sel, Static).render())


def _head_zeroed_loss(workload, h: int) -> float:
    ref = copy.deepcopy(workload.model)
    o = ref.model.layers[1].self_attn.o_proj
    dh = o.in_features // ref.config.num_attention_heads
    with torch.no_grad():
        o.weight[:, h * dh:(h + 1) * dh] = 0
        return float(workload.batch.call(ref).loss)


async def _open_form(app, pilot, module: str = "model.layers.1.mlp") -> None:
    """Select ``module``'s call in the step view and open the edit form on it (``e``)."""
    app.screen.jump(module)
    await pilot.pause()
    await pilot.press("e")
    await wait_until(pilot, lambda: isinstance(app.screen, EditFormScreen))


async def test_e_form_rerun_and_diff_view_largest_first_then_back(step):
    trace, workload = step
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        assert isinstance(app.screen, StepScreen)
        app.screen.jump(ATTN)
        await pilot.pause()
        await pilot.press("e")
        await wait_until(pilot, lambda: isinstance(app.screen, EditFormScreen))
        form = app.screen
        assert form.options[:2] == [f"zero {ATTN}", f"zero {ATTN} head=0"]
        box = form.query_one("#edit-spec", Input)
        box.value = f"zero {ATTN} head=9"  # out of range: said in the form, nothing runs
        box.focus()
        await pilot.press("enter")
        assert "out of range" in _text(app, "#edit-hint") and not form.running
        box.value = f"zero {ATTN} head=2"
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, EditDiffScreen))
        view = app.screen
        assert view.b.edits[0].applied and view.edits == [f"zero {ATTN} head=2"]
        assert abs(view.b.meta["loss"] - _head_zeroed_loss(workload, 2)) < 1e-5
        assert view.b.meta["loss"] != trace.meta["loss"]
        status = _text(app, "#status")
        assert status.startswith(f"loss {trace.meta['loss']:.6g} → {view.b.meta['loss']:.6g}")
        # rows: the loss first, then the edited module's own outputs (the attention and the
        # o_proj the head edit hooks), then the rest largest relative change first (from the
        # traces' stats), the calls whose row count changed (experts' tokens) last (issue 35)
        table = view.query_one("#diff-table", DataTable)
        assert table.row_count == len(view.rows) > 0
        diffs = [r["diff"] for r in view.rows]
        assert (diffs[0].module, diffs[0].tensor) == ("", trace.meta["loss_source"])
        own = {ATTN, f"{ATTN}.o_proj"}
        k = next(i for i, d in enumerate(diffs[1:], 1)
                 if not (d.direction == "forward" and d.module in own))
        assert k > 1 and {d.module for d in diffs[1:k]} == own
        rest = diffs[k:]
        assert not any(d.direction == "forward" and d.module in own for d in rest)
        moved = [d.shape_changed for d in rest]
        assert moved == sorted(moved)  # same-shape rows, then the changed token counts
        for part in ([d for d in rest if not d.shape_changed],
                     [d for d in rest if d.shape_changed]):
            rel = [d.relative() for d in part]
            assert rel == sorted(rel, reverse=True)
        o_proj = next(r for r in trace.forward if r.module == f"{ATTN}.o_proj")
        before = {(c.module, c.call_index) for c in trace.forward  # done before o_proj ran
                  if c.index < o_proj.index and c.module
                  and not o_proj.module.startswith(c.module + ".")}
        assert len(before) > 10
        assert not any(r["diff"].direction == "forward" and
                       (r["diff"].module, r["diff"].call_index) in before
                       for r in view.rows)  # nothing before the edit changed
        await pilot.press("escape")
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))


async def test_ctrl_c_in_the_edit_form_closes_it(step):
    """The spec box is an Input, whose own Ctrl-C (copy) swallowed the key: Ctrl-C closes the
    form as Esc does, nothing is re-run, and the step view is back."""
    trace, _ = step
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await _open_form(app, pilot)
        box = app.screen.query_one("#edit-spec", Input)
        box.focus()
        await wait_until(pilot, lambda: box.has_focus)
        await pilot.press("ctrl+c")
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))
        assert app.is_running


async def test_edit_again_composes_on_top(step):
    trace, _ = step
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await _open_form(app, pilot)
        # Enter on the 'drop … expert=0' choice copies it to the input; Enter runs it
        form = app.screen
        i = form.options.index("drop model.layers.1.mlp expert=0")
        form.query_one("#edit-options").highlighted = i
        await pilot.press("enter", "enter")
        await wait_until(pilot, lambda: isinstance(app.screen, EditDiffScreen))
        first = app.screen
        await pilot.press("e")
        await wait_until(pilot, lambda: isinstance(app.screen, EditFormScreen))
        assert app.screen.base == ["drop model.layers.1.mlp expert=0"]
        app.screen.query_one("#edit-spec", Input).value = "zero model.layers.0.mlp"
        app.screen.query_one("#edit-spec", Input).focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, EditDiffScreen)
                         and app.screen is not first)
        both = app.screen
        assert [e.spec for e in both.b.edits] == ["drop model.layers.1.mlp expert=0",
                                                  "zero model.layers.0.mlp"]
        assert all(e.applied for e in both.b.edits)
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.screen is first)
        await pilot.press("escape")
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))


async def test_e_on_a_trace_from_disk_says_why(step, tmp_path):
    from hooks import Trace

    trace, _ = step
    loaded = Trace.load(trace.save(tmp_path / "t.mdbtrace"))
    app = make_step_app(loaded)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("n", "e")
        await pilot.pause()
        assert isinstance(app.screen, StepScreen)
        assert "loaded from disk" in _text(app, "#hint")


async def test_the_app_of_mdb_diff_edit_quits_with_q_and_edits_again_with_e(step):
    from hooks.whatif.rerun import rerun_edited
    from tui.commands.diff_edit import _app

    trace, _ = step
    spec = "scale model.layers.0.mlp by=2"
    b = rerun_edited(trace, [spec])
    app = _app(EditDiffScreen(trace, b, trace.diff(b), [spec], embedded=False))
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, EditDiffScreen))
        assert _text(app, "#title") == f"what if · {spec}"
        assert "1 of 1 call(s) changed" in _text(app, "#edit-applied")
        await pilot.press("escape")  # the main screen: Esc does not leave it
        assert isinstance(app.screen, EditDiffScreen)
        await pilot.press("e")
        await wait_until(pilot, lambda: isinstance(app.screen, EditFormScreen))
        assert app.screen.base == [spec]
        await pilot.press("escape")
        await wait_until(pilot, lambda: isinstance(app.screen, EditDiffScreen))
        await pilot.press("q")
        await wait_until(pilot, lambda: not app.is_running)


def test_e_re_runs_a_step_whose_loss_comes_from_the_factory_s_loss_fn():
    """A user's factory returning (model, batch, loss_fn) whose loss reads batch.targets: the
    re-run uses the step's own batch and loss function (kept on the trace's replay)."""
    from hooks.batch import Batch
    from hooks.whatif.rerun import rerun_edited
    from tui.commands.workload import Workload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(5, 6), torch.tensor([0, 2, 1, 1, 0])

    def loss_fn(out, batch):
        return torch.nn.functional.cross_entropy(out, batch.targets)

    trace = capture_step(Workload(model, Batch((x,), targets=y), loss_fn), attention=False)
    b = rerun_edited(trace, ["scale 0 by=0"])
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model[2](torch.relu(model[0](x) * 0)), y)
    assert b.edits[0].applied and abs(b.meta["loss"] - float(ref)) < 1e-6


async def test_typing_after_a_pick_continues_the_spec(step):
    """Issue 35: typing after picking a choice replaced the whole spec (End was needed first,
    and nothing said so)."""
    trace, _ = step
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await _open_form(app, pilot, ATTN)
        form = app.screen
        box = form.query_one("#edit-spec", Input)
        assert form.options[0] == f"zero {ATTN}"
        await wait_until(pilot, lambda: form.query_one("#edit-options").has_focus)
        await pilot.press("enter")  # pick "zero ATTN"
        await wait_until(pilot, lambda: box.has_focus)
        await pilot.press(*" head=1")
        assert box.value == f"zero {ATTN} head=1"
        assert "typing continues it" in _text(app, "#edit-hint")


async def test_the_what_if_views_status_and_edit_lines_wrap_whole_at_80_columns(step):
    """Issue 35: no message is cut off; the loss line of the what-if view ended in ``0 …``
    at 80 columns."""
    import html
    import re

    from tui.screens.edit_diff import edits_line, loss_change_line
    from tui.widgets.diff_rows import summary_line

    trace, _ = step
    app = make_step_app(trace)
    async with app.run_test(size=(80, 24)) as pilot:
        await _open_form(app, pilot, ATTN)
        box = app.screen.query_one("#edit-spec", Input)
        box.value = f"zero {ATTN} head=2"
        box.focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, EditDiffScreen))
        await pilot.pause()
        view = app.screen
        drawn = " ".join(" ".join(html.unescape(t).replace("\u00a0", " ").split()) for t in
                         re.findall(r"<text [^>]*>([^<]*)</text>", app.export_screenshot()))
        drawn = " ".join(drawn.split())
        status = (f"{loss_change_line(view.a, view.b)} · "
                  f"{summary_line(view.diff, 'A (as is)', 'B (edited)')}")
        assert len(status) > 78 and " ".join(status.split()) in drawn
        assert " ".join(edits_line(view.b).split()) in drawn
