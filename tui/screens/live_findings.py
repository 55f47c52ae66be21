"""``LoopFindings``: the training-loop doctor's findings of a run on the live screen of
``mdb watch`` (hidden while there are none).

Up to :attr:`LoopFindings.SHOWN` findings, the errors first: ``✗`` an error, ``⚠`` a warning
(the finding's ``detail["severity"]``), each the finding's own line with its step, wrapped
(never cut at the screen's width); the rest are counted. ``f`` opens :class:`FindingsScreen`:
every finding, whole (``mdb doctor --run NAME`` and ``mdb runs --json`` list them too). A thread
worker reads ``RunStore.findings`` every :attr:`LoopFindings.POLL_INTERVAL` seconds on a
connection of its own and posts :class:`FindingsPolled`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text
from textual import work
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Static
from textual.worker import Worker, WorkerState

from hooks.text import printable
from tui.screens.base import show
from tui.store_handle import StoreHandle

__all__ = ["FindingsPolled", "FindingsScreen", "LoopFindings", "LOOP_KINDS"]

#: The kinds of finding the training-loop doctor makes (``hooks.doctor.loop.checks``); the
#: other kinds (a torchrun job's ranks) are on the ranks lines.
LOOP_KINDS = ("grad_accumulation", "scheduler_steps", "weight_decay", "train_eval",
              "zero_grad", "optimizer_params", "labels", "padding", "precision",
              "memory_growth")


class FindingsPolled(Message):
    """What :class:`LoopFindings`' worker read: the findings after the last one seen, and
    whether the run still runs."""

    def __init__(self, findings: list, running: bool) -> None:
        super().__init__()
        self.findings, self.running = findings, running


class LoopFindings(Static):
    """The loop findings of ``run`` in the database ``store_path`` (see the module docstring).

    Args:
        store_path: The run database (``None``: nothing to read, never shown).
        run: The :class:`hooks.store.store.RunInfo` watched.
    """

    #: Seconds between two reads of the run store while the run runs (4x after it ended).
    POLL_INTERVAL = 1.0
    #: Lines shown at most.
    SHOWN = 3

    def __init__(self, store_path: str | Path | None, run: Any, **kwargs: Any) -> None:
        super().__init__("", id="live-findings", markup=False, **kwargs)
        self.store_path = Path(store_path) if store_path is not None else None
        self.run = run
        self.findings: list = []
        self._after = 0
        self._store = StoreHandle(self.store_path) if self.store_path is not None else None
        show(self, False)

    def on_mount(self) -> None:
        if self._store is not None:
            self._poll()

    def on_unmount(self) -> None:
        if self._store is not None:
            self._store.close()

    @work(thread=True, exclusive=True, exit_on_error=False, group="findings-poll",
          description="read the loop doctor's findings")
    def _poll(self) -> None:
        with self._store.use() as store:
            if store is None:  # unmounted
                return
            found = store.findings(self.run.id, after_id=self._after)
            running = store.run(self.run.id).status == "running"
        self.post_message(FindingsPolled(found, running))

    def on_findings_polled(self, message: FindingsPolled) -> None:
        message.stop()
        if message.findings:
            self._after = message.findings[-1].id
            self.findings += [f for f in message.findings if f.kind in LOOP_KINDS]
            self.update(self.text())
            show(self, bool(self.findings))
        self.set_timer(self.POLL_INTERVAL * (1 if message.running else 4), self._poll)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group == "findings-poll" and event.state == WorkerState.ERROR:
            self._store.reset()  # reopened at the next read
            self.set_timer(2.0, self._poll)

    def ordered(self) -> list:
        """The findings, errors first, then in the order they were found."""
        return sorted(self.findings, key=lambda f: (
            (f.detail or {}).get("severity") == "warning", f.id))

    def text(self, shown: int | None = None) -> Text:
        """The findings shown (also what a test reads): the first ``shown`` (default
        :attr:`SHOWN`; ``0``: all), each wrapped whole, the rest counted."""
        ordered = self.ordered()
        shown = self.SHOWN if shown is None else (shown or len(ordered))
        out = Text()
        for i, f in enumerate(ordered[:shown]):
            warn = (f.detail or {}).get("severity") == "warning"
            if i:
                out.append("\n")
            out.append("⚠ " if warn else "✗ ", style="bold yellow" if warn else "bold red")
            out.append(printable(f"loop: {f.line}"), style="yellow" if warn else "red")
        rest = len(ordered) - shown
        if rest > 0:
            out.append(printable(f" (+{rest} more: f shows them all)"), style="dim")
        return out


class FindingsScreen(ModalScreen[None]):
    """Every loop finding of the watched run, each whole (``f`` on the live screen).

    Args:
        findings: The :class:`LoopFindings` widget whose findings are shown.
    """

    BINDINGS = [
        Binding("f,q,escape,enter", "close", "close", id="findings.close"),
        Binding("j,down", "scroll(1)", "down", show=False, id="findings.down"),
        Binding("k,up", "scroll(-1)", "up", show=False, id="findings.up"),
    ]

    def __init__(self, findings: LoopFindings) -> None:
        super().__init__()
        self.findings = findings

    def compose(self):
        with VerticalScroll(id="findings-box"):
            yield Static(f"loop findings of run {printable(self.findings.run.name)} · "
                         "f/Esc closes", id="findings-title", markup=False)
            yield Static(self.findings.text(shown=0), id="findings-all", markup=False)

    def action_close(self) -> None:
        self.dismiss(None)

    def action_scroll(self, delta: int) -> None:
        self.query_one("#findings-box", VerticalScroll).scroll_relative(y=delta,
                                                                        animate=False)
