"""What ``mdb watch`` shows about the ranks of a distributed run, kept small (no Textual).

:class:`RankSeries` is fed the rows of every rank (:class:`hooks.store.store.RankRow`, read by
``RunStore.rank_steps``) and the ranks, findings and checks of the run. A step counts once every
rank that is still reporting has sent it (ranks reach the store in batches, every
``gather_every`` steps): then, for each metric, the minimum, median and maximum over the ranks
go into three bounded series (:class:`tui.screens.live_data.Downsampler`) — the band — and the
step's values per rank are kept as the latest. From those:

* :meth:`RankSeries.furthest`: the rank furthest from the median of a metric, and by how much;
* :meth:`RankSeries.times` and :meth:`RankSeries.stragglers`: each rank's median step time and
  compute time over its last :data:`TIME_WINDOW` steps, and the ranks slower than the median
  of the ranks by more than :data:`hooks.store.rank_stats.STRAGGLER_RATIO`, on the basis
  :func:`hooks.store.rank_stats.straggler_basis` picks (compute time whenever every rank has
  it). These numbers are computed by :mod:`hooks.store.rank_stats`, as ``mdb runs --json``
  computes them; this module only keeps each rank's last times;
* :meth:`RankSeries.expert_load`: the latest expert load of each rank, (L_moe, E).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hooks.store import rank_stats
from hooks.store.rank_stats import TIME_WINDOW
from hooks.store.rank_stats import finite as _finite
from hooks.store.store import loss_metric
from tui.screens.live_data import DEFAULT_CAPACITY, Downsampler


class RankSeries:
    """The ranks of one distributed run, fed one :class:`hooks.store.store.RankRow` at a time.

    Args:
        world_size: The run's number of ranks.
        capacity: Buckets per band series.

    Attributes:
        world_size: The number of ranks.
        names: Every metric the ranks logged, in first-seen order.
        ranks: The latest :class:`hooks.store.store.RankInfo` of each rank, by rank.
        findings: The run's findings (:class:`hooks.store.store.Finding`), in the order found.
        checks: The cross-rank comparisons made (``RunStore.checks``).
        step: The last step every reporting rank has sent (0 before).
        last_step: Per rank, the last step it sent.
        values: Per rank, its values at :attr:`step` (``None`` = NaN).
        latest: Per rank, the values of the last step it sent (a rank that died stops there).
    """

    def __init__(self, world_size: int, capacity: int = DEFAULT_CAPACITY) -> None:
        self.world_size = int(world_size)
        self.capacity = capacity
        self.names: list[str] = []
        self.ranks: dict[int, Any] = {}
        self.findings: list[Any] = []
        self.checks: list[dict[str, Any]] = []
        self.step = 0
        self.last_step: dict[int, int] = {}
        self.values: dict[int, dict[str, float | None]] = {}
        self.latest: dict[int, tuple[int, dict[str, float | None]]] = {}
        self._bands: dict[str, tuple[Downsampler, Downsampler, Downsampler]] = {}
        self._pending: dict[int, dict[int, Any]] = {}
        self._times: dict[int, deque] = {}
        self._compute: dict[int, deque] = {}
        self._load: dict[int, list[list[float]]] = {}
        self.rows = 0

    # -- feeding ----------------------------------------------------------------------------------
    def set_ranks(self, ranks: Iterable[Any]) -> None:
        """The ranks as the store has them now (a rank that died or went silent is no longer
        waited for)."""
        for r in ranks:
            self.ranks[r.rank] = r
        self._complete()

    def add(self, row: Any) -> None:
        """Add one rank's step (steps of a rank arrive in increasing order)."""
        self.rows += 1
        for name in row.values:
            if name not in self._bands:
                self._bands[name] = tuple(Downsampler(self.capacity) for _ in range(3))
                self.names.append(name)
        self._pending.setdefault(row.step, {})[row.rank] = row
        self.last_step[row.rank] = max(self.last_step.get(row.rank, 0), row.step)
        if row.step >= self.latest.get(row.rank, (0, {}))[0]:
            self.latest[row.rank] = (row.step, dict(row.values))
        if row.step_time is not None:
            self._times.setdefault(row.rank, deque(maxlen=TIME_WINDOW)).append(row.step_time)
        if row.compute_time is not None:
            self._compute.setdefault(row.rank, deque(maxlen=TIME_WINDOW)).append(
                row.compute_time)
        if row.expert_load:
            self._load[row.rank] = row.expert_load

    def add_all(self, rows: Iterable[Any]) -> None:
        """:meth:`add` each row, then settle the steps every rank has sent."""
        for row in rows:
            self.add(row)
        self._complete()

    def _awaited(self) -> list[int]:
        return rank_stats.awaited(self.world_size,
                                  {r: info.state for r, info in self.ranks.items()})

    def _complete(self) -> None:
        awaited = self._awaited()
        if not awaited:
            return
        upto = min(self.last_step.get(r, 0) for r in awaited)
        for step in sorted(s for s in self._pending if s <= upto):
            rows = self._pending.pop(step)
            for name, (lo, med, hi) in self._bands.items():
                band = rank_stats.spread(r.values.get(name) for r in rows.values()
                                         if name in r.values)
                if band is not None:
                    lo.append(step, band[0])
                    med.append(step, band[1])
                    hi.append(step, band[2])
            self.values = {r: dict(row.values) for r, row in sorted(rows.items())}
            self.step = step

    # -- reading ----------------------------------------------------------------------------------
    def band(self, name: str) -> tuple[Downsampler, Downsampler, Downsampler] | None:
        """The (min, median, max) series of ``name`` over the ranks, per step."""
        return self._bands.get(name)

    def loss_name(self) -> str | None:
        """The metric that stands for the loss (:func:`hooks.store.store.loss_metric`)."""
        return loss_metric(self.names)

    def grad_name(self) -> str | None:
        """The gradient norm's metric: ``grad_norm``, else the first name with ``grad``."""
        if "grad_norm" in self.names:
            return "grad_norm"
        return next((n for n in self.names if "grad" in n), None)

    def furthest(self, name: str) -> tuple[int, float, float, float | None] | None:
        """The rank furthest from the median of ``name`` at :attr:`step`
        (:func:`hooks.store.rank_stats.furthest`)."""
        return rank_stats.furthest({r: v.get(name) for r, v in self.values.items()})

    def tied_with(self, name: str, rank: int) -> list[int]:
        """The other ranks exactly as far from the median of ``name`` as ``rank``
        (:func:`hooks.store.rank_stats.tied_with`)."""
        return rank_stats.tied_with({r: v.get(name) for r, v in self.values.items()}, rank)

    def nonfinite_ranks(self, name: str) -> list[int]:
        """Ranks whose ``name`` at :attr:`step` is NaN or ±inf."""
        return [r for r, v in self.values.items() if name in v and not _finite(v[name])]

    def times(self) -> dict[int, tuple[float | None, float | None]]:
        """Per rank, the median (step time, compute time) of its last :data:`TIME_WINDOW`
        steps, in seconds (``None``: not measured; :func:`hooks.store.rank_stats.median_times`)."""
        return rank_stats.median_times(self._times, self._compute)

    def awaited(self) -> list[int]:
        """The ranks still reporting (not dead, silent or absent)."""
        return self._awaited()

    def straggler_basis(self) -> str | None:
        """``"compute"`` when every awaited rank has a compute time, else ``"step"`` when they
        have step times, else ``None`` (:func:`hooks.store.rank_stats.straggler_basis`)."""
        return rank_stats.straggler_basis(self.times(), self._awaited())

    def stragglers(self) -> list[tuple[int, float, float]]:
        """``(rank, its time, the median of the ranks)`` of each rank slower than the median
        by more than :data:`hooks.store.rank_stats.STRAGGLER_RATIO`, slowest first, on the
        :meth:`straggler_basis` (:func:`hooks.store.rank_stats.slow_ranks`)."""
        return rank_stats.slow_ranks(self.times(), self._awaited())

    def expert_load(self) -> dict[int, list[list[float]]]:
        """Per rank, the latest expert load it logged, (L_moe, E) shares."""
        return dict(sorted(self._load.items()))

    def checks_summary(self) -> dict[str, tuple[int, int]]:
        """Per kind (``params``, ``grads``): (comparisons made, comparisons that differed).
        A check that compared no tensor (every tensor a shard of one rank: FSDP2) is not a
        comparison made: see :meth:`checks_not_compared`."""
        out: dict[str, tuple[int, int]] = {}
        for c in self.checks:
            if not c.get("compared"):
                continue
            n, bad = out.get(c["kind"], (0, 0))
            out[c["kind"]] = (n + 1, bad + (1 if c["differing"] else 0))
        return out

    def checks_not_compared(self) -> dict[str, tuple[int, str]]:
        """Per kind (``params``, ``grads``): (checks that compared no tensor, why: the store's
        ``note``, e.g. FSDP2 shards differ by design)."""
        out: dict[str, tuple[int, str]] = {}
        for c in self.checks:
            if c.get("compared"):
                continue
            n, _ = out.get(c["kind"], (0, ""))
            out[c["kind"]] = (n + 1, str(c.get("note") or "no tensor held by two ranks"))
        return out


