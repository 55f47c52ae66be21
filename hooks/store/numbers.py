"""One meaning for each number a view shows about a run, defined here and nowhere in the UI.

``mdb runs``, ``mdb compare``, ``mdb watch`` and the live screen of ``mdb overfit`` all show
"the loss" of a run, its speed and its ETA, and for a ``torchrun`` job the ranks' times and
stragglers. Each is defined once:

* **the loss** — which logged metric stands for the run's loss: :func:`loss_metric` (below);
* **steps/s** — the median spacing of the walls of the last recorded steps
  (:class:`hooks.store.rates.StepRate`); **the ETA** — the steps left at that pace
  (:func:`hooks.store.rates.eta_seconds`);
* **rank medians and stragglers** — each rank's median step and compute time over its last
  :data:`hooks.store.rank_stats.TIME_WINDOW` steps, the basis they are compared on, and the
  ranks slower than the median (:mod:`hooks.store.rank_stats`).

The live views feed those definitions one row at a time; :func:`stored_numbers` computes the
same numbers from a stored run in a few indexed reads (``mdb runs``), whatever its length.

This module uses only the standard library; it never imports textual, rich or tui.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hooks.store import rank_stats
from hooks.store.rates import RATE_WINDOW, StepRate, eta_seconds

__all__ = ["HELD_OUT", "RunNumbers", "is_loss_like", "loss_metric", "stored_numbers"]

#: A held-out evaluation logged next to the training loss (``mdb ablate``'s ``ce@32``: the
#: cross-entropy on held-out windows of 32 tokens); never the run's loss.
HELD_OUT = re.compile(r"^ce@(\d+)$")
_LOSS_TOKENS = frozenset({"ce", "nll", "ppl", "xent", "perplexity"})


def is_loss_like(name: str) -> bool:
    """Whether a metric is a loss by its name: it contains ``loss`` or ``perplexity``, or one
    of its ``_``/``/``/``.``/``-``-separated words is ``ce``, ``nll``, ``ppl`` or ``xent``
    (``val_loss``, ``train/ce``, ``nll``, ``val_ppl`` yes; ``acc``, ``balance``, ``lr`` no)."""
    low = name.lower()
    if "loss" in low or "perplexity" in low:
        return True
    return any(tok in _LOSS_TOKENS for tok in re.split(r"[^a-z0-9]+", low))


def loss_metric(names: Iterable[str]) -> str | None:
    """The metric that stands for "the loss" of a run among the names it logged (in
    first-logged order), the same in every view:

    1. ``total`` — ``mdb overfit``'s back-propagated loss (``ce + aux`` for minillm);
    2. ``loss`` — what a ``hooks.run`` loop or an HF model calls its loss;
    3. the first name containing ``loss`` (``train_loss``, ``val_loss``);
    4. ``ce`` — a run that logs only its cross-entropy back-propagates that;
    5. the first other loss-like name (:func:`is_loss_like`: ``nll``, ``train/xent``, ``ppl``),
       never a held-out ``ce@N`` (:data:`HELD_OUT`).

    ``None`` when the run logs none of these.

    Why the back-propagated loss, and not the cross-entropy first: it is the number the
    optimizer minimises, the one a failed run's ``non-finite loss`` and the spike detector
    (:mod:`hooks.store.spikes`) are about, and the one the store keeps as
    :attr:`hooks.store.rows.RunInfo.last_loss`. For a dense minillm ``total`` equals ``ce``
    (``aux`` is 0); for a MoE model it adds the load-balancing loss, and ``mdb compare`` shows
    the ``ce`` besides it.
    """
    names = list(names)
    for key in ("total", "loss"):
        if key in names:
            return key
    named = next((n for n in names if "loss" in n), None)
    if named is not None:
        return named
    if "ce" in names:
        return "ce"
    return next((n for n in names if is_loss_like(n) and not HELD_OUT.match(n)), None)


@dataclass(frozen=True)
class RunNumbers:
    """The numbers every view shows about a stored run (:func:`stored_numbers`).

    Attributes:
        loss_metric: The metric that is the run's loss (:func:`loss_metric`), ``None``
            without one.
        loss: Its latest value (``None``: NaN, or not logged).
        steps_per_s: End-to-end steps per second (:class:`hooks.store.rates.StepRate`),
            ``None`` before two steps (or one step without ``step_time``).
        eta_s: Seconds until ``total_steps`` at that pace
            (:func:`hooks.store.rates.eta_seconds`); ``None`` without a step target or a pace.
        rank_times: A distributed run's ranks: per rank, the median (step time, compute time)
            of its last :data:`hooks.store.rank_stats.TIME_WINDOW` steps, in seconds (``None``:
            not measured).
        straggler_basis: ``"compute"``, ``"step"`` or ``None``
            (:func:`hooks.store.rank_stats.straggler_basis`).
        stragglers: ``(rank, its time, the median of the ranks)`` of each straggler, slowest
            first (:func:`hooks.store.rank_stats.slow_ranks`).
    """

    loss_metric: str | None = None
    loss: float | None = None
    steps_per_s: float | None = None
    eta_s: float | None = None
    rank_times: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)
    straggler_basis: str | None = None
    stragglers: list[tuple[int, float, float]] = field(default_factory=list)


def _recent_walls(conn: sqlite3.Connection, run_id: int) -> list[float]:
    """The walls of the run's last ``RATE_WINDOW + 1`` steps, in step order."""
    rows = conn.execute("SELECT wall FROM metrics WHERE run_id = ? ORDER BY step DESC LIMIT ?",
                        (run_id, RATE_WINDOW + 1)).fetchall()
    return [float(r[0]) for r in reversed(rows) if isinstance(r[0], (int, float))]


