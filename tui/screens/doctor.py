"""``DoctorScreen``: the doctor's check results in a table; choosing a finding jumps to its module.

Opened by the step view's ``d`` key (``tui.screens.doctor_slot``) with the results of
:func:`hooks.doctor.model.run_checks`, or by ``mdb doctor --tui``. One row per check (number, name,
status, evidence); the panel below shows the highlighted row's full evidence, hint and module.

Statuses: ``pass``, ``n/a`` (the check does not apply to this kind of model; the evidence says
why), ``skip`` (it applies but could not run), ``warn``, ``fail``, ``error`` (mdb's own fault).
Choosing a row (Enter) whose status is ``fail``, ``error`` or ``warn`` and that names a module
dismisses the screen with that module name and posts :class:`DoctorScreen.JumpToModule`
to the app (a subclass of :class:`tui.messages.JumpToModule`, so ``on_jump_to_module`` handlers
receive it).

Keys, as in the step debugger's other views: ``s``, Esc or ``d`` close the screen (dismiss
result ``None``: back to the step view), ``r``/``a``/``g`` open another view of the step screen
beneath, ``?`` lists the keys, ``q`` quits (the app, or the embedded step screen). It is an
:class:`tui.screens.base.MdbScreen`: below 80×24 it shows "terminal too small" and ignores
every key but ``q``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.widgets import DataTable, Footer, Static

from hooks.text import printable
from tui import messages
from tui.screens.base import MdbScreen

#: Rich style of each status in the table.
STATUS_STYLE = {
    "pass": "green",
    "n/a": "dim",
    "skip": "dim",
    "warn": "yellow",
    "fail": "bold red",
    "error": "bold magenta",
}
#: Statuses whose module the user can jump to.
JUMPABLE = frozenset({"fail", "error", "warn"})


def _as_dict(result: Any) -> dict[str, Any]:
    """A result as a dict: a :class:`hooks.doctor.model.CheckResult` or a dict from ``--json``."""
    if isinstance(result, dict):
        return result
    to_dict = getattr(result, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise TypeError(f"expected a CheckResult or a dict, got {type(result).__name__}")


def summary_line(rows: list[dict[str, Any]]) -> str:
    """``"10 checks · 8 pass · 1 warn · 1 fail"`` (statuses with a zero count left out)."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    parts = [f"{len(rows)} checks"]
    parts += [f"{counts[s]} {s}" for s in STATUS_STYLE if counts.get(s)]
    return " · ".join(parts)


