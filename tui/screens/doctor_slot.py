"""The step view's ``d`` key: the doctor's results when there are some, else how to get them.

``tui/screens/doctor.py`` (``DoctorScreen``) is written separately; it lists
``hooks.doctor.model.CheckResult`` rows and posts :class:`tui.messages.JumpToModule` to open a
module in the step view (handled by :class:`tui.app.MdbApp` and by the step screen). A screen
that returns a module name through ``dismiss`` is handled too.
"""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from hooks.text import printable


def model_options(meta: dict | None) -> str | None:
    """The ``mdb`` options that rebuild a trace's model, read from its description
    (``minillm default · …`` → ``--preset default``; ``Net from m.py:build · …`` →
    ``--model m.py:build``), or None when it does not say."""
    desc = (meta or {}).get("description") or ""
    head = desc.split(" · ", 1)[0]
    if head.startswith("minillm "):
        name = head.removeprefix("minillm ").strip()
        if name:
            return f"--config {name}" if name.endswith(".toml") else f"--preset {name}"
    if " from " in head:
        spec = head.rsplit(" from ", 1)[1].strip()
        if ":" in spec:
            return f"--model {spec}"
    return None


def no_results_text(meta: dict | None = None) -> str:
    """What ``d`` says when the step view has no results and no model to run the checks on."""
    opts = model_options(meta)
    opts = printable(opts) if opts else opts  # read from the trace's description
    rows = [(f"mdb doctor {opts} --tui", "the checks, then this view with the findings"),
            (f"mdb doctor {opts}", "the checks as a table"),
            (f"mdb step {opts}", "then d runs them here")]
    how = ("\n".join(f"  {c}\n      {what}" for c, what in rows)
           if opts else
           "  mdb doctor --tui  with the options that built the model (--preset NAME,\n"
           "                    --config FILE.toml or --model module:function)")
    return ("doctor · no check results for this trace\n\n"
            "This trace was opened without its model (from a file or a run), so the checks "
            "(initial loss, causality, RoPE, GQA, gradients, routing, tied weights, numerics) "
            "cannot run here. They run on the model:\n\n"
            f"{how}\n\n"
            + ("(give --model the file's path from here). " if opts and "--model" in opts
               else "")
            + "Enter on a finding opens its module in the step view.\n\nq, d or Esc closes "
            "this.")


class NoDoctorScreen(ModalScreen[None]):
    """Says that no doctor results were given, and how to get them (the command for the
    trace's model when its description names it)."""

    BINDINGS = [Binding("q,d,escape,enter", "close", "close", id="nodoctor.close")]

    def __init__(self, meta: dict | None = None) -> None:
        super().__init__()
        self.text = no_results_text(meta)

    def compose(self):
        with Vertical(id="nodoctor-box"):
            yield Static(self.text, id="nodoctor-text", markup=False)

    def action_close(self) -> None:
        self.dismiss(None)


def doctor_screen(step):
    """The screen ``d`` opens from ``step`` (a :class:`tui.screens.step.StepScreen`)."""
    results = step.doctor_results
    runner = getattr(step, "doctor_runner", None)
    if not results and runner is None:
        return NoDoctorScreen(getattr(step.trace, "meta", None))
    from tui.screens.doctor import DoctorScreen

    if results:
        return DoctorScreen(results)
    return DoctorScreen(runner=runner)
