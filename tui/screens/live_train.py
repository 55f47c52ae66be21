"""``TrainScreen``: the live screen of an :class:`hooks.train.overfit.OverfitSession` trained in
this process (:func:`tui.live_app.make_overfit_app`: the API, the tests, the benchmark; ``mdb
overfit`` itself trains in a process of its own and shows :mod:`tui.screens.live_watch`).

The session runs in a daemon thread (not a Textual worker, which the app would wait for when
it closes: a user's forward that never returns must not keep the process alive after ``q q``).
Its step callback appends each step to a buffer and posts :class:`tui.messages.StepsPending`
(replaceable, so a fast trainer cannot flood the queue); the keys drive the session's
:class:`hooks.train.trainer.TrainControl`: ``p`` pause, ``s`` one step while paused, ``c``
capture the next step and open it, ``x`` stop with a checkpoint, ``q`` stop and quit (again:
quit at once).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from rich.text import Text

from hooks.text import printable
from tui import messages
from tui.screens.live import POST_INTERVAL, LiveScreen

__all__ = ["TrainScreen"]


class TrainScreen(LiveScreen):
    """Trains ``session`` and shows it.

    Args:
        session: The :class:`hooks.train.overfit.OverfitSession` to train.
        heartbeat: Seconds between the writer's heartbeats.
        text_interval: Minimum seconds between redraws of the numbers.
        chart_interval: Minimum seconds between redraws of the charts (1 s: the trainer
            shares the process).

    Attributes:
        ended: Set (a ``TrainingEnded``) once the training thread returned.
        training_done: A ``threading.Event`` set when the training thread has returned.
        quit_now: ``q`` was pressed again while the run was stopping: the caller leaves without
            waiting for the step in progress.
    """

    def __init__(self, session, *, heartbeat: float = 1.0, text_interval: float = 0.2,
                 chart_interval: float | None = None, name: str | None = None) -> None:
        declared = {"names": session.metric_names, "loss_names": session.loss_metrics,
                    "text": session.text, "top_k": session.top_k, "moe": session.has_experts}
        super().__init__(declared=declared, total=session.trainer.total_steps,
                         run_name=session.name, text_interval=text_interval,
                         chart_interval=1.0 if chart_interval is None else chart_interval,
                         name=name)
        self.session = session
        self.run = None
        self.heartbeat = heartbeat
        self.state = "starting"
        self.ended: messages.TrainingEnded | None = None
        self.quit_now = False
        self.training_done = threading.Event()
        self._spike_seen: Any = None  # the writer's latest spike already queued
        self._pending: collections.deque = collections.deque()
        self._want_capture = False
        self._quitting = False

    def _title(self) -> str:
        s = self.session
        return f"mdb overfit · run {s.name} · {s.describe()} · {s.store.path}"

    def _start(self) -> None:
        self.hint("training · p pause · c capture a step · x stop · m metric · ? keys")
        self._train()

    def _db_path(self) -> str:
        return str(self.session.store.path)

    def spike_source(self) -> tuple[str, str] | None:
        """The trained run's database and name."""
        return str(self.session.store.path), self.session.name

    def _capture_hint(self, step: int) -> str:
        self._drain()
        return f"captured step {step} · training paused · p resumes"

    def _back_from_step(self, _result=None) -> None:
        if self.ended is None:
            self.hint("back · training paused · p resumes · s steps · c captures again")

    def _state_text(self) -> Text:
        state = self.state
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

    def _end_lines(self) -> list[tuple[str, str]]:
        return self._trained_end()

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
            lines, memorised = self._verdict()
            self._post(messages.TrainingEnded(
                result.status, result.last_step, result.reason,
                f.step if f else None, f.module if f else None, lines, memorised))
        except BaseException as exc:  # the user's model raised, a database write failed
            line = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            self._post(messages.TrainingCrashed(line))
        finally:
            self.training_done.set()

    def _verdict(self) -> tuple[tuple[str, ...], bool | None]:
        """The run's verdict (lines, memorised), read in the training thread; none when the
        store cannot say."""
        try:
            v = self.session.verdict()
            return tuple(printable(x) for x in v.lines()), v.memorised
        except Exception:  # the end line says what happened; a verdict is extra
            return (), None

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
        from hooks.train.trainer import signal_exit_code

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

    def _trained_end(self) -> list[tuple[str, str]]:
        ended = self.ended
        if self.error is not None:
            return [("✗ " + self.error, "bold red")]
        if ended is None:
            return []
        if ended.status == "failed":
            return [("✗ " + ended.reason, "bold red")]
        verdict = [(line, ("bold green" if ended.memorised else "bold yellow") if i == 0
                    else "yellow") for i, line in enumerate(ended.verdict)]
        if ended.status == "interrupted":
            return [(f"■ stopped after step {ended.last_step} ({ended.reason}) · checkpoint "
                     "written", "bold yellow"), (self._resume_hint(), "bold"), *verdict]
        return verdict

    # -- keys ------------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """``p``, ``s``, ``x`` until the run ended; ``d`` never (nothing to detach from)."""
        if action == "detach" or (action in ("pause", "step", "stop") and (
                self.ended is not None or self.error is not None)):
            return False
        return super().check_action(action, parameters)

    def _read_only(self) -> bool:
        if self.ended is not None or self.error is not None:
            self.hint(f"the run has ended ({self.state}) · q quits")
            return True
        return False

    def action_pause(self) -> None:
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
        if self._read_only():
            return
        self._want_capture = True
        self.session.control.request_capture(pause_after=True)
        self.hint(f"capturing step {self.series.step + 1}; its step view opens when it is done")

    def action_stop(self) -> None:
        if self._read_only():
            return
        self.session.control.stop("stopped from the live screen")
        self.hint("stopping after the current step and writing a checkpoint…")

    def action_interrupt(self) -> None:
        """Ctrl-C: as ``q``."""
        self.action_quit_live()

    def action_quit_live(self) -> None:
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
