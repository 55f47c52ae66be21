"""Cross-rank statistics of a ``torchrun`` job, computed once for every view (``mdb watch``'s
ranks line and screen, ``mdb runs``): the band of a metric over the ranks, the rank furthest
from their median, and the stragglers.

Every function takes plain numbers per rank (``None``, NaN and ±inf are left out) and returns
plain numbers. This module never imports textual, rich or tui.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["STRAGGLER_RATIO", "TIME_WINDOW", "furthest", "spread", "stragglers", "tied_with"]

#: Steps of each rank whose times give its median step and compute time.
TIME_WINDOW = 20
#: A rank slower than the median of the ranks by this factor is a straggler.
STRAGGLER_RATIO = 1.10


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
