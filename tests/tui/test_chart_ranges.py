"""Charts of a long run keep every spike visible at any zoom (issue 25): the live screen's
:class:`Downsampler` keeps min/max per bucket, the chart draws each bucket's range."""

from __future__ import annotations

import random

import pytest

from tui.screens.live_chart import Series, chart_rows
from tui.screens.live_data import Downsampler


@pytest.mark.parametrize("points", [8, 16, 40, 128, 256, None])
def test_a_single_spike_among_100k_points_survives_every_resolution(points):
    rng = random.Random(points or 1)
    spike_at = rng.randrange(100_000)
    values = [rng.uniform(1.0, 2.0) for _ in range(100_000)]
    values[spike_at] = 50.0
    values[(spike_at + 50_000) % 100_000] = -7.0  # a dip too
    d = Downsampler(256)
    for i, v in enumerate(values):
        d.append(i, v)
    xs, means, lows, highs = d.ranges(points)
    assert len(xs) <= (points or 256)
    assert max(highs) == 50.0 and min(lows) == -7.0  # exact, whatever the zoom
    assert max(means) < 50.0  # a mean per bucket alone would hide the spike
    assert xs[-1] == 99_999 and d.points(points) == (xs, means)
    # each bucket's range holds its mean
    assert all(lo <= m + 1e-12 and m <= hi + 1e-12 for lo, m, hi in
               zip(lows, means, highs, strict=True))


def test_loaded_buckets_then_new_points():
    d = Downsampler(8)
    # 20 buckets of 5 points each (the store's history), the 7th holding a spike
    steps = [5 * (i + 1) for i in range(20)]
    lows = [1.0] * 20
    highs = [2.0 if i != 6 else 99.0 for i in range(20)]
    d.load(steps, [5] * 20, [7.5] * 20, lows, highs)
    assert len(d) <= 8
    d.append(101, 3.0)
    xs, means, lo, hi = d.ranges()
    assert max(hi) == 99.0 and xs[-1] == 101 and min(lo) == 1.0
    assert d.count == 101


def test_the_chart_draws_the_range_so_its_top_is_the_spike():
    xs = list(range(0, 1000, 10))
    ys = [1.0] * len(xs)
    highs = [1.5] * len(xs)
    highs[37] = 40.0
    rows = chart_rows([Series("loss", xs, ys, lows=[0.5] * len(xs), highs=highs)], 60, 12)
    plot = ["".join(t for t, _ in row) for row in rows[1:-1]]
    labels = [p.split("┤")[0].strip() for p in plot]
    assert labels[0] == "40"  # the top of the y axis is the spike, not the means' 1.0
    top = plot[0].split("┤")[1]
    assert top.strip(), "a dot of the spike's range reaches the top row"
    # without the ranges, the means alone are a flat line at 1.0: no spike to see
    flat = chart_rows([Series("loss", xs, ys)], 60, 12)
    assert "40" not in "".join(t for row in flat for t, _ in row)


def test_a_live_chart_starts_at_step_1_not_at_the_first_buckets_last_step():
    """Issue 35: the live charts started at step 4–12 (the first bucket's last step)."""
    d = Downsampler(8)
    for step in range(1, 101):
        d.append(step, 10.0 / step)
    xs, means, lows, highs = d.ranges(20)
    assert len(xs) <= 20 and xs[0] == 1 and xs[-1] == 100
    assert means[0] == lows[0] == highs[0] == 10.0  # the first point itself
    rows = chart_rows([Series("loss", xs, means, lows=lows, highs=highs)], 60, 10)
    axis = "".join(t for t, _ in rows[-1]).split()
    assert axis[0] == "1" and axis[-1] == "100"


def test_loaded_buckets_start_at_their_first_step():
    d = Downsampler(8)
    d.load([10, 20, 30], [10, 10, 10], [15.0, 25.0, 35.0], [1.0, 2.0, 3.0], [2.0, 3.0, 4.0],
           first=1)
    xs, means, lows, highs = d.ranges()
    assert xs == [1, 10, 20, 30]
    assert (means[0], lows[0], highs[0]) == (1.5, 1.0, 2.0)  # the first bucket's, at step 1


def test_a_chart_narrower_than_the_buckets_still_starts_at_step_1():
    """121 steps in buckets of one, drawn at 70 points: the first group of buckets ends at
    step 2; the chart still starts at step 1 (the watch screen showed ``2``)."""
    d = Downsampler(256)
    for step in range(1, 122):
        d.append(step, 1.0 + step)
    xs, means, lows, highs = d.ranges(70)
    assert len(xs) <= 70 and xs[0] == 1 and means[0] == 2.0 and xs[-1] == 121
