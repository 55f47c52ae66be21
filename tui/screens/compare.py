"""``CompareScreen``: 2–8 runs of the run store side by side, live — ``mdb compare`` and
``mdb ablate``.

* **One chart** of every run's loss on shared axes (:func:`hooks.store.numbers.loss_metric`:
  ``total`` for minillm runs, as ``mdb runs`` and ``mdb watch`` say), log scale by default
  (``l``: linear). Each run has a colour *and* a marker
  (:data:`tui.screens.compare_data.RUN_STYLES`), kept while the run is on the screen, so the
  lines stay apart without colour (``NO_COLOR``, a text capture).
* **One table**, a column per run: the config fields in which the runs differ, parameters,
  attention parameters per layer, KV-cache bytes per token, the last and best loss, the last
  ``ce`` when the loss is another metric, held-out ``ce@N`` when recorded, steps/s, step and
  status
  (:func:`tui.screens.compare_data.compare_rows`). Numbers of a run whose config is not a
  minillm config are "—", and a line below the table says why.
* **Live**: a thread worker reads what is new about every shown run from the store
  (``RunStore.poll``, the call ``mdb watch`` makes) every ``poll_interval`` seconds and posts
  it; redraws are throttled (the table at most every 0.25 s, the chart every 0.5 s).
* **Keys**: ``a`` picks the runs to show from the store (add or remove), ``d`` removes the
  run of the selected column (←/→ select), ``l`` log/linear, ``q`` quits. Under ``mdb
  ablate`` the screen also has a *controller* (its worker processes): ``x`` or Ctrl-C stop them
  all (each run is marked interrupted), and their state (queued, a worker that failed and
  why) shows in the status row.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rich.segment import Segment
from rich.text import Text
from textual import on, work
from textual.app import App
from textual.binding import Binding
from textual.message import Message
from textual.screen import ModalScreen
from textual.strip import Strip
from textual.widgets import Checkbox, DataTable, Footer, SelectionList, Static
from textual.widgets.option_list import OptionDoesNotExist
from textual.widgets.selection_list import Selection
from textual.worker import Worker, WorkerState

from hooks.text import printable
from tui.driver import TerminalOutput
from tui.keys import KeysInOrder
from tui.screens.base import CTRL_C_QUITS, MdbScreen
from tui.screens.compare_data import (
    MAX_RUNS,
    RunView,
    assign_slot,
    compare_rows,
    short_labels,
    why_lines,
)
from tui.screens.help import HelpScreen, help_text
from tui.screens.live_chart import LineChart, Series
from tui.screens.live_data import first_read
from tui.store_handle import StoreHandle

#: Columns between two markers of one line.
MARK_EVERY = 10
_STATUS_STYLES = {"running": "green", "paused": "yellow", "finished": "cyan",
                  "interrupted": "yellow", "failed": "red", "gone": "red", "queued": "dim",
                  "starting": "dim", "not": "dim", "worker": "red", "stopped": "yellow"}


class Controller(Protocol):
    """What ``mdb ablate`` hands the screen: the worker processes behind the runs."""

    def status(self, name: str) -> str | None:
        """A status for run ``name`` the store cannot know (``queued``, why a worker failed),
        or ``None``."""

    def stop(self, reason: str) -> None:
        """Stop every worker (the runs end interrupted) and start no more."""

    def running(self) -> bool:
        """Whether a worker is still running or queued."""


@dataclass
class ComparePolled(Message):
    """The poll worker's read of the store: every run row, and what is new per shown run
    (``updates``: name → ``(RunUpdate, History or None)`` of
    :func:`tui.screens.live_data.first_read`)."""

    runs: list
    updates: dict
    last_rows: dict


class RunChoices(SelectionList):
    """A :class:`SelectionList` whose box reads ``▐✓▌`` for a chosen run and ``▐ ▌`` for the
    others: the choice shows without colour too (``NO_COLOR``, a text capture), where
    Textual's own box is ``▐X▌`` either way and differs only by its colour."""

    def render_line(self, y: int) -> Strip:
        strip = super().render_line(y)
        segments = list(strip)
        if len(segments) < 3 or segments[1].text != Checkbox.BUTTON_INNER:
            return strip  # not an option's line
        try:
            option = self.get_option_at_index(self.scroll_offset.y + y)
        except OptionDoesNotExist:
            return strip
        inner = segments[1]
        mark = "✓" if option.value in self.selected else " "
        segments[1] = Segment(mark, inner.style, inner.control)
        return Strip(segments, strip.cell_length)

    def action_select(self) -> None:
        """Space (or a click): toggle the highlighted run at once. Textual's toggles it in a
        message posted to itself, after the key has been handled, so an Enter typed right
        after the space (a priority binding) would apply the choice without it."""
        index = self.highlighted
        if index is not None:
            option = self.get_option_at_index(index)
            if not option.disabled:
                self.toggle(option)


