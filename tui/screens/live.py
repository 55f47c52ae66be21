"""``LiveScreen``: the charts and numbers of a training run as it happens, shared by its two
screens:

* :class:`tui.screens.live_watch.WatchScreen` follows a run from the run store: ``mdb watch``,
  and ``mdb overfit``'s live screen, a viewer of the trainer process it started (its keys:
  :mod:`tui.screens.live_controls`);
* :class:`tui.screens.live_train.TrainScreen` trains an
  :class:`hooks.train.overfit.OverfitSession` in this process (the API, the tests, the
  benchmark).

What it shows is whatever the run logs (:class:`tui.screens.live_data.RunSeries`), the same for
a run of ``mdb overfit`` (minillm or ``--model``) and one of a user's own loop (``hooks.run``):

* a chart of the loss-like metrics (``ce``, ``aux`` and ``total`` of minillm; ``loss``;
  ``val_loss``...; log scale by default, ``l`` toggles), each line with its own marker so they
  stay apart without colour; ``m`` charts one metric at a time instead, any of them;
* beside it, a table of the other metrics (last, min, max) above a chart of the one marked ▸
  (``o`` moves the mark; gradient norm first where the run logs it);
* tokens routed to each expert over steps for each MoE layer — only for runs whose steps
  record expert load;
* steps/s (and tokens/s when known; :mod:`hooks.store.rates`), a progress bar with ETA when
  the run has a step target;
* the latest greedy continuation of the text's beginning with how many characters already
  match the text — only for runs that memorise a text;
* the step (and, where named, the module) of the first non-finite value, and the run's loss
  spikes (a ``!`` on the loss chart at each spike's peak, the largest in words below) — both
  as the run store recorded them;
* how the run ended, and for a run that can continue, its checkpoint and the command;
* a step that takes far longer than the ones before (a forward that hangs): for how long.

Every line is laid out for 80 columns: the status line keeps the state, the step, the loss
(:func:`hooks.store.numbers.loss_metric`) and ``|g|`` and drops the other losses first; hints are
one line; the help wraps whole words.

Redraws are throttled so the screen costs a trainer in the same process little (see
``benchmarks/bench_overfit_ui.py``): the numbers at most every ``text_interval`` (0.2 s), the
charts at most every ``chart_interval``, every series is bounded by
:class:`tui.screens.live_data.Downsampler`, so a redraw costs the same at step 100,000 as at
step 100. Nothing is redrawn while another screen (the step view) covers this one.
"""

from __future__ import annotations

import math
import time
from typing import Any

from rich.text import Text
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, ProgressBar, Static

from hooks.store.store import nonfinite_sentence
from hooks.text import printable
from tui import messages
from tui.screens.base import MdbScreen, show
from tui.screens.live_chart import LineChart, Series
from tui.screens.live_data import (
    RunSeries,
    display_name,
    format_duration,
)
from tui.screens.live_help import LiveHelpScreen
from tui.screens.live_ranks import open_ranks
from tui.screens.live_spikes import SpikeOpener

#: Columns an expert chart needs to stay legible; fewer layers are shown when narrower.
EXPERT_CHART_MIN_WIDTH = 19
#: Styles of the metrics minillm logs; other loss lines take :data:`LINE_STYLES` in turn.
METRIC_STYLES = {"total": "bold", "aux": "yellow", "ce": "cyan", "loss": "cyan"}
LINE_STYLES = ("magenta", "green", "red", "blue", "bright_white", "yellow")
#: Markers of the loss lines, by first-logged order (minillm: ce ●, aux ▲, total ■).
LINE_MARKERS = ("●", "▲", "■", "◆", "▼", "✚", "★", "○")
#: Columns between two markers of one line.
MARK_EVERY = 12
#: How the status line and the side chart name some metrics.
METRIC_LABELS = {"grad_norm": "grad norm"}
EXPERT_STYLES = ("cyan", "yellow", "green", "magenta", "red", "blue", "bright_white",
                 "bright_black")
