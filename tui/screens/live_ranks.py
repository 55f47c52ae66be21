"""The ranks of a distributed run in ``mdb watch``: two lines on the live screen, ``k`` for all.

* :class:`RanksSummary` — two lines on the live screen of a run recorded from a ``torchrun``
  job (hidden for a single process): the band (min‥max over the ranks) of the loss and the
  gradient norm at the last step every rank has sent and the rank furthest from the median,
  the step and compute times with the stragglers named, and the first problem found (a rank
  that died or stopped reporting, a parameter that diverged, a gradient not all-reduced, the
  rank that first went non-finite). It reads the run store itself, in a thread worker every
  :attr:`RanksSummary.POLL_INTERVAL` seconds, on a connection of its own, and holds the
  :class:`tui.screens.live_ranks_data.RankSeries`.
* :class:`RanksScreen` — ``k``: every rank (host, pid, state, last step, loss, gradient norm,
  step and compute time), the loss and gradient-norm bands over the steps (max ▲, median ●,
  min ▼), the expert load of each rank per MoE layer, the non-finite finding, the findings
  and which checks ran. ``m`` charts another metric's band; ``q`` goes back.

Only numbers the ranks logged are shown; what was not measured says so (no compute time
without ``run.watch``; no parameter or gradient checks without a ``DistributedDataParallel``
model watched).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import work
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Footer, Static
from textual.worker import Worker, WorkerState

from hooks.text import printable
from tui.screens.base import MdbScreen, show
from tui.screens.live_chart import LineChart, Series
from tui.screens.live_ranks_data import (
    RankSeries,
    bar_string,
    hot_expert,
    rank_label,
    summarise_states,
)
from tui.store_handle import StoreHandle

#: Band lines: (label, style, marker) of the max, median and min over the ranks.
BAND = (("max", "red", "▲"), ("med", "cyan", "●"), ("min", "green", "▼"))
#: Findings listed on the ranks screen (the rest: ``mdb runs --json``).
MAX_FINDINGS_SHOWN = 5
#: Ranks listed in the table of the ranks screen.
MAX_RANKS_SHOWN = 8
#: Rows of one rank read per poll: a long job is read a page at a time (memory stays flat).
RANK_PAGE = 20_000


def _num(x: float | None) -> str:
    """A value in at most 7 characters: ``0.0412``, ``1.2e-05``, ``nan``, ``—`` (missing)."""
    if x is None:
        return "—"
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    text = f"{x:.4g}"
    return text if len(text) <= 7 else f"{x:.1e}"


def _short(x: float) -> str:
    """Three significant digits: ``0.0591``, ``12.3``, ``1.2e-05``."""
    text = f"{x:.3g}"
    return text.replace("e-0", "e-").replace("e+0", "e")


def _ms(x: float | None) -> str:
    """Seconds as milliseconds: ``12.3``, ``227`` (``—``: not measured)."""
    if x is None:
        return "—"
    ms = x * 1e3
    return f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _pct(rel: float | None) -> str:
    return "" if rel is None else f"{rel * 100:+.1f}%"


class RanksPolled(Message):
    """What :class:`RanksSummary`'s worker read: the run row, its ranks, their new rows, the
    findings after the last one seen, and the checks; ``more``: a rank's page of rows was
    full (:data:`RANK_PAGE`), so there are more to read at once."""

    def __init__(self, run: Any, ranks: list, rows: list, findings: list, checks: list,
                 more: bool = False) -> None:
        super().__init__()
        self.run, self.ranks, self.rows = run, ranks, rows
        self.findings, self.checks, self.more = findings, checks, more


class RanksSummary(Static):
    """Two lines about the ranks of a distributed run (hidden for a single process).

    Args:
        store_path: The run database.
        run: The :class:`hooks.store.store.RunInfo` watched.
    """

    #: Seconds between two reads of the run store.
    POLL_INTERVAL = 0.5
    #: Seconds between two looks at the screen's own reading of the run (:meth:`_follow_screen`).
    FOLLOW_INTERVAL = 0.1
    #: The screen states of a run that has ended (``LiveScreen.state`` in ``mdb watch``).
    ENDED = ("finished", "interrupted", "failed")

    def __init__(self, store_path: str | Path | None, run: Any, **kwargs: Any) -> None:
        super().__init__("", id="live-ranks", markup=False, **kwargs)
        self.store_path = Path(store_path) if store_path is not None else None
        self.run = run
        world = getattr(run, "world_size", None)  # None: one process (or a store before it)
        self.series = RankSeries(world or 1)
        self.polls = 0
        self._cursor: dict[int, int] = {}
        self._findings_after = 0
        self._store = StoreHandle(self.store_path) if self.store_path is not None else None
        #: Shown: a torchrun job (known at start, or from the first read of its ranks).
        self.shown = bool(world) and self.store_path is not None
        show(self, self.shown)
        #: The screen says the run ended while this widget's last read had it running: the
        #: line says it is reading the ranks' final state until the next read lands.
        self.catching_up = False
        self._next_poll: Any = None

    def _poll_in(self, delay: float) -> None:
        """The next read in ``delay`` s: one timer at a time, whatever asked for a read."""
        if self._next_poll is not None:
            self._next_poll.stop()
        self._next_poll = self.set_timer(delay, self._poll)

    def on_mount(self) -> None:
        self.set_interval(self.FOLLOW_INTERVAL, self._follow_screen)
        if self.shown:
            self._poll()
        elif self.store_path is not None and getattr(self.run, "status", "") == "running":
            self.set_timer(2.0, self._look)  # a row read before its world size was written

    @work(thread=True, exclusive=True, exit_on_error=False, group="ranks-poll",
          description="see whether the run is a torchrun job")
    def _look(self) -> None:
        with self._store.use() as store:
            if store is None:  # unmounted
                return
            run = store.run(self.run.id)
        if run.world_size:
            self.post_message(RanksPolled(run, [], [], [], []))
        elif run.status == "running":
            self.app.call_from_thread(self.set_timer, 2.0, self._look)

    def _follow_screen(self) -> None:
        """Read the ranks again at once when the screen's status line has the run ended and
        this widget's last read had it running: the two reads are apart by up to a poll, and
        "✓ finished 300/300" must not sit beside a ranks line of step 290 with a rank running."""
        shown = getattr(self.screen, "state", None)
        if (not self.shown or self._store is None or shown not in self.ENDED
                or getattr(self.run, "status", None) != "running"):
            return
        if not self.catching_up:
            self.catching_up = True
            self.update(self.summary())
        self._poll()

    def on_unmount(self) -> None:
        if self._store is not None:
            self._store.close()  # waits for a poll in progress (tui.store_handle)

    @work(thread=True, exclusive=True, exit_on_error=False, group="ranks-poll",
          description="read the ranks of the run")
    def _poll(self) -> None:
        rid = self.run.id
        with self._store.use() as store:
            if store is None:  # unmounted
                return
            run = store.run(rid)
            ranks = store.ranks(rid)
            rows, full = [], False
            for r in range(run.world_size or 1):  # a page per rank: memory stays flat
                page = store.rank_steps(rid, after_step=self._cursor.get(r, 0), rank=r,
                                        limit=RANK_PAGE)
                full |= len(page) == RANK_PAGE
                rows += page
            findings = store.findings(rid, after_id=self._findings_after)
            checks = store.checks(rid)
        self.post_message(RanksPolled(run, ranks, rows, findings, checks, full))

    def on_ranks_polled(self, message: RanksPolled) -> None:
        message.stop()
        if not self.shown:  # it turned out to be a torchrun job
            self.shown = True
            show(self, True)
            self.run = message.run
            self.series = RankSeries(message.run.world_size)
            self._poll()
            return
        self.polls += 1
        s = self.series
        self.run = message.run
        if message.run.world_size and message.run.world_size != s.world_size:
            s.world_size = message.run.world_size
        rows = sorted(message.rows, key=lambda r: (r.step, r.rank))
        for row in rows:
            self._cursor[row.rank] = max(self._cursor.get(row.rank, 0), row.step)
        s.add_all(rows)
        s.set_ranks(message.ranks)
        if message.findings:
            s.findings += message.findings
            self._findings_after = message.findings[-1].id
        s.checks = message.checks
        self.catching_up = message.run.status == "running" and self.catching_up
        self.update(self.summary())
        ended = message.run.status != "running"
        if message.more:  # a long run read a page at a time: the next page at once
            self._poll_in(0.01)
            return
        self._poll_in(self.POLL_INTERVAL * (4 if ended else 1))

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group == "ranks-poll" and event.state == WorkerState.ERROR:
            exc = event.worker.error
            self.update(Text(f"ranks: cannot read {self.store_path}: "
                             f"{type(exc).__name__}: {exc}"[:200], style="red"))
            self._store.reset()  # reopened at the next poll
            self._poll_in(2.0)

    # -- the two lines ---------------------------------------------------------------------------
    def summary(self) -> Text:
        """The two lines (also what a test reads)."""
        s = self.series
        text = Text(no_wrap=True, overflow="ellipsis")
        n = s.world_size
        text.append(f"{n} ranks", style="bold")
        if self.catching_up:  # the screen has the run ended: no step nor state of before
            text.append(" · reading their final state…", style="dim")
            text.append("\n")
            return text
        states = {r.state for r in s.ranks.values()}
        if s.ranks and states != {"running"}:
            bad = states & {"dead", "silent", "failed", "absent"}
            text.append(f" ({summarise_states(s.ranks)})", style="bold red" if bad else "dim")
        if not s.step:
            text.append(" · waiting for the first gathered step · k: ranks", style="dim")
        else:
            text.append(f" · @{s.step}")
            for name, label in ((s.loss_name(), None), (s.grad_name(), "|g|")):
                if name is None:
                    continue
                band = [v.get(name) for v in s.values.values()]
                xs = [x for x in band if x is not None and math.isfinite(x)]
                if not xs:
                    text.append(f" · {label or name} nan", style="red")
                    continue
                text.append(f" · {label or name} {_short(min(xs))}‥{_short(max(xs))}")
                far = s.furthest(name)
                if far is not None and far[1] != far[2] and not s.tied_with(name, far[0]):
                    text.append(f" r{far[0]}↕", style="bold")
            text.append(" · k", style="dim")
        text.append("\n")
        text.append_text(self.second_line())
        return text

    def second_line(self) -> Text:
        """Times and stragglers, or the first problem."""
        s = self.series
        line = Text(no_wrap=True, overflow="ellipsis")
        problems = [f for f in s.findings if f.kind in ("rank_dead", "rank_silent",
                                                         "rank_failed")]
        problems += [f for f in s.findings if f not in problems]
        nf = getattr(self.run, "nonfinite", None)
        if problems:
            f = problems[0]
            line.append("✗ " + f.line, style="bold red")
            if len(s.findings) > 1:
                line.append(f" (+{len(s.findings) - 1} more, k)", style="red")
            return line
        if nf and nf.get("rank") is not None:
            where = f" in {nf['module']}" if nf.get("module") else ""
            line.append(f"⚠ rank {nf['rank']} first went non-finite: {nf.get('metric')} at "
                        f"step {nf['step']}{where}", style="bold red")
            return line
        times = s.times()
        basis = s.straggler_basis()
        if times:
            st = [t[0] for t in times.values() if t[0] is not None]
            ct = [t[1] for t in times.values() if t[1] is not None]
            if st:
                line.append(f"step {_ms(min(st))}‥{_ms(max(st))} ms")
            if ct:
                line.append(f" · compute {_ms(min(ct))}‥{_ms(max(ct))} ms")
            slow = s.stragglers()
            if slow:
                r, x, med = slow[0]
                line.append(f" · straggler rank {r} (+{(x / med - 1) * 100:.0f}% "
                            f"{basis} time)", style="bold yellow")
            elif basis:
                line.append(" · no straggler", style="dim")
        summary, skipped = s.checks_summary(), s.checks_not_compared()
        if summary:
            n = sum(v[0] for v in summary.values())
            line.append(f" · {n} checks ✓", style="green")
        if skipped:  # the why, in full, on the k screen
            line.append(" · not compared: no replicas", style="yellow")
        return line


class RanksScreen(MdbScreen):
    """Every rank of a distributed run (``k`` on the live screen of ``mdb watch``).

    Args:
        summary: The live screen's :class:`RanksSummary` (its series is read, not copied).
    """

    BINDINGS = [
        Binding("m", "next_metric", "band: next metric", id="ranks.metric"),
        Binding("q", "quit_view", "back", id="ranks.back"),
    ]

    def __init__(self, summary: RanksSummary) -> None:
        super().__init__()
        self.summary = summary
        self._metric: str | None = None
        self.redraws = 0

    def compose(self):
        yield Static("", id="title", markup=False)
        yield Static("", id="ranks-table", markup=False)
        with Horizontal(id="ranks-charts"):
            yield LineChart("", id="ranks-loss", mark_every=10)
            yield LineChart("", id="ranks-grad", mark_every=10)
        yield Static("", id="ranks-times", markup=False)
        yield Static("", id="ranks-experts", markup=False)
        yield Static("", id="ranks-findings", markup=False)
        yield Static("", id="hint", markup=False)
        yield Footer()

    def on_mount(self) -> None:  # (MdbScreen's own on_mount runs too: Textual calls both)
        self.redraw()
        self.set_interval(0.5, self.redraw)
        self.hint("m: band of another metric · q: back to the live screen")

    def action_quit_view(self) -> None:
        self.app.pop_screen()

    def action_next_metric(self) -> None:
        names = self.summary.series.names
        if not names:
            self.hint("no metrics gathered yet")
            return
        cur = self._left()
        self._metric = names[(names.index(cur) + 1) % len(names)] if cur in names else names[0]
        self.hint(f"band: {self._metric} · m: next")
        self.redraw()

    def _left(self) -> str | None:
        s = self.summary.series
        if self._metric in s.names:
            return self._metric
        return s.loss_name() or (s.names[0] if s.names else None)

    # -- drawing ---------------------------------------------------------------------------------
    def redraw(self) -> None:
        """Redraw everything from the summary's series."""
        if not self.is_current:
            return
        self.redraws += 1
        s, run = self.summary.series, self.summary.run
        every = (run.config or {}).get("gather_every") if isinstance(run.config, dict) else None
        gathered = f" · gathered every {every}" if every else ""
        self.query_one("#title", Static).update(
            f"ranks · run {run.name} · {s.world_size} ranks{gathered} · complete to step "
            f"{s.step}")
        self.query_one("#ranks-table", Static).update(self.table_text())
        left, grad = self._left(), s.grad_name()
        self._band(self.query_one("#ranks-loss", LineChart), left)
        right = grad if grad != left else None
        self._band(self.query_one("#ranks-grad", LineChart), right)
        self.query_one("#ranks-times", Static).update(self.times_text())
        experts = self.experts_text()
        box = self.query_one("#ranks-experts", Static)
        box.display = experts is not None
        if experts is not None:
            box.update(experts)
        self.query_one("#ranks-findings", Static).update(self.findings_text())

    def _band(self, chart: LineChart, name: str | None) -> None:
        s = self.summary.series
        band = s.band(name) if name else None
        if band is None:
            chart.plot([], title="no band: no metric gathered yet" if name else "")
            return
        n = chart.resolution
        series = [Series(label, *sampler.points(n), style, marker)
                  for (label, style, marker), sampler in zip(BAND, (band[2], band[1], band[0]),
                                                             strict=True)]
        chart.plot(series, title=name[:12])

    def table_text(self) -> Text:
        s = self.summary.series
        loss, grad = self._left(), s.grad_name()
        times = s.times()
        slow = {r for r, *_ in s.stragglers()}
        far = {}
        for name in (loss, grad):
            f = s.furthest(name) if name else None
            if f is not None and f[1] != f[2] and not s.tied_with(name, f[0]):
                far[name] = f[0]
        t = Text(no_wrap=True, overflow="ellipsis")
        glabel = "|g|" if grad in (None, "grad_norm") else grad
        head = (f"{'rank':>4} {'host':<8} {'pid':>7} {'state':<9} {'step':>6} "
                f"{(loss or 'loss')[:8]:>8} {glabel[:8]:>8} {'step ms':>8} "
                f"{'comp ms':>8}")
        t.append(head, style="dim")
        ranks = sorted(set(range(s.world_size)) | set(s.ranks))
        for r in ranks[:MAX_RANKS_SHOWN]:
            info = s.ranks.get(r)
            vals = s.values.get(r)
            if vals is None:  # not at the complete step (it died before it): its last one
                vals = s.latest.get(r, (0, {}))[1]
            st, ct = times.get(r, (None, None))
            state = info.state if info else "?"
            style = {"dead": "bold red", "silent": "bold red", "failed": "bold red",
                     "absent": "yellow"}.get(state, "")
            t.append("\n")
            t.append(f"{r:>4} {((info.host if info else '') or '')[:8]:<8} "
                     f"{(info.pid if info and info.pid is not None else ''):>7} ")
            t.append(f"{state:<9}", style=style)
            t.append(f" {s.last_step.get(r, 0):>6} ")
            for name in (loss, grad):
                v = vals.get(name) if name else None
                bad = name in vals and (v is None or not math.isfinite(v))
                t.append(f"{_num(v) if not bad else 'nan':>8}",
                         style="bold red" if bad else ("bold" if far.get(name) == r else ""))
                t.append(" ")
            t.append(f"{_ms(st):>8} {_ms(ct):>8}")
            if r in slow:
                t.append(" ◀ straggler", style="bold yellow")
            elif r in far.values():
                t.append(" ◀ furthest", style="dim")
        if len(ranks) > MAX_RANKS_SHOWN:
            t.append(f"\n     +{len(ranks) - MAX_RANKS_SHOWN} more ranks (mdb runs --json)",
                     style="dim")
        return t

    def times_text(self) -> Text:
        s = self.summary.series
        t = Text(no_wrap=True, overflow="ellipsis")
        loss = self._left()
        f = s.furthest(loss) if loss else None
        if f is not None:
            ties = s.tied_with(loss, f[0])
            tied = f"; tied: {', '.join(f'rank {r}' for r in ties)}" if ties else ""
            t.append(f"{loss}: median {_num(f[2])} · furthest rank {f[0]}: {_num(f[1])} "
                     f"({_pct(f[3])}{tied})")
        elif loss:
            t.append(f"{loss}: fewer than two ranks with a finite value at step {s.step}",
                     style="dim")
        basis = s.straggler_basis()
        slow = s.stragglers()
        t.append("\n")
        if len(s.awaited()) < 2:
            t.append("stragglers: fewer than two ranks still reporting", style="dim")
        elif basis is None:
            t.append("stragglers: no step times yet", style="dim")
        elif slow:
            names = ", ".join(f"rank {r} (+{(x / med - 1) * 100:.0f}%)" for r, x, med in slow)
            t.append(f"straggler(s) by {basis} time: {names}", style="bold yellow")
        else:
            t.append(f"no straggler by {basis} time (none > 10% above the median)",
                     style="dim")
        if basis == "step":
            t.append(" · compute time not measured (run.watch(model) measures it)",
                     style="dim")
        return t

    def experts_text(self) -> Text | None:
        s = self.summary.series
        loads = s.expert_load()
        if not loads:
            return None
        t = Text(no_wrap=True, overflow="ellipsis")
        layers = max(len(v) for v in loads.values())
        e = max((len(layer) for v in loads.values() for layer in v), default=0)
        t.append(f"expert load per rank and layer (share per expert; uniform {100 / e:.0f}%) "
                 "· hottest", style="dim")
        for r, load in list(loads.items())[:MAX_RANKS_SHOWN]:
            t.append(f"\n r{r:<3}")
            for i, shares in enumerate(load[:layers]):
                hot = hot_expert(shares)
                t.append(f" L{i} ")
                t.append(bar_string(shares, 1.0 if max(shares) < 1e-12 else None),
                         style="cyan")
                if hot is not None:
                    t.append(f" e{hot[0]} {hot[1] * 100:.0f}%", style="dim")
        return t

    def findings_text(self) -> Text:
        s, run = self.summary.series, self.summary.run
        t = Text(no_wrap=True, overflow="ellipsis")
        nf = getattr(run, "nonfinite", None)
        if nf:
            who = f"rank {nf['rank']}" if nf.get("rank") is not None else "a rank"
            where = (f", first in {nf['module'] or 'the root module'} ({nf.get('direction')})"
                     if nf.get("module") is not None else " (module not located)")
            t.append(printable(f"⚠ {who} first went non-finite: {nf.get('metric')} at step "
                               f"{nf['step']}{where}") + "\n", style="bold red")
        if s.findings:
            t.append(f"findings ({len(s.findings)}):", style="bold red")
            for f in s.findings[:MAX_FINDINGS_SHOWN]:
                t.append("\n✗ " + printable(f.line), style="red")
            if len(s.findings) > MAX_FINDINGS_SHOWN:
                t.append(f"\n  +{len(s.findings) - MAX_FINDINGS_SHOWN} more: mdb runs --json",
                         style="dim")
        else:
            t.append("findings: none", style="green")
        summary, skipped = s.checks_summary(), s.checks_not_compared()
        if summary or skipped:
            parts = [f"{'parameters' if k == 'params' else 'gradients'} "
                     + (f"differ at {bad} of {n} steps" if bad else f"equal at {n} steps")
                     for k, (n, bad) in sorted(summary.items(), reverse=True)]
            parts += [f"{'parameters' if k == 'params' else 'gradients'} not compared: {why}"
                      + (f" ({n} steps)" if k in summary else "")
                      for k, (n, why) in sorted(skipped.items(), reverse=True)]
            t.append("\nchecks: " + " · ".join(parts), style="dim" if summary else "yellow")
        else:
            t.append("\nchecks: parameters and gradients not compared (run.watch on a "
                     "DistributedDataParallel model compares them)", style="dim")
        dead = [rank_label(i) for i in s.ranks.values() if i.state in ("dead", "silent")]
        if dead and not s.findings:
            t.append("\n" + ", ".join(dead) + " stopped reporting", style="bold red")
        return t


def open_ranks(screen: Any) -> None:
    """``k`` on the live screen: push the :class:`RanksScreen` (or say why not)."""
    found = screen.query(RanksSummary)
    if not found or not found.first().display:
        screen.hint("k: the ranks of a torchrun job; this run is one process")
        return
    screen.app.push_screen(RanksScreen(found.first()))