class RunPicker(ModalScreen[list[str] | None]):
    """Choose the runs of the store to compare (space toggles, Enter applies, q cancels)."""

    BINDINGS = [
        Binding("enter", "apply", "apply", priority=True, id="pick.apply"),
        Binding("q,a", "cancel", "cancel", id="pick.cancel"),
    ]

    def __init__(self, runs: Sequence[Any], shown: Sequence[str]) -> None:
        super().__init__()
        self.runs = list(runs)
        self.shown = list(shown)

    def compose(self):
        items = []
        for r in self.runs:
            steps = f"{r.last_step}/{r.total_steps}" if r.total_steps else str(r.last_step)
            prompt = Text(printable(f"{r.name}  {r.status_line()}  {steps}"))
            items.append(Selection(prompt, r.name,
                                   r.name in self.shown))
        yield Static(f"compare which runs? (at most {MAX_RUNS}) · space toggles · Enter "
                     "applies · q cancels", id="pick-title", markup=False)
        yield RunChoices(*items, id="pick-list")

    def action_apply(self) -> None:
        chosen = list(self.query_one("#pick-list", SelectionList).selected)
        order = [n for n in self.shown if n in chosen] + [n for n in chosen
                                                          if n not in self.shown]
        self.dismiss(order)

    def action_cancel(self) -> None:
        self.dismiss(None)