#: Rows the side chart keeps below the table of metrics.
SIDE_CHART_MIN_ROWS = 5
#: Seconds between two "new steps" messages of the training thread (at most).
POST_INTERVAL = 0.05
#: A step counts as slow (the rate row says for how long it has run) after this many seconds
#: and this many times the usual step time.
SLOW_STEP_S = 3.0
SLOW_STEP_FACTOR = 10.0
#: Lines of the note area at most (non-finite value, spike, end of the run, resume command).
NOTE_LINES = 3

def _num(x: float | None, spec: str = ".4f") -> str:
    if x is None:
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return format(x, spec)


def _rate(x: float | None, unit: str) -> str:
    if x is None:
        return f"— {unit}"
    if x >= 100:
        return f"{x:,.0f} {unit}"
    return f"{x:.1f} {unit}"


def _ranged(label: str, sampler, n: int, style: str = "", marker: str = "",
            flags=()) -> Series:
    """A chart line of ``sampler`` (:class:`tui.screens.live_data.Downsampler`) at ``n``
    points, each drawn as the min-max range of its bucket (a spike stays visible)."""
    xs, ys, lows, highs = sampler.ranges(n)
    return Series(label, xs, ys, style, marker, flags=flags, lows=lows, highs=highs)


def compact(x: float | None, width: int = 7) -> str:
    """A number in at most ``width`` characters: ``0.0155``, ``1.55e-5``, ``3.2e12``, ``nan``."""
    if x is None:
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    a = abs(x)
    if 1e-3 <= a < 1e5:
        for digits in range(4, 0, -1):
            text = f"{x:.{digits}g}"
            if len(text) <= width and "e" not in text:
                return text
    for digits in range(2, -1, -1):
        text = f"{x:.{digits}e}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")
        if len(text) <= width:
            return text
    return text


