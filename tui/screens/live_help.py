"""``LiveHelpScreen``: the keys of the live screen (``mdb overfit`` training here, or a viewer
of a run: ``mdb watch`` and the live ``mdb overfit``), generated from its bindings."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Static

from tui.screens.help import HelpScreen, binding_lines


class LiveHelpScreen(HelpScreen):
    """The live screen's keys (generated from its bindings; watching, without the keys that
    drive training), closed like the step view's help. The prose is whole paragraphs that the
    box wraps at word boundaries (no word left alone on a line at 80 columns)."""

    def __init__(self, watch: bool, bindings) -> None:
        super().__init__()
        self.watch = watch
        self.bindings = bindings

    def help_text(self) -> str:
        """What the box shows."""
        bindings = [b for b in self.bindings
                    if not (self.watch and b.action == "step")
                    and not (not self.watch and b.action == "detach")]
        lines = [
            "mdb watch · a viewer of the run · every action has a letter key." if self.watch
            else "mdb overfit live screen · every action has a letter key.",
            "",
            *binding_lines(bindings),
            "",
            "The left chart shows the losses together, each line with its own marker; a red !"
            " marks a loss spike (a jump to several times the running median), and the line"
            " under the charts says how large the largest was. Enter (or i) opens the step"
            " where the latest spike was captured, before its update, with its batch (pressed"
            " again: the spike before that one).",
            "",
            "m charts one metric at a time instead, any that the run logs, and back. The table"
            " lists the other metrics (last, min, max); o moves its ▸ mark, and the chart"
            " below the table shows the marked one.",
            "",
        ]
        if self.watch:
            lines += [
                "Training runs in a process of its own; this screen is a view of it. While"
                " the run trains, p pauses or resumes it and x stops it with a checkpoint"
                " (asked through the run database: mdb overfit runs and hooks.run loops that"
                " check run.should_stop obey). d detaches: the screen closes, training goes"
                " on, and mdb watch re-attaches from any terminal; Ctrl-C detaches too, and"
                " q asks whether to detach or stop. When the writer has stopped or is gone,"
                " the line under the charts says how to continue it.",
                "",
                "c opens the run's latest stored capture in the step view (mdb overfit records"
                " one every --every steps, run.watch(model, every=N) every N); q there comes"
                " back here.",
                "",
                "The training-loop doctor's findings show above the keys, each wrapped whole;"
                " f opens every one of them in full.",
            ]
        else:
            lines += [
                "c captures the next step's internals (forward, backward, routing) and opens"
                " them in the step view; training stays paused there, q in the step view"
                " comes back here and p resumes.",
                "",
                "x stops the run after the current step and writes a checkpoint (continue it"
                " with mdb overfit --resume RUN); q does the same and quits. A step that does"
                " not finish (a forward that hangs): q a second time quits at once, and the"
                " run resumes from its last checkpoint.",
            ]
        return "\n".join(lines)

    def compose(self):
        with VerticalScroll(id="help-box"):
            yield Static(self.help_text(), id="help-text", markup=False)
