"""What the live screen plots, kept small: bounded series and the run's latest numbers.

Pure Python (no Textual, no torch), so the live screen's bookkeeping is testable on its own and
costs the same at step 100 as at step 100,000:

* :class:`Downsampler` keeps at most ``capacity`` buckets of a series; when full, neighbouring
  buckets are merged pairwise and the bucket width doubles (the scheme of an "online
  decimation" buffer). Appending is amortised O(1), reading is O(capacity), memory is bounded.
* :class:`RunSeries` feeds every :class:`hooks.store.store.MetricRow` of a run into one downsampler
  per metric the run logs — whatever their names: ``ce``/``aux``/``total`` of ``mdb overfit``,
  ``loss`` of a user's model, ``val_loss`` or ``acc`` of a user's own loop — keeps each
  metric's last, min and max, per MoE layer per expert the tokens routed to it, and the numbers
  the header shows (throughput, ETA, last sample). :func:`hooks.store.numbers.is_loss_like`
  decides which metrics are charted together as losses (a run may declare them instead).

Every number shown about a run — which metric is "the loss", steps/s, the ETA — is defined in
:mod:`hooks.store.numbers` (with :mod:`hooks.store.rates`) and only fed here, so ``mdb runs``,
``mdb compare`` and the live screen agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hooks.store.numbers import is_loss_like, loss_metric
from hooks.store.rates import StepRate, eta_seconds
from hooks.text import printable

#: Buckets kept per series: about two points per column of a full-width chart.
DEFAULT_CAPACITY = 256
#: A run of at least this many steps is first read as its history bucketed by the store
#: (:meth:`hooks.store.store.RunStore.history`: min/max/mean per bucket, so spikes stay
#: visible), not from all its rows (:func:`first_read`); shorter ones are read whole.
HISTORY_AFTER_STEPS = 4096
#: The fixed metric columns of a run store without ``MetricRow.values`` (and what an
#: ``mdb overfit`` run of minillm logs), in logging order.
FIXED_METRICS = ("ce", "aux", "total", "grad_norm", "lr", "step_time", "tokens_per_s",
                 "steps_per_s")
#: Metrics the rate row shows already (not repeated in the table).
THROUGHPUT_METRICS = ("step_time", "tokens_per_s", "steps_per_s")


def display_name(name: str) -> str:
    """A metric or run name as one printable line (:func:`hooks.text.printable`: control
    characters escaped, ``a\\nb``), ``""`` for an empty name (``hooks.run`` takes any
    keyword)."""
    return printable(name) if name else '""'


def metric_values(row: Any, names: Sequence[str] | None = None) -> dict[str, float | None]:
    """Every metric of one stored step by name (``None`` = NaN or not measured).

    A row with ``values`` (a store that keeps any metric by name) gives exactly those; a row
    with only the fixed columns gives ``names`` (what the run's config says it logged; default
    :data:`FIXED_METRICS`), with ``loss`` read from the ``total`` column.
    """
    values = getattr(row, "values", None)
    if isinstance(values, Mapping):
        return dict(values)
    out: dict[str, float | None] = {}
    for name in names or FIXED_METRICS:
        attr = "total" if name == "loss" else name
        if hasattr(row, attr):
            out[name] = getattr(row, attr)
    return out


@dataclass
class MetricStats:
    """Last, min and max of one metric over the steps seen.

    Attributes:
        last: The latest value (``None`` = NaN; ``±inf`` kept).
        min: The smallest finite value (``None`` before one).
        max: The largest finite value.
        last_step: Step of ``last``.
        nonfinite: How many values were NaN or ±inf.
    """

    last: float | None = None
    min: float | None = None
    max: float | None = None
    last_step: int = 0
    nonfinite: int = 0

    def add(self, step: int, value: float | None) -> None:
        """Record ``value`` at ``step``."""
        self.last, self.last_step = value, step
        if value is None or not math.isfinite(value):
            self.nonfinite += 1
            return
        self.min = value if self.min is None else min(self.min, value)
        self.max = value if self.max is None else max(self.max, value)


def _first_step(history: Any, end: int) -> int | None:
    """The first step of the store's bucket that ends at ``end`` (buckets of
    ``history.width`` steps from ``history.first``), never after ``end``."""
    if history.first is None:
        return None
    width = max(1, int(history.width or 1))
    return min(end, history.first + (end - history.first) // width * width)


class Downsampler:
    """A series of (step, value) points reduced to at most ``capacity`` buckets, each with the
    mean, min and max of its points.

    Each bucket covers ``width`` consecutive appended points and reports the step of its last
    point, the mean of its values, and their min and max — a chart draws the min-max range, so
    a spike is as tall in a bucket of a thousand steps as it was (never every n-th point). The
    last bucket may be partial (it always shows the latest point's step). Non-finite values
    are skipped (a NaN loss is reported elsewhere). :meth:`ranges` starts with the first
    point itself, so a chart starts at the first step (1), not at the first bucket's last.

    Args:
        capacity: Maximum number of buckets (even, ≥ 4).

    Raises:
        ValueError: ``capacity`` is odd or < 4.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 4 or capacity % 2:
            raise ValueError(f"capacity must be even and >= 4, got {capacity}")
        self.capacity = capacity
        self.clear()

    def append(self, step: float, value: float | None) -> None:
        """Add one point; ``None``, NaN and ±inf are ignored."""
        if value is None or not math.isfinite(value):
            return
        self.count += 1
        self.last = value
        if self.first is None:
            self.first = (step, value)
        if self._counts and self._counts[-1] < self.width:
            self._xs[-1] = step
            self._sums[-1] += value
            self._counts[-1] += 1
            if value < self._lows[-1]:
                self._lows[-1] = value
            if value > self._highs[-1]:
                self._highs[-1] = value
            return
        if len(self._counts) == self.capacity:
            self._halve()
        self._xs.append(step)
        self._sums.append(value)
        self._counts.append(1)
        self._lows.append(value)
        self._highs.append(value)

    def load(self, steps: Sequence[float], counts: Sequence[int], sums: Sequence[float],
             lows: Sequence[float | None], highs: Sequence[float | None],
             first: float | None = None) -> None:
        """Replace the points with buckets aggregated elsewhere (a run's history bucketed by
        the store, :func:`hooks.store.summary.history`): per bucket the step of its last
        point, how many finite points, their sum, min and max. Buckets without a finite point
        are skipped; more than ``capacity`` are merged pairwise. Points appended later go into
        buckets as wide as the widest loaded one. ``first``: the first step the buckets cover
        (their first point's value is not known: :meth:`ranges` starts with the first bucket's
        mean and range there)."""
        self.clear()
        if first is not None:
            self.first = (first, None)
        for x, c, t, lo, hi in zip(steps, counts, sums, lows, highs, strict=True):
            if c <= 0 or lo is None or hi is None:
                continue
            self._xs.append(x)
            self._counts.append(int(c))
            self._sums.append(float(t))
            self._lows.append(float(lo))
            self._highs.append(float(hi))
            self.count += int(c)
        while len(self._counts) > self.capacity:
            self._halve()
        self.width = max(self.width, max(self._counts, default=1))

    def prepend(self, older: Downsampler) -> None:
        """Put the buckets of ``older`` (points of earlier steps, read after this one was
        started) before this one's; more than ``capacity`` are merged pairwise."""
        self._xs = older._xs + self._xs
        self._sums = older._sums + self._sums
        self._counts = older._counts + self._counts
        self._lows = older._lows + self._lows
        self._highs = older._highs + self._highs
        self.count += older.count
        self.first = older.first if older.first is not None else self.first
        self.width = max(self.width, older.width)
        while len(self._counts) > self.capacity:
            self._halve()

    def _halve(self) -> None:
        n = len(self._counts)
        xs, sums, counts, lows, highs = [], [], [], [], []
        for i in range(0, n, 2):
            j = min(n, i + 2)
            xs.append(self._xs[j - 1])
            sums.append(sum(self._sums[i:j]))
            counts.append(sum(self._counts[i:j]))
            lows.append(min(self._lows[i:j]))
            highs.append(max(self._highs[i:j]))
        self._xs, self._sums, self._counts = xs, sums, counts
        self._lows, self._highs = lows, highs
        self.width *= 2

    def points(self, max_points: int | None = None) -> tuple[list[float], list[float]]:
        """``(steps, means)``, one pair per bucket, in step order.

        Args:
            max_points: At most this many points: groups of ``g`` consecutive buckets are
                merged (step of the group's last point, mean of its points), ``g`` the
                smallest that fits. A chart passes its horizontal resolution.
        """
        xs, ys, _lo, _hi = self.ranges(max_points)
        return xs, ys

    def ranges(self, max_points: int | None = None
               ) -> tuple[list[float], list[float], list[float], list[float]]:
        """``(steps, means, mins, maxs)``, one of each per bucket, in step order, grouped as
        :meth:`points` groups them (a group's min and max are those of all its points). When
        the first bucket (or group of them) holds more than the first point, it comes first on its
        own (its step and value; for loaded buckets, the first step with the first bucket's
        mean and range), so a chart starts at the first step; at most ``max_points`` in all."""
        xs, ys, lows, highs = self._grouped(max_points)
        if self.first is None or not xs or xs[0] <= self.first[0]:
            return xs, ys, lows, highs
        if max_points is not None:
            if max_points < 2:
                return xs, ys, lows, highs  # one point: the mean of every point
            if len(xs) >= max_points:  # room for the first point
                xs, ys, lows, highs = self._grouped(max_points - 1)
        step, value = self.first
        mean, lo, hi = (ys[0], lows[0], highs[0]) if value is None else (value,) * 3
        return [step, *xs], [mean, *ys], [lo, *lows], [hi, *highs]

    def _grouped(self, max_points: int | None
                 ) -> tuple[list[float], list[float], list[float], list[float]]:
        n = len(self._counts)
        if max_points is None or n <= max_points:
            return (list(self._xs), [s / c for s, c in zip(self._sums, self._counts, strict=True)],
                    list(self._lows), list(self._highs))
        g = -(-n // max(1, max_points))
        xs, ys, lows, highs = [], [], [], []
        for i in range(0, n, g):
            j = min(n, i + g)
            xs.append(self._xs[j - 1])
            ys.append(sum(self._sums[i:j]) / sum(self._counts[i:j]))
            lows.append(min(self._lows[i:j]))
            highs.append(max(self._highs[i:j]))
        return xs, ys, lows, highs

    def __len__(self) -> int:
        return len(self._counts)

    def clear(self) -> None:
        """Forget every point."""
        self.width = 1  # points per full bucket
        self._xs: list[float] = []  # step of each bucket's last point
        self._sums: list[float] = []
        self._counts: list[int] = []
        self._lows: list[float] = []
        self._highs: list[float] = []
        self.count = 0  # finite points appended
        self.last: float | None = None
        #: ``(step, value)`` of the first finite point; value ``None`` for loaded buckets
        self.first: tuple[float, float | None] | None = None


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
        names: The metrics the run logs, for rows without ``values`` (its config's
            ``metrics``); ``None``: :data:`FIXED_METRICS`.
        loss_names: The run's own list of its losses (config ``loss_metrics``); ``None``:
            decided by :func:`is_loss_like`.

    Attributes:
        names: Every metric seen, in first-logged order.
        series: Per metric, a :class:`Downsampler` of its finite values per step.
        stats: Per metric, its :class:`MetricStats`.
        experts: Per MoE layer, per expert, a :class:`Downsampler` of the tokens routed to that
            expert at each step (fraction × N·k, N = tokens per step), shape (L_moe, E).
        last: The latest :class:`hooks.store.store.MetricRow` (``None`` before the first).
        first_step: Step of the first row seen (a resumed run does not start at 1).
        sample: The latest :class:`Sample`.
        spikes: The run's loss spikes (:class:`hooks.store.spikes.Spike`, as its writer
            recorded them) by first step.
    """

    def __init__(self, total_steps: int | None = None, *, text: str = "", top_k: int = 1,
                 capacity: int = DEFAULT_CAPACITY, names: Sequence[str] | None = None,
                 loss_names: Sequence[str] | None = None) -> None:
        self.total_steps = total_steps
        self.text = text
        self.top_k = max(1, int(top_k))
        self.capacity = capacity
        self.declared = list(names) if names else None
        self.declared_loss = list(loss_names) if loss_names is not None else None
        self.names: list[str] = []
        self.series: dict[str, Downsampler] = {}
        self.stats: dict[str, MetricStats] = {}
        self.experts: list[list[Downsampler]] = []
        self.last: Any = None
        self.first_step: int | None = None
        self.sample: Sample | None = None
        self.spikes: dict[int, Any] = {}
        self.rows = 0
        self._rate = StepRate()
        self._tokens_per_step: float | None = None
        self._empty = Downsampler(capacity)

    # -- feeding --------------------------------------------------------------------------------
    def add(self, row: Any) -> None:
        """Add one :class:`hooks.store.store.MetricRow` (steps must arrive in increasing order)."""
        step = row.step
        if self.first_step is None:
            self.first_step = step
        self.rows += 1
        self.last = row
        values = metric_values(row, self.declared)
        for name, value in values.items():
            sampler = self.series.get(name)
            if sampler is None:
                sampler = self.series[name] = Downsampler(self.capacity)
                self.stats[name] = MetricStats()
                self.names.append(name)
            sampler.append(step, value)
            self.stats[name].add(step, value)
        self._add_detail(row, values)

    def _add_detail(self, row: Any, values: Mapping[str, float | None]) -> None:
        """What a row adds besides its metrics' series: the latest row, the step rate, the
        tokens per step, the expert load."""
        self.last = row
        self._rate.add(row.wall)
        tps, st = values.get("tokens_per_s"), values.get("step_time")
        if tps and st:
            self._tokens_per_step = tps * st
        load = getattr(row, "expert_load", None)
        if load:
            if len(self.experts) != len(load):
                self.experts = [
                    [Downsampler(self.capacity) for _ in layer] for layer in load
                ]
            slots = (self._tokens_per_step or 0.0) * self.top_k
            for samplers, fractions in zip(self.experts, load, strict=False):
                for sampler, frac in zip(samplers, fractions, strict=False):
                    sampler.append(row.step, frac * slots if slots else frac)

    def load_history(self, history: Any, recent: Sequence[Any]) -> None:
        """Start from a run's history bucketed by the store (a
        :class:`hooks.store.summary.History`: per metric, per bucket of steps, the step of its
        last value, counts, sum, min and max) and the metric rows of its last steps
        (``recent``, which the buckets hold already: they give the latest row, the step rate
        and the expert load). Later rows are :meth:`add` ed as usual."""
        latest = getattr(history, "latest", None) or {}
        for name, b in history.metrics.items():
            sampler = self.series.get(name)
            if sampler is None:
                sampler = self.series[name] = Downsampler(self.capacity)
                self.names.append(name)
            sampler.load(b.steps, b.n, b.total, b.lo, b.hi,
                         first=_first_step(history, b.steps[0]) if b.steps else None)
            lows = [v for v in b.lo if v is not None]
            highs = [v for v in b.hi if v is not None]
            step, value = latest.get(name, (b.steps[-1] if b.steps else 0, sampler.last))
            self.stats[name] = MetricStats(last=value, min=min(lows, default=None),
                                           max=max(highs, default=None), last_step=step,
                                           nonfinite=sum(b.count) - sum(b.n))
        self.first_step = history.first
        self.rows = max((sum(b.count) for b in history.metrics.values()), default=0)
        for row in recent:
            self._add_detail(row, metric_values(row, self.declared))

    def expert_samplers(self, loads: Sequence[tuple[int, Sequence[Sequence[float]]]],
                        slots: float | None) -> list[list[Downsampler]]:
        """Per MoE layer, per expert, a :class:`Downsampler` of ``loads`` (``(step, (L_moe, E)
        fractions)``, in step order), each fraction times ``slots`` (tokens routed per step,
        N·k) when given: the expert-load history a first frame left out
        (:meth:`prepend_experts`)."""
        out: list[list[Downsampler]] = []
        for step, load in loads:
            if len(out) != len(load):
                if out:
                    continue  # a row of another shape (a changed model): not mixed in
                out = [[Downsampler(self.capacity) for _ in layer] for layer in load]
            for samplers, fractions in zip(out, load, strict=False):
                for sampler, frac in zip(samplers, fractions, strict=False):
                    sampler.append(step, frac * slots if slots else frac)
        return out

    def prepend_experts(self, older: list[list[Downsampler]]) -> None:
        """Put the expert-load history of earlier steps (:meth:`expert_samplers`) before what
        the series has (its last steps): the detail a first frame from the store's bucketed
        history leaves out."""
        if not self.experts:
            self.experts = older
            return
        if [len(x) for x in older] != [len(x) for x in self.experts]:
            return
        for mine, theirs in zip(self.experts, older, strict=True):
            for sampler, before in zip(mine, theirs, strict=True):
                sampler.prepend(before)

    def metric(self, name: str) -> Downsampler:
        """The :class:`Downsampler` of ``name`` (an empty one when the run does not log it)."""
        return self.series.get(name, self._empty)

    def value(self, name: str) -> float | None:
        """The latest value of ``name`` (``None``: NaN, or not logged)."""
        st = self.stats.get(name)
        return st.last if st is not None else None

    @property
    def ce(self) -> Downsampler:
        """Cross-entropy per step (``mdb overfit``'s ``ce``)."""
        return self.metric("ce")

    @property
    def aux(self) -> Downsampler:
        """The auxiliary (load-balancing) loss per step."""
        return self.metric("aux")

    @property
    def total(self) -> Downsampler:
        """The back-propagated loss per step (minillm's ``total``)."""
        return self.metric("total")

    @property
    def grad_norm(self) -> Downsampler:
        """The global gradient norm per step."""
        return self.metric("grad_norm")

    def loss_names(self) -> list[str]:
        """The metrics charted together as losses, in first-logged order: the run's declared
        ones, else those :func:`is_loss_like` accepts, else the first metric."""
        if self.declared_loss is not None:
            found = [n for n in self.names if n in self.declared_loss]
        else:
            found = [n for n in self.names if is_loss_like(n)]
        if not found and self.names and self.declared_loss is None:
            found = [n for n in self.names if n not in THROUGHPUT_METRICS][:1]
        return found

    @property
    def loss_name(self) -> str | None:
        """The metric that is the run's loss (:func:`hooks.store.numbers.loss_metric`, the
        same in every view), ``None`` when it logs none."""
        return loss_metric(self.names)

    def other_names(self) -> list[str]:
        """The metrics shown in the table: neither losses nor throughput (the rate row's)."""
        losses = set(self.loss_names())
        return [n for n in self.names if n not in losses and n not in THROUGHPUT_METRICS]

    def add_spike(self, spike: Any) -> None:
        """Record a loss spike (a new one, or a later state of one already seen: its peak and
        last step move while the episode lasts)."""
        self.spikes[spike.step] = spike

    def spike_steps(self, metric: str) -> list[int]:
        """The peak steps of the spikes of ``metric``, in step order."""
        return [sp.peak_step for _, sp in sorted(self.spikes.items()) if sp.metric == metric]

    def add_sample(self, step: int, prompt: str, text: str) -> None:
        """Record a greedy continuation generated at ``step``."""
        reference = self.text[len(prompt):] if self.text.startswith(prompt) else ""
        self.sample = Sample(step, prompt, text, matching_prefix(text, reference))

    def reset(self) -> None:
        """Forget everything (a watched run was resumed from an earlier checkpoint)."""
        self.__init__(self.total_steps, text=self.text, top_k=self.top_k,  # type: ignore[misc]
                      capacity=self.capacity, names=self.declared,
                      loss_names=self.declared_loss)

    # -- derived numbers ------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The latest step (0 before the first)."""
        return self.last.step if self.last is not None else 0

    @property
    def has_tokens(self) -> bool:
        """Whether the run says how many tokens a step trains on (``tokens_per_s``)."""
        return bool(self._tokens_per_step)

    @property
    def expert_units(self) -> str:
        """What the expert series count: ``"tokens"`` (routed slots) or ``"share"``."""
        return "tokens" if self._tokens_per_step else "share"

    @property
    def expert_slots(self) -> float:
        """Routed (token, expert) slots of a step: tokens per step × ``top_k``; 0 unknown."""
        return (self._tokens_per_step or 0.0) * self.top_k

    def seconds_per_step(self) -> float | None:
        """Median wall-clock spacing of the last steps, robust to a pause
        (:class:`hooks.store.rates.StepRate`, the one definition every view shows)."""
        return self._rate.seconds_per_step(self.value("step_time"))

    def steps_per_s(self) -> float | None:
        """End-to-end training steps per second (steps, sampling and recording;
        :meth:`hooks.store.rates.StepRate.steps_per_s`)."""
        return self._rate.steps_per_s(self.value("step_time"))

    def tokens_per_s(self) -> float | None:
        """Tokens trained on per second, end to end."""
        rate = self.steps_per_s()
        if rate is None or not self._tokens_per_step:
            return None
        return rate * self._tokens_per_step

    def eta(self) -> float | None:
        """Seconds until ``total_steps`` at the current rate (``None`` if unknown;
        :func:`hooks.store.rates.eta_seconds`)."""
        return eta_seconds(self.total_steps, self.step, self.seconds_per_step())


def first_read(store, run_id: int, cursor: int,
               capacity: int = DEFAULT_CAPACITY) -> tuple[Any, Any]:
    """A viewer's next read of a run: ``(store.poll(run_id, cursor), None)``, or on a first
    read (``cursor`` 0) of a run of :data:`HISTORY_AFTER_STEPS` steps or more ``(update,
    history)`` from :meth:`hooks.store.store.RunStore.history` (its metrics bucketed into at
    most ``capacity`` step ranges; ``update.metrics`` only its last steps), for
    :meth:`RunSeries.load_history`. A store-like object with ``poll`` only is polled."""
    if cursor == 0 and hasattr(store, "history"):
        update, history = store.history(run_id, capacity)
        if history.last is not None and history.last - history.first >= HISTORY_AFTER_STEPS:
            return update, history
    return store.poll(run_id, cursor), None


def run_declaration(run) -> dict[str, Any]:
    """What a stored run says about itself, for the live screen: the metrics it logs
    (``names``; for a store without ``MetricRow.values``), its losses (``loss_names``), the
    text it memorises, experts per token, and whether it has MoE layers.

    Only runs of ``mdb overfit`` declare anything (their config is mdb's own); a user's own
    loop (``hooks.run``) stores the user's config, so nothing is read from it. Runs written
    before the declaration existed are minillm runs: :data:`FIXED_METRICS`, losses ce/aux/total.
    """
    cfg = run.config if isinstance(run.config, Mapping) else {}
    out: dict[str, Any] = {"names": None, "loss_names": None, "text": "", "top_k": 1,
                           "moe": False}
    if getattr(run, "kind", "overfit") != "overfit":
        return out
    resolved = cfg.get("resolved_model_config") or cfg.get("model_config") or {}
    minillm = isinstance(resolved, Mapping) and bool(resolved)
    names, losses = cfg.get("metrics"), cfg.get("loss_metrics")
    if not isinstance(names, list) and minillm:
        names = list(FIXED_METRICS)
    if not isinstance(losses, list) and minillm:
        losses = ["ce", "aux", "total"]
    out["names"] = names if isinstance(names, list) else None
    out["loss_names"] = losses if isinstance(losses, list) else None
    out["text"] = cfg.get("text", "") if isinstance(cfg.get("text"), str) else ""
    top_k = cfg.get("top_k") or (resolved.get("num_experts_per_tok") if minillm else None)
    out["top_k"] = int(top_k or 1)
    moe = cfg.get("moe")
    out["moe"] = bool(moe) if moe is not None else (
        minillm and bool(resolved.get("num_local_experts", 0)))
    return out


def nonfinite_of(run) -> dict[str, Any] | None:
    """Where a stored run first logged a non-finite value: ``RunInfo.nonfinite`` where the store
    has it, else a failed run's ``fail_step``/``fail_module``; ``None`` if nothing was."""
    nf = getattr(run, "nonfinite", None)
    if isinstance(nf, Mapping) and nf.get("step") is not None:
        return dict(nf)
    if run.status == "failed" and run.fail_step is not None:
        return {"step": run.fail_step, "metric": None, "module": run.fail_module,
                "direction": None}
    return None