def bar_string(shares: Sequence[float], top: float | None = None) -> str:
    """One block character per expert, its height the share relative to ``top`` (default the
    largest): ``▁▅█▂``."""
    blocks = " ▁▂▃▄▅▆▇█"
    top = max(shares) if top is None else top
    if not top or top <= 0:
        return " " * len(shares)
    return "".join(blocks[max(1, min(8, round(8 * s / top)))] if s > 0 else " "
                   for s in shares)


def hot_expert(shares: Sequence[float]) -> tuple[int, float] | None:
    """``(expert, share)`` of the expert with the largest share."""
    if not shares:
        return None
    e = max(range(len(shares)), key=lambda i: shares[i])
    return e, shares[e]


def rank_label(info: Any) -> str:
    """``rank 1 (pid 4242 on vm)`` of a :class:`hooks.store.store.RankInfo` (or ``rank N``)."""
    describe = getattr(info, "describe", None)
    return describe() if callable(describe) else f"rank {info}"


def summarise_states(ranks: Mapping[int, Any]) -> str:
    """``2 running · 1 dead``."""
    counts: dict[str, int] = {}
    for info in ranks.values():
        counts[info.state] = counts.get(info.state, 0) + 1
    return " · ".join(f"{n} {state}" for state, n in counts.items())
