"""``mdb doctor``: run the battery of measured checks on a model and report pass/warn/fail.

The model is minillm with any preset/config, or a user's model via ``--model module:function``
(the same options as ``mdb step``). Each check (see :mod:`hooks.doctor.model`) measures something
through the model's behaviour and reports a status, the evidence with numbers, and a one-line
hint at the cause; a check that does not apply to the kind of model (decoder-only,
bidirectional encoder, encoder-decoder, not a sequence model) says ``n/a`` and why. Output: a
Rich table on stdout at the terminal's width (plain text when piped, at ``$COLUMNS`` or full
width; ``--wide``: full width), ``--json`` for machines (stdout holds the JSON document only:
whatever the user's factory or forward writes to stdout, also straight to file descriptor 1,
goes to stderr), ``--tui`` to browse the results in the step debugger's doctor view. Exit code
1 when a check fails (or crashes in mdb), 2 on bad input, else 0; ``n/a``, ``skip`` and
``warn`` do not change it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hooks.text import printable
from tui.commands.options import add_model_arguments, positive_int
from tui.commands.process import is_terminal, stdout_to_stderr
from tui.errors import MdbError, print_error

HELP = "check a model for common build mistakes (init, mask, RoPE, GQA, gradients, routing...)"

_CHECK_LIST = ("checks: 1 init-loss, 2 causality, 3 rope, 4 gqa, 5 grad-flow, 6 routing, "
               "7 nonfinite, 8 tied, 9 numerics, 10 overfit (only with --overfit); invariances: "
               "21 padding, 22 batch, 23 cache, 24 attn-impl, 25 packing. "
               "Exit code 1 when a check fails.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    g = parser.add_argument_group("doctor")
    out = g.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true",
                     help="print the results as JSON (one object: model, kind, results, "
                          "summary) and nothing else on stdout")
    out.add_argument("--tui", action="store_true",
                     help="open the results in the step debugger's doctor view (Enter on a "
                          "finding jumps to its module)")
    g.add_argument("--wide", action="store_true",
                   help="the table at full width, one line per check, whatever the "
                        "terminal's width (piped output without $COLUMNS is always full width)")
    g.add_argument("--overfit", action="store_true",
                   help="also run check 10: overfit the batch (slower)")
    g.add_argument("--overfit-steps", type=positive_int, default=300, metavar="N",
                   help="most optimizer steps of the overfit check (default 300)")
    g.add_argument("--only", metavar="IDS", default=None,
                   help="comma-separated check numbers or names, e.g. 1,2,gqa")
    g.add_argument("--run", metavar="NAME", default=None,
                   help="instead of a model: the findings of a recorded training run (the "
                        "training-loop doctor of run.watch(..., optimizer=, scheduler=), a "
                        "torchrun job's checks) in a table; exclusive with the model options")
    g.add_argument("--db", metavar="PATH", default=None,
                   help="with --run: the run database (default $MDB_DB, else "
                        "./runs/mdb.sqlite)")
    g.add_argument("--threads", type=positive_int, default=1, metavar="N",
                   help="torch intra-op threads while checking (default 1: the checks run "
                        "many small ops, which extra threads slow down on a busy machine; "
                        "see benchmarks/bench_doctor.py)")
    parser.epilog = _CHECK_LIST


def status_text(status: str):
    from rich.text import Text

    from tui.screens.doctor import STATUS_STYLE

    return Text(status.upper(), style=STATUS_STYLE.get(status, ""))


#: Below this width the hint goes under the evidence and checks are named by their key.
NARROW = 140


def build_table(results, title: str = "", width: int | None = NARROW):
    """The Rich table of ``results`` (check, status, evidence, hint).

    Args:
        results: :class:`hooks.doctor.model.CheckResult` objects.
        title: the table's title.
        width: the cells it must fit: from :data:`NARROW` up, one column each for evidence
            and hint; below, checks are named by their key (what ``--only`` takes) and the
            hint goes under the evidence, so the evidence keeps most of the width; None:
            full width, one line per check.
    """
    from rich import box
    from rich.table import Table
    from rich.text import Text

    narrow = width is not None and width < NARROW
    heading = Text(printable(title)) if title else None
    if narrow:
        table = Table(title=heading, title_justify="left", header_style="bold",
                      box=box.SIMPLE_HEAD, show_lines=True, show_edge=False, pad_edge=False)
    else:
        table = Table(title=heading, title_justify="left", header_style="bold",
                      show_lines=width is not None, expand=False)
    wrap = width is not None
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("evidence" + (" · hint" if narrow else ""), ratio=3 if wrap else None,
                     no_wrap=not wrap)
    if not narrow:
        table.add_column("hint", ratio=2 if wrap else None, no_wrap=not wrap)
    for r in results:
        ev = Text(printable(r.evidence))  # names a module, quotes an error: never raw
        if r.module is not None and r.status not in ("pass", "skip", "n/a"):
            ev.append(("\n" if wrap else " ") + f"→ {printable(r.module or '<root>')}",
                      style="cyan")
        hint = Text(printable(r.hint), style="dim")
        if narrow:
            if r.hint:
                ev.append("\nhint: ", style="dim bold")
                ev.append_text(hint)
            table.add_row(str(r.id), Text(r.key), status_text(r.status), ev)
        else:
            table.add_row(str(r.id), Text(r.name), status_text(r.status), ev, hint)
    return table


def summary(results, seconds: float) -> dict:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    return {"checks": len(results), "counts": counts, "seconds": round(seconds, 3),
            "failed": [r.key for r in results if r.failed]}


def run(args: argparse.Namespace) -> int:
    from hooks.doctor.model import resolve_only

    if args.run is not None:  # a recorded run's findings (tui.commands.doctor_run)
        from tui.commands.doctor_run import run_findings

        return run_findings(args)
    if args.db is not None:
        raise MdbError("--db goes with --run NAME (the run database to read)")
    try:
        only = resolve_only(args.only) if args.only is not None else None
    except ValueError as exc:
        raise MdbError(f"--only: {exc}") from None
    from tui.commands.process import require_terminal
    from tui.commands.workload import build_workload

    # stdout carries the table or the JSON document only: what the user's code writes to it
    # (the factory, the forward: print, os.write(1, ...), C code) goes to stderr
    with stdout_to_stderr():
        workload = build_workload(args)
    if args.tui:  # after the input checks: bad input is reported as such either way
        require_terminal("mdb doctor --tui", "`mdb doctor` for the table or `--json`")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _check_and_report(args, workload, only)
    finally:
        torch.set_num_threads(threads)


def _check_and_report(args: argparse.Namespace, workload, only) -> int:
    from hooks.doctor.model import DoctorOptions, Target, run_checks

    opts = DoctorOptions(overfit_steps=args.overfit_steps, seed=args.seed)
    target = Target.from_any(workload)
    status = None
    if is_terminal(sys.stderr) and not args.json:
        from rich.console import Console

        status = Console(stderr=True).status("mdb doctor: running checks…")
        status.start()

    def progress(res) -> None:
        if status is not None:
            status.update(f"mdb doctor: {res.id} {res.key} {res.status} ({res.seconds:.1f} s)…")

    t0 = time.perf_counter()
    try:
        with stdout_to_stderr():
            kind = target.kind
            results = run_checks(target, only=only, overfit=args.overfit, options=opts,
                                 on_result=progress)
    finally:
        if status is not None:
            status.stop()
    total = time.perf_counter() - t0
    info = summary(results, total)
    broken = None
    if not args.tui and any("exception" in (r.data or {}) for r in results):
        broken = _model_error(workload)  # did the model raise on its own batch too?
    if args.json:
        doc = {"model": workload.description, "kind": kind.to_dict(),
               "results": [r.to_dict() for r in results], "summary": info}
        print(json.dumps(doc, indent=2, allow_nan=False))
    elif args.tui:
        return _run_tui(workload, results, info)
    else:
        _print_table(workload.description, kind.describe(), results, info, args.wide)
    if broken is not None:  # the same line as mdb summary/capture/step, and exit 1
        print_error(broken)
        return 1
    return 1 if info["failed"] else 0


def _model_error(workload) -> str | None:
    """The one line of :func:`hooks.errors.describe_error` when the model's forward, its loss
    or its backward raises on the user's own batch (a check's resized batch may make a correct
    model raise: that stays a skip), else ``None``. The RNG state and the gradients are left
    as they were."""
    import torch

    from hooks.batch import BatchError, select_loss
    from hooks.errors import describe_error

    model, batch = workload.model, workload.batch
    doing = "the forward pass"
    try:
        with torch.random.fork_rng(devices=[]), stdout_to_stderr():
            out = batch.call(model)
            doing = "loss_fn"
            choice = select_loss(out, workload.loss_fn, batch)
            doing = "the backward pass"
            choice.loss.backward()
    except BatchError:
        return None  # reported by the checks themselves
    except Exception as exc:
        return describe_error(exc, model, doing)
    finally:
        model.zero_grad(set_to_none=True)
    return None


def _print_table(description: str, kind: str, results, info: dict, wide: bool = False) -> None:
    """The table on stdout: at the terminal's width (or ``$COLUMNS``), full width when
    piped without ``$COLUMNS`` (as ``mdb summary``)."""
    from rich.console import Console

    from tui.commands.summary import output_width
    from tui.screens.doctor import summary_line

    tty = is_terminal(sys.stdout)
    width = output_width(tty, wide)
    console = Console(file=sys.stdout, width=width or 10_000, no_color=not tty or None,
                      highlight=False, soft_wrap=width is None)
    table = build_table(results, width=width)
    if width is None:
        console.width = console.measure(table).maximum
    for line in (f"mdb doctor · {description}", f"kind: {kind}"):
        console.print(printable(line), markup=False, soft_wrap=width is None, style="bold")
    console.print(table)
    line = summary_line([r.to_dict() for r in results]) + f" · {info['seconds']:.1f} s"
    console.print(line, markup=False, soft_wrap=width is None)


def make_doctor_app(trace, results, *, title: str = "mdb doctor"):
    """The step app on ``trace`` with the doctor view of ``results`` open on top (Esc or
    ``q`` closes it to the step view, ``d`` reopens it; Enter on a finding jumps)."""
    from pathlib import Path

    import tui.app
    from tui.app import MdbApp
    from tui.screens.doctor import DoctorScreen

    class DoctorApp(MdbApp):
        # CSS_PATH is relative to the defining module: point at the app's own stylesheet
        CSS_PATH = str(Path(tui.app.__file__).with_name(str(MdbApp.CSS_PATH)))

        def on_mount(self) -> None:
            # Textual also runs MdbApp.on_mount (handlers are dispatched along the MRO), which
            # pushes the step view; the doctor view goes on top of it after that.
            self.call_after_refresh(self.push_screen, DoctorScreen(results, title=title))

    return DoctorApp(trace, doctor_results=results)


def _run_tui(workload, results, info: dict) -> int:
    """Capture one step of the workload and open the step app with the doctor view on top."""
    from tui.commands.capturing import capture_step

    with stdout_to_stderr():
        trace = capture_step(workload, attention=True)
    app = make_doctor_app(trace, results, title=f"mdb doctor · {workload.description}")
    app.run()
    if app.error:
        print_error(app.error)
        return app.return_code or 2
    return 1 if info["failed"] else 0
