"""``mdb diff A B``: what changed between two captured steps, call by call.

``A`` and ``B`` are trace directories (``mdb capture --out``) or stored captures of a run,
``RUN@STEP`` (``mdb watch``'s ``c``, ``hooks.run(...).watch``). Calls are matched by module name
and call index (:meth:`hooks.Trace.diff`); where the architectures differ (GQA against MHA) the
names that agree are matched, tensors whose shape changed come first, and the rest are listed
as only in A or only in B. In a terminal the rows open in a Textual screen (Enter shows the
call of A and of B side by side); without one, or with ``--table``, the table is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tui.commands.options import check_path, nonneg_int
from tui.errors import MdbError

HELP = "compare two captured steps (trace directories or RUN@STEP), call by call"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="a trace directory, or RUN@STEP of the run store")
    parser.add_argument("b", metavar="B", help="the trace to compare A with (B - A is shown)")
    parser.add_argument("--db", metavar="FILE", default=None,
                        help="run store for RUN@STEP (default: $MDB_DB or ./runs/mdb.sqlite)")
    parser.add_argument("--table", action="store_true",
                        help="print the table even in a terminal")
    parser.add_argument("--json", action="store_true", help="print the diff as JSON")
    parser.add_argument("--limit", type=nonneg_int, default=40, metavar="N",
                        help="rows of the printed table (default 40; 0: all)")


def resolve_trace(spec: str, db: str | None = None):
    """The :class:`hooks.Trace` that ``spec`` names: a trace directory if one exists there,
    else ``RUN@STEP`` of the run store.

    Raises:
        MdbError: neither (also a name too long to be a file, or a symbolic-link loop), or the
            run/step/file cannot be read (a trace.json that is a FIFO or a device, too big).
    """
    from hooks import Trace, TraceFormatError

    path = Path(spec)
    try:
        exists = path.exists()
    except (OSError, ValueError):  # a name too long for a file: RUN@STEP, or said below
        exists = False
    if exists:
        try:
            return Trace.load(path)
        except FileNotFoundError:
            raise MdbError(f"{spec}: not a trace (no trace.json in it)") from None
        except TraceFormatError as exc:
            raise MdbError(f"{spec}: {exc}") from None
        except OSError as exc:
            raise MdbError(f"{spec}: cannot read ({exc.strerror or exc})") from None
    name, sep, step = spec.rpartition("@")
    if not sep or not name or not step.isdigit():
        check_path("", spec)  # a name too long, a symbolic-link loop: say that
        raise MdbError(f"{spec}: no such trace directory, and not RUN@STEP")
    from tui.commands.step import load_run_trace

    return load_run_trace(spec, db, label="")


def print_table(diff, a: str, b: str, limit: int) -> None:
    import os

    from rich.console import Console
    from rich.table import Table

    from tui.widgets.diff_rows import rows, summary_line

    tty = sys.stdout.isatty()
    width = None
    if not tty:  # piped: $COLUMNS when set, else wide enough for the longest module names
        cols = os.environ.get("COLUMNS", "")
        width = int(cols) if cols.isdigit() and int(cols) > 0 else 160
    console = Console(file=sys.stdout, width=width, no_color=not tty or None, highlight=False)
    console.print(f"A = {a}\nB = {b}\n{summary_line(diff, a, b)}", markup=False)
    if diff.is_zero():
        return
    table = Table(title="B - A per module call, largest change first", title_justify="left",
                  show_edge=False, pad_edge=False)
    for col, just in (("pass", "left"), ("call", "left"), ("tensor", "left"),
                      ("shape", "left"), ("Δmean", "right"), ("Δstd", "right"),
                      ("change", "right")):
        table.add_column(col, justify=just, no_wrap=col in ("call", "change"))
    rs = rows(diff)
    for r in rs[:limit] if limit else rs:
        table.add_row(r["pass"], r["call"], r["tensor"], r["shape"], r["mean"], r["std"],
                      r["change"])
    console.print(table)
    if limit and len(rs) > limit:
        console.print(f"… {len(rs) - limit} more (--limit 0 lists all)", markup=False)
    for label, keys in (("only in A", diff.only_in_self), ("only in B", diff.only_in_other)):
        if keys:
            shown = ", ".join(keys[:12]) + (f", … {len(keys) - 12} more" if len(keys) > 12
                                             else "")
            console.print(f"{label}: {shown}", markup=False)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb diff``."""
    a = resolve_trace(args.a, args.db)
    b = resolve_trace(args.b, args.db)
    diff = a.diff(b)
    if args.json:
        doc = {"a": args.a, "b": args.b, "no_differences": diff.is_zero(), **diff.to_dict()}
        print(json.dumps(doc, allow_nan=False, default=str))
        return 0
    if args.table or not (sys.stdin.isatty() and sys.stdout.isatty()):
        print_table(diff, args.a, args.b, args.limit)
        return 0
    from tui.app import make_diff_app

    make_diff_app(a, b, diff, args.a, args.b).run()
    return 0
