"""Loss spikes: a loss that jumps to several times its running median, found as steps are logged.

A long run can blow up for a few dozen steps and recover (an Adam update after the loss has
converged, a bad batch): a 2,000-step ``mdb overfit`` jumped at step 687 from a total loss of
0.040 to 3.33 three steps later, with a gradient norm of 14.9, and was back under 0.2 twenty
steps after. On a chart of 2,000 steps such an episode is a few columns wide; this module finds
it so that the run records it.

The rule (:class:`SpikeDetector`), for one positive metric (the run's loss):

* the **baseline** is the median of the last :data:`WINDOW` finite values before this one
  (at least :data:`MIN_HISTORY` of them: nothing is flagged earlier);
* a value **spikes** when it is more than :data:`FACTOR` times the baseline *and* above it by
  more than :data:`MIN_RISE` of the run's initial level (the median of its first
  :data:`MIN_HISTORY` values), so that the tiny noise of a loss that has converged to ~1e-4 is
  not taken for a jump;
* consecutive spiking values form one **episode**, recorded once as a :class:`Spike`: its first
  step, the baseline before it, its peak and its last spiking step.

The median, not the mean, keeps the spike itself out of its own baseline (a median moves only
once more than half the window is high). A loss that settles at a higher level for good ends its
episode after about ``WINDOW / 2`` steps, when the median has caught up.

Pure Python (the run store uses it as it writes steps); it imports neither torch nor the UI.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["FACTOR", "MIN_HISTORY", "MIN_RISE", "WINDOW", "Spike", "SpikeDetector"]

#: A value spikes above this many times its running median.
FACTOR = 3.0
#: Values the running median is taken over.
WINDOW = 50
#: Finite values needed before anything is flagged (and that give the initial level).
MIN_HISTORY = 20
#: The smallest rise above the median that counts, as a fraction of the initial level.
MIN_RISE = 0.01


@dataclass(frozen=True)
class Spike:
    """One episode of a metric far above its running median.

    Attributes:
        step: The first step of the episode.
        metric: The metric (the run's loss: ``total``, ``loss`` ...).
        value: The peak value of the episode.
        baseline: The running median just before the episode (the last :data:`WINDOW` values).
        peak_step: The step of ``value``.
        last_step: The last step of the episode that was still spiking.
    """

    step: int
    metric: str
    value: float
    baseline: float
    peak_step: int
    last_step: int

    @property
    def ratio(self) -> float:
        """``value / baseline``: how many times its median the peak was."""
        return self.value / self.baseline if self.baseline > 0 else math.inf

    def describe(self) -> str:
        """One line: ``loss spike at step 687: total 3.33 at step 690, 83× its median 0.0400
        over the 50 steps before (4 steps)``."""
        at = f" at step {self.peak_step}" if self.peak_step != self.step else ""
        n = self.last_step - self.step + 1
        span = f" ({n} steps)" if n > 1 else ""
        return (f"loss spike at step {self.step}: {self.metric} {_num(self.value)}{at}, "
                f"{self.ratio:.0f}× its median {_num(self.baseline)}{span}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable fields, with ``ratio``."""
        return {**asdict(self), "ratio": self.ratio}


def _num(x: float) -> str:
    return f"{x:.3g}" if abs(x) >= 1e-3 else f"{x:.2e}"


class SpikeDetector:
    """Feed one metric's values in step order; :meth:`observe` says when they spike.

    Args:
        metric: The metric's name (stored in each :class:`Spike`).
        factor: See :data:`FACTOR`.
        window: See :data:`WINDOW`.
        min_history: See :data:`MIN_HISTORY`.
        min_rise: See :data:`MIN_RISE`.

    Raises:
        ValueError: ``factor <= 1``, ``window < 1`` or ``min_history < 1``.
    """

    def __init__(self, metric: str, *, factor: float = FACTOR, window: int = WINDOW,
                 min_history: int = MIN_HISTORY, min_rise: float = MIN_RISE) -> None:
        if not factor > 1 or window < 1 or min_history < 1:
            raise ValueError("a spike needs factor > 1, window >= 1 and min_history >= 1")
        self.metric = metric
        self.factor = float(factor)
        self.min_history = int(min_history)
        self.min_rise = float(min_rise)
        self.window = int(window)
        self._window: deque[float] = deque()  # the last `window` values, in step order
        self._sorted: list[float] = []  # the same values, sorted (the median in O(1))
        self._first: list[float] = []
        self._current: Spike | None = None

    def _push(self, value: float) -> None:
        if len(self._window) == self.window:
            old = self._window.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._window.append(value)
        bisect.insort(self._sorted, value)

    def _median(self) -> float:
        v, n = self._sorted, len(self._sorted)
        return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2

    @property
    def baseline(self) -> float | None:
        """The running median now (of the last ``window`` finite values), ``None`` before the
        first one: what the next value is compared with."""
        return self._median() if self._sorted else None

    @property
    def initial(self) -> float | None:
        """The run's initial level: the median of its first ``min_history`` values."""
        if len(self._first) < self.min_history:
            return None
        return statistics.median(self._first)

    def seed(self, first: Iterable[float | None], last: Iterable[float | None]) -> None:
        """Start from a run's history (a resumed run): its first values (the initial level)
        and its last ``window`` values (the running median), both in step order."""
        for v in first:
            if _usable(v) and len(self._first) < self.min_history:
                self._first.append(float(v))  # type: ignore[arg-type]
        for v in last:
            if _usable(v):
                self._push(float(v))  # type: ignore[arg-type]

    def observe(self, step: int, value: float | None) -> Spike | None:
        """Add the value logged at ``step``.

        Returns:
            The episode this value belongs to (a new :class:`Spike`, or the current one with
            its peak and last step updated), else ``None``. NaN, ±inf and ``None`` are skipped
            (a non-finite value is reported by the run's ``nonfinite``) and return ``None``.
        """
        if not _usable(value):
            return None
        value = float(value)  # type: ignore[arg-type]
        found = None
        initial = self.initial
        if initial is not None and initial > 0 and len(self._window) >= self.min_history:
            base = self._median()
            if base > 0 and value > self.factor * base and value - base > self.min_rise * initial:
                cur = self._current
                if cur is None:
                    cur = Spike(int(step), self.metric, value, base, int(step), int(step))
                elif value > cur.value:
                    cur = Spike(cur.step, cur.metric, value, cur.baseline, int(step), int(step))
                else:
                    cur = Spike(cur.step, cur.metric, cur.value, cur.baseline, cur.peak_step,
                                int(step))
                self._current = found = cur
        if found is None:
            self._current = None
        if len(self._first) < self.min_history:
            self._first.append(value)
        self._push(value)
        return found


def _usable(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