class LiveScreen(SpikeOpener, MdbScreen):
    """What the two live screens share: the layout, the throttled redraws, the charts, the
    table, the notes, and the keys that only change the view. Build one with
    :func:`tui.live_app.make_watch_app` or :func:`tui.live_app.make_overfit_app`.

    Args:
        declared: What the run declares it logs (:func:`tui.screens.live_data.run_declaration`:
            ``names``, ``loss_names``, ``text``, ``top_k``, ``moe``).
        total: The run's step target, or ``None``.
        run_name: The run's name.
        text_interval: Minimum seconds between redraws of the numbers.
        chart_interval: Minimum seconds between redraws of the charts.

    Attributes:
        series: The :class:`tui.screens.live_data.RunSeries` being plotted.
        state: ``reading``/``starting``, ``running``, ``paused``, or how the run ended.
        error: One line when training crashed or the database became unreadable.
        watch: Whether this screen follows a run from the store (``WatchScreen``).
    """

    watch = False

    BINDINGS = [
        Binding("p", "pause", "pause/resume", id="live.pause"),
        Binding("s", "step", "step", id="live.step"),
        Binding("c", "capture", "step view", id="live.capture"),
        Binding("x", "stop", "stop", id="live.stop"),
        Binding("d", "detach", "detach", id="live.detach"),
        Binding("m", "next_metric", "chart: losses / one metric", show=False,
                id="live.metric"),
        Binding("o", "next_other", "table: mark the next metric", show=False,
                id="live.other"),
        Binding("l", "log_scale", "log/linear loss", show=False, id="live.log"),
        Binding("e", "next_layers", "more MoE layers", show=False, id="live.layers"),
        Binding("k", "ranks", "ranks of a torchrun job", show=False, id="live.ranks"),
        Binding("enter", "open_spike", "open a spike's captured step", show=False,
                id="live.spike"),
        Binding("i", "open_spike", "open a spike's captured step (as Enter)", show=False,
                id="live.spike_letter"),
        Binding("question_mark", "help", "keys", key_display="?", id="live.help"),
        Binding("q", "quit_live", "quit", id="live.quit"),
        Binding("ctrl+c", "interrupt", "quit (as q; watching: detach)", show=False,
                id="live.interrupt"),
    ]

    def __init__(self, *, declared: dict[str, Any], total: int | None, run_name: str,
                 text_interval: float = 0.2, chart_interval: float = 1.0,
                 name: str | None = None) -> None:
        super().__init__(name=name)
        self.text_interval = text_interval
        self.chart_interval = chart_interval
        self.run_name = run_name
        self.expect_experts = bool(declared["moe"])
        self.series = RunSeries(total, text=declared["text"], top_k=declared["top_k"],
                                names=declared["names"], loss_names=declared["loss_names"])
        self.state = "reading"
        self.error: str | None = None
        self._pending_capture: Any = None  # a capture that arrived under another screen
        self._log_scale = True
        self._main: str | None = None  # None: the losses together; else one metric
        self._other: str | None = None  # the table's marked metric (None: the default)
        self._layer_page = 0
        self._redraw_timer = None
        self._next_text = 0.0
        self._next_chart = 0.0
        self._dirty_text = True
        self._dirty_charts = True
        self._shown: dict[str, str] = {}
        self._shown_progress: tuple[int, int] | None = None
        self.redraws = 0  # chart redraws (tests, benchmark)

    # -- what each screen says -------------------------------------------------------------------
    def _title(self) -> str:
        raise NotImplementedError

    def _start(self) -> None:
        """Start reading or training steps (on mount)."""
        raise NotImplementedError

    def _state_text(self) -> Text:
        """One short word (and a mark that shows without colour) for the state."""
        raise NotImplementedError

    def _end_lines(self) -> list[tuple[str, str]]:
        """How the run ended, and how it continues, as ``(line, style)``."""
        return []

    def _nonfinite(self) -> dict[str, Any] | None:
        """The run's first non-finite value as the store recorded it, for the notes."""
        return None

    def _db_path(self) -> str:
        raise NotImplementedError

    def _steps_are_steps(self) -> bool:
        """Whether a gap between two recorded steps is a step in progress (``mdb overfit``),
        not a user's loop doing something else."""
        return True

    def _capture_hint(self, step: int) -> str:
        raise NotImplementedError

    def _back_from_step(self, _result=None) -> None:
        """The step view opened with ``c`` was closed."""

    # -- layout ----------------------------------------------------------------------------------
    def compose(self):
        yield Static(printable(self._title()), id="title", markup=False)
        yield Static("", id="live-status")
        with Horizontal(id="live-progress-row"):
            yield ProgressBar(total=self.series.total_steps, show_eta=False, id="live-progress")
            yield Static("", id="live-rate", markup=False)
        with Horizontal(id="live-charts"):
            yield LineChart("loss", log=True, mark_every=MARK_EVERY, id="live-loss")
            with Vertical(id="live-side"):
                yield Static("", id="live-table", markup=False)
                yield LineChart("grad norm", id="live-grad")
        with Vertical(id="live-experts"):
            yield Static("", id="live-experts-head", markup=False)
            yield Horizontal(id="live-experts-row")
        yield Static("", id="live-sample")
        yield Static("", id="live-note")
        yield from self._more_widgets()
        yield Static("", id="hint", markup=False)
        yield Footer()

    def _more_widgets(self):
        """Widgets of one screen only, above the hint line."""
        return iter(())

    def on_mount(self) -> None:
        self._start()
        self.set_interval(1.0, self._tick)
        self._layout_panels()
        self._redraw_all()

    def _tick(self) -> None:
        """Once a second: a step that is taking long gets its time in the rate row."""
        if self.state == "running" and self._slow_step() is not None:
            self._dirty_text = True
            self._schedule_redraw()

    def _slow_step(self) -> float | None:
        """Training (here, or an ``mdb overfit`` run watched): seconds the step after the last
        one has been running, when that is long (more than :data:`SLOW_STEP_S` and
        :data:`SLOW_STEP_FACTOR` times the usual step), else None."""
        s = self.series
        if s.last is None or self.state != "running" or not self._steps_are_steps():
            return None  # a user's loop: a gap may be it evaluating, not a step
        usual = s.seconds_per_step() or 0.0
        waited = time.time() - s.last.wall
        if waited > max(SLOW_STEP_S, SLOW_STEP_FACTOR * usual):
            return waited
        return None

    def _layout_panels(self) -> None:
        """Show only the panels this run has data for: the MoE panel for a run with expert
        load, the sample for a run that memorises a text, the side table when there are
        metrics besides the losses, the progress bar when there is a step target, the note
        when a non-finite value was logged."""
        s = self.series
        self._display("#live-experts", bool(s.experts) or (self.expect_experts and not s.rows))
        self._display("#live-sample", bool(s.text) or s.sample is not None)
        self._display("#live-side", bool(s.other_names()) or not s.rows)
        self._display("#live-progress", bool(s.total_steps))
        self._display("#live-note", bool(self._notes()))

    def _display(self, selector: str, visible: bool) -> None:
        widget = self.query_one(selector)
        if widget.display != visible or (visible and self.has_class("-too-small")):
            show(widget, visible)

    def on_screen_resume(self) -> None:
        self._dirty_text = self._dirty_charts = True
        self._schedule_redraw()
        pending, self._pending_capture = self._pending_capture, None
        if pending is not None:
            self.call_later(self._open_capture, pending)

    def on_resize(self) -> None:
        self._dirty_charts = True
        self._schedule_redraw()

    def on_step_captured(self, message: messages.StepCaptured) -> None:
        message.stop()
        if self.app.screen is not self:  # the user opened help meanwhile: not on top of it
            self._pending_capture = message
            self.hint(f"step {message.step} captured · its step view opens after this")
            return
        self._open_capture(message)

    def _open_capture(self, message) -> None:
        from tui.screens.step import StepScreen

        self.hint(self._capture_hint(message.step))
        screen = StepScreen(message.trace, embedded=True)
        self.app.push_screen(screen, self._back_from_step)

    def on_hint(self, message: messages.Hint) -> None:
        message.stop()
        self.hint(message.text)

    # -- redraws (throttled) ---------------------------------------------------------------------
    def _data_changed(self) -> None:
        self._dirty_text = self._dirty_charts = True
        self._schedule_redraw()

    def _schedule_redraw(self) -> None:
        if self._redraw_timer is not None:
            return
        now = time.monotonic()
        due = self._next_text if self._dirty_text else self._next_chart
        if self._dirty_charts:
            due = min(due, self._next_chart)
        # (a zero-delay Timer divides by zero in Textual 8: 10 ms at least)
        self._redraw_timer = self.set_timer(max(0.01, due - now), self._redraw_due)

    def _redraw_due(self) -> None:
        self._redraw_timer = None
        if not self.is_current:
            return  # covered by the step view: redrawn on resume
        now = time.monotonic()
        if self._dirty_text and now >= self._next_text:
            self._draw_text()
            self._next_text = now + self.text_interval
        if self._dirty_charts and now >= self._next_chart:
            self._draw_charts()
            self._next_chart = now + self.chart_interval
        if self._dirty_text or self._dirty_charts:
            self._schedule_redraw()

    def _redraw_all(self) -> None:
        self._draw_text()
        self._draw_charts()

    def _draw_text(self) -> None:
        self._dirty_text = False
        s = self.series
        self._layout_panels()
        self._set("#live-status", self._status_text())
        if s.total_steps and (s.total_steps, s.step) != self._shown_progress:
            self._shown_progress = (s.total_steps, s.step)
            self.query_one("#live-progress", ProgressBar).update(total=s.total_steps,
                                                                 progress=s.step)
        eta = s.eta()
        ended = self.state not in ("running", "starting", "reading")
        rate = _rate(s.steps_per_s(), "steps/s")
        if s.has_tokens:
            rate += f" · {_rate(s.tokens_per_s(), 'tok/s')}"
        if s.total_steps:
            rate += f" · ETA {format_duration(eta) if not ended else '—'}"
        slow = self._slow_step()
        if slow is not None:
            usual = s.seconds_per_step()
            rate = (f"step {s.step + 1} running for {format_duration(slow)}"
                    + (f" (steps took {usual:.2g} s)" if usual else ""))
        self._set("#live-rate", rate)
        if s.text or s.sample is not None:
            self._set("#live-sample", self._sample_text())
        notes = self._notes()
        if notes:
            text = Text()
            for i, (line, style) in enumerate(notes[:NOTE_LINES]):
                text.append(("\n" if i else "") + printable(line), style=style)
            self._set("#live-note", text)

    def _set(self, selector: str, content) -> None:
        """Update a Static only when its content changed (an update costs a layout pass)."""
        key = content.markup if isinstance(content, Text) else content
        if self._shown.get(selector) != key:
            self._shown[selector] = key
            self.query_one(selector, Static).update(content)

    def _status_text(self) -> Text:
        """The state, the step, the losses and ``|g|``, fitted to the line: the run's loss
        first, the other losses dropped before anything is cut (``|g|`` keeps its place)."""
        s = self.series
        total = f"/{s.total_steps}" if s.total_steps else ""
        pieces: list[tuple[int, str, str]] = [(0, f"step {s.step}{total}", "")]  # (rank, ...)
        if s.last is not None:
            # the run's loss first (hooks.store.numbers.loss_metric, as mdb runs and mdb compare
            # show it), then the other losses charted with it
            main = s.loss_name if s.loss_name in s.stats else None
            losses = ([main] if main else []) + [n for n in s.loss_names() if n != main]
            for i, name in enumerate(losses[:3]):
                pieces.append((1 if i == 0 else 3, f"{display_name(name)} "
                               f"{_num(s.value(name))}", ""))
            if "grad_norm" in s.stats:
                pieces.append((2, f"|g| {_num(s.value('grad_norm'), '.3g')}", ""))
        head = self._state_text()
        width = max(20, (self.query_one("#live-status").size.width or self.app.size.width) - 2)
        room = width - head.cell_len
        keep = set()
        for _rank, text, _ in sorted(pieces, key=lambda p: p[0]):
            if len(text) + 2 <= room:
                keep.add(text)
                room -= len(text) + 2
        line = Text()
        line.append_text(head)
        for _, text, style in pieces:
            if text in keep:
                line.append("  " + text, style=style)
        return line

    def _notes(self) -> list[tuple[str, str]]:
        """The lines under the charts, most important first: how the run ended (and, for a run
        that can continue, its checkpoint and the command), where a value first turned
        non-finite, the largest loss spike."""
        notes: list[tuple[str, str]] = list(self._end_lines())
        nf = self._nonfinite()
        if nf and not (self.state == "failed" and getattr(self.run, "fail_step", None)
                       == nf.get("step")):
            notes.append(("⚠ " + nonfinite_sentence(nf), "bold red"))
        spikes = list(self.series.spikes.values())
        if spikes:
            top = max(spikes, key=lambda sp: sp.ratio)
            more = f" · {len(spikes)} spikes" if len(spikes) > 1 else ""
            notes.append(("! " + top.describe() + more + " · Enter opens it", "bold red"))
        return notes

    def _resume_hint(self) -> str:
        """The command that continues this run (``--db`` unless it is the default database)."""
        from pathlib import Path

        from hooks.store.store import default_db_path

        db = Path(self._db_path())
        same = db.resolve() == default_db_path().resolve()
        return f"continue: mdb overfit --resume {self.run_name}" + ("" if same else f" --db {db}")

    def _selected_other(self) -> str | None:
        others = self.series.other_names()
        if self._other in others:
            return self._other
        if "grad_norm" in others:
            return "grad_norm"
        return others[0] if others else None

    def _table_text(self) -> Text:
        """The other metrics' last, min and max; ▸ marks the one charted below."""
        s = self.series
        side = self.query_one("#live-side")
        width = max(20, side.size.width or 36)
        height = side.size.height or 11
        num = 8
        name_w = max(4, width - 1 - 3 * num)
        others = s.other_names()
        room = max(1, height - SIDE_CHART_MIN_ROWS - 1)
        shown = others if len(others) <= room else others[: room - 1]
        selected = self._selected_other()
        if selected not in shown and shown:
            shown = shown[:-1] + [selected] if len(shown) > 1 else [selected]
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(" " + "metric".ljust(name_w) + "last".rjust(num) + "min".rjust(num)
                    + "max".rjust(num), style="dim")
        for name in shown:
            st = s.stats[name]
            shown_name = display_name(name)  # one line, escaped: never splits the row
            label = (shown_name if len(shown_name) <= name_w - 1
                     else shown_name[: name_w - 2] + "…")
            mark = "▸" if name == selected else " "
            text.append("\n" + mark + label.ljust(name_w),
                        style="bold" if name == selected else "")
            for value in (st.last, st.min, st.max):
                bad = value is None or not math.isfinite(value)
                text.append(compact(value).rjust(num), style="red" if bad else "")
        if len(shown) < len(others):
            text.append(f"\n  +{len(others) - len(shown)} more · o marks the next", style="dim")
        return text

    def _sample_text(self) -> Text:
        sample = self.series.sample
        if sample is None:
            return Text("greedy continuation of the text's beginning: not sampled yet",
                        style="dim")
        text = Text(f"@{sample.step} ", style="dim")
        text.append(printable(sample.prompt), style="bold")
        text.append("│", style="dim")
        body = sample.text.replace("\n", "⏎")
        text.append(printable(body[: sample.matched]), style="green")
        text.append(printable(body[sample.matched:]), style="red")
        if self.series.text:
            text.append(f"  ({sample.matched}/{len(sample.text)} match)", style="dim")
        return text

    def _loss_styles(self) -> dict[str, tuple[str, str]]:
        """(style, marker) of each loss line, by first-logged order."""
        out, k = {}, 0
        for i, name in enumerate(self.series.loss_names()):
            style = METRIC_STYLES.get(name)
            if style is None:
                style = LINE_STYLES[k % len(LINE_STYLES)]
                k += 1
            out[name] = (style, LINE_MARKERS[i % len(LINE_MARKERS)])
        return out

    def _main_names(self) -> list[str]:
        s = self.series
        if self._main is not None and self._main in s.stats:
            return [self._main]
        self._main = None
        return s.loss_names()

    def _draw_charts(self) -> None:
        self._dirty_charts = False
        self.redraws += 1
        s = self.series
        loss = self.query_one("#live-loss", LineChart)
        n = loss.resolution
        names = self._main_names()
        # log only when every value drawn is positive (else the line would vanish)
        lows = [s.stats[m].min for m in names if s.stats[m].min is not None]
        log = self._log_scale and all(v > 0 for v in lows)
        scale = "log" if log else "linear"
        if self._main is None:
            styles = self._loss_styles()
            # drawn last-logged first, so the first-logged (the main loss) lies on top
            flagged = self._flagged(names)
            loss.plot([_ranged(display_name(name), s.metric(name), n, *styles[name],
                               flags=s.spike_steps(flagged) if name == flagged else ())
                       for name in reversed(names)],
                      title=f"loss ({scale})" if names else "loss", log=log)
        else:
            name = names[0]
            spiked = {sp.metric for sp in s.spikes.values()}
            loss.plot([_ranged("", s.metric(name), n, "cyan",
                               flags=s.spike_steps(name) if name in spiked else ())],
                      title=f"{display_name(name)} ({scale}) · m: next", log=log)
        other = self._selected_other()
        if other is not None:  # the table at the charts' pace: its numbers are a chart's too
            self._set("#live-table", self._table_text())
            grad = self.query_one("#live-grad", LineChart)
            grad.plot([_ranged("", s.metric(other), grad.resolution, "green")],
                      title=METRIC_LABELS.get(other, display_name(other)))
        if self.redraws % 2 == 1 or self.watch or self.state != "running":
            self._draw_experts()  # slow-moving: every other redraw while training here

    def _flagged(self, names: list[str]) -> str | None:
        """The loss line that carries the spike flags: the spiking metric itself, else (when it
        is not drawn) the first loss."""
        metrics = {sp.metric for sp in self.series.spikes.values()}
        if not metrics:
            return None
        hit = [n for n in names if n in metrics]
        return hit[0] if hit else (names[0] if names else None)

    def _draw_experts(self) -> None:
        s = self.series
        box = self.query_one("#live-experts", Vertical)
        row = self.query_one("#live-experts-row", Horizontal)
        head = self.query_one("#live-experts-head", Static)
        if not s.experts:
            if box.display:
                head.update("tokens per expert: waiting for the first step")
            return
        charts = list(row.query(LineChart))
        if len(charts) != len(s.experts):
            row.remove_children()
            charts = [LineChart(x_axis=False, mark_every=0, classes="live-expert")
                      for _ in s.experts]
            row.mount(*charts)
        width = row.size.width or self.app.size.width
        per_page = max(1, (width + 1) // (EXPERT_CHART_MIN_WIDTH + 1))
        pages = max(1, math.ceil(len(charts) / per_page))
        self._layer_page %= pages
        first = self._layer_page * per_page
        last = min(len(charts), first + per_page) - 1
        what = ("tokens routed to each expert" if s.expert_units == "tokens"
                else "share of the routed slots of each expert")
        if pages > 1:
            head.update(f"{what} · MoE layers {first}-{last} of {len(charts)} "
                        f"({self._layer_page + 1}/{pages}) · e: next layers")
        else:
            head.update(f"{what}, per MoE layer, over the steps")
        for i, (chart, samplers) in enumerate(zip(charts, s.experts, strict=True)):
            visible = first <= i <= last
            chart.display = visible
            chart.set_class(i == last, "-last")
            if not visible:
                continue
            n = chart.resolution
            chart.plot(
                [Series(f"{e}", *sampler.points(n), EXPERT_STYLES[e % len(EXPERT_STYLES)],
                        marker=str(e) if e < 10 else "")
                 for e, sampler in enumerate(samplers)],
                title=f"L{i}")

    # -- actions that change the view ------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Leaving works while the terminal is too small; every other key does nothing then."""
        if action in ("interrupt", "quit_live", "detach") and self.has_class("-too-small"):
            return True
        return super().check_action(action, parameters)

    def action_next_metric(self) -> None:
        """``m``: the losses together → each metric alone, in logging order → the losses."""
        names = self.series.names
        if not names:
            self.hint("no metrics yet")
            return
        order = [None, *names]
        i = order.index(self._main) if self._main in order else 0
        self._main = order[(i + 1) % len(order)]
        self.hint("chart: the losses together" if self._main is None else
                  f"chart: {self._main} · m: next metric")
        self._dirty_charts = True
        self._schedule_redraw()

    def action_next_other(self) -> None:
        """``o``: mark the next metric of the table; the chart below it shows that one."""
        others = self.series.other_names()
        if not others:
            self.hint("no other metrics: the run logs only losses")
            return
        current = self._selected_other()
        self._other = others[(others.index(current) + 1) % len(others)]
        self.hint(f"table: {self._other} charted below · o: next")
        self._dirty_text = self._dirty_charts = True
        self._schedule_redraw()

    def action_log_scale(self) -> None:
        self._log_scale = not self._log_scale
        self.hint(f"loss on a {'log' if self._log_scale else 'linear'} scale")
        self._dirty_charts = True
        self._schedule_redraw()

    def action_next_layers(self) -> None:
        self._layer_page += 1
        self._dirty_charts = True
        self._schedule_redraw()

    def action_ranks(self) -> None:
        open_ranks(self)

    def action_help(self) -> None:
        self.app.push_screen(LiveHelpScreen(self.watch, self.BINDINGS))
