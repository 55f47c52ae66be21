"""The verdict ``mdb overfit`` ends with: did the model memorise the batch, and what happened
at each loss spike.

* **Memorised**: the run's loss (``ce`` for minillm, ``loss`` for a ``--model``) stayed below
  :data:`THRESHOLD` nats from some step N to the end, and — when the run memorises a text — the
  last greedy sample equals the text's continuation of the prompt, character for character.
* **Each spike** the run store recorded (:mod:`hooks.store.spikes`): the loss just before it and
  its peak, whether it **recovered** (the loss back under the threshold, or under twice its level
  before the spike when that was higher, at a step after the episode) and the capture to open
  (``mdb step --run NAME@STEP``): the step captured before its update by the trigger
  (:mod:`hooks.train.spike_capture`), or the nearest capture at most :data:`NEAR` steps before.

Read from the run store only (any overfit run, also one read back later). This module never
imports textual, rich or tui.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from hooks.store.spikes import Spike

__all__ = ["NEAR", "THRESHOLD", "SpikeOutcome", "Verdict", "overfit_verdict", "spike_stories",
           "story_for"]

#: The loss (nats per token) a memorised batch stays below.
THRESHOLD = 0.05
#: Steps before a spike within which a capture still tells its story.
NEAR = 10


@dataclass(frozen=True)
class SpikeOutcome:
    """One spike and how it ended.

    Attributes:
        spike: The recorded episode.
        before: The verdict's loss before it: its median over the :data:`NEAR` steps before
            the episode (``None`` unknown).
        peak: Its largest value during the episode.
        recovered_at: The first step after the episode where it was back (see the module),
            ``None`` when it never was.
        capture: The stored capture to open for it, ``None`` without one.
        story: That capture's one-line story (``meta["spike"]["line"]``), if it has one.
    """

    spike: Spike
    before: float | None
    peak: float | None
    recovered_at: int | None
    capture: int | None
    story: str | None = None


@dataclass
class Verdict:
    """What ``mdb overfit`` concludes (see the module docstring).

    Attributes:
        run: The run's name.
        metric: The loss judged (``ce``, ``loss``).
        threshold: :data:`THRESHOLD`.
        memorised: The verdict.
        below_from: The step N from which the loss stayed below the threshold to the end.
        first_below: The first step whose loss was below the threshold.
        last: The last step's loss.
        last_step: The last step.
        sample_ok: Whether the last greedy sample equals the text (``None``: no text/sample).
        sample_step: The step of that sample.
        spikes: Each spike's :class:`SpikeOutcome`, in step order.
    """

    run: str
    metric: str
    threshold: float
    memorised: bool
    below_from: int | None
    first_below: int | None
    last: float | None
    last_step: int
    sample_ok: bool | None
    sample_step: int | None
    spikes: list[SpikeOutcome] = field(default_factory=list)

    def lines(self, db: str | None = None) -> list[str]:
        """The verdict in words: one line, then one per spike."""
        m, thr = self.metric, _num(self.threshold)
        first, end = self.first_below, self.last_step
        if self.below_from is not None:
            why = f"{m} below {thr} from step {self.below_from} to the end ({end})"
            if first is not None and first < self.below_from:
                why = f"{m} first below {thr} at step {first}; {why.removeprefix(m + ' ')}"
        else:
            why = f"{m} {_num(self.last)} at step {end} is not below {thr}"
        if self.sample_ok is True:
            why += f"; the greedy sample at step {self.sample_step} equals the text"
        elif self.sample_ok is False:
            why += f"; the greedy sample at step {self.sample_step} differs from the text"
        out = [f"verdict: {'memorised' if self.memorised else 'not memorised'} — {why}"]
        opt = f" --db {db}" if db else ""
        for o in self.spikes:
            s = o.spike
            line = (f"spike at step {s.step}: {m} {_num(o.before)} → {_num(o.peak)}"
                    f" ({s.last_step - s.step + 1} steps); ")
            line += (f"recovered by step {o.recovered_at}" if o.recovered_at is not None
                     else "not recovered by the end")
            if o.capture is not None:
                line += f"; open it: mdb step --run {self.run}@{o.capture}{opt}"
            out.append(line)
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        d = {k: v for k, v in self.__dict__.items() if k != "spikes"}
        d["spikes"] = [{**o.spike.to_dict(), "before": o.before, "peak": o.peak,
                        "recovered_at": o.recovered_at, "capture": o.capture,
                        "story": o.story} for o in self.spikes]
        return d


def _num(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "nan"
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"


def _below_from(series: list[tuple[int, float | None]], threshold: float) -> int | None:
    start = None
    for step, v in series:
        if v is None or not v < threshold:
            start = None
        elif start is None:
            start = step
    return start


def _outcome(spike: Spike, series: list[tuple[int, float | None]], threshold: float,
             captures: list[int], stories: dict[int, str]) -> SpikeOutcome:
    prior = [v for s, v in series if spike.step - NEAR <= s < spike.step and v is not None]
    before = statistics.median(prior) if prior else None
    during = [v for s, v in series if spike.step <= s <= spike.last_step and v is not None]
    peak = max(during) if during else None
    back = max(threshold, 2 * before) if before is not None else threshold
    recovered = next((s for s, v in series if s > spike.last_step and v is not None
                      and v < back), None)
    near = [c for c in captures if spike.step - NEAR <= c <= spike.last_step]
    own = [c for c in near if c in stories]
    pick = min(own, key=lambda c: abs(c - spike.step)) if own else (max(
        [c for c in near if c <= spike.step], default=None))
    return SpikeOutcome(spike, before, peak, recovered, pick, stories.get(pick))


def overfit_verdict(store: Any, run: Any, metric: str, text: str = "",
                    threshold: float = THRESHOLD) -> Verdict:
    """The verdict of a stored run.

    Args:
        store: The :class:`hooks.store.store.RunStore`.
        run: Its :class:`hooks.store.store.RunInfo`.
        metric: The loss to judge (``ce``, ``loss``).
        text: The memorised text (``""``: no sample is judged).
        threshold: :data:`THRESHOLD`.

    Returns:
        The :class:`Verdict`.
    """
    rows = store.metrics(run.id)
    series = [(r.step, r.values.get(metric)) for r in rows]
    last_step, last = (series[-1] if series else (0, None))
    below = _below_from(series, threshold)
    sample_ok = sample_step = None
    samples = store.samples(run.id) if text else []
    if samples:
        s = samples[-1]
        want = text[len(s.prompt):][: len(s.text)] if text.startswith(s.prompt) else None
        sample_ok, sample_step = bool(s.text) and s.text == want, s.step
    memorised = below is not None and sample_ok is not False
    captures = store.internals_steps(run.id)
    stories = spike_stories(store, run.id, captures)
    spikes = [_outcome(sp, series, threshold, captures, stories)
              for sp in store.spikes(run.id)]
    first = next((s for s, v in series if v is not None and v < threshold), None)
    return Verdict(run.name, metric, threshold, memorised, below, first, last, last_step,
                   sample_ok, sample_step, spikes)


def spike_stories(store: Any, run_id: int, captures: list[int] | None = None
                  ) -> dict[int, str]:
    """The stories (``meta["spike"]["line"]``) of a run's triggered captures near its recorded
    spikes, by captured step; only those captures' rows are read."""
    spikes = store.spikes(run_id)
    near = {s for sp in spikes for s in range(sp.step - NEAR, sp.last_step + 1)}
    if captures is None:
        captures = store.internals_steps(run_id)
    out = {}
    for c in captures:
        if c not in near:
            continue
        meta = (store.internals(run_id, c) or {}).get("meta") or {}
        line = (meta.get("spike") or {}).get("line")
        if isinstance(line, str):
            out[c] = line
    return out


def story_for(spike: Spike, stories: dict[int, str]) -> tuple[int, str] | None:
    """``(captured step, story)`` of the triggered capture that tells ``spike``'s story: the
    one at its first step, else the nearest before it (at most :data:`NEAR` steps), else
    ``None``."""
    own = [c for c in stories if spike.step - NEAR <= c <= spike.last_step]
    if not own:
        return None
    c = min(own, key=lambda c: (abs(c - spike.step), c))
    return c, stories[c]
