"""The live screen of ``mdb overfit``: bounded series, the braille chart, and Pilot runs of the
real screen (charts grow, loss falls, pause / step / capture → step view → back, stop, NaN)."""

from __future__ import annotations

import math

import pytest
import torch

from hooks.store.store import MetricRow, RunStore
from tests.conftest import drawn, wait_until
from tests.models import tiny_session
from tui.screens.live_chart import Series, _line, chart_rows
from tui.screens.live_data import Downsampler, RunSeries, matching_prefix

TEXT = "人工智能正在改变世界。" * 3


pytestmark = pytest.mark.usefixtures("one_thread")


# -- pure parts ----------------------------------------------------------------------------------

def test_downsampler_matches_block_means():
    rng = torch.Generator().manual_seed(0)
    values = torch.rand(1000, generator=rng, dtype=torch.float64).tolist()
    d = Downsampler(capacity=16)
    for i, v in enumerate(values, start=1):
        d.append(i, v)
    d.append(1001, float("nan"))  # skipped
    xs, ys = d.points()
    assert len(xs) <= 16 + 1 and d.count == 1000
    assert (xs[0], ys[0]) == (1, values[0])  # the first point on its own: charts start at 1
    xs, ys = xs[1:], ys[1:]
    width = d.width
    assert width == 64  # 1000 points in ≤ 16 buckets: widths 1, 2, 4, ... 64
    for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
        block = values[k * width:(k + 1) * width]
        assert x == min((k + 1) * width, 1000)
        assert y == pytest.approx(torch.tensor(block, dtype=torch.float64).mean().item(),
                                  rel=1e-12)
    # max_points merges whole groups of buckets, weighted by their point counts; the first
    # point is one of the max_points
    xs4, ys4 = d.points(5)
    assert len(xs4) == 5 and xs4[0] == 1 and xs4[-1] == 1000
    assert ys4[1] == pytest.approx(sum(values[: 4 * width]) / (4 * width), rel=1e-12)


def test_bresenham_line_is_connected_and_close_to_the_segment():
    for (x0, y0, x1, y1) in [(0, 0, 9, 3), (5, 7, 0, 0), (2, 2, 2, 9), (0, 5, 7, 5), (3, 1, 0, 8)]:
        pts = list(_line(x0, y0, x1, y1))
        assert pts[0] == (x0, y0) and pts[-1] == (x1, y1)
        for (a, b), (c, d) in zip(pts, pts[1:], strict=False):
            assert max(abs(a - c), abs(b - d)) == 1  # 8-connected, no repeats
        length = math.hypot(x1 - x0, y1 - y0)
        for px, py in pts:  # distance to the infinite line ≤ 1 dot
            dist = abs((y1 - y0) * px - (x1 - x0) * py + x1 * y0 - y1 * x0) / length
            assert dist <= 1.0


def test_chart_places_a_rising_line_from_bottom_left_to_top_right():
    rows = chart_rows([Series("a", [0, 10], [0.0, 1.0], "cyan")], 20, 6, title="t")
    assert len(rows) == 6
    plot = ["".join(t for t, _ in r) for r in rows[1:5]]
    gutter = plot[0].index("┤") + 1
    first, last = plot[0][gutter:], plot[-1][gutter:]
    assert first.rstrip()[-1] != " " and len(first.rstrip()) == len(first)  # top row: right end
    assert last[0] != " "  # bottom row: left end
    assert plot[0].lstrip().startswith("1┤") and plot[-1].lstrip().startswith("0┤")  # y labels
    axis = "".join(t for t, _ in rows[5])
    assert axis.split() == ["0", "step", "10"]


def test_chart_log_scale_skips_nonpositive_and_labels_decades():
    rows = chart_rows([Series("a", [1, 2, 3, 4], [100.0, 10.0, 0.0, 1.0])], 30, 7, log=True)
    labels = ["".join(t for t, _ in r).split("┤")[0].strip() for r in rows[1:6]]
    assert labels[0] == "100" and labels[-1] == "1" and labels[2] == "10"


def test_run_series_rates_eta_and_expert_tokens():
    s = RunSeries(total_steps=100, text="abcdef", top_k=2)
    for i in range(1, 11):
        s.add(MetricRow(step=i, wall=100 + 0.5 * i, ce=1 / i, aux=0.01, total=1 / i + 0.01,
                        grad_norm=1.0, step_time=0.25, tokens_per_s=40.0,
                        expert_load=[[0.75, 0.25]]))
    assert s.steps_per_s() == pytest.approx(2.0)
    assert s.tokens_per_s() == pytest.approx(2.0 * 10)  # 10 tokens per step
    assert s.eta() == pytest.approx(90 * 0.5)
    _, tokens = s.experts[0][0].points()
    assert tokens[-1] == pytest.approx(0.75 * 10 * 2)  # fraction × N × k
    s.add_sample(10, "ab", "cdxy")
    assert s.sample.matched == 2 == matching_prefix("cdxy", "cdef")


# -- the screen, with a real trainer ---------------------------------------------------------------

