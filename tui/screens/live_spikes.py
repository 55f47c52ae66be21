"""Enter (or ``i``) on the live screen: open the step a loss spike was captured at.

Each loss spike is flagged ``!`` on the loss chart (:mod:`tui.screens.live_chart`); the
trainer (``mdb overfit``) and ``run.watch(..., optimizer=)`` capture the spiking step before its
update (:mod:`hooks.recorder.trigger`). Enter opens the capture that tells the latest spike's
story in the step view (the triggered capture at its step, else the nearest stored one at
most :data:`hooks.train.verdict.NEAR` steps before it); pressed again, the spike before it, and
so on round. The story itself (:mod:`hooks.recorder.story`) is said on the hint line.
"""

from __future__ import annotations

from typing import Any

from textual import work

from tui import messages


class SpikeOpener:
    """Mixed into the live screens; uses ``series.spikes``, ``hint``, ``post_message`` and
    :meth:`spike_source`."""

    _spike_turn = 0

    def spike_source(self) -> tuple[str, str] | None:
        """``(database path, run name)`` of the run on the screen, ``None`` before it has
        one."""
        raise NotImplementedError

    def action_open_spike(self) -> None:
        """Open the captured step of the next spike, latest first."""
        spikes = sorted(self.series.spikes.values(), key=lambda sp: sp.step)
        source = self.spike_source()
        if not spikes or source is None:
            self.hint("no loss spike flagged on the chart (a ! marks one)")
            return
        spike = spikes[-1 - self._spike_turn % len(spikes)]
        self._spike_turn += 1
        self.hint(f"reading the capture of the spike at step {spike.step} …")
        self._read_spike(source, spike)

    @work(thread=True, exclusive=True, exit_on_error=False, group="spike-capture",
          description="read a spike's capture")
    def _read_spike(self, source: tuple[str, str], spike: Any) -> None:
        """The capture that tells ``spike``'s story, read on a connection of this thread and
        posted as :class:`messages.StepCaptured` (a hint when there is none)."""
        from hooks.store.store import RunStore
        from hooks.train.trainer import load_trace
        from hooks.train.verdict import NEAR, spike_stories, story_for

        try:
            with RunStore(source[0]) as store:
                run = store.run(source[1])
                steps = store.internals_steps(run.id)
                told = story_for(spike, spike_stories(store, run.id, steps))
                near = [s for s in steps if spike.step - NEAR <= s <= spike.step]
                step = told[0] if told is not None else (near[-1] if near else None)
                trace = load_trace(store, run.id, step) if step is not None else None
        except Exception as exc:  # a store that cannot be read: one line
            self.post_message(messages.Hint(f"cannot read the spike's capture: {exc}"[:200]))
            return
        if trace is None:
            self.post_message(messages.Hint(
                f"the spike at step {spike.step} has no stored capture (run.watch(model, "
                "every, optimizer=opt) and mdb overfit capture a spiking step as it happens)"))
            return
        self.post_message(messages.StepCaptured(step, trace))
        if told is not None:
            self.post_message(messages.Hint(told[1]))