class DoctorScreen(MdbScreen):
    """The doctor's results as a table.

    Args:
        results: :class:`hooks.doctor.model.CheckResult` objects, or their ``to_dict()`` form (the
            ``results`` list of ``mdb doctor --json``).
        title: the first line (e.g. the model's description).
        runner: when there are no results yet, a function ``runner(on_result) -> results``
            that runs the checks (``mdb step`` passes one bound to its model); it runs in a
            thread worker when the screen is first shown, and rows appear as checks finish.
    """

    CSS_PATH = "doctor.tcss"

    BINDINGS = [
        Binding("enter", "jump", "jump", key_display="Enter", id="doctor.jump", priority=True,
                tooltip="open the highlighted finding's module in the step view, or a "
                        "passing check's evidence"),
        Binding("s,escape,d", "close", "step", key_display="s", id="doctor.close",
                tooltip="close the doctor view: back to the step view"),
        Binding("r", "view('router')", "router", id="doctor.router", tooltip="router view"),
        Binding("a", "view('attention')", "attn", id="doctor.attention",
                tooltip="attention view"),
        Binding("g", "view('gradients')", "grads", id="doctor.gradients",
                tooltip="gradients view"),
        Binding("question_mark", "help", "keys", key_display="?", id="doctor.help",
                tooltip="this list of keys"),
        Binding("q", "quit_view", "quit", id="doctor.quit", tooltip="quit mdb"),
    ]

    #: What ``?`` lists for this view (the step view's help lists it too).
    HELP_BINDINGS = [*BINDINGS, Binding("up,down", "", "move between the checks")]

    class JumpToModule(messages.JumpToModule):
        """Posted (to the app) when the user chooses a finding that names a module.

        Attributes:
            module: qualified module name from the check result.
            call_index: always 0 (the module's first call).
        """

    @dataclass
    class ResultReady(Message):
        """One check finished in the runner's worker."""

        result: dict[str, Any]

    @dataclass
    class RunFinished(Message):
        """The runner's worker ended; ``error`` is a one-line reason when it failed."""

        error: str | None = None

    def __init__(self, results: Iterable[Any] = (), *, title: str = "mdb doctor",
                 runner: Callable[[Callable[[Any], None]], Any] | None = None) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = [_as_dict(r) for r in results]
        self.title_text = title
        self.runner = runner if not self.rows else None
        self.running = False

    # -- layout ---------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(self._title(summary_line(self.rows)), id="doctor-title")
        yield DataTable(id="doctor-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="doctor-detail")
        yield Static("", id="hint", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#doctor-table", DataTable)
        table.add_column("#", key="id")
        table.add_column("check", key="check")
        table.add_column("status", key="status")
        table.add_column("evidence", key="evidence")
        for i, r in enumerate(self.rows):
            self._add_row(table, i, r)
        if self.runner is not None:
            self.running = True
            self._set_title("running the checks on this model… (takes a few seconds)")
            self.query_one("#doctor-detail", Static).update(
                "results appear as each check finishes; q, d or Esc closes this view and the "
                "checks go on in the background")
            self._run_checks()
        else:
            self._select_first_bad()
        table.focus()

    def _title(self, status: str) -> Text:
        """``mdb doctor · <status> · <model>``: the status first, where a cut cannot hide it;
        :func:`hooks.text.printable` (the model's description, a check's error)."""
        head, sep, rest = self.title_text.partition(" · ")
        if head == "mdb doctor" and sep:
            return Text(printable(f"{head} · {status} · {rest}"), style="bold")
        return Text(printable(f"{self.title_text} · {status}"), style="bold")

    def _set_title(self, status: str) -> None:
        self.query_one("#doctor-title", Static).update(self._title(status))

    def _add_row(self, table: DataTable, i: int, r: dict[str, Any]) -> None:
        status = r["status"]
        evidence = printable(str(r.get("evidence", "")))
        short = evidence if len(evidence) <= 90 else evidence[:89] + "…"
        name = printable(str(r.get("name", r.get("key", ""))))
        table.add_row(Text(printable(str(r.get("id", i + 1)))), Text(name),
                      Text(printable(str(status)), style=STATUS_STYLE.get(status, "")),
                      Text(short), key=str(i))

    @work(thread=True, exclusive=True, exit_on_error=False, group="doctor",
          description="run the doctor's checks")
    def _run_checks(self) -> None:
        try:
            self.runner(lambda r: self.post_message(self.ResultReady(_as_dict(r))))
        except Exception as exc:  # a check framework failure: one line, the view stays up
            self.post_message(self.RunFinished(f"{type(exc).__name__}: {exc}"))
        else:
            self.post_message(self.RunFinished())

    def on_doctor_screen_result_ready(self, message: ResultReady) -> None:
        table = self.query_one("#doctor-table", DataTable)
        self.rows.append(message.result)
        self._add_row(table, len(self.rows) - 1, message.result)
        self._set_title(f"running… {summary_line(self.rows)}")

    def on_doctor_screen_run_finished(self, message: RunFinished) -> None:
        self.running = False
        if message.error:
            self._set_title(f"the checks stopped: {message.error}")
            return
        self._set_title(summary_line(self.rows))
        self._select_first_bad()

    def _select_first_bad(self) -> None:
        table = self.query_one("#doctor-table", DataTable)
        first_bad = next((i for i, r in enumerate(self.rows)
                          if r["status"] in ("fail", "error")), None)
        if self.rows:
            table.move_cursor(row=first_bad or 0)
            self._show(first_bad or 0)
        else:
            self.query_one("#doctor-detail", Static).update("no check results")
        table.focus()

    # -- behaviour ------------------------------------------------------------------------------
    def _show(self, index: int) -> None:
        if not (0 <= index < len(self.rows)):
            return
        from tui.screens.doctor_evidence import result_head

        r = self.rows[index]
        text = result_head(r, STATUS_STYLE)
        module = r.get("module")
        if r["status"] in JUMPABLE and module is not None:
            text.append("  (Enter opens it in the step view)", style="dim")
        else:
            text.append("\nEnter: the evidence in full, with what was measured", style="dim")
        self.query_one("#doctor-detail", Static).update(text)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self._show(event.cursor_row)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.choose(event.cursor_row)

    def action_jump(self) -> None:
        self.choose(self.query_one("#doctor-table", DataTable).cursor_row)

    def choose(self, index: int) -> bool:
        """Act on row ``index``: jump when it is a finding naming a module, else open the
        check's evidence in full (:class:`tui.screens.doctor_evidence.EvidenceScreen`),
        from which Enter opens the module it measured.

        Returns:
            True when the screen was dismissed with a module to jump to.
        """
        if not (0 <= index < len(self.rows)):
            return False
        r = self.rows[index]
        module = r.get("module")
        if r["status"] not in JUMPABLE or module is None:
            from tui.screens.doctor_evidence import EvidenceScreen

            def opened(module: str | None) -> None:
                if module is not None:
                    self._jump(module)

            self.app.push_screen(EvidenceScreen(r, STATUS_STYLE), opened)
            return False
        self._jump(module)
        return True

    def _jump(self, module: str) -> None:
        app = self.app
        self.dismiss(module)
        app.post_message(self.JumpToModule(module))

    def action_close(self) -> None:
        self.dismiss(None)

    def _step_screen(self):
        """The step view beneath this screen (it opens the other views), or None."""
        for screen in reversed(self.app.screen_stack):
            if screen is not self and hasattr(screen, "open_view"):
                return screen
        return None

    def action_view(self, view: str) -> None:
        step = self._step_screen()
        if step is None:
            self.hint(f"no step view to show the {view} view from")
            return
        step.open_view(view, replace=True)

    @staticmethod
    def help_text(step=None) -> str:
        """The doctor view's keys, then the step view's (when there is one beneath)."""
        from tui.screens.help import help_text

        sections = [("doctor view", DoctorScreen.HELP_BINDINGS)]
        if step is not None and hasattr(step, "help_sections"):
            sections += [x for x in step.help_sections() if not x[0].startswith("doctor")]
        return help_text(sections)

    def action_help(self) -> None:
        from tui.screens.help import HelpScreen

        self.app.push_screen(HelpScreen(self.help_text(self._step_screen())))

    def action_quit_view(self) -> None:
        """Quit: through the step view beneath (which exits the app, or returns to an
        embedding app's screen), else the app."""
        step = self._step_screen()
        self.dismiss(None)
        if step is not None and hasattr(step, "action_quit_view"):
            step.action_quit_view()
        else:
            self.app.exit()


# Textual names the handler after the nesting ("on_doctor_screen_jump_to_module"); use the
# parent's name so the app's and the step view's ``on_jump_to_module`` receive it.
DoctorScreen.JumpToModule.handler_name = messages.JumpToModule.handler_name
