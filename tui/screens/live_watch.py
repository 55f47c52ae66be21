"""``WatchScreen``: a viewer of a run in the run store — ``mdb watch``, and the live screen of
``mdb overfit``, whose trainer is a process of its own.

The first read of a run of
:data:`tui.screens.live_data.HISTORY_AFTER_STEPS` steps or more takes its history
bucketed by the store (``RunStore.history``: per metric, at most as many step ranges as a
chart has points, with min/max/mean each, from the per-block aggregates the writer keeps, plus
its last steps' rows), so the first frame of a run of a million steps costs the same as one of
ten thousand; the expert load of its earlier steps is filled in after that frame by a worker
(20,000 rows at a time, downsampled as read). Then a thread worker reads everything new about
the run (``RunStore.poll``) and posts
:class:`tui.messages.RunPolled`; the handler re-arms the next poll with ``set_timer`` (every
``poll_interval`` seconds, 0.2 by default, so a new step shows within ~0.3 s). Watching a
finished run replays it; the status line says when the writer finished, was interrupted,
failed, or is gone (pid gone or heartbeat stale), and for a run that can continue, its
checkpoint and the command. Of a run that trains, ``p``, ``x``, ``d``, ``q`` and Ctrl-C act
through the store (:mod:`tui.screens.live_controls`); ``c`` opens the latest stored capture.
"""

from __future__ import annotations

import threading
from typing import Any

from rich.text import Text
from textual import on, work
from textual.binding import Binding
from textual.widgets import ProgressBar
from textual.worker import Worker, WorkerState

from tui import messages
from tui.screens.live import LiveScreen
from tui.screens.live_controls import ViewerControls
from tui.screens.live_data import first_read, nonfinite_of, run_declaration
from tui.screens.live_findings import FindingsScreen, LoopFindings
from tui.screens.live_ranks import RanksSummary

__all__ = ["WatchScreen"]


