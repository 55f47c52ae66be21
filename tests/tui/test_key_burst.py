"""Keys typed in one burst across a change of view: every key acts, in the order typed, on the
view that is on screen when that key is handled (``r s g`` from the step view ends on the
gradients view, ``r s n`` moves the step view's selection).

A burst is posted to the app all at once, as a terminal delivers keys typed faster than the app
handles them (``tmux send-keys r s g``); ``Pilot.press`` waits for the app to be idle after each
key, so it is used only for the comparison in :func:`test_same_end_as_keys_pressed_one_by_one`.
Expected screens and selections follow from the keys' documented meanings (the ``Binding``
objects of the screens) and the trace's own records, never from the code under test."""

from __future__ import annotations

import pytest
import torch
from textual import events

from tests.conftest import wait_until
from tests.models import tiny_workload
from tui.app import make_step_app
from tui.commands.capturing import capture_step
from tui.screens.attention import AttentionScreen
from tui.screens.gradients import GradientsScreen
from tui.screens.help import HelpScreen
from tui.screens.router import RouterScreen
from tui.screens.step import StepScreen

SIZE = (80, 24)
CHARS = {"question_mark": "?", "slash": "/"}


@pytest.fixture(scope="module")
def trace():
    """One captured step of the tiny preset (MoE: the router view has layers to show)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return capture_step(tiny_workload(), attention=True)
    finally:
        torch.set_num_threads(threads)


def burst(app, *keys: str) -> None:
    """Post every key to the app at once, before it handles the first one."""
    for key in keys:
        app.post_message(events.Key(key, CHARS.get(key, key)))


async def settle(pilot, cond, what: str) -> None:
    """Run the app until ``cond()`` holds (AssertionError naming ``what`` after 5 s), then a
    few more turns so that a key still queued would have acted."""
    try:
        await wait_until(pilot, cond, timeout=5.0)
    except AssertionError:
        raise AssertionError(f"never reached: {what}") from None
    for _ in range(3):
        await pilot.pause()


def stack(app) -> list[type]:
    return [type(s) for s in app.screen_stack[1:]]  # below: Textual's default screen


@pytest.mark.parametrize(("keys", "view"), [
    (("r", "s", "g"), GradientsScreen),
    (("r", "s", "a"), AttentionScreen),
    (("g", "s", "r"), RouterScreen),
    (("a", "s", "g"), GradientsScreen),
    (("r", "g", "s", "a"), AttentionScreen),   # g replaces the router view, s closes it
    (("r", "a", "g"), GradientsScreen),
    (("g", "s", "question_mark"), HelpScreen),
    (("r", "s", "r", "s", "g", "s", "a"), AttentionScreen),
])
async def test_burst_ends_on_the_last_view_typed(trace, keys, view):
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        step = app.screen
        assert isinstance(step, StepScreen)
        burst(app, *keys)
        await settle(pilot, lambda: isinstance(app.screen, view), f"{view.__name__} after "
                     f"{' '.join(keys)}")
        want = [StepScreen, view] if view is not HelpScreen else [StepScreen, HelpScreen]
        assert stack(app) == want
        assert app.screen.is_mounted


@pytest.mark.parametrize(("keys", "index"), [
    (("r", "s", "n"), 1),
    (("g", "s", "n", "n"), 2),
    (("n", "n", "n", "a", "s", "p"), 2),
    (("r", "s", "n", "g", "s", "n", "n"), 3),
])
async def test_step_keys_right_after_leaving_a_view_move_the_selection(trace, keys, index):
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        step = app.screen
        assert step.stepper.index == 0 and step.stepper.direction == "forward"
        burst(app, *keys)
        await settle(pilot, lambda: app.screen is step and step.stepper.index == index,
                     f"step view at call {index + 1} after {' '.join(keys)}")
        assert step.stepper.current is trace.forward[index]
        assert stack(app) == [StepScreen]


async def test_view_keys_right_after_opening_a_view_act_on_it(trace):
    """``r N``: the router view's next layer, not the step view's (same key, other meaning)."""
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        step = app.screen
        burst(app, "r", "N")
        await settle(pilot, lambda: isinstance(app.screen, RouterScreen)
                     and app.screen.position == 1, "router view at its second layer")
        assert step.stepper.index == 0  # the step view did not move
        assert app.screen.record.layer == 1  # tiny preset: MoE in layers 0 and 1


async def test_letters_typed_right_after_slash_reach_the_search_box(trace):
    """``/layers`` at once: the box opens and gets every letter (none reach the step view)."""
    from textual.widgets import Input

    from tui.screens.search import SearchScreen

    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        step = app.screen
        burst(app, "slash", *"layers")
        await settle(pilot, lambda: isinstance(app.screen, SearchScreen)
                     and app.screen.query_one(Input).value == "layers", "'layers' in the box")
        assert step.stepper.index == 0


async def test_help_from_a_view_then_back_to_the_step_view(trace):
    """``r ? q s n``: help over the router view, closed; the router view closed; next call."""
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        step = app.screen
        burst(app, "r", "question_mark", "q", "s", "n")
        await settle(pilot, lambda: app.screen is step and step.stepper.index == 1,
                     "the step view at call 2")
        assert stack(app) == [StepScreen]


async def test_quit_in_a_burst_quits(trace):
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        burst(app, "r", "s", "g", "q")
        await settle(pilot, lambda: not app.is_running, "the app quitting")
    assert app.return_code == 0


async def test_same_end_as_keys_pressed_one_by_one(trace):
    """What a burst does is what the same keys pressed one at a time do."""
    keys = ("r", "s", "n", "n", "a", "s", "p", "g")
    ends = []
    for at_once in (False, True):
        app = make_step_app(trace)
        async with app.run_test(size=SIZE) as pilot:
            step = app.screen
            if at_once:
                burst(app, *keys)
                await settle(pilot, lambda app=app: isinstance(app.screen, GradientsScreen),
                             "the gradients view")
            else:
                await pilot.press(*keys)
                await pilot.pause()
            ends.append((stack(app), step.stepper.index))
    assert ends[0] == ends[1] == ([StepScreen, GradientsScreen], 1)
