"""``mdb diff --dtype bfloat16|float16 [model options]``: where the model's step under a low
dtype parts from the same step in fp32 (:func:`hooks.precision_diff`).

``mdb diff``'s parser (:mod:`tui.commands.diff`) takes ``--dtype`` and the model options and
calls :func:`run_dtype`. Piped (or with ``--table``) it prints the result and the diff table
of ``mdb diff A B``; ``--json`` prints it as JSON; in a terminal it opens the diff view with the
first divergent and the first non-finite call on top
(:class:`tui.screens.precision_diff.PrecisionDiffScreen`).
"""

from __future__ import annotations

import argparse
import json
import sys

from hooks.text import printable
from tui.errors import MdbError, ModelError


def compute(workload, dtype: str, how: str = "cast"):
    """:func:`hooks.precision_diff` of a workload; the model's own errors as one line.

    Raises:
        MdbError: a dtype or ``how`` it does not take.
        ModelError: the model raised in either run.
    """
    from hooks.errors import describe_error
    from hooks.whatif.precision import precision_diff

    if dtype not in ("bfloat16", "float16") or how not in ("cast", "autocast"):
        raise MdbError(f"--dtype {dtype}: give bfloat16 or float16")
    try:
        return precision_diff(workload.model, workload.batch, dtype, how=how,
                              loss_fn=workload.loss_fn)
    except Exception as exc:  # the user's model may raise anything, in fp32 or the dtype
        raise ModelError(describe_error(exc, workload.model, f"the step in fp32 or {dtype}"))\
            from None


def to_json(pd) -> dict:
    """The result as a JSON-ready dict (non-finite numbers as strings)."""
    from dataclasses import asdict

    from hooks.tensors.stats import encode_float

    def div(d):
        if d is None:
            return None
        return {k: encode_float(v) if isinstance(v, float) else v for k, v in asdict(d).items()}

    return {"dtype": pd.dtype, "how": pd.how, "eps": pd.eps, "tolerance": pd.tolerance,
            "floor": pd.floor, "threshold": pd.threshold_text,
            "loss": {k: encode_float(v) for k, v in pd.loss.items()},
            "first_divergent": div(pd.first_divergent),
            "first_nonfinite": div(pd.first_nonfinite), "notes": pd.notes,
            "no_differences": pd.diff.is_zero(), **pd.diff.to_dict()}


def run_dtype(args: argparse.Namespace) -> int:
    """``mdb diff --dtype``: build the workload the model options describe, step it in fp32
    and under ``args.dtype`` (``args.autocast``, when the parser has it: CPU autocast instead
    of a cast copy), and print or show the result."""
    from tui.commands.step import set_threads
    from tui.commands.workload import build_workload

    set_threads(args)
    workload = build_workload(args)
    how = "autocast" if getattr(args, "autocast", False) else "cast"
    pd = compute(workload, args.dtype, how)
    if getattr(args, "json", False):
        print(json.dumps(to_json(pd), allow_nan=False, default=str))
        return 0
    if getattr(args, "table", False) or not (sys.stdin.isatty() and sys.stdout.isatty()):
        from tui.commands.diff_table import print_table

        print(printable(workload.description))
        print("\n".join(map(printable, pd.lines())))  # they name modules
        print_table(pd.diff, "fp32", f"{pd.dtype} ({pd.how})", getattr(args, "limit", 40))
        return 0
    make_precision_app(pd).run()
    return 0


def make_precision_app(pd):
    """The app of ``mdb diff --dtype``: :class:`tui.app.DiffApp` opening a
    :class:`tui.screens.precision_diff.PrecisionDiffScreen` for ``pd`` (a
    :class:`hooks.whatif.precision.PrecisionDiff`)."""
    from pathlib import Path

    import tui.app
    from tui.app import DiffApp
    from tui.screens.precision_diff import PrecisionDiffScreen

    class PrecisionDiffApp(DiffApp):
        CSS_PATH = str(Path(tui.app.__file__).with_name("app.tcss"))
        TITLE = "mdb diff --dtype"

        def on_mount(self, event) -> None:
            event.prevent_default()  # DiffApp's would open the plain DiffScreen too
            self.push_screen(PrecisionDiffScreen(pd))

    return PrecisionDiffApp(pd.reference, pd.low, pd.diff, "fp32", pd.dtype)
