"""The live screen shows whatever a run logs: loss-like metrics charted (told apart by markers
without colour), the others in a table with last/min/max, the MoE panel and the sample only
where the run has them, and the first non-finite value's step and module — for a run of a
user's own loop (rows carrying ``values``, as the run store's schema v2 gives them) as for a
``mdb overfit --model`` run."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from hooks.store.store import RunUpdate
from tests.conftest import drawn, wait_until
from tui.screens.live_chart import Series, chart_rows
from tui.screens.live_data import RunSeries, is_loss_like, metric_values


@pytest.mark.parametrize("name, loss", [
    ("loss", True), ("val_loss", True), ("train/ce", True), ("ce", True), ("nll", True),
    ("val_ppl", True), ("perplexity", True), ("lossG", True), ("ce_loss", True),
    ("acc", False), ("balance", False), ("lr", False), ("grad_norm", False), ("aux", False),
    ("source_len", False), ("precision", False),
])
def test_loss_like_names(name, loss):
    assert is_loss_like(name) is loss


@dataclass
class Row:
    """A stored step as a store with arbitrary metric names returns it."""

    step: int
    wall: float
    values: dict[str, float | None]
    expert_load: Any = None


def test_run_series_keeps_any_metric_with_last_min_max():
    s = RunSeries()
    acc = [0.1, 0.5, float("nan"), 0.4, 0.9]
    for i, a in enumerate(acc, start=1):
        values = {"loss": 2.0 / i, "acc": None if math.isnan(a) else a, "lr": 1e-3}
        if i % 2 == 0:
            values["val_loss"] = 3.0 / i
        s.add(Row(i, 100.0 + i, values))
    assert s.names == ["loss", "acc", "lr", "val_loss"]  # first-logged order
    assert s.loss_names() == ["loss", "val_loss"] and s.other_names() == ["acc", "lr"]
    st = s.stats["acc"]
    assert (st.last, st.min, st.max, st.nonfinite, st.last_step) == (0.9, 0.1, 0.9, 1, 5)
    assert s.metric("val_loss").points() == ([2, 4], [1.5, 0.75])
    assert s.metric("acc").count == 4  # the NaN is in the stats, not on the chart
    assert s.ce.count == 0 and s.metric("nope").points() == ([], [])
    assert not s.has_tokens and s.steps_per_s() == pytest.approx(1.0)


def test_rows_without_values_give_the_declared_metrics():
    """A row with only fixed columns (no ``values`` mapping): the declared names, ``loss``
    read from ``total``."""
    from types import SimpleNamespace

    row = SimpleNamespace(step=3, wall=1.0, ce=None, aux=0.5, total=1.5, grad_norm=2.0, lr=0.1)
    assert metric_values(row, ["loss", "grad_norm"]) == {"loss": 1.5, "grad_norm": 2.0}
    assert metric_values(row)["ce"] is None and metric_values(row)["aux"] == 0.5


def _plain(rows) -> list[str]:
    return ["".join(text for text, _ in row) for row in rows]


def test_chart_lines_stay_apart_without_colour():
    """Two crossing lines: markers on each line and in the legend name them, so a monochrome
    terminal (NO_COLOR) or a text capture still tells which is which."""
    xs = list(range(40))
    up = Series("loss", xs, [0.1 * x for x in xs], "cyan", marker="●")
    down = Series("val_loss", xs, [4.0 - 0.1 * x for x in xs], "magenta", marker="▲")
    rows = chart_rows([up, down], 60, 12, title="loss", mark_every=12)
    text = _plain(rows)
    assert "● loss" in text[0] and "▲ val_loss" in text[0]
    plot = text[1:-1]
    dots = {m: [(r, c) for r, line in enumerate(plot) for c, ch in enumerate(line) if ch == m]
            for m in "●▲"}
    assert len(dots["●"]) >= 3 and len(dots["▲"]) >= 3  # every 12 columns and at the end
    # each marker sits where its own line runs: ● climbs to the right, ▲ falls
    first_up, last_up = min(dots["●"], key=lambda p: p[1]), max(dots["●"], key=lambda p: p[1])
    first_dn, last_dn = min(dots["▲"], key=lambda p: p[1]), max(dots["▲"], key=lambda p: p[1])
    assert first_up[0] > last_up[0] and first_dn[0] < last_dn[0]
    assert last_up[0] == 0 and last_dn[0] == len(plot) - 1  # the last points: top and bottom
    # along the way the two lines' markers never share a column (staggered); both end at x=39
    assert {c for _, c in dots["●"]} & {c for _, c in dots["▲"]} == {last_up[1]} == {last_dn[1]}
    # a legend entry whose marker is its name (expert ids) is not written twice
    head = _plain(chart_rows([Series("0", [0, 1], [1, 2], marker="0")], 20, 4))[0]
    assert re.sub(r"\s+", " ", head).strip() == "0"


class FakeRun:
    """What ``RunStore.poll`` returns about a run of a user's own loop (``hooks.run``)."""

    def __init__(self, **kw):
        self.id, self.name, self.kind = 1, "exp1", "api"
        # the user's own config: never read as a declaration (it is not mdb's)
        self.config = {"lr": 3e-3, "metrics": ["bogus"], "text": "not a text to memorise"}
        self.status, self.total_steps, self.paused = "running", None, False
        self.last_step, self.checkpoint_step = 0, None
        self.fail_step = self.fail_module = self.reason = None
        self.nonfinite = None
        self.__dict__.update(kw)

    def writer_state(self, *a, **k):
        return self.status

    def status_line(self, *a, **k):
        return self.status

    def gone_reason(self, *a, **k):
        return ""


