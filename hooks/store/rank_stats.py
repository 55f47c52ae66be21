"""Cross-rank statistics of a ``torchrun`` job, computed once for every view (``mdb watch``'s
ranks line and screen, ``mdb runs --json``): the band of a metric over the ranks, the rank
furthest from their median, each rank's median step and compute time, the basis the ranks'
times are compared on, and the stragglers.

In synchronous DDP every rank waits for the slowest in the gradient all-reduce, so the time
between two ``log()`` calls is the same on every rank; the compute time (measured with
``run.watch``: until the rank's backward produced its first gradient, before it waits) is what
tells them apart, and is the basis whenever every rank still reporting has it
(:func:`straggler_basis`).

Every function takes plain numbers per rank (``None``, NaN and ±inf are left out) and returns
plain numbers. This module never imports textual, rich or tui.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["GONE_STATES", "STRAGGLER_RATIO", "TIME_WINDOW", "awaited", "furthest", "median_times",
           "slow_ranks", "spread", "straggler_basis", "stragglers", "tied_with"]

#: Steps of each rank whose times give its median step and compute time.
TIME_WINDOW = 20
#: A rank slower than the median of the ranks by this factor is a straggler.
STRAGGLER_RATIO = 1.10
#: States of a rank (:data:`hooks.store.rows.RANK_STATES`) whose steps are no longer awaited:
#: its times are not compared with the others'.
GONE_STATES = ("dead", "silent", "absent")


def finite(v: Any) -> bool:
    """Whether ``v`` is a finite int or float."""
    return isinstance(v, (int, float)) and math.isfinite(v)


def _finite_values(values: Mapping[int, Any]) -> dict[int, float]:
    return {r: float(x) for r, x in values.items() if finite(x)}


def spread(values: Iterable[Any]) -> tuple[float, float, float] | None:
    """``(min, median, max)`` of the finite values, ``None`` without one."""
    xs = [float(v) for v in values if finite(v)]
    if not xs:
        return None
    return min(xs), statistics.median(xs), max(xs)


def furthest(values: Mapping[int, Any]) -> tuple[int, float, float, float | None] | None:
    """The rank whose value is furthest from the median of the ranks: ``(rank, value, median,
    (value − median) / |median|)`` (``None`` for a zero median); the lower rank on a tie;
    ``None`` with fewer than two finite values.

    Args:
        values: Per rank, its value of one metric at one step.
    """
    vals = _finite_values(values)
    if len(vals) < 2:
        return None
    med = statistics.median(vals.values())
    rank = max(vals, key=lambda r: (abs(vals[r] - med), -r))
    rel = (vals[rank] - med) / abs(med) if med else None
    return rank, vals[rank], med, rel


def tied_with(values: Mapping[int, Any], rank: int) -> list[int]:
    """The other ranks exactly as far from the median as ``rank`` (with two ranks, always the
    other one: the median is their mean)."""
    vals = _finite_values(values)
    if rank not in vals or len(vals) < 2:
        return []
    med = statistics.median(vals.values())
    d = abs(vals[rank] - med)
    return [r for r, x in vals.items()
            if r != rank and math.isclose(abs(x - med), d, rel_tol=1e-9)]


def stragglers(times: Mapping[int, float],
               ratio: float = STRAGGLER_RATIO) -> list[tuple[int, float, float]]:
    """``(rank, its time, the median of the ranks)`` of each rank slower than the median by
    more than ``ratio``, slowest first.

    Args:
        times: Per rank, its (median) step or compute time in seconds.
        ratio: How much slower than the median makes a straggler.
    """
    if len(times) < 2:
        return []
    med = statistics.median(times.values())
    slow = [(r, x, med) for r, x in times.items() if med > 0 and x > ratio * med]
    return sorted(slow, key=lambda s: -s[1])


def awaited(world_size: int, states: Mapping[int, str]) -> list[int]:
    """The ranks ``0 … world_size − 1`` still reporting: those whose state (by rank; a rank
    not listed is awaited) is not one of :data:`GONE_STATES`."""
    return [r for r in range(int(world_size)) if states.get(r) not in GONE_STATES]


def median_times(step_times: Mapping[int, Iterable[Any]], compute_times: Mapping[int, Iterable[Any]]
                 ) -> dict[int, tuple[float | None, float | None]]:
    """Per rank, the median of its step times and of its compute times (each rank's last
    :data:`TIME_WINDOW` steps, as the caller gives them), ``None`` where it has none; the
    ranks in order."""
    out = {}
    for r in sorted(set(step_times) | set(compute_times)):
        st = [float(x) for x in step_times.get(r, ()) if finite(x)]
        ct = [float(x) for x in compute_times.get(r, ()) if finite(x)]
        out[r] = (statistics.median(st) if st else None, statistics.median(ct) if ct else None)
    return out


def straggler_basis(times: Mapping[int, tuple[float | None, float | None]],
                    ranks: Iterable[int]) -> str | None:
    """What the ranks' times are compared on: ``"compute"`` when every rank of ``ranks`` (the
    ranks still reporting) has a compute time in ``times`` (:func:`median_times`), else
    ``"step"`` when every one has a step time, else ``None`` (so with fewer than two ranks)."""
    ranks = list(ranks)
    if len(ranks) < 2:
        return None
    if all(r in times and times[r][1] is not None for r in ranks):
        return "compute"
    if all(r in times and times[r][0] is not None for r in ranks):
        return "step"
    return None


def slow_ranks(times: Mapping[int, tuple[float | None, float | None]],
               ranks: Iterable[int], ratio: float = STRAGGLER_RATIO
               ) -> list[tuple[int, float, float]]:
    """The stragglers among ``ranks`` on their :func:`straggler_basis`: ``(rank, its median
    time, the median of the ranks)``, slowest first (:func:`stragglers`); none without a
    basis."""
    ranks = list(ranks)
    basis = straggler_basis(times, ranks)
    if basis is None:
        return []
    k = 1 if basis == "compute" else 0
    return stragglers({r: times[r][k] for r in ranks}, ratio)
