"""``mdb doctor --run NAME``: the findings of a recorded run in a table — the training-loop
doctor's (``run.watch(model, every, optimizer=, scheduler=)``, docs/loop-doctor.md) and a
torchrun job's cross-rank checks, from the run store's ``findings``.

One row per finding: its step, kind, severity (``error``; ``warn`` for what may be on
purpose), the subject (a parameter group, a parameter, the scheduler …), the line and the
evidence. ``--json`` prints ``{"run", "status", "findings": [...], "summary"}`` instead. Exit
code 1 when a finding is an error, 0 otherwise (also with none: the line says what was
checked); a run that does not exist, or ``--run`` with a model option: one ``mdb: error:``
line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from hooks.text import printable
from tui.commands.process import is_terminal
from tui.errors import MdbError

#: Model options that ``--run`` excludes (the run's model is the one its loop trained).
_MODEL_OPTIONS = (("model", "--model"), ("preset", "--preset"), ("config", "--config"),
                  ("tui", "--tui"), ("overfit", "--overfit"), ("only", "--only"),
                  ("text", "--text"))


def check_exclusive(args: argparse.Namespace) -> None:
    """``--run`` with a model option: :class:`MdbError` (one line)."""
    for attr, flag in _MODEL_OPTIONS:
        if getattr(args, attr, None) not in (None, False):
            raise MdbError(f"--run and {flag} are exclusive: --run shows the findings of a "
                           "recorded training run, the other options check a model")


def severity(finding) -> str:
    """``error`` or ``warn`` (a finding whose evidence says it may be on purpose)."""
    return "warn" if (finding.detail or {}).get("severity") == "warning" else "error"


def build_table(run, findings, width: int | None):
    """The Rich table of ``findings`` of ``run`` (step, kind, severity, subject, finding and
    its evidence)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(printable(f"run {run.name} · {run.status} · {len(findings)} "
                                       "finding(s)")),
                  title_justify="left", header_style="bold", show_lines=width is not None)
    wrap = width is not None
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("subject", no_wrap=not wrap, max_width=28 if wrap else None)
    table.add_column("finding · evidence", ratio=1 if wrap else None, no_wrap=not wrap)
    for f in findings:
        sev = severity(f)
        cell = Text(printable(str(f.line)))
        evidence = (f.detail or {}).get("evidence")
        if evidence:
            cell.append(("\n" if wrap else " · ") + printable(str(evidence)), style="dim")
        # every cell a Text: a kind or step written elsewhere is shown as is, never read as
        # Rich markup (``[bold]``) nor written raw (an ESC)
        table.add_row(Text("—" if f.step is None else printable(str(f.step))),
                      Text(printable(str(f.kind))),
                      Text(sev.upper(), style="bold red" if sev == "error" else "yellow"),
                      Text(printable(str(f.subject))), cell)
    return table


def run_findings(args: argparse.Namespace) -> int:
    """Entry point of ``mdb doctor --run NAME`` (see the module docstring)."""
    from hooks.store.store import RunStore, RunStoreError, default_db_path

    check_exclusive(args)
    path = args.db if args.db else default_db_path()
    try:
        with RunStore(path) as store:
            info = store.run(args.run)
            findings = store.findings(info.id)
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None
    errors = sum(severity(f) == "error" for f in findings)
    if args.json:
        doc = {"run": info.name, "status": info.status,
               "findings": [f.to_dict() for f in findings],
               "summary": {"findings": len(findings), "errors": errors,
                           "warnings": len(findings) - errors}}
        print(json.dumps(doc))
        return 1 if errors else 0
    if not findings:
        print(f"run {printable(info.name)}: no finding (the loop doctor checks a loop watched with "
              "run.watch(model, every, optimizer=opt, scheduler=sched); see "
              "docs/loop-doctor.md)")
        return 0
    from rich.console import Console

    from tui.commands.summary import output_width

    tty = is_terminal(sys.stdout)
    width = output_width(tty, args.wide)
    console = Console(file=sys.stdout, width=width or 10_000, no_color=not tty or None,
                      highlight=False, soft_wrap=width is None)
    table = build_table(info, findings, width)
    if width is None:
        console.width = console.measure(table).maximum
    console.print(table)
    return 1 if errors else 0
