"""``LiveScreen``: a training run as it happens — ``mdb overfit`` live, and ``mdb watch``.

One screen, two sources of steps:

* **training** (:meth:`LiveScreen.training`): an :class:`hooks.runs.overfit.OverfitSession`
  runs in a daemon thread (not a Textual worker, which the app would wait for when it closes:
  a user's forward that never returns must not keep the process alive after ``q q``). Its step
  callback appends each step to a buffer and posts :class:`tui.messages.StepsPending`
  (replaceable, so a fast trainer cannot flood the queue); the keys drive the session's
  :class:`hooks.runs.trainer.TrainControl`.
* **watching** (:meth:`LiveScreen.watching`): read-only. A thread worker reads everything new
  about the run from the run store (``RunStore.poll``) and posts
  :class:`tui.messages.RunPolled`; the handler re-arms the next poll with ``set_timer`` (every
  ``poll_interval`` seconds, 0.2 by default, so a new step shows within ~0.3 s). Watching a
  finished run replays it; the status line says when the writer finished, was interrupted,
  failed, or is gone (pid gone or heartbeat stale).

What it shows is whatever the run logs (:class:`tui.screens.live_data.RunSeries`), the same for
a run of ``mdb overfit`` (minillm or ``--model``) and one of a user's own loop (``hooks.run``):

* a chart of the loss-like metrics (``ce``, ``aux`` and ``total`` of minillm; ``loss``;
  ``val_loss``...; log scale by default, ``l`` toggles), each line with its own marker so they
  stay apart without colour; ``m`` charts one metric at a time instead, any of them;
* beside it, a table of the other metrics (last, min, max) above a chart of the one marked ▸
  (``o`` moves the mark; gradient norm first where the run logs it);
* tokens routed to each expert over steps for each MoE layer — only for runs whose steps
  record expert load;
* steps/s (and tokens/s when known), a progress bar with ETA when the run has a step target;
* the latest greedy continuation of the text's beginning with how many characters already
  match the text — only for runs that memorise a text;
* the step (and, where named, the module) of the first non-finite value, and the run's loss
  spikes (a ``!`` on the loss chart at each spike's peak, the largest in words below) — both
  as the run store recorded them;
* for a watched run whose writer stopped (interrupted, or gone after ``kill -9``): why, the
  step of its last checkpoint and the command that continues it;
* a step that takes far longer than the ones before (a forward that hangs): for how long.

Every line is laid out for 80 columns: the status line keeps the state, the step, the main loss
and ``|g|`` and drops the other losses first; hints are one line; the help wraps whole words.

Redraws are throttled so the screen costs the trainer little (see
``benchmarks/bench_overfit_ui.py``): the numbers at most every ``text_interval`` (0.2 s), the
charts at most every ``chart_interval`` (1 s while training in this process, 0.25 s when
watching, where no trainer shares the process; the expert charts every other time), every
series is bounded by
:class:`tui.screens.live_data.Downsampler`, so a redraw costs the same at step 100,000 as at
step 100. Nothing is redrawn while another screen (the step view) covers this one.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Any

from rich.text import Text
from textual import on, work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, ProgressBar, Static
from textual.worker import Worker, WorkerState

from hooks.runs.store import nonfinite_sentence
from tui import messages
from tui.screens.base import MdbScreen, show
from tui.screens.live_chart import LineChart, Series
from tui.screens.live_controls import ViewerControls
from tui.screens.live_data import (
    RunSeries,
    display_name,
    format_duration,
    nonfinite_of,
    run_declaration,
)
from tui.screens.live_help import LiveHelpScreen
from tui.screens.live_ranks import RanksSummary, open_ranks

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


class LiveScreen(ViewerControls, MdbScreen):
    """Charts and numbers of one training run, live (training) or read-only (watching).

    Build it with :meth:`training` or :meth:`watching` rather than directly.

    Args:
        session: The :class:`hooks.runs.overfit.OverfitSession` to train (training mode).
        store: A :class:`hooks.runs.store.RunStore` to read (watch mode).
        run: The :class:`hooks.runs.store.RunInfo` to follow (watch mode).
        heartbeat: Seconds between the writer's heartbeats (training mode).
        poll_interval: Seconds between database polls (watch mode).
        text_interval: Minimum seconds between redraws of the numbers.
        chart_interval: Minimum seconds between redraws of the charts (default: 1 s when
            training, 0.25 s when watching).

    Attributes:
        series: The :class:`tui.screens.live_data.RunSeries` being plotted.
        ended: Set (a ``TrainingEnded``) once the training thread returned.
        training_done: A ``threading.Event`` set when the training thread has returned.
        error: One line when training crashed or the database became unreadable.
        fatal: One line when the watched run cannot be read at all (a row changed outside
            mdb): the app exits with status 2 and the command prints it.
        quit_now: ``q`` was pressed again while the run was stopping: the caller leaves without
            waiting for the step in progress.
    """

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
        Binding("question_mark", "help", "keys", key_display="?", id="live.help"),
        Binding("q", "quit_live", "quit", id="live.quit"),
        Binding("ctrl+c", "interrupt", "quit (as q; watching: detach)", show=False,
                id="live.interrupt"),
    ]

    def __init__(self, *, session=None, store=None, run=None, heartbeat: float = 1.0,
                 poll_interval: float = 0.2, text_interval: float = 0.2,
                 chart_interval: float | None = None, name: str | None = None) -> None:
        super().__init__(name=name)
        if (session is None) == (run is None):
            raise ValueError("LiveScreen needs a session (training) or a store and run (watch)")
        self.session = session
        self.store = store
        # held while a worker reads the store: unmounting waits for it, so that the caller
        # can close the store once the app returned (tui.store_handle explains why)
        self._store_lock = threading.Lock()
        self._unmounted = False
        self.run = run
        self.watch = session is None
        self.heartbeat = heartbeat
        self.poll_interval = poll_interval
        self.text_interval = text_interval
        if chart_interval is None:
            chart_interval = 0.25 if session is None else 1.0
        self.chart_interval = chart_interval
        if session is not None:
            declared = {"names": session.metric_names, "loss_names": session.loss_metrics,
                        "text": session.text, "top_k": session.top_k,
                        "moe": session.has_experts}
            total = session.trainer.total_steps
            self.run_name = session.name
        else:
            declared = run_declaration(run)
            total = run.total_steps
            self.run_name = run.name
        self.expect_experts = bool(declared["moe"])
        self.series = RunSeries(total, text=declared["text"], top_k=declared["top_k"],
                                names=declared["names"], loss_names=declared["loss_names"])
        self.state = "starting" if not self.watch else "reading"
        self.ended: messages.TrainingEnded | None = None
        self.error: str | None = None
        self.fatal: str | None = None
        self.quit_now = False
        self.training_done = threading.Event()
        self._spike_seen: Any = None  # the writer's latest spike already queued (training)
        self._pending: collections.deque = collections.deque()
        self._want_capture = False
        self._pending_capture: messages.StepCaptured | None = None  # arrived under another screen
        self._quitting = False
        self._cursor = 0
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
        self.polls = 0

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def training(cls, session, **kwargs) -> LiveScreen:
        """The live screen of an :class:`hooks.runs.overfit.OverfitSession` it will train."""
        return cls(session=session, **kwargs)

    @classmethod
    def watching(cls, store, run, **kwargs) -> LiveScreen:
        """A read-only screen following ``run`` (a :class:`hooks.runs.store.RunInfo`) in
        ``store``."""
        return cls(store=store, run=run, **kwargs)

    # -- layout ----------------------------------------------------------------------------------
    def compose(self):
        yield Static(self._title(), id="title", markup=False)
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
        if self.watch:
            yield RanksSummary(getattr(self.store, "path", None), self.run)
        yield Static("", id="hint", markup=False)
        yield Footer()

    def _title(self) -> str:
        if self.watch:
            return f"mdb watch · run {self.run_name} · {self.store.path}"
        s = self.session
        return f"mdb overfit · run {s.name} · {s.describe()} · {s.store.path}"

    def on_mount(self) -> None:
        if self.watch:
            self.hint("following the database · c latest capture · m metric · ? keys")
            self._poll()
        else:
            self.hint("training · p pause · c capture a step · x stop · m metric · ? keys")
            self._train()
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
        if s.last is None or self.state != "running" or (
                self.watch and getattr(self.run, "kind", None) != "overfit"):
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

    # -- training (a daemon thread) --------------------------------------------------------------
    def _train(self) -> None:
        """Start the training thread (a daemon: see the module docstring)."""
        threading.Thread(target=self._train_main, name="mdb-train", daemon=True).start()

    def _post(self, message) -> None:
        """``post_message`` from the training thread; nothing once the app has closed."""
        try:
            self.post_message(message)
        except Exception:  # the app's loop is gone (the UI closed first)
            pass

    def _train_main(self) -> None:
        session = self.session
        control = session.control

        last_post = [0.0]

        def on_step(report) -> None:
            spike = session.writer.spikes[-1] if session.writer.spikes else None
            if spike == self._spike_seen:
                spike = None
            else:
                self._spike_seen = spike
            self._pending.append((report.metrics, report.sample, spike))
            if report.trace is not None and self._want_capture:
                self._want_capture = False
                self._post(messages.StepCaptured(report.step, report.trace))
            # Each post wakes the UI's event loop; a fast model (100+ steps/s) would wake it
            # every step. The numbers redraw every text_interval anyway: say "look" at most
            # every POST_INTERVAL, and at once when the loop is about to wait (pause, single
            # step, the last step) so that nothing shown lags behind a paused run.
            now = time.monotonic()
            if (now - last_post[0] >= POST_INTERVAL or report.paused_after or control.paused
                    or report.failure is not None or report.step >= session.trainer.total_steps):
                last_post[0] = now
                self._post(messages.StepsPending(report.step))

        def on_state(state: str) -> None:
            self._post(messages.TrainingState(state))

        session.on_warning = lambda line: self._post(messages.Hint("⚠ " + line))
        try:
            self._post(messages.TrainingState("running"))
            result = session.run(on_step=on_step, on_state=on_state,
                                 heartbeat_interval=self.heartbeat)
            f = result.failure
            self._post(messages.TrainingEnded(
                result.status, result.last_step, result.reason,
                f.step if f else None, f.module if f else None))
        except BaseException as exc:  # the user's model raised, a database write failed
            line = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            self._post(messages.TrainingCrashed(line))
        finally:
            self.training_done.set()

    def on_steps_pending(self, message: messages.StepsPending) -> None:
        message.stop()
        self._drain()

    def _drain(self) -> None:
        got = False
        while self._pending:
            row, sample, spike = self._pending.popleft()
            self.series.add(row)
            if sample is not None:
                self.series.add_sample(row.step, sample[0], sample[1])
            if spike is not None:
                self.series.add_spike(spike)
            got = True
        if got:
            self._data_changed()

    def on_training_state(self, message: messages.TrainingState) -> None:
        message.stop()
        self._drain()
        if self.ended is None:
            self.state = message.state
            if message.state == "paused":
                self.hint("paused · p resumes · s runs one step · c captures the next step")
            self._dirty_text = True
            self._schedule_redraw()

    def on_step_captured(self, message: messages.StepCaptured) -> None:
        message.stop()
        if self.app.screen is not self:  # the user opened help meanwhile: not on top of it
            self._pending_capture = message
            self.hint(f"step {message.step} captured · its step view opens after this")
            return
        self._open_capture(message)

    def _open_capture(self, message: messages.StepCaptured) -> None:
        from tui.screens.step import StepScreen

        if self.watch:
            self.hint(f"stored capture of step {message.step} · q in the step view: back")
        else:
            self._drain()
            self.hint(f"captured step {message.step} · training paused · p resumes")
        screen = StepScreen(message.trace, embedded=True)
        self.app.push_screen(screen, self._back_from_step)

    def _back_from_step(self, _result=None) -> None:
        if self.watch:
            self.hint("back from the step view · c opens the latest stored capture again")
        elif self.ended is None:
            self.hint("back · training paused · p resumes · s steps · c captures again")

    def on_training_ended(self, message: messages.TrainingEnded) -> None:
        message.stop()
        self._drain()
        self.ended = message
        self.state = message.status
        if message.status == "failed":
            self.hint("the run failed (see above) · q quits")
        elif message.status == "finished":
            self.hint(f"finished {message.last_step} steps · checkpoint written · q quits")
        else:
            self.hint(f"stopped after step {message.last_step} · checkpoint written · q quits")
        if self.is_current:  # the end of a run is shown at once, not at the next redraw slot
            self._redraw_all()
        else:
            self._dirty_text = self._dirty_charts = True
            self._schedule_redraw()
        reason = self.session.control.stop_reason or ""
        if self._quitting or reason.startswith("SIG"):
            self.app.exit(return_code=self.exit_code())

    def exit_code(self) -> int:
        """Exit status of ``mdb overfit`` (live): 0 finished or stopped from the screen, 1
        failed (non-finite value) or crashed, 128 + n when stopped by signal n."""
        from hooks.runs.trainer import signal_exit_code

        if self.error is not None:
            return 1
        if self.ended is None:
            return 130 if self.quit_now else 0
        if self.ended.status == "failed":
            return 1
        return signal_exit_code(self.session.control.stop_reason) or 0

    def on_training_crashed(self, message: messages.TrainingCrashed) -> None:
        message.stop()
        self._drain()
        self.error = f"training stopped by an error: {message.error}"
        self.state = "crashed"
        self.hint("training stopped by an error (see above) · q quits")
        self._dirty_text = True
        self._schedule_redraw()
        if self._quitting:
            self.app.exit(return_code=1)

    # -- watching (thread worker + timer) --------------------------------------------------------
    @work(thread=True, exclusive=True, exit_on_error=False, group="poll",
          description="read new steps from the run database")
    def _poll(self) -> None:
        with self._store_lock:
            if self._unmounted:
                return
            update = self.store.poll(self.run.id, self._cursor)
        self.post_message(messages.RunPolled(update))

    def on_unmount(self) -> None:
        with self._store_lock:
            self._unmounted = True

    def on_run_polled(self, message: messages.RunPolled) -> None:
        message.stop()
        self.polls += 1
        u = message.update
        if u.restarted:  # resumed from an earlier checkpoint: read the run again from scratch
            self.series.reset()
            self._cursor = 0
            self.call_later(self._poll)
            return
        was_error, self.error = self.error, None
        if was_error:
            self.hint("following the database again")
        self.run = u.run
        if u.run.total_steps != self.series.total_steps:
            self.series.total_steps = u.run.total_steps
            self.query_one("#live-progress", ProgressBar).update(total=u.run.total_steps)
        samples = {s.step: s for s in u.samples}
        for row in u.metrics:
            self.series.add(row)
            s = samples.pop(row.step, None)
            if s is not None:
                self.series.add_sample(s.step, s.prompt, s.text)
        for s in samples.values():
            self.series.add_sample(s.step, s.prompt, s.text)
        for spike in getattr(u, "spikes", ()):
            self.series.add_spike(spike)
        self._cursor = u.last_step if u.metrics else self._cursor
        state = u.run.writer_state()
        if state == "running" and u.run.paused:
            state = "paused"
        changed = state != self.state
        self.state = state
        if changed:
            self.refresh_bindings()  # p, x, d only while the run trains
        if u.metrics or changed or self.polls == 1 or getattr(u, "spikes", None):
            self._data_changed()
        # An ended run may still be resumed by `mdb overfit --resume`: keep looking, less often.
        delay = self.poll_interval if state in ("running", "paused") else 1.0
        self.set_timer(delay, self._poll)

    @work(thread=True, exclusive=True, exit_on_error=False, group="stored-capture",
          description="read the latest stored capture")
    def _open_stored_capture(self) -> None:
        """Watch mode's ``c``: the run's latest captured step, rebuilt from the store on a
        connection of this thread, posted as :class:`messages.StepCaptured`."""
        from hooks.runs.store import RunStore
        from hooks.runs.trainer import load_trace

        with RunStore(self.store.path) as store:
            steps = store.internals_steps(self.run.id)
            trace = load_trace(store, self.run.id, steps[-1]) if steps else None
        if trace is None:
            self.post_message(messages.Hint(
                "no stored capture in this run (mdb overfit stores one every --every N steps; "
                "a loop of your own with run.watch(model, every=N))"))
            return
        self.post_message(messages.StepCaptured(steps[-1], trace))

    def on_hint(self, message: messages.Hint) -> None:
        message.stop()
        self.hint(message.text)

    @on(Worker.StateChanged)
    def _worker_changed(self, event: Worker.StateChanged) -> None:
        worker = event.worker
        if event.state != WorkerState.ERROR:
            return
        exc = worker.error
        line = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        if worker.group == "stored-capture":
            self.hint(f"cannot open the stored capture: {line}")
        elif worker.group == "poll":
            from hooks.runs.store import DamagedRunError

            if isinstance(exc, DamagedRunError):  # retrying cannot help: say it and leave
                self.fatal = str(exc)
                self.app.exit(return_code=2)
                return
            self.error = f"cannot read {self.store.path}: {line}"
            self.hint(f"cannot read the database ({line[:40]}) · retrying")
            self.set_timer(1.0, self._poll)

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
                text.append(("\n" if i else "") + line, style=style)
            self._set("#live-note", text)

    def _set(self, selector: str, content) -> None:
        """Update a Static only when its content changed (an update costs a layout pass)."""
        key = content.markup if isinstance(content, Text) else content
        if self._shown.get(selector) != key:
            self._shown[selector] = key
            self.query_one(selector, Static).update(content)

    def _status_text(self) -> Text:
        """The state, the step, the losses and ``|g|``, fitted to the line: the losses after the
        first are dropped before anything is cut (``|g|`` keeps its place)."""
        s = self.series
        total = f"/{s.total_steps}" if s.total_steps else ""
        pieces: list[tuple[int, str, str]] = [(0, f"step {s.step}{total}", "")]  # (rank, ...)
        if s.last is not None:
            for i, name in enumerate(s.loss_names()[:3]):
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

    def _state_text(self) -> Text:
        """One short word (and a mark that shows without colour) for the state; what it means
        in full is in the note lines."""
        state = self.state
        if self.watch and self.run is not None:
            if self.polls == 0:
                return Text("… reading", style="bold")
            if state == "failed" and self.run.fail_step is not None:
                return Text(f"✗ failed @ step {self.run.fail_step}", style="bold red")
            labels = {"running": ("● running", "bold green"),
                      "paused": ("‖ paused", "bold yellow"),
                      "finished": ("✓ finished", "bold cyan"),
                      "interrupted": ("■ interrupted", "bold yellow"),
                      "failed": ("✗ failed", "bold red"),
                      "gone": ("✗ writer gone", "bold red")}
            label, style = labels.get(state, (state, "bold"))
            return Text(label, style=style)
        if state == "failed" and self.ended is not None:
            return Text(f"✗ failed @ step {self.ended.fail_step}", style="bold red")
        labels = {
            "starting": ("… starting", "bold"),
            "running": ("● running", "bold green"),
            "paused": ("‖ paused", "bold yellow"),
            "finished": ("✓ finished", "bold cyan"),
            "interrupted": ("■ stopped", "bold yellow"),
            "crashed": ("✗ crashed", "bold red"),
        }
        label, style = labels.get(state, (state, "bold"))
        return Text(label, style=style)

    def _notes(self) -> list[tuple[str, str]]:
        """The lines under the charts, most important first: how the run ended (and, for a run
        that can continue, its checkpoint and the command), where a value first turned
        non-finite, the largest loss spike."""
        notes: list[tuple[str, str]] = []
        if self.watch and self.run is not None and self.polls:
            notes += self._watched_end()
        elif not self.watch:
            notes += self._trained_end()
        nf = nonfinite_of(self.run) if self.watch and self.run is not None else None
        if nf and not (self.state == "failed" and self.run.fail_step == nf.get("step")):
            notes.append(("⚠ " + nonfinite_sentence(nf), "bold red"))
        spikes = list(self.series.spikes.values())
        if spikes:
            top = max(spikes, key=lambda sp: sp.ratio)
            more = f" · {len(spikes)} spikes" if len(spikes) > 1 else ""
            notes.append(("! " + top.describe() + more, "bold red"))
        return notes

    def _resume_hint(self) -> str:
        """The command that continues this run (``--db`` unless it is the default database)."""
        from pathlib import Path

        from hooks.runs.store import default_db_path

        db = Path(self.store.path if self.watch else self.session.store.path)
        same = db.resolve() == default_db_path().resolve()
        return f"continue: mdb overfit --resume {self.run_name}" + ("" if same else f" --db {db}")

    def _watched_end(self) -> list[tuple[str, str]]:
        run, state = self.run, self.state
        ckpt = run.checkpoint_step
        resumable = getattr(run, "kind", "overfit") == "overfit" and ckpt is not None
        saved = f" · checkpoint @ step {ckpt}" if resumable else ""
        if state == "gone":
            lines = [("✗ " + run.gone_reason() + saved, "bold red")]
        elif state == "interrupted":
            lines = [(f"■ {run.status_line()}{saved}", "bold yellow")]
        elif state == "failed":
            why = run.reason or run.status_line()
            where = f" (first in {run.fail_module})" if run.fail_module and (
                run.fail_module not in why) else ""
            return [(f"✗ {why}{where}", "bold red")]
        else:
            return []
        if resumable:
            lines.append((self._resume_hint(), "bold"))
        return lines

    def _trained_end(self) -> list[tuple[str, str]]:
        ended = self.ended
        if self.error is not None:
            return [("✗ " + self.error, "bold red")]
        if ended is None:
            return []
        if ended.status == "failed":
            return [("✗ " + ended.reason, "bold red")]
        if ended.status == "interrupted":
            return [(f"■ stopped after step {ended.last_step} ({ended.reason}) · checkpoint "
                     "written", "bold yellow"), (self._resume_hint(), "bold")]
        return []

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
            label = name if len(name) <= name_w - 1 else name[: name_w - 2] + "…"
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
        text.append(sample.prompt, style="bold")
        text.append("│", style="dim")
        body = sample.text.replace("\n", "⏎")
        text.append(body[: sample.matched], style="green")
        text.append(body[sample.matched:], style="red")
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
            loss.plot([Series(display_name(name), *s.metric(name).points(n), *styles[name],
                              flags=s.spike_steps(flagged) if name == flagged else ())
                       for name in reversed(names)],
                      title=f"loss ({scale})" if names else "loss", log=log)
        else:
            name = names[0]
            spiked = {sp.metric for sp in s.spikes.values()}
            loss.plot([Series("", *s.metric(name).points(n), "cyan",
                              flags=s.spike_steps(name) if name in spiked else ())],
                      title=f"{display_name(name)} ({scale}) · m: next", log=log)
        other = self._selected_other()
        if other is not None:  # the table at the charts' pace: its numbers are a chart's too
            self._set("#live-table", self._table_text())
            grad = self.query_one("#live-grad", LineChart)
            grad.plot([Series("", *s.metric(other).points(grad.resolution), "green")],
                      title=METRIC_LABELS.get(other, other))
        if self.redraws % 2 == 1 or self.watch or self.state != "running":
            self._draw_experts()  # slow-moving: every other redraw while training

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

    # -- actions ---------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The keys that drive training are shown only while they can act: watching, ``p``,
        ``x`` and ``d`` of a running run (``s`` never); training here, ``p``, ``s``, ``x``
        until the run ended (``d`` never). Every key but leaving does nothing while the
        terminal is too small."""
        if action in ("interrupt", "quit_live", "detach") and self.has_class("-too-small"):
            return True
        if action in ("pause", "step", "stop", "detach"):
            if self.watch:
                if action == "step" or not self.viewing_live_run():
                    return False
            elif action == "detach" or self.ended is not None or self.error is not None:
                return False
        return super().check_action(action, parameters)

    def _read_only(self) -> bool:
        if self.ended is not None or self.error is not None:
            self.hint(f"the run has ended ({self.state}) · q quits")
            return True
        return False

    def action_pause(self) -> None:
        if self.watch:
            self.watch_pause()
            return
        if self._read_only():
            return
        paused = self.session.control.toggle_pause()
        if paused:
            self.hint("pausing after the current step · p resumes · s runs one step")
        else:
            self.state = "running"
            self.hint("resumed · p pauses · c captures the next step")
            self._dirty_text = True
            self._schedule_redraw()

    def action_step(self) -> None:
        if self._read_only():
            return
        control = self.session.control
        if not control.paused:
            self.hint("s runs one step while paused · p pauses first")
            return
        control.step_once()
        self.hint(f"running step {self.series.step + 1} · s again for another · p resumes")

    def action_capture(self) -> None:
        if self.watch:
            self.hint("reading the latest stored capture…")
            self._open_stored_capture()
            return
        if self._read_only():
            return
        self._want_capture = True
        self.session.control.request_capture(pause_after=True)
        self.hint(f"capturing step {self.series.step + 1}; its step view opens when it is done")

    def action_stop(self) -> None:
        if self.watch:
            self.watch_stop()
            return
        if self._read_only():
            return
        self.session.control.stop("stopped from the live screen")
        self.hint("stopping after the current step and writing a checkpoint…")

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

    def action_interrupt(self) -> None:
        """Ctrl-C: watching, detach (and the command says so); training here, as ``q``."""
        if self.watch:
            self.watch_interrupt()
        else:
            self.action_quit_live()

    def action_quit_live(self) -> None:
        if self.watch:
            self.watch_quit()
            return
        if self.ended is not None or self.error is not None:
            self.app.exit(return_code=self.exit_code())
            return
        if self._quitting:  # q again while the step does not end: leave it behind
            self.quit_now = True
            self.app.exit(return_code=130)
            return
        self._quitting = True
        self.session.control.stop("quit")
        self.hint("stopping after this step, writing a checkpoint… · q again: quit at once")
