"""``AttentionScreen``: one head's attention probabilities as a shaded T×T grid.

Rows are query positions, columns key positions, both labelled with their tokens; each cell is
a shade for its probability (`` `` 0, ``·`` < 5 %, ``░`` < 20 %, ``▒`` < 40 %, ``▓`` < 60 %,
``█`` ≥ 60 %), so the picture reads without colour. Each row is a softmax, so it sums to 1.
The title says which KV head the query head reads (grouped-query attention: query head h uses
KV head ``h // (H / H_kv)``) and which other heads share it.
"""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import ScrollableContainer
from textual.widgets import Footer, Static

from tui.screens.view import VIEW_BINDINGS, LayerViewScreen
from tui.widgets import fmt

LEGEND = "shade: ' ' 0 · '·' <5% · '░' <20% · '▒' <40% · '▓' <60% · '█' ≥60%"


def kv_groups(num_heads: int, num_kv_heads: int | None) -> list[int] | None:
    """KV head of each query head (``h // (H / H_kv)``), or None when H_kv is unknown."""
    if not num_kv_heads or num_heads % num_kv_heads:
        return None
    group = num_heads // num_kv_heads
    return [h // group for h in range(num_heads)]


def grid_text(matrix: list[list[float]], labels: list[str]) -> str:
    """The shaded grid: a header of key labels, then one row per query position.

    Args:
        matrix: (T_q, T_k) probabilities.
        labels: a token label per position (the first character is used in the header).
    """
    tk = len(matrix[0]) if matrix else 0
    lab = [(labels[i] if i < len(labels) else "?") for i in range(max(len(matrix), tk))]
    head = " " * 9 + "".join((lab[j][:1] or " ") for j in range(tk))
    lines = [head]
    for i, row in enumerate(matrix):
        lines.append(f"{i:>3} {lab[i][:4]:<4}│" + "".join(fmt.shade(p) for p in row) + "│")
    return "\n".join(lines)


class AttentionScreen(LayerViewScreen):
    """Attention probabilities of a chosen layer, head and sequence of the batch."""

    VIEW = "attention"
    LAYER_KIND = "attention layers"
    BINDINGS = [
        Binding("N,right_square_bracket", "layer(1)", "next layer", key_display="N",
                id="attention.next_layer"),
        Binding("P,left_square_bracket", "layer(-1)", "prev layer", key_display="P",
                show=False, id="attention.prev_layer"),
        Binding("l,right,full_stop", "head(1)", "next head", key_display="l",
                id="attention.next_head"),
        Binding("h,left,comma", "head(-1)", "prev head", key_display="h", show=False,
                id="attention.prev_head"),
        Binding("x", "sequence", "next sequence", show=False, id="attention.sequence"),
        Binding("j", "scroll(1)", "scroll down", show=False, id="attention.down"),
        Binding("k", "scroll(-1)", "scroll up", show=False, id="attention.up"),
        *VIEW_BINDINGS,
    ]

    def __init__(self, step) -> None:
        super().__init__(step)
        self.records = list(self.trace.attention)
        self.head = 0
        self.batch = 0
        self.start_at_step_layer()
        self.matrix: list[list[float]] = []

    def compose(self):
        yield Static("", id="title", markup=False)
        yield Static("", id="kv", markup=False)
        with ScrollableContainer(id="grid-scroll"):
            yield Static("", id="grid", markup=False)
        yield Static(LEGEND, id="legend", markup=False)
        yield Static("", id="hint", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        if not self.records:
            self.query_one("#title", Static).update(
                "attention · no attention probabilities were recorded "
                "(capture with attention=True; mdb step does)")
            return
        self.show()
        self.query_one("#grid-scroll").focus()

    def on_layer_changed(self) -> None:
        self.head = min(self.head, self.record.probs.shape[1] - 1)

    def action_head(self, delta: int) -> None:
        if not self.records:
            return
        heads = self.record.probs.shape[1]
        self.head = (self.head + delta) % heads
        self.hint("")
        self.show()

    def action_sequence(self) -> None:
        if not self.records:
            return
        self.batch = (self.batch + 1) % self.record.probs.shape[0]
        self.show()

    def action_scroll(self, delta: int) -> None:
        grid = self.query_one("#grid-scroll", ScrollableContainer)
        grid.scroll_relative(y=delta * 3, animate=False)

    def show(self) -> None:
        """Draw the grid of the current layer, head and sequence."""
        rec = self.record
        b_count, n_heads, t_q, _ = rec.probs.shape
        self.batch = min(self.batch, b_count - 1)
        self.matrix = rec.probs[self.batch, self.head].float().tolist()
        layer = "?" if rec.layer is None else rec.layer
        self.query_one("#title", Static).update(
            f"attention · layer {layer} ({self.position + 1}/{len(self.records)}) · "
            f"head {self.head}/{n_heads} · seq {self.batch}/{b_count} · {rec.module}"
        )
        config = self.trace.meta.get("config") or {}
        groups = kv_groups(n_heads, config.get("num_key_value_heads"))
        if groups is None:
            kv = "KV sharing unknown (no minillm config in this trace)"
        else:
            mine = groups[self.head]
            sharers = [h for h, g in enumerate(groups) if g == mine]
            kind = "MHA" if len(set(groups)) == n_heads else (
                "MQA" if len(set(groups)) == 1 else "GQA")
            kv = (f"{kind}: query head {self.head} reads KV head {mine} of "
                  f"{len(set(groups))}, shared by heads {' '.join(map(str, sharers))}")
        self.query_one("#kv", Static).update(kv)
        tokens = self.trace.meta.get("tokens") or []
        labels = tokens[self.batch * t_q:(self.batch + 1) * t_q]
        self.query_one("#grid", Static).update(grid_text(self.matrix, labels))
