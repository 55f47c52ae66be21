"""``AttentionScreen``: one head's attention probabilities as a shaded T×S grid.

Rows are query positions, columns key positions, labelled with their tokens where the call's
positions are the input's tokens. Each cell is a shade for its probability (``·`` < 5 %,
``░`` < 20 %, ``▒`` < 40 %, ``▓`` < 60 %, ``█`` ≥ 60 %); a key the call masked out is blank
(distinct from a tiny probability), a NaN is ``!``, so the picture reads without colour. A row
is a softmax and sums to 1, unless every key is masked (SDPA gives 0, a hand-written softmax
NaN: said at the row's end) or the model's softmax also covered non-key columns (sinks).

The second line says where the numbers come from (:data:`hooks.trace.records.ATTENTION_SOURCES`) and
which KV head the query head reads, as recorded from the call's own shapes (``H`` query heads
against the keys' heads under ``enable_gqa``, or identical consecutive key heads when K/V were
repeated before the call; :func:`hooks.probes.attention.kv_heads`): query head h uses KV head
``h // (H / H_kv)`` (:func:`hooks.probes.attention.kv_groups`). A record whose call did not show the
keys says the sharing is unknown rather than guessing it from the config.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

from textual.binding import Binding
from textual.containers import ScrollableContainer
from textual.widgets import Static

from hooks.probes.attention import DEFAULT_ATTENTION_BYTES
from hooks.text import printable
from tui.screens.view import VIEW_BINDINGS, LayerViewScreen
from tui.widgets import fmt
from tui.widgets.footer import MdbFooter

LEGEND = "shade: ' ' 0 · '·' <5% · '░' <20% · '▒' <40% · '▓' <60% · '█' ≥60%"
LEGEND_MASKED = "' ' masked · '·' <5% · '░' <20% · '▒' <40% · '▓' <60% · '█' ≥60% · '!' NaN"
#: Where the probabilities come from, in a few words (keys of ``AttentionRecord.source``).
SOURCE_SHORT = {
    "sdpa": "SDPA call",
    "softmax": "model's softmax",
    "eager": "module's weights",
    "recomputed": "q_proj/k_proj (old trace)",
}


#: Why a record's KV heads are unknown, by its source.
KV_UNKNOWN = {
    "softmax": "the softmax sees no keys",
    "eager": "the module returned its weights, not its keys",
    "recomputed": "a trace of an older mdb",
}


def kv_line(record, head: int) -> str:
    """Where the probabilities come from and which KV head ``head`` reads, as recorded at the
    call (``AttentionRecord.num_kv_heads``, grouped by :func:`hooks.probes.attention.kv_groups`);
    "unknown" when the call did not show the keys."""
    from hooks.probes.attention import kv_groups

    n_heads = int(record.probs.shape[1])
    source = SOURCE_SHORT.get(record.source, record.source)
    hkv = getattr(record, "num_kv_heads", None)
    how = getattr(record, "kv_detail", "") or ""
    groups = kv_groups(n_heads, hkv)
    if groups is None:
        why = KV_UNKNOWN.get(record.source, "the keys were not seen")
        if hkv:
            why = f"{hkv} KV heads do not divide {n_heads} query heads"
        return f"{source} · {n_heads} heads · KV sharing unknown ({why})"
    mine = groups[head]
    sharers = [h for h, g in enumerate(groups) if g == mine]
    n_kv = len(set(groups))
    if n_kv == n_heads:
        return f"{source} · MHA: {n_heads} query heads, each with its own KV head"
    kind = "MQA" if n_kv == 1 else "GQA"
    detail = {"enable_gqa": " (enable_gqa)", "repeated": " (K/V repeated)"}.get(how, "")
    return (f"{source} · {kind}: query head {head} reads KV head {mine} of {n_kv}{detail}, "
            f"heads {' '.join(map(str, sharers))}")


def _cell(p: float, kept: bool) -> str:
    if math.isnan(p):
        return "!"
    if not kept:
        return " "
    return fmt.shade(p) if p > 0.0 else fmt.SHADES[1]


def grid_text(matrix: list[list[float]], labels: list[str], key_labels: list[str] | None = None,
              mask: list[list[bool]] | None = None) -> str:
    """The shaded grid: a header of key labels, then one row per query position (the lines
    of :func:`grid_parts`, joined)."""
    head, rows = grid_parts(matrix, labels, key_labels, mask)
    return "\n".join(head + rows)


def grid_parts(matrix: list[list[float]], labels: list[str],
               key_labels: list[str] | None = None,
               mask: list[list[bool]] | None = None) -> tuple[list[str], list[str]]:
    """The shaded grid as ``(header lines, row lines)``: the header of key labels (the view
    keeps it in place while the rows scroll), then one row per query position.

    Args:
        matrix: (T_q, T_k) probabilities.
        labels: a token label per query position (``[]`` when the positions are not tokens).
        key_labels: a label per key position (default: ``labels``).
        mask: (T_q, T_k) True where the key took part; None draws ``' '`` for 0.

    Single-character labels (a character tokenizer) head each column; longer ones (ids,
    subwords) are listed with separators above a ruler of key positions.
    """
    tk = len(matrix[0]) if matrix else 0
    keys = labels if key_labels is None else key_labels
    keys = [(keys[j] if j < len(keys) else "") for j in range(tk)]
    rows = [(labels[i] if i < len(labels) else "") for i in range(len(matrix))]
    single = all(len(k) <= 1 for k in keys + rows)
    width = 4 if single else max(4, min(6, max((len(r) for r in rows), default=0)))
    pad = " " * (width + 5)
    head = []
    if single:
        head.append(pad + "".join((k[:1] or " ") for k in keys))
    else:
        if any(keys):
            head.append("keys " + " ".join(k or "?" for k in keys))
        head.append(pad + "".join(str(j % 10) for j in range(tk)))
    lines = []
    for i, row in enumerate(matrix):
        kept = mask[i] if mask is not None else [True] * tk
        cells = "".join(_cell(p, k) if mask is not None else
                        ("!" if math.isnan(p) else fmt.shade(p)) for p, k in zip(row, kept,
                                                                                  strict=True))
        end = ""
        if mask is not None and not any(kept):
            end = " NaN: no key to attend to" if any(math.isnan(p) for p in row) \
                else " no key (all masked)"
        elif any(math.isnan(p) for p in row):
            end = " NaN"
        lines.append(f"{i:>3} {rows[i][:width]:<{width}}│{cells}│{end}")
    return head, lines


def empty_reason(trace) -> list[str]:
    """Why a trace holds no attention probabilities: the capture's notes, else that attention
    was not requested, with the way to request it where the trace came from: ``run.watch`` of
    ``hooks.run`` (its captures carry ``meta["logged"]``, the values of that step's ``log()``),
    else ``hooks.capture`` / ``mdb capture``."""
    notes = [(f"{n.module}: " if n.module else "") + n.message
             for n in trace.notes if n.kind == "attention"]
    if notes:
        return notes
    meta = getattr(trace, "meta", None) or {}
    if "logged" in meta:
        run = f" of run {meta['run']}" if meta.get("run") else ""
        return [f"step {meta.get('step', '?')}{run} was recorded by hooks.run's run.watch, "
                "which records attention probabilities only when asked: "
                "run.watch(model, every=50, attention=True) (each recorded step then stores "
                f"at most attention_bytes of them, {DEFAULT_ATTENTION_BYTES >> 20} MiB by "
                "default; attention_bytes=... sets "
                "the budget, attention=['pattern'] a subset of the modules)"]
    return ["this trace was captured without attention probabilities "
            "(hooks.capture(model, attention=True); mdb capture without --no-attention)"]


@dataclass
class NoProbabilities:
    """A decoder layer without attention probabilities (state-space, RWKV or linear attention),
    from the capture's note on it (:func:`hooks.probes.attention.no_softmax_kind`): listed among the
    layers so the view says so instead of leaving it out."""

    module: str
    layer: int | None
    note: str
    call_index: int = 0


def with_layers_without(trace, records: list) -> list:
    """``records`` with a :class:`NoProbabilities` for each layer the capture noted, placed
    before the first record of a later layer."""
    from hooks.trace.records import layer_of

    out = list(records)
    for n in trace.notes:
        if n.kind != "attention" or not n.module or not n.message.startswith(
                "no attention probabilities"):
            continue
        item = NoProbabilities(n.module, layer_of(n.module), n.message)
        at = next((i for i, r in enumerate(out) if item.layer is not None
                   and r.layer is not None and r.layer > item.layer), len(out))
        out.insert(at, item)
    return out


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
        self.records = with_layers_without(self.trace, list(self.trace.attention))
        self.head = 0
        self.batch = 0
        self.start_at_step_layer()
        self.matrix: list[list[float]] = []

    def compose(self):
        yield Static("", id="title", markup=False)
        yield Static("", id="kv", markup=False)
        with ScrollableContainer(id="grid-keys-scroll"):  # follows the grid's x, never its y
            yield Static("", id="grid-keys", markup=False)
        with ScrollableContainer(id="grid-scroll"):
            yield Static("", id="grid", markup=False)
        yield Static(LEGEND, id="legend", markup=False)
        yield Static("", id="hint", markup=False)
        yield MdbFooter()

    def on_mount(self) -> None:
        if not self.records:
            self.query_one("#title", Static).update(
                "attention · no attention probabilities were recorded")
            text = "\n\n".join(textwrap.fill(printable(r), 76)  # they name modules
                               for r in empty_reason(self.trace))
            self.query_one("#grid", Static).update(text)
            self.query_one("#legend", Static).update("")
            return
        self.show()
        grid = self.query_one("#grid-scroll", ScrollableContainer)
        self.watch(grid, "scroll_x", self._follow_x)
        grid.focus()

    def _follow_x(self, x: float) -> None:
        """Keep the header of key tokens over the columns the grid shows."""
        self.query_one("#grid-keys-scroll", ScrollableContainer).scroll_x = x

    def on_layer_changed(self) -> None:
        if not isinstance(self.record, NoProbabilities):
            self.head = min(self.head, self.record.probs.shape[1] - 1)

    def action_head(self, delta: int) -> None:
        if not self.records:
            return
        if isinstance(self.record, NoProbabilities):
            self.hint("this layer computes no attention probabilities: no heads to show")
            return
        heads = self.record.probs.shape[1]
        self.head = (self.head + delta) % heads
        self.hint("")
        self.show()

    def action_sequence(self) -> None:
        if not self.records or isinstance(self.record, NoProbabilities):
            return
        self.batch = (self.batch + 1) % self.record.probs.shape[0]
        self.show()

    def action_scroll(self, delta: int) -> None:
        grid = self.query_one("#grid-scroll", ScrollableContainer)
        grid.scroll_relative(y=delta * 3, animate=False)

    def _labels(self, rec, t_q: int, t_k: int) -> tuple[list[str], list[str]]:
        """Token labels of the queries and keys, where the call's positions are the input's."""
        tokens = self.trace.meta.get("tokens") or []
        shape = self.trace.meta.get("input_shape") or []
        seq = int(shape[-1]) if shape else (len(tokens) // max(rec.probs.shape[0], 1))
        names = {m.name for m in self.trace.modules}
        if {"encoder", "decoder"} <= names and not rec.module.startswith("encoder."):
            return [], []  # decoder positions are the labels', not the input's
        row = [printable(t) for t in tokens[self.batch * seq:(self.batch + 1) * seq]] \
            if seq else []  # a token's text: a control character shown escaped
        q = row if t_q == seq else []
        k = row if t_k == seq else []
        return q, k

    def show(self) -> None:
        """Draw the grid of the current layer, head and sequence."""
        rec = self.record
        if isinstance(rec, NoProbabilities):
            self.query_one("#title", Static).update(printable(
                f"attention · layer {'?' if rec.layer is None else rec.layer} "
                f"({self.position + 1}/{len(self.records)}) · {rec.module} · no probabilities"))
            self.query_one("#kv", Static).update("")
            self.query_one("#grid-keys", Static).update("")
            self.query_one("#grid", Static).update(textwrap.fill(printable(rec.note), 76))
            self.query_one("#legend", Static).update("")
            return
        b_count, n_heads, t_q, t_k = rec.probs.shape
        self.batch = min(self.batch, b_count - 1)
        self.matrix = rec.probs[self.batch, self.head].float().tolist()
        layer = "?" if rec.layer is None else rec.layer
        call = f" #{rec.call_index}" if rec.call_index else ""
        self.query_one("#title", Static).update(printable(
            f"attention · layer {layer} ({self.position + 1}/{len(self.records)}) · "
            f"head {self.head}/{n_heads} · {fmt.sequence(self.batch, b_count)} · "
            f"{rec.module}{call}"))
        self.query_one("#kv", Static).update(
            printable(kv_line(rec, self.head)))  # a trace file's source string
        mask = None
        if rec.mask is not None:
            m = rec.mask.expand(rec.probs.shape)
            mask = m[self.batch, self.head].tolist()
        q_labels, k_labels = self._labels(rec, t_q, t_k)
        notes = [rec.note] if rec.note else []
        if rec.dropout:
            notes.append(f"dropout p={rec.dropout:g} was applied after these probabilities")
        keys, rows = grid_parts(self.matrix, q_labels, k_labels, mask)
        self.query_one("#grid-keys", Static).update(
            "\n".join([textwrap.fill(printable(n), 76) for n in notes] + keys))
        self.query_one("#grid", Static).update("\n".join(rows))
        self.query_one("#legend", Static).update(LEGEND if mask is None else LEGEND_MASKED)