class CompareScreen(MdbScreen):
    """Several runs of one run store on one screen (see the module docstring).

    Args:
        db: The run store's path.
        names: The runs to show (1 to :data:`MAX_RUNS`; they need not exist yet).
        controller: ``mdb ablate``'s worker processes (:class:`Controller`), or ``None``.
        poll_interval: Seconds between two reads of the store.
        title: The title line (default: ``mdb compare · N runs · DB``).

    Attributes:
        views: The :class:`RunView` of each shown run, in column order.
        polls: Completed reads of the store (tests).
    """

    BINDINGS = [
        Binding("a", "pick", "add/remove runs", id="compare.pick",
                tooltip="choose the runs of the store to compare"),
        Binding("d", "drop", "remove", id="compare.drop",
                tooltip="remove the run of the selected column (←/→ select)"),
        Binding("l", "log_scale", "log/linear", id="compare.log"),
        Binding("x", "stop", "stop all", id="compare.stop",
                tooltip="stop every worker of the ablation (runs end interrupted)"),
        Binding("ctrl+c", "ctrl_c", "stop all (mdb ablate), else quit", show=False,
                priority=True, id="compare.ctrl_c"),
        Binding("question_mark", "help", "keys", key_display="?", id="compare.help"),
        Binding("q", "quit_view", "quit", id="compare.quit"),
    ]

    def __init__(self, db: str | Path, names: Sequence[str], *,
                 controller: Controller | None = None, poll_interval: float = 0.3,
                 title: str | None = None) -> None:
        super().__init__()
        self.db = Path(db)
        self.controller = controller
        self.poll_interval = poll_interval
        self.views: list[RunView] = []
        for name in list(dict.fromkeys(names))[:MAX_RUNS]:
            self._add_view(name)
        self._title = title
        self.runs: list = []  # every run of the store, as last read
        self.polls = 0
        self.log_scale = True
        self.error: str | None = None
        self._store = StoreHandle(self.db)
        self._next_table = 0.0
        self._next_chart = 0.0
        self._redraw_timer = None
        self._table_key: tuple | None = None
        self._stopping = False
        self._workers_running = controller is not None

    # -- views -----------------------------------------------------------------------------------
    def _add_view(self, name: str) -> RunView:
        view = RunView(name, assign_slot([v.slot for v in self.views]))
        self.views.append(view)
        return view

    def set_runs(self, names: Sequence[str]) -> None:
        """Show exactly ``names`` (existing views keep their colour, marker and data)."""
        keep = {v.name: v for v in self.views}
        self.views = [keep[n] for n in names if n in keep]
        for n in names:
            if n not in keep and len(self.views) < MAX_RUNS:
                self._add_view(n)
        self._table_key = None
        self._changed()
        self._start_poll()

    @property
    def labels(self) -> list[str]:
        return short_labels([v.name for v in self.views])

    # -- layout ----------------------------------------------------------------------------------
    def compose(self):
        yield Static(self._title_text(), id="title", markup=False)
        yield LineChart("loss", log=True, mark_every=MARK_EVERY, id="cmp-chart")
        yield DataTable(id="cmp-table", cursor_type="column", zebra_stripes=False,
                        show_cursor=True)
        yield Static("", id="cmp-note", markup=False)
        yield Static("", id="hint", markup=False)
        yield Footer()

    def _title_text(self) -> str:
        if self._title:
            return printable(self._title)  # mdb ablate's: the variants' keys, the db's path
        return printable(f"mdb compare · {len(self.views)} runs · {self.db}")

    def on_mount(self) -> None:
        self.hint("reading the run store · a add/remove runs · l log/linear · ? keys")
        self._start_poll()
        self._redraw()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop" and (self.controller is None or not self.controller.running()):
            return False  # nothing (left) to stop: the key is not shown
        if action == "ctrl_c":
            return True
        return super().check_action(action, parameters)

    # -- reading the store (thread worker) -------------------------------------------------------
    def _start_poll(self) -> None:
        # the last row is read again once, when a run has ended (see RunView.needs_last_row)
        targets = [(v.name, v.cursor, v.info is None or v.info.status == "running"
                    or v.needs_last_row) for v in self.views]
        self._poll(targets)

    @work(thread=True, exclusive=True, exit_on_error=False, group="poll",
          description="read the compared runs from the run store")
    def _poll(self, targets: list[tuple[str, int, bool]]) -> None:
        with self._store.use() as store:
            if store is None:  # the screen is gone
                return
            runs = store.runs()
            by_name = {r.name: r for r in runs}
            updates, last_rows = {}, {}
            for name, cursor, last in targets:
                run = by_name.get(name)
                if run is not None:  # a long run's first read: its bucketed history
                    updates[name] = first_read(store, run.id, cursor)
                    if last and updates[name][0].run.status != "running":
                        last_rows[name] = store.last_metrics(run.id)
        self.post_message(ComparePolled(runs, updates, last_rows))

    def on_compare_polled(self, message: ComparePolled) -> None:
        message.stop()
        self.polls += 1
        self.runs = message.runs
        if self.error is not None:
            self.error = None
            self.hint("reading the run store again")
        changed = self.polls == 1
        if self.polls == 1:
            what = "x stops the workers · " if self.controller is not None else ""
            self.hint(f"following {len(self.views)} runs · {what}a add/remove · d remove · "
                      "? keys")
        for view in self.views:
            update = message.updates.get(view.name)
            if update is not None:
                view.add_update(*update)
                changed = True  # the status may have changed
                if view.name in message.last_rows and view.needs_last_row:
                    view.add_last_row(message.last_rows[view.name])
            if self.controller is not None:
                external = self.controller.status(view.name)
                changed |= external != view.external
                view.external = external
        if self.controller is not None:
            running = self.controller.running()
            if running != self._workers_running:
                self._workers_running = running
                self.refresh_bindings()
                if not running and self.polls > 1:
                    self.hint("every worker has ended · q quits (the table is printed)")
        if changed:
            self._changed()
        self.set_timer(self.poll_interval, self._start_poll)

    @on(Worker.StateChanged)
    def _worker_changed(self, event: Worker.StateChanged) -> None:
        if event.state != WorkerState.ERROR or event.worker.group != "poll":
            return
        exc = event.worker.error
        self.error = f"cannot read {self.db}: {type(exc).__name__}: {exc}".splitlines()[0]
        self.hint(self.error[:200] + " · retrying")
        self._store.reset()
        self.set_timer(1.0, self._start_poll)

    def on_unmount(self) -> None:
        self._store.close()  # waits for a poll in progress (tui.store_handle)

    # -- drawing (throttled) ---------------------------------------------------------------------
    def _changed(self) -> None:
        if self._redraw_timer is None:
            due = max(0.01, self._next_table - time.monotonic())
            self._redraw_timer = self.set_timer(due, self._redraw_due)

    def _redraw_due(self) -> None:
        self._redraw_timer = None
        if self.is_current:
            self._redraw()

    def on_screen_resume(self) -> None:
        self._changed()

    def on_resize(self) -> None:
        self._changed()

    def _redraw(self) -> None:
        now = time.monotonic()
        self._next_table = now + 0.25
        self.query_one("#title", Static).update(self._title_text())
        self._draw_table()
        if now >= self._next_chart:
            self._draw_chart()
            self._next_chart = now + 0.5
        else:  # the chart's slot comes later: draw it then
            self._redraw_timer = self.set_timer(self._next_chart - now, self._redraw_due)

    def _draw_chart(self) -> None:
        chart = self.query_one("#cmp-chart", LineChart)
        series = []
        names = set()
        for view, label in zip(self.views, self.labels, strict=True):
            metric = view.loss_name
            if metric:
                names.add(metric)
            xs, ys, lows, highs = (view.series.metric(metric).ranges(chart.resolution)
                                   if metric else ([], [], [], []))
            series.append(Series(label, xs, ys, style=view.style, marker=view.marker,
                                 lows=lows, highs=highs))  # each bucket's min-max range
        what = printable(names.pop()) if len(names) == 1 else "loss"  # a metric's name
        chart.plot(series, title=f"{what} ({'log' if self.log_scale else 'linear'})",
                   log=self.log_scale)

    def _draw_table(self) -> None:
        table = self.query_one("#cmp-table", DataTable)
        rows = compare_rows(self.views)
        labels = self.labels
        key = (tuple(v.name for v in self.views), tuple(r.label for r in rows))
        if key != self._table_key:
            cursor = table.cursor_column
            table.clear(columns=True)
            width = max([len(r.label) for r in rows] + [6])
            table.add_column("", key="label", width=min(width, 20))
            table.fixed_columns = 1  # the labels stay when 8 runs scroll sideways
            for view, label in zip(self.views, labels, strict=True):
                head = Text(f"{view.marker} {label}", style=f"bold {view.style}")
                table.add_column(head, key=view.name)
            for i, r in enumerate(rows):
                table.add_row(Text(r.label, style="bold" if r.kind == "config" else "dim"),
                              *(self._cell(r.label, c) for c in r.cells), key=str(i))
            self._table_key = key
            if self.views:
                table.move_cursor(column=min(max(1, cursor), len(self.views)))
        else:
            for i, r in enumerate(rows):
                for view, cell in zip(self.views, r.cells, strict=True):
                    table.update_cell(str(i), view.name, self._cell(r.label, cell),
                                      update_width=True)
        notes = why_lines(self.views, labels)
        if self.controller is not None and self.controller.running():
            notes.append("x or Ctrl-C stops every worker (their runs end interrupted)")
        self.query_one("#cmp-note", Static).update("\n".join(notes))
        self.query_one("#cmp-note").display = bool(notes)

    @staticmethod
    def _cell(label: str, text: str):
        if label != "status":
            return Text(text)  # never markup
        word = text.split(" ")[0].split(":")[0]
        return Text(text, style=_STATUS_STYLES.get(word, ""))

    # -- actions ---------------------------------------------------------------------------------
    def action_log_scale(self) -> None:
        self.log_scale = not self.log_scale
        self._next_chart = 0.0
        self._draw_chart()
        self.hint(f"{'log' if self.log_scale else 'linear'} loss axis · l toggles")

    def action_pick(self) -> None:
        runs = self.runs
        if not runs:
            self.hint("no runs read from the store yet")
            return

        def done(names: list[str] | None) -> None:
            if names is None:
                self.hint("no change")
                return
            if not names:
                self.hint("keep at least one run")
                return
            if len(names) > MAX_RUNS:
                self.hint(f"at most {MAX_RUNS} runs: the first {MAX_RUNS} are shown")
                names = names[:MAX_RUNS]
            added = [n for n in names if n not in {v.name for v in self.views}]
            removed = [v.name for v in self.views if v.name not in names]
            self.set_runs(names)
            self.hint(f"{len(names)} runs · added {len(added)} · removed {len(removed)}")

        self.app.push_screen(RunPicker(runs, [v.name for v in self.views]), done)

    def action_drop(self) -> None:
        table = self.query_one("#cmp-table", DataTable)
        col = table.cursor_column
        if col < 1 or col > len(self.views):
            self.hint("select a run's column first (←/→)")
            return
        if len(self.views) == 1:
            self.hint("the last run stays (a picks others)")
            return
        name = self.views[col - 1].name
        self.set_runs([v.name for v in self.views if v.name != name])
        self.hint(f"removed {name} · a adds runs back")

    def action_ctrl_c(self) -> None:
        if self.controller is None:
            self.app.exit(0)
        else:
            self.action_stop()

    def action_stop(self) -> None:
        if self.controller is None:
            return
        if self._stopping:
            self.hint("already stopping: each worker finishes its step and writes a checkpoint")
            return
        self._stopping = True
        self.controller.stop("stopped from the screen")
        self.hint("stopping every worker after its current step · q quits once they end")

    def action_quit_view(self) -> None:
        if self.controller is not None and self.controller.running():
            self.controller.stop("quit")
        self.app.exit(0)

    def action_help(self) -> None:
        text = help_text([("mdb compare", self.BINDINGS)]) + (
            "\n\nThe chart overlays each run's loss (total for minillm runs); every run keeps"
            "\nits colour and marker while shown. The table's columns are the runs: the"
            "\nsettings in which they differ, then parameters, attention parameters per"
            "\nlayer, KV-cache bytes per token, last and best loss, last ce, held-out ce@N,"
            "\nsteps/s."
            "\n'—': not known for that run (the line below the table says why).")
        self.app.push_screen(HelpScreen(text))


class CompareApp(KeysInOrder, TerminalOutput, App[int]):
    """The app of ``mdb compare`` and ``mdb ablate``: one :class:`CompareScreen`. Keys typed in
    one burst act in order (:class:`tui.keys.KeysInOrder`)."""

    CSS_PATH = ["../app.tcss", "compare.tcss"]
    TITLE = "mdb compare"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [CTRL_C_QUITS]

    def __init__(self, screen: CompareScreen) -> None:
        super().__init__()
        self.compare = screen

    def on_mount(self) -> None:
        self.push_screen(self.compare)
