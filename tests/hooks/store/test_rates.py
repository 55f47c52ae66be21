"""The speed of a run, one figure everywhere (issue 21): the live screen's series, ``mdb
compare``'s table and a headless ``mdb overfit`` line all show the median spacing of the
recorded steps' walls (:mod:`hooks.store.rates`), not a step's own ``1 / step_time``."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from hooks.store.rates import StepRate
from hooks.store.store import MetricRow
from tui.screens.live_data import RunSeries

# walls of five steps: spacings 0.1, 0.2, 0.1 and a 1.0 s pause; median 0.15 s
WALLS = [100.0, 100.1, 100.3, 100.4, 101.4]
STEP_TIME = 0.01  # each step's own compute: 100 steps/s, which no view may show as the speed


def test_the_rate_is_the_median_spacing_of_the_walls():
    rate = StepRate()
    assert rate.steps_per_s(STEP_TIME) == pytest.approx(1 / STEP_TIME)  # one step: its own
    for w in WALLS:
        rate.add(w)
    assert rate.seconds_per_step() == pytest.approx(0.15)
    assert rate.steps_per_s() == pytest.approx(1 / 0.15)
    rate.reset()
    assert rate.steps_per_s() is None


def test_the_live_series_and_the_headless_line_show_the_same_speed():
    from tui.commands.overfit import _Reporter

    rows = [MetricRow(step=i + 1, wall=w, ce=1.0, aux=0.0, total=1.0, grad_norm=1.0, lr=1e-3,
                      step_time=STEP_TIME, tokens_per_s=64 / STEP_TIME,
                      steps_per_s=1 / STEP_TIME) for i, w in enumerate(WALLS)]
    series = RunSeries(100)
    for row in rows:
        series.add(row)
    assert series.steps_per_s() == pytest.approx(1 / 0.15)
    assert series.tokens_per_s() == pytest.approx(64 / 0.15)

    session = SimpleNamespace(trainer=SimpleNamespace(total_steps=100, start_step=0),
                              metric_names=None, headline_metrics=["total"])
    out = io.StringIO()  # not a terminal: plain lines
    reporter = _Reporter(session, stream=out)
    reporter.every = 1
    for row in rows:
        reporter.on_step(SimpleNamespace(metrics=row, sample=None))
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("step 5/100") and last.endswith(f"  {1 / 0.15:.1f} steps/s")
