"""``mdb diff --edit SPEC [--edit SPEC …] [model options]``: the model's step as is (A) against
the same step edited (B), on the same model, weights, batch and random state.

The edits are checked against the model before anything runs (bad input: one line, exit 2).
Both steps are captured (:func:`tui.commands.capturing.capture_step`) with the model's
gradients set aside in between, so that B differs from A by the edits only. In a terminal the
what-if diff view opens (:class:`tui.screens.edit_diff.EditDiffScreen`: the loss change on
top, the calls that changed most first, ``e`` edits again on top); piped or with ``--table``
the table is printed under the loss change and what each edit did; ``--json`` prints both.
"""

from __future__ import annotations

import argparse
import json

from hooks.text import printable
from tui.commands.process import has_screen


def edited_pair(workload, edits: list[str], sources: dict):
    """``(a, b)``: the step of ``workload`` as is and with ``edits``, from the same random
    state, the model's ``.grad`` as they were before (each step's own gradients are recorded).

    Raises:
        MdbError / ModelError: from :func:`tui.commands.capturing.capture_step`.
    """
    import torch

    from tui.commands.capturing import capture_step

    params = [p for p in workload.model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    state = torch.get_rng_state()
    traces = []
    try:
        for e in (None, edits):
            for p in params:
                p.grad = None
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(state)
                traces.append(capture_step(workload, attention=False, edits=e,
                                           sources=sources if e else None))
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    from hooks.whatif.rerun import note_unread_positions

    note_unread_positions(traces[1], workload.model, workload.batch, workload.loss_fn)
    return traces[0], traces[1]


def run_edit(args: argparse.Namespace) -> int:
    """``mdb diff --edit``: the step as is (A) and edited (B); the what-if view in a terminal,
    else the printed table (:func:`tui.commands.diff_table.print_table`) or ``--json``."""
    from tui.commands.diff_table import print_table
    from tui.commands.editing import edit_lines, edit_plan
    from tui.commands.step import set_threads
    from tui.commands.workload import build_workload
    from tui.screens.edit_diff import EditDiffScreen, loss_change_line

    set_threads(args)
    workload = build_workload(args)
    edits, sources = edit_plan(args, workload)  # every check before anything runs
    a, b = edited_pair(workload, edits, sources)
    diff = a.diff(b)
    if args.json:
        doc = {"a": "as is", "b": "edited", "edits": [e.to_dict() for e in b.edits],
               "loss_a": a.meta.get("loss"), "loss_b": b.meta.get("loss"),
               "no_differences": diff.is_zero(), **diff.to_dict()}
        print(json.dumps(doc, allow_nan=False, default=str))
        return 0
    if args.table or not has_screen():
        print(printable(loss_change_line(a, b)))
        for line in edit_lines(b):
            print(printable(line))  # it names the module
        print_table(diff, "the step as is", f"edited ({' + '.join(edits)})", args.limit)
        return 0
    _app(EditDiffScreen(a, b, diff, edits, embedded=False, loss_fn=workload.loss_fn)).run()
    return 0


def _app(screen):
    """A Textual app showing ``screen`` (mdb's stylesheet, Ctrl-C quits, keys typed in one burst
    act in order: :class:`tui.keys.KeysInOrder`)."""
    from pathlib import Path

    from textual.app import App

    import tui.app
    from tui.driver import TerminalOutput
    from tui.keys import KeysInOrder
    from tui.screens.base import CTRL_C_QUITS

    class EditDiffApp(KeysInOrder, TerminalOutput, App[int]):
        CSS_PATH = str(Path(tui.app.__file__).with_name("app.tcss"))
        TITLE = "mdb diff --edit"
        ENABLE_COMMAND_PALETTE = False
        BINDINGS = [CTRL_C_QUITS]

        def on_mount(self) -> None:
            self.push_screen(screen)

    return EditDiffApp()


__all__ = ["edited_pair", "run_edit"]
