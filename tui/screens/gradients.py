"""``GradientsScreen``: every parameter's gradient norm as a bar, its ‖g‖/‖w‖ and a verdict.

One row per :class:`hooks.ParamGradRecord` (tied parameters once, under their first name), in
the model's order, with its decoder layer. Bars are on a log scale between the smallest and the
largest non-zero finite gradient norm of the model, so layers that differ by orders of magnitude
stay comparable. Verdicts (``✓ ok``, ``▼ vanishing``, ``◦ few tokens``, ``▲ exploding``,
``✗ NaN/Inf``, ``∅ None``, ``∅ not called``...) follow :func:`hooks.doctor.verdicts.param_verdict`,
the rule and thresholds the doctor's gradient-flow check uses, judged knowing how many rows (tokens)
reached each parameter's module (:func:`hooks.doctor.verdicts.rows_by_module`). The total ``‖g‖`` is
:func:`hooks.doctor.verdicts.grad_total_norm`: the exact L2 norm over every ``.grad`` (what
``clip_grad_norm_`` and the trainer's ``grad_norm`` give), NaN when one gradient is NaN. Enter on
a row opens the step view at the module that owns the parameter.
"""

from __future__ import annotations

import math
from collections import Counter

from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable, Static

from hooks.text import printable
from tui.screens.view import VIEW_BINDINGS, ViewScreen
from tui.widgets import fmt
from tui.widgets.footer import MdbFooter

BAR_WIDTH = 10


def log_fraction(value: float | None, lo: float, hi: float) -> float:
    """Where ``value`` sits between ``lo`` and ``hi`` on a log10 scale, in [0, 1]."""
    if value is None or not math.isfinite(value) or value <= 0:
        return 0.0
    if hi <= lo:
        return 1.0
    return (math.log10(value) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))


def short_name(name: str) -> tuple[str, str]:
    """``("1", "mlp.gate.weight")`` for ``model.layers.1.mlp.gate.weight``; ``("—", ...)``
    outside the decoder layers (``model.`` stripped)."""
    from hooks.trace.records import layer_of

    layer = layer_of(name)
    if layer is None:
        return "—", name.removeprefix("model.")
    marker = f".{layer}."
    return str(layer), name.split(marker, 1)[1] if marker in name else name


def total_text(total) -> str:
    """``total ‖g‖ 1.03e1``; ``total ‖g‖ nan (2 of 126 gradients NaN/Inf)``; ``no ‖g‖``."""
    if total.norm is None:
        return "no gradient to total"
    text = f"total ‖g‖ {fmt.sci(total.norm)}"
    if total.nonfinite:
        text += f" ({total.nonfinite} of {total.counted} gradients NaN/Inf)"
    return text


class GradientsScreen(ViewScreen):
    """All parameter gradients of the trace, with a summary of the verdicts."""

    VIEW = "gradients"
    BINDINGS = [
        Binding("j", "cursor(1)", "down", show=False, id="gradients.down"),
        Binding("k", "cursor(-1)", "up", show=False, id="gradients.up"),
        Binding("f", "next_flagged", "next flagged", key_display="f", id="gradients.flagged"),
        *VIEW_BINDINGS,
    ]

    def compose(self):
        yield Static("", id="title", markup=False)
        yield Static("", id="grad-summary", markup=False)
        yield DataTable(id="grads", cursor_type="row", zebra_stripes=True)
        yield Static("", id="hint", markup=False)
        yield MdbFooter()

    def on_mount(self) -> None:
        from hooks.doctor.verdicts import grad_total_norm, param_verdict, rows_by_module

        params = list(self.trace.params.values())
        rows, batch_rows = rows_by_module(self.trace)
        self.verdicts = {
            p.name: param_verdict(p, rows.get(p.name.rsplit(".", 1)[0] if "." in p.name else ""),
                                  batch_rows)
            for p in params
        }
        table = self.query_one("#grads", DataTable)
        for label, key in (("L", "layer"), ("parameter", "name"), ("‖g‖", "norm"),
                           ("log bar", "bar"), ("‖g‖/‖w‖", "ratio"), ("", "flag")):
            table.add_column(label, key=key)
        norms = [p.grad_norm for p in params
                 if p.grad_norm is not None and math.isfinite(p.grad_norm) and p.grad_norm > 0]
        lo, hi = (min(norms), max(norms)) if norms else (1.0, 1.0)
        for p in params:
            layer, name = short_name(printable(p.name))
            frac = log_fraction(p.grad_norm, lo, hi)
            frac = 0.1 + 0.9 * frac if p.grad_norm and math.isfinite(p.grad_norm) else 0.0
            table.add_row(
                Text(layer), Text(name), fmt.sci(p.grad_norm), fmt.bar(frac, BAR_WIDTH),
                fmt.sci(p.ratio), fmt.flag(self.verdicts[p.name]), key=p.name,
            )  # fmt: skip
        counts = Counter(self.verdicts.values())
        self.total = grad_total_norm(params)
        self.query_one("#title", Static).update(
            f"gradients · {len(params)} parameters · {total_text(self.total)} · "
            + (f"log bars {fmt.sci(lo)} … {fmt.sci(hi)}" if norms
               else "no finite non-zero ‖g‖ to draw"))
        # the four verdicts that matter always, on one line; the others below when there are
        main = [f"{fmt.FLAG_TEXT[k]} {counts.get(k, 0)}"
                for k in ("ok", "vanishing", "exploding", "nan")]
        other = [f"{fmt.FLAG_TEXT[k]} {counts[k]}"
                 for k in ("few", "unused", "none", "stale", "zero", "frozen") if counts.get(k)]
        self.query_one("#grad-summary", Static).update(
            " · ".join(main) + ("\n" + " · ".join(other) if other else ""))
        from hooks.nonfinite.origin import nonfinite_weight_notes

        weights = nonfinite_weight_notes(self.trace)  # a sharded weight's NaN, and whose shard
        if not params:
            self.hint("no parameter gradients recorded (was backward run?)")
        elif weights:
            self.hint("✗ " + " · ".join(weights))
        table.focus()

    def action_cursor(self, delta: int) -> None:
        table = self.query_one("#grads", DataTable)
        table.move_cursor(row=max(0, table.cursor_row + delta))

    def action_next_flagged(self) -> None:
        table = self.query_one("#grads", DataTable)
        names = list(self.trace.params)
        n = len(names)
        for off in range(1, n + 1):
            i = (table.cursor_row + off) % n
            if self.verdicts[names[i]] != "ok":
                table.move_cursor(row=i)
                self.hint(f"{names[i]}: {fmt.FLAG_TEXT[self.verdicts[names[i]]]}")
                return
        self.hint("✓ no flagged parameter")

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        name = str(event.row_key.value)
        self.jump_to(name.rsplit(".", 1)[0] if "." in name else "")
