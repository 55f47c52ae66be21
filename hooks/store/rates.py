"""Training speed and the time left, one definition for every view: end-to-end steps per
second and the ETA.

The speed of a run is read from the wall-clock times at which its steps were recorded
(:attr:`hooks.store.store.MetricRow.wall`): the median spacing of the last :data:`RATE_WINDOW`
steps. It counts everything the loop does per step (forward, backward, optimizer, sampling,
recording) and a pause or an evaluation between two steps moves it by one sample of the median
only. The live screen, ``mdb watch``, ``mdb compare`` and a headless ``mdb overfit`` all show
this figure (``mdb runs --json`` too, :func:`hooks.store.numbers.stored_numbers`); the stored
``steps_per_s`` metric is a step's own ``1 / step_time`` (compute only) and is not shown as
the run's speed. The ETA is the steps left to the run's target at that pace
(:func:`eta_seconds`).

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["RATE_WINDOW", "StepRate", "eta_seconds"]

#: Steps whose spacing makes the rate.
RATE_WINDOW = 20


class StepRate:
    """The end-to-end speed of a run from the walls of its recorded steps.

    Args:
        window: How many of the last spacings the median is taken over.
    """

    def __init__(self, window: int = RATE_WINDOW) -> None:
        self._walls: deque[float] = deque(maxlen=window + 1)

    def add(self, wall: float) -> None:
        """A step recorded at Unix time ``wall`` (s), in step order."""
        self._walls.append(float(wall))

    def reset(self) -> None:
        """Forget every step (a run read again from its start)."""
        self._walls.clear()

    def seconds_per_step(self, step_time: float | None = None) -> float | None:
        """Median spacing (s) of the last steps; with fewer than two steps, ``step_time`` (the
        one step's own time, if known), else ``None``."""
        walls = list(self._walls)
        if len(walls) < 2:
            return float(step_time) if step_time else None
        gaps = [b - a for a, b in zip(walls, walls[1:], strict=False) if b >= a]
        return statistics.median(gaps) if gaps else None

    def steps_per_s(self, step_time: float | None = None) -> float | None:
        """Steps per second, end to end (see :meth:`seconds_per_step`); ``None`` if unknown."""
        spp = self.seconds_per_step(step_time)
        return 1.0 / spp if spp else None


def eta_seconds(total_steps: int | None, step: int, seconds_per_step: float | None
                ) -> float | None:
    """Seconds until step ``total_steps`` from ``step`` at ``seconds_per_step`` (0 once the
    target is reached); ``None`` without a target or a pace."""
    if not total_steps or seconds_per_step is None:
        return None
    return max(0, int(total_steps) - int(step)) * float(seconds_per_step)
