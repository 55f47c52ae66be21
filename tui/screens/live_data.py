"""What the live screen plots, kept small: bounded series and the run's latest numbers.

Pure Python (no Textual, no torch), so the live screen's bookkeeping is testable on its own and
costs the same at step 100 as at step 100,000:

* :class:`Downsampler` keeps at most ``capacity`` buckets of a series; when full, neighbouring
  buckets are merged pairwise and the bucket width doubles (the scheme of an "online
  decimation" buffer). Appending is amortised O(1), reading is O(capacity), memory is bounded.
* :class:`RunSeries` feeds every :class:`hooks.runs.store.MetricRow` of a run into one downsampler
  per plotted quantity (CE, aux, total loss, gradient norm, and per MoE layer per expert the
  tokens routed to it) and keeps the numbers the header shows (throughput, ETA, last sample).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

#: Buckets kept per series: about two points per column of a full-width chart.
DEFAULT_CAPACITY = 256
#: Steps whose wall-clock spacing gives the throughput and the ETA.
RATE_WINDOW = 20


class Downsampler:
    """A series of (step, value) points reduced to at most ``capacity`` bucket means.

    Each bucket covers ``width`` consecutive appended points and reports the step of its last
    point and the mean of its values; the last bucket may be partial (it always shows the latest
    point's step). Non-finite values are skipped (a NaN loss is reported elsewhere).

    Args:
        capacity: Maximum number of buckets (even, ≥ 4).

    Raises:
        ValueError: ``capacity`` is odd or < 4.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 4 or capacity % 2:
            raise ValueError(f"capacity must be even and >= 4, got {capacity}")
        self.capacity = capacity
        self.width = 1  # points per full bucket
        self._xs: list[float] = []  # step of each bucket's last point
        self._sums: list[float] = []
        self._counts: list[int] = []
        self.count = 0  # finite points appended
        self.last: float | None = None

    def append(self, step: float, value: float | None) -> None:
        """Add one point; ``None``, NaN and ±inf are ignored."""
        if value is None or not math.isfinite(value):
            return
        self.count += 1
        self.last = value
        if self._counts and self._counts[-1] < self.width:
            self._xs[-1] = step
            self._sums[-1] += value
            self._counts[-1] += 1
            return
        if len(self._counts) == self.capacity:
            self._halve()
        self._xs.append(step)
        self._sums.append(value)
        self._counts.append(1)

    def _halve(self) -> None:
        xs, sums, counts = [], [], []
        for i in range(0, len(self._counts) - 1, 2):
            xs.append(self._xs[i + 1])
            sums.append(self._sums[i] + self._sums[i + 1])
            counts.append(self._counts[i] + self._counts[i + 1])
        self._xs, self._sums, self._counts = xs, sums, counts
        self.width *= 2

    def points(self, max_points: int | None = None) -> tuple[list[float], list[float]]:
        """``(steps, means)``, one pair per bucket, in step order.

        Args:
            max_points: At most this many points: groups of ``g`` consecutive buckets are
                merged (step of the group's last point, mean of its points), ``g`` the
                smallest that fits. A chart passes its horizontal resolution.
        """
        n = len(self._counts)
        if max_points is None or n <= max_points:
            return list(self._xs), [s / c for s, c in zip(self._sums, self._counts, strict=True)]
        g = -(-n // max(1, max_points))
        xs, ys = [], []
        for i in range(0, n, g):
            j = min(n, i + g)
            xs.append(self._xs[j - 1])
            ys.append(sum(self._sums[i:j]) / sum(self._counts[i:j]))
        return xs, ys

    def __len__(self) -> int:
        return len(self._counts)

    def clear(self) -> None:
        """Forget every point."""
        self.width = 1
        self._xs, self._sums, self._counts = [], [], []
        self.count = 0
        self.last = None


@dataclass
class Sample:
    """The latest greedy continuation and how much of it matches the text being memorised.

    Attributes:
        step: Step it was generated at.
        prompt: The text's first characters, fed to the model.
        text: The model's greedy continuation.
        matched: Leading characters of ``text`` equal to the text after the prompt.
    """

    step: int
    prompt: str
    text: str
    matched: int = 0


def matching_prefix(generated: str, reference: str) -> int:
    """Number of leading characters ``generated`` shares with ``reference``."""
    n = 0
    for a, b in zip(generated, reference, strict=False):
        if a != b:
            break
        n += 1
    return n


def format_duration(seconds: float | None) -> str:
    """``0:42``, ``12:05``, ``3:02:11``; ``—`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "—"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class RunSeries:
    """Everything the live screen shows about one run, fed one metric row at a time.

    Args:
        total_steps: The run's step target (``None`` if unknown).
        text: The text being memorised (to score samples), or ``""``.
        top_k: Experts per token, k: converts expert-load fractions to routed tokens.
        capacity: Buckets per plotted series.

    Attributes:
        ce, aux, total, grad_norm: :class:`Downsampler` of those metrics per step.
        experts: Per MoE layer, per expert, a :class:`Downsampler` of the tokens routed to that
            expert at each step (fraction × N·k, N = tokens per step), shape (L_moe, E).
        last: The latest :class:`hooks.runs.store.MetricRow` (``None`` before the first).
        first_step: Step of the first row seen (a resumed run does not start at 1).
        sample: The latest :class:`Sample`.
    """

    def __init__(self, total_steps: int | None = None, *, text: str = "", top_k: int = 1,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self.total_steps = total_steps
        self.text = text
        self.top_k = max(1, int(top_k))
        self.capacity = capacity
        self.ce = Downsampler(capacity)
        self.aux = Downsampler(capacity)
        self.total = Downsampler(capacity)
        self.grad_norm = Downsampler(capacity)
        self.experts: list[list[Downsampler]] = []
        self.last: Any = None
        self.first_step: int | None = None
        self.sample: Sample | None = None
        self.rows = 0
        self._walls: deque[float] = deque(maxlen=RATE_WINDOW + 1)
        self._tokens_per_step: float | None = None

    # -- feeding --------------------------------------------------------------------------------
    def add(self, row: Any) -> None:
        """Add one :class:`hooks.runs.store.MetricRow` (steps must arrive in increasing order)."""
        step = row.step
        if self.first_step is None:
            self.first_step = step
        self.rows += 1
        self.last = row
        self.ce.append(step, row.ce)
        self.aux.append(step, row.aux)
        self.total.append(step, row.total)
        self.grad_norm.append(step, row.grad_norm)
        self._walls.append(row.wall)
        if row.tokens_per_s and row.step_time:
            self._tokens_per_step = row.tokens_per_s * row.step_time
        load = row.expert_load
        if load:
            if len(self.experts) != len(load):
                self.experts = [
                    [Downsampler(self.capacity) for _ in layer] for layer in load
                ]
            slots = (self._tokens_per_step or 0.0) * self.top_k
            for samplers, fractions in zip(self.experts, load, strict=False):
                for sampler, frac in zip(samplers, fractions, strict=False):
                    sampler.append(step, frac * slots if slots else frac)

    def add_sample(self, step: int, prompt: str, text: str) -> None:
        """Record a greedy continuation generated at ``step``."""
        reference = self.text[len(prompt):] if self.text.startswith(prompt) else ""
        self.sample = Sample(step, prompt, text, matching_prefix(text, reference))

    def reset(self) -> None:
        """Forget everything (a watched run was resumed from an earlier checkpoint)."""
        self.__init__(self.total_steps, text=self.text, top_k=self.top_k,  # type: ignore[misc]
                      capacity=self.capacity)

    # -- derived numbers ------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The latest step (0 before the first)."""
        return self.last.step if self.last is not None else 0

    @property
    def expert_units(self) -> str:
        """What the expert series count: ``"tokens"`` (routed slots) or ``"share"``."""
        return "tokens" if self._tokens_per_step else "share"

    def seconds_per_step(self) -> float | None:
        """Median wall-clock spacing of the last :data:`RATE_WINDOW` steps (robust to a pause)."""
        walls = list(self._walls)
        if len(walls) < 2:
            if self.last is not None and self.last.step_time:
                return float(self.last.step_time)
            return None
        gaps = [b - a for a, b in zip(walls, walls[1:], strict=False) if b >= a]
        return statistics.median(gaps) if gaps else None

    def steps_per_s(self) -> float | None:
        """End-to-end training steps per second (steps, sampling and recording)."""
        spp = self.seconds_per_step()
        return 1.0 / spp if spp else None

    def tokens_per_s(self) -> float | None:
        """Tokens trained on per second, end to end."""
        rate = self.steps_per_s()
        if rate is None or not self._tokens_per_step:
            return None
        return rate * self._tokens_per_step

    def eta(self) -> float | None:
        """Seconds until ``total_steps`` at the current rate (``None`` if unknown)."""
        if self.total_steps is None:
            return None
        spp = self.seconds_per_step()
        if spp is None:
            return None
        return max(0, self.total_steps - self.step) * spp
