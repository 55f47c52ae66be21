"""Pilot test of the ``e`` form with the edits by role (issue 36, item 1): the form lists a head's
pattern, q/k/v, head patch, ``add`` and ``clamp`` on an attention module, and running the
offered ``zero … pattern head=0`` re-runs the step. The expected loss is computed independently:
head 0's pattern zeroed makes its output P·V zero, the same as the o projection's columns of
head 0 zeroed in a copy of the model."""

from __future__ import annotations

import copy

from textual.widgets import Input, OptionList

from tests.conftest import wait_until
from tests.tui.test_edit_screen import ATTN, SIZE, step  # noqa: F401 (the fixture)
from tui.app import make_step_app
from tui.screens.edit_diff import EditDiffScreen
from tui.screens.edit_form import EditFormScreen


def _o_columns_zeroed_loss(workload, h: int) -> float:
    import torch

    ref = copy.deepcopy(workload.model)
    o = ref.model.layers[1].self_attn.o_proj
    dh = o.in_features // ref.config.num_attention_heads
    with torch.no_grad():
        o.weight[:, h * dh:(h + 1) * dh] = 0
        return float(workload.batch.call(ref).loss)


async def test_the_form_offers_and_runs_a_pattern_edit(step):  # noqa: F811
    trace, workload = step
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        app.screen.jump(ATTN)
        await pilot.pause()
        await pilot.press("e")
        await wait_until(pilot, lambda: isinstance(app.screen, EditFormScreen))
        form = app.screen
        want = f"zero {ATTN} pattern head=0"
        for spec in (want, f"patch {ATTN} head=0 from=rolled", f"zero {ATTN} q head=0",
                     f"add {ATTN} from=rolled scale=0.5", f"clamp {ATTN} min=-1 max=1"):
            assert spec in form.options
        options = form.query_one("#edit-options", OptionList)
        options.highlighted = form.options.index(want)
        options.focus()
        await pilot.press("enter")  # copies the choice to the spec line
        box = form.query_one("#edit-spec", Input)
        await wait_until(pilot, lambda: box.value == want and box.has_focus)
        await pilot.press("enter")  # runs it
        await wait_until(pilot, lambda: isinstance(app.screen, EditDiffScreen))
        view = app.screen
        assert view.edits == [want] and view.b.edits[0].applied
        assert abs(view.b.meta["loss"] - _o_columns_zeroed_loss(workload, 0)) < 1e-5
        assert view.b.meta["loss"] != trace.meta["loss"]