async def test_live_screen_20_steps_charts_grow_and_loss_falls(tmp_path):
    from tui.live_app import make_overfit_app

    session = tiny_session(tmp_path, steps=20)
    app = make_overfit_app(session, chart_interval=0.05, text_interval=0.05)
    screen = app.live
    sizes = []
    async with app.run_test(size=(80, 24)) as pilot:
        loss_chart = app.screen.query_one("#live-loss")

        def size() -> int:
            return sum(len(s.xs) for s in loss_chart.series)

        while not screen.training_done.is_set():  # every size the chart is drawn at
            sizes.append(size())
            await wait_until(pilot, lambda: size() != sizes[-1]
                             or screen.training_done.is_set())
        await wait_until(pilot, lambda: screen.ended is not None)
        await drawn(pilot, app.live)
        sizes.append(sum(len(s.xs) for s in loss_chart.series))
        assert screen.state == "finished"
        assert screen.series.step == 20 and screen.series.rows == 20
        status = str(app.screen.query_one("#live-status").render())
        assert "finished" in status and "step 20/20" in status
        assert len(app.screen.query(".live-expert")) == 2  # one chart per MoE layer
        await pilot.press("q")
    assert app.return_code == 0
    # the chart's data grew while training ran, up to 3 lines × 20 steps
    assert sizes[-1] == 60
    assert any(0 < a < sizes[-1] for a in sizes) or len(set(sizes)) > 2
    assert sizes == sorted(sizes)
    # the loss fell: what the chart drew against the run store's rows
    xs, ce = screen.series.ce.points()
    with RunStore(tmp_path / "mdb.sqlite") as store:
        rows = store.metrics(store.run("live").id)
    assert xs == [r.step for r in rows]
    assert ce == pytest.approx([r.ce for r in rows], rel=1e-12)
    assert rows[-1].ce < 0.5 * rows[0].ce


async def test_pause_step_capture_opens_step_view_and_comes_back(tmp_path):
    from tests.hooks.train.test_training import CountingControl
    from tui.live_app import make_overfit_app
    from tui.screens.live import LiveScreen
    from tui.screens.step import StepScreen

    session = tiny_session(tmp_path, steps=400)
    session.control = control = CountingControl()
    app = make_overfit_app(session, chart_interval=0.1)
    screen = app.live
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: screen.series.step >= 2)
        await pilot.press("p")
        await wait_until(pilot, lambda: screen.state == "paused")
        paused_at = session.trainer.step
        # two decisions to wait after the pause was seen: no step started in between
        waits = control.wait_for_wait(control.wait_for_wait(0))
        await wait_until(pilot, lambda: screen.series.step == paused_at)
        assert session.trainer.step == paused_at and control.waits >= waits  # stays paused
        await pilot.press("s")
        await wait_until(pilot, lambda: screen.series.step == paused_at + 1)
        await pilot.press("c")
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))
        assert app.screen.trace.step == paused_at + 2
        assert app.screen.trace.forward and app.screen.trace.backward
        await pilot.press("q")  # back to the live screen, still paused
        await wait_until(pilot, lambda: isinstance(app.screen, LiveScreen))
        assert session.control.paused
        assert screen.series.step == paused_at + 2
        await pilot.press("x")
        await wait_until(pilot, lambda: screen.ended is not None)
        assert screen.ended.status == "interrupted"
        await pilot.press("q")
    assert app.return_code == 0
    with RunStore(tmp_path / "mdb.sqlite") as store:
        run = store.run("live")
    assert (run.status, run.last_step, run.checkpoint_step) == (
        "interrupted", paused_at + 2, paused_at + 2)


async def test_nonfinite_loss_shows_failed_with_step_and_module(tmp_path):
    import argparse

    from tui.commands.overfit import _arm_nan
    from tui.live_app import make_overfit_app

    session = tiny_session(tmp_path, steps=30)
    _arm_nan(session, 4)
    app = make_overfit_app(session)
    screen = app.live
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: screen.ended is not None)
        await drawn(pilot, app.live)
        status = str(app.screen.query_one("#live-status").render())
        note = str(app.screen.query_one("#live-note").render())
        assert screen.ended.status == "failed" and screen.ended.fail_step == 4
        assert status.startswith("✗ failed @ step 4  step 4/30")
        assert note.startswith("✗ non-finite loss at step 4, first in model.layers.1.self_attn")
        await pilot.press("q")
    assert app.return_code == 1
    with RunStore(tmp_path / "mdb.sqlite") as store:
        run = store.run("live")
    assert (run.status, run.fail_step) == ("failed", 4)
    assert run.fail_module.startswith("model.layers.1.self_attn")
    del argparse


@pytest.mark.slow
async def test_keys_do_nothing_while_the_live_screen_is_too_small(tmp_path):
    """At 60x20 ``p`` (pause) and ``x`` (stop) must not act unseen; once the terminal is large
    enough again, ``p`` pauses."""
    from tui.live_app import make_overfit_app

    session = tiny_session(tmp_path, steps=100_000, name="small")
    app = make_overfit_app(session)
    async with app.run_test(size=(60, 20)) as pilot:
        screen = app.live
        await wait_until(pilot, lambda: session.trainer.step >= 1)
        assert app.screen.has_class("-too-small")
        await pilot.press("p", "x")
        await pilot.pause()
        assert not session.control.paused and not session.control.stop_requested
        await pilot.resize_terminal(80, 24)
        await wait_until(pilot, lambda: not screen.has_class("-too-small"))
        await pilot.press("p")
        assert session.control.paused
        await pilot.press("q")


async def test_too_small_terminal_says_so(tmp_path):
    from tui.live_app import make_overfit_app

    session = tiny_session(tmp_path, steps=3)
    app = make_overfit_app(session)
    async with app.run_test(size=(60, 20)) as pilot:
        await wait_until(pilot, lambda: app.live.training_done.is_set())
        await wait_until(pilot, lambda: app.screen.has_class("-too-small"))
        assert "terminal too small" in str(app.screen.query_one("#too-small").render())
        await pilot.press("q")
