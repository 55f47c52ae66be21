"""``CallDetails``: everything known about the current call, as one scrollable pane.

Sections, top to bottom: the call (module, class, call number); its input and output tensors
(shape, dtype); the statistics of its outputs (in the backward pass, beside the gradient of the
same output); a histogram of the values; the module's own parameters with their gradient norms,
``‖g‖/‖w‖`` ratios and verdicts; notes on what could not be captured.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from tui.widgets import fmt
from tui.widgets.verdicts import param_verdict

#: Rows of the statistics table: label, TensorStats attribute.
STAT_ROWS = (
    ("mean", "mean"),
    ("std", "std"),
    ("min", "min"),
    ("max", "max"),
    ("|x| max", "abs_max"),
    ("l2", "l2"),
)
MAX_STAT_COLUMNS = 3


def _stat_cells(stats) -> list[Text]:
    if stats is None:
        return [Text("—")] * (len(STAT_ROWS) + 2)
    cells = [Text(fmt.sci(getattr(stats, attr))) for _, attr in STAT_ROWS]
    cells.append(Text(fmt.pct(stats.zero_frac)))
    bad = stats.nan_count + stats.inf_count
    cells.append(
        Text(f"✗ {stats.nan_count}/{stats.inf_count}", style="bold red") if bad
        else Text("✓ 0/0", style="green")
    )  # fmt: skip
    return cells


def stats_table(columns: list[tuple[str, object]]) -> Table:
    """A transposed statistics table: one row per statistic, one column per tensor.

    Args:
        columns: ``(heading, TensorStats | None)`` pairs, at most :data:`MAX_STAT_COLUMNS`.
    """
    table = Table(box=None, pad_edge=False, padding=(0, 1), show_edge=False, expand=False)
    table.add_column("stat", style="dim", no_wrap=True)
    for heading, _ in columns:
        table.add_column(heading, justify="right", no_wrap=True, overflow="ellipsis")
    labels = [label for label, _ in STAT_ROWS] + ["zeros", "nan/inf"]
    cols = [_stat_cells(stats) for _, stats in columns]
    for i, label in enumerate(labels):
        table.add_row(label, *(c[i] for c in cols))
    return table


def histogram_block(title: str, stats) -> Group | Text:
    """Three rows of block characters over ``stats.hist`` with its value range underneath."""
    if stats is None or not stats.hist or sum(stats.hist) == 0:
        return Text(f"{title}: no histogram", style="dim")
    lines = fmt.histogram(stats.hist, rows=3)
    width = len(lines[0])
    lo, hi = fmt.sci(stats.hist_min), fmt.sci(stats.hist_max)
    axis = lo + " " * max(1, width - len(lo) - len(hi)) + hi
    body = Text("\n".join(lines), style="cyan")
    return Group(Text(title, style="bold"), body, Text(axis, style="dim"))


def params_table(params) -> Table:
    """The module's own parameters: name, shape, gradient norm, ‖g‖/‖w‖, verdict."""
    table = Table(box=None, pad_edge=False, padding=(0, 1), show_edge=False)
    for name, justify in (("param", "left"), ("shape", "left"), ("‖g‖", "right"),
                          ("‖g‖/‖w‖", "right"), ("", "left")):
        table.add_column(name, justify=justify, no_wrap=True)
    for p in params:
        table.add_row(
            p.name.rsplit(".", 1)[-1], fmt.shape(p.shape), fmt.sci(p.grad_norm),
            fmt.sci(p.ratio), fmt.flag(param_verdict(p)),
        )  # fmt: skip
    return table


def section(title: str) -> Text:
    return Text(f"── {title} ", style="bold")


class CallDetails(VerticalScroll):
    """The details pane of the step view; :meth:`show` redraws it for the stepper's position."""

    def compose(self):
        yield Static(id="details-body")

    def show(self, stepper) -> None:
        """Render the details of ``stepper``'s current record (a call, or a gradient)."""
        self.query_one("#details-body", Static).update(self.render_details(stepper))

    @staticmethod
    def render_details(stepper) -> Group:
        """Build the renderable (kept separate so tests can inspect it)."""
        call = stepper.call
        if call is None:
            return Group(Text("nothing recorded", style="dim"))
        parts: list = []
        title = Text(call.module or "<root>", style="bold")
        title.append(f"  {call.module_type} · call {call.call_index}", style="dim")
        parts.append(title)

        io = Table(box=None, pad_edge=False, padding=(0, 1), show_edge=False, show_header=False)
        io.add_column(style="dim", no_wrap=True, min_width=3)
        io.add_column(no_wrap=True, overflow="ellipsis", max_width=18)
        io.add_column(no_wrap=True, min_width=9)
        io.add_column(style="dim", no_wrap=True, min_width=7)
        for kind, tensors in (("in", call.inputs), ("out", call.outputs)):
            for t in tensors:
                io.add_row(kind, t.path, fmt.shape(t.shape), t.dtype)
        if not call.inputs and not call.outputs:
            io.add_row("", "no tensors", "", "")
        parts.append(io)

        grads = stepper.grads_of(call)
        if stepper.direction == "backward":
            g = stepper.current
            out = call.output(g.output)
            parts.append(section(f"statistics · {g.output} and its gradient"))
            parts.append(stats_table([("value", out.stats if out else None), ("∇ grad", g.stats)]))
            parts.append(histogram_block(f"∇ gradient of {g.output} {fmt.shape(g.shape)}",
                                         g.stats))
        else:
            shown = [t for t in call.outputs if t.stats is not None][:MAX_STAT_COLUMNS]
            parts.append(section("statistics of the outputs"))
            if shown:
                parts.append(stats_table([(t.path, t.stats) for t in shown]))
                extra = len(call.outputs) - len(shown)
                if extra > 0:
                    parts.append(Text(f"… {extra} more output(s)", style="dim"))
                main = shown[0]
                parts.append(histogram_block(f"values of {main.path} {fmt.shape(main.shape)}",
                                             main.stats))
            else:
                parts.append(Text("no tensor outputs", style="dim"))
            if grads:
                parts.append(Text(f"{len(grads)} gradient(s) recorded · b shows backward",
                                  style="dim"))
            else:
                parts.append(Text("no gradient recorded for this call", style="dim"))

        params = stepper.params_of(call.module)
        parts.append(section("parameters"))
        if params:
            parts.append(params_table(params))
        else:
            parts.append(Text("no parameters of its own", style="dim"))
        if call.notes:
            parts.append(section("notes"))
            parts.extend(Text(f"• {n}", style="yellow") for n in call.notes)
        return Group(*parts)