def _recent_rank_times(conn: sqlite3.Connection, run_id: int, ranks: Iterable[int],
                       column: str) -> dict[int, list[float]]:
    """Per rank, its last :data:`~hooks.store.rank_stats.TIME_WINDOW` measured ``column``
    (``step_time`` or ``compute_time``) values."""
    out: dict[int, list[float]] = {}
    for rank in ranks:
        rows = conn.execute(
            f"SELECT {column} FROM rank_steps WHERE run_id = ? AND rank = ? AND {column} IS NOT"
            " NULL ORDER BY step DESC LIMIT ?", (run_id, rank, rank_stats.TIME_WINDOW),
        ).fetchall()
        values = [float(r[0]) for r in rows if rank_stats.finite(r[0])]
        if values:
            out[rank] = values
    return out


def stored_numbers(conn: sqlite3.Connection, run: Any, names: Iterable[str],
                   latest: Mapping[str, tuple[int, float | None]],
                   ranks: Iterable[Any] = ()) -> RunNumbers:
    """The numbers of a stored run (:class:`RunNumbers`), as the live views compute them from
    its rows, read in a few indexed queries.

    Args:
        conn: A connection to the run store (a read transaction around the call gives one
            snapshot).
        run: The run's :class:`hooks.store.rows.RunInfo` (``id``, ``total_steps``,
            ``last_step``, ``world_size``).
        names: The metrics it logged, in first-logged order.
        latest: Each metric's ``(step, value)`` at the last step it was logged
            (:attr:`hooks.store.summary.RunSummary.latest`).
        ranks: A distributed run's :class:`hooks.store.rows.RankInfo` rows.

    Raises:
        sqlite3.DatabaseError: The file cannot be read there.
    """
    key = loss_metric(names)
    loss = latest[key][1] if key is not None and key in latest else None
    rate = StepRate()
    for wall in _recent_walls(conn, run.id):
        rate.add(wall)
    step_time = latest.get("step_time", (0, None))[1]
    spp = rate.seconds_per_step(step_time)
    numbers: dict[str, Any] = {
        "loss_metric": key, "loss": loss, "steps_per_s": rate.steps_per_s(step_time),
        "eta_s": eta_seconds(run.total_steps, run.last_step, spp)}
    if run.world_size:
        states = {r.rank: r.state for r in ranks}
        every = range(int(run.world_size))
        times = rank_stats.median_times(_recent_rank_times(conn, run.id, every, "step_time"),
                                        _recent_rank_times(conn, run.id, every, "compute_time"))
        awaited = rank_stats.awaited(run.world_size, states)
        numbers.update(rank_times=times, straggler_basis=rank_stats.straggler_basis(
            times, awaited), stragglers=rank_stats.slow_ranks(times, awaited))
    return RunNumbers(**numbers)