class WatchScreen(ViewerControls, LiveScreen):
    """Follows ``run`` in ``store``.

    Args:
        store: A :class:`hooks.store.store.RunStore` to read.
        run: The :class:`hooks.store.store.RunInfo` to follow.
        poll_interval: Seconds between database polls.
        text_interval: Minimum seconds between redraws of the numbers.
        chart_interval: Minimum seconds between redraws of the charts (0.25 s: no trainer
            shares the process).
        heartbeat: Accepted for :func:`tui.live_app.make_watch_app`'s callers; unused.

    Attributes:
        fatal: One line when the watched run cannot be read at all (a row changed outside
            mdb): the app exits with status 2 and the command prints it.
        polls: Reads of the store so far.
    """

    watch = True
    BINDINGS = [*LiveScreen.BINDINGS,
                Binding("f", "findings", "loop findings, whole", show=False,
                        id="watch.findings")]

    def __init__(self, store, run, *, poll_interval: float = 0.2, text_interval: float = 0.2,
                 chart_interval: float | None = None, heartbeat: float = 1.0,
                 name: str | None = None) -> None:
        super().__init__(declared=run_declaration(run), total=run.total_steps,
                         run_name=run.name, text_interval=text_interval,
                         chart_interval=0.25 if chart_interval is None else chart_interval,
                         name=name)
        self.store = store
        self.run = run
        self.poll_interval = poll_interval
        self.fatal: str | None = None
        self.polls = 0
        self._cursor = 0
        # held while a worker reads the store: unmounting waits for it, so that the caller
        # can close the store once the app returned (tui.store_handle explains why)
        self._store_lock = threading.Lock()
        self._unmounted = False

    def _title(self) -> str:
        return f"mdb watch · run {self.run_name} · {self.store.path}"

    def _more_widgets(self):
        yield RanksSummary(getattr(self.store, "path", None), self.run)
        yield LoopFindings(getattr(self.store, "path", None), self.run)

    def _start(self) -> None:
        self.hint("following the database · c latest capture · m metric · ? keys")
        self._poll()

    def _db_path(self) -> str:
        return str(self.store.path)

    def _steps_are_steps(self) -> bool:
        return getattr(self.run, "kind", None) == "overfit"

    def spike_source(self) -> tuple[str, str] | None:
        """The watched run's database and name."""
        return (str(self.store.path), self.run.name) if self.run is not None else None

    def _capture_hint(self, step: int) -> str:
        return f"stored capture of step {step} · q in the step view: back"

    def _back_from_step(self, _result=None) -> None:
        self.hint("back from the step view · c opens the latest stored capture again")

    def _nonfinite(self) -> dict[str, Any] | None:
        return nonfinite_of(self.run) if self.run is not None else None

    def _end_lines(self) -> list[tuple[str, str]]:
        return self._watched_end() if self.polls else []

    def _state_text(self) -> Text:
        state = self.state
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

    # -- reading the store (thread worker + timer) -----------------------------------------------
    @work(thread=True, exclusive=True, exit_on_error=False, group="poll",
          description="read new steps from the run database")
    def _poll(self) -> None:
        with self._store_lock:
            if self._unmounted:
                return
            # a first read of a long run: its history bucketed by the store, not its rows
            update, history = first_read(self.store, self.run.id, self._cursor,
                                         self.series.capacity)
        self.post_message(messages.RunPolled(update, history))

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
        if message.history is not None:
            self.series.load_history(message.history, u.metrics)
        for row in u.metrics if message.history is None else ():
            self.series.add(row)
            s = samples.pop(row.step, None)
            if s is not None:
                self.series.add_sample(s.step, s.prompt, s.text)
        for s in samples.values():
            self.series.add_sample(s.step, s.prompt, s.text)
        for spike in getattr(u, "spikes", ()):
            self.series.add_spike(spike)
        self._cursor = u.last_step if u.metrics else self._cursor
        if message.history is not None:
            self._cursor = message.history.last
            if self.series.experts and u.metrics:  # the expert load of the steps before
                self._fill_experts(message.history.first, u.metrics[0].step)
        state = u.run.writer_state()
        if state == "running" and u.run.paused:
            state = "paused"
        before, self.state = self.state, state
        changed = state != before
        if changed:
            self.refresh_bindings()  # p, x, d only while the run trains
            self.say_state(before, state)  # not "asked the run to pause" once it stopped
        if u.metrics or changed or self.polls == 1 or getattr(u, "spikes", None):
            self._data_changed()
        # An ended run may still be resumed by `mdb overfit --resume`: keep looking, less often.
        delay = self.poll_interval if state in ("running", "paused") else 1.0
        self.set_timer(delay, self._poll)

    @work(thread=True, exclusive=True, exit_on_error=False, group="detail",
          description="read the expert load of a long run's earlier steps")
    def _fill_experts(self, first: int, before: int) -> None:
        """After a first frame from the bucketed history: the expert load of steps ``first``
        to ``before`` (exclusive), read 20,000 rows at a time on a connection of this thread
        and downsampled as read (memory stays flat), posted as
        :class:`messages.HistoryDetail`."""
        import json

        from hooks.store.store import RunStore

        series = self.series
        slots = series.expert_slots
        loads: list = []
        older = None
        cursor = first - 1
        with RunStore(self.store.path) as store:
            while not self._unmounted:
                rows = store.connection.execute(
                    "SELECT step, expert_load FROM metrics WHERE run_id = ? AND step > ?"
                    " AND step < ? AND expert_load IS NOT NULL ORDER BY step LIMIT 20000",
                    (self.run.id, cursor, before)).fetchall()
                if not rows:
                    break
                cursor = rows[-1][0]
                loads = [(step, json.loads(text)) for step, text in rows]
                part = series.expert_samplers(loads, slots)
                if older is None:
                    older = part
                elif [len(x) for x in part] == [len(x) for x in older]:
                    for mine, theirs in zip(part, older, strict=True):
                        for sampler, before_it in zip(mine, theirs, strict=True):
                            sampler.prepend(before_it)
                    older = part
        if older and not self._unmounted:
            self.post_message(messages.HistoryDetail(older))

    def on_history_detail(self, message: messages.HistoryDetail) -> None:
        message.stop()
        self.series.prepend_experts(message.experts)
        self._data_changed()

    @work(thread=True, exclusive=True, exit_on_error=False, group="stored-capture",
          description="read the latest stored capture")
    def _open_stored_capture(self) -> None:
        """Watch mode's ``c``: the run's latest captured step, rebuilt from the store on a
        connection of this thread, posted as :class:`messages.StepCaptured`."""
        from hooks.store.store import RunStore
        from hooks.train.trainer import load_trace

        with RunStore(self.store.path) as store:
            last = store.summary(self.run.id).last_capture  # kept by the writer: no scan
            steps = [last] if last is not None else []
            trace = load_trace(store, self.run.id, steps[-1]) if steps else None
        if trace is None:
            self.post_message(messages.Hint(
                "no stored capture in this run (mdb overfit stores one every --every N steps; "
                "a loop of your own with run.watch(model, every=N))"))
            return
        self.post_message(messages.StepCaptured(steps[-1], trace))

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
            from hooks.store.store import DamagedRunError

            if isinstance(exc, DamagedRunError):  # retrying cannot help: say it and leave
                self.fatal = str(exc)
                self.app.exit(return_code=2)
                return
            self.error = f"cannot read {self.store.path}: {line}"
            self.hint(f"cannot read the database ({line[:40]}) · retrying")
            self.set_timer(1.0, self._poll)

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

    # -- keys: through the store (tui.screens.live_controls) --------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """``p``, ``x`` and ``d`` only while the run trains; ``s`` never (a viewer cannot
        single-step another process's training)."""
        if action == "step" or (action in ("pause", "stop", "detach")
                                and not self.viewing_live_run()):
            return False
        return super().check_action(action, parameters)

    def action_pause(self) -> None:
        self.watch_pause()

    def action_stop(self) -> None:
        self.watch_stop()

    def action_capture(self) -> None:
        self.hint("reading the latest stored capture…")
        self._open_stored_capture()

    def action_findings(self) -> None:
        """``f``: every loop finding of the run, each whole."""
        findings = self.query_one(LoopFindings)
        if not findings.findings:
            self.hint("no loop findings so far")
            return
        self.app.push_screen(FindingsScreen(findings))

    def action_interrupt(self) -> None:
        """Ctrl-C: detach (the command then says so)."""
        self.watch_interrupt()

    def action_quit_live(self) -> None:
        self.watch_quit()