@dataclass
class FakeStore:
    path: str = "/tmp/fake.sqlite"
    rows: list = field(default_factory=list)
    run: FakeRun = field(default_factory=FakeRun)

    def poll(self, run_id, after_step=0):
        new = [r for r in self.rows if r.step > after_step]
        return RunUpdate(self.run, new, [], [], False)


def _api_rows(n: int = 30) -> list[Row]:
    rows = []
    for i in range(1, n + 1):
        values = {"loss": 3.0 * 0.9 ** i, "acc": min(1.0, 0.02 * i), "lr": 3e-3}
        if i % 10 == 0:
            values["val_loss"] = 3.5 * 0.9 ** i
        if i == 25:
            values["loss"] = math.inf
        rows.append(Row(i, 1000.0 + 0.1 * i, values))
    return rows


async def test_watch_of_a_users_own_loop_looks_like_an_overfit_run():
    from tui.live_app import make_watch_app

    nf = {"step": 25, "metric": "loss", "module": "model.layers.1.mlp", "direction": "forward"}
    store = FakeStore(rows=_api_rows(), run=FakeRun(last_step=30, nonfinite=nf))
    app = make_watch_app(store, store.run)
    screen = app.live
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: screen.polls >= 1 and screen.series.rows == 30)
        await drawn(pilot, app.live)
        q = app.screen.query_one
        status = str(q("#live-status").render())
        assert "● running  step 30" in status and "step 30/" not in status
        assert "loss 0.1272" in status and "val_loss 0.1484" in status
        assert "aux" not in status and "nan" not in status
        # no MoE panel, no sample, no progress bar (no step target): nothing made up
        assert not q("#live-experts").display and not q("#live-sample").display
        assert not q("#live-progress").display
        assert "MoE" not in " ".join(str(w.render()) for w in app.screen.query("Static"))
        rate = str(q("#live-rate").render())
        assert "10.0 steps/s" in rate and "tok/s" not in rate and "ETA" not in rate
        # the losses charted, with their markers; the rest in the table
        chart = q("#live-loss")
        assert [s.name for s in chart.series] == ["val_loss", "loss"]
        assert [s.marker for s in chart.series] == ["▲", "●"]
        assert chart.series[1].xs == [r.step for r in store.rows if r.step != 25]  # inf skipped
        table = str(q("#live-table").render()).splitlines()
        assert table[0].split() == ["metric", "last", "min", "max"]
        assert table[1].split() == ["▸acc", "0.6", "0.02", "0.6"]
        assert table[2].split() == ["lr", "0.003", "0.003", "0.003"]
        assert [s.name for s in q("#live-grad").series] == [""]
        assert q("#live-grad").chart_title == "acc"
        note = str(q("#live-note").render())
        assert q("#live-note").display
        assert note == "⚠ non-finite loss at step 25, first in model.layers.1.mlp (forward)"
        # m: one metric at a time, any of them; o: the table's mark (and the chart below it)
        await pilot.press("m")
        await drawn(pilot, app.live)
        assert chart.chart_title == "loss (log) · m: next" and len(chart.series) == 1
        await pilot.press("m", "m")
        await drawn(pilot, app.live)
        assert chart.chart_title.startswith("lr (log)")
        await pilot.press("m", "m")
        await drawn(pilot, app.live)
        assert chart.chart_title == "loss (log)" and len(chart.series) == 2
        await pilot.press("o")
        await drawn(pilot, app.live)
        assert str(q("#live-table").render()).splitlines()[2].startswith("▸lr")
        assert q("#live-grad").chart_title == "lr"
        await pilot.press("q")


async def test_watch_replays_a_model_run_without_aux_or_moe(tmp_path):
    from hooks.store.store import RunStore
    from hooks.train.overfit import ModelOverfitOptions, ModelOverfitSession
    from tests.conftest import REPO
    from tui.commands.overfit import _build_workload
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    db = tmp_path / "mdb.sqlite"
    with RunStore(db, create=True) as store:
        opts = ModelOverfitOptions(model=f"{REPO / 'tests' / 'families.py'}:nanogpt", steps=8)
        ModelOverfitSession.create(store, "g", opts, _build_workload).run()
    store, run = open_run(str(db), "g")
    app = make_watch_app(store, run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.polls >= 1)
        await drawn(pilot, app.live)
        s = app.live.series
        assert s.names == ["loss", "grad_norm", "lr", "step_time", "tokens_per_s",
                           "steps_per_s"]
        status = str(app.screen.query_one("#live-status").render())
        assert "✓ finished  step 8/8  loss " in status and "aux" not in status
        assert not app.screen.query_one("#live-experts").display
        assert [x.name for x in app.screen.query_one("#live-loss").series] == ["loss"]
        await pilot.press("q")
    store.close()
