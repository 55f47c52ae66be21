"""``LensScreen``: the logit lens of the step's batch (``L`` in the step view).

A layers × positions grid: each cell the token decoder layer l already predicts at position t
(the top-1 of its output read through the model's final norm and LM head,
:func:`hooks.logit_lens`), coloured by its probability; ``m`` shows the lens in the middle of
each block instead (after attention, before the MLP). Enter on a cell shows its top k below
the grid and the direct logit attribution of that token at that position
(:func:`hooks.logit_attribution`: what each block's attention and MLP, and the heads that write
most, add to its logit through the final norm with its scale frozen); ``x`` shows the next
sequence of the batch. The lens is computed in a thread worker
from the step's own model and batch (the trace's replay), so a trace loaded from disk has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual import work
from textual.binding import Binding
from textual.message import Message
from textual.widgets import DataTable, Footer, Static

from hooks.text import printable
from tui.screens.view import VIEW_BINDINGS, ViewScreen
from tui.widgets import fmt

#: Tokens kept per cell for Enter.
TOP_K = 5
#: Characters of a token shown in a cell.
CELL_WIDTH = 6
#: Probability bands and their styles, lowest first: (upper bound, style, legend label).
BANDS = [(0.1, "grey50", "<.1"), (0.3, "cyan", "<.3"), (0.6, "yellow", "<.6"),
         (0.9, "bold dark_orange", "<.9"), (1.01, "bold red", "≥.9")]


def band_style(p: float) -> str:
    """The style of a cell whose top-1 probability is ``p``."""
    return next(style for upper, style, _ in BANDS if p < upper)


def legend() -> Text:
    """``p: <.1 <.3 <.6 <.9 ≥.9``, each band in its style."""
    text = Text("p: ")
    for _, style, label in BANDS:
        text.append(label + " ", style=style)
    return text


class KnownTokens:
    """A tokenizer made of what the trace knows: the label of each input id (its ``tokens``
    meta); other ids are ``#id``. Enough to name most predictions of a model trained on the
    batch's text, without the tokenizer itself."""

    def __init__(self, ids: list[int], labels: list[str]) -> None:
        self.labels = dict(zip(ids, labels, strict=False)) if len(ids) == len(labels) else {}

    def token_strings(self, ids) -> list[str]:
        """A label per id: the input token's, or ``#id``."""
        return [self.labels.get(int(i), f"#{int(i)}") for i in ids]


def _cut(text: str, width: int = CELL_WIDTH) -> str:
    text = printable(text)  # a token's or a module's text: a control character escaped
    return text if len(text) <= width else text[: width - 1] + "…"


class LensScreen(ViewScreen):
    """The logit lens grid over the step screen's trace.

    Args:
        step: the step screen beneath (its trace's replay gives the model and the batch).
    """

    VIEW = "lens"
    BINDINGS = [
        Binding("enter", "top", "top k", id="lens.top", tooltip="the selected cell's top k"),
        Binding("x", "next_row", "next seq", id="lens.next_row",
                tooltip="the next sequence of the batch"),
        Binding("m", "toggle_mid", "mid-block", id="lens.mid",
                tooltip="the lens after attention, before the MLP (m again: the block outputs)"),
        *VIEW_BINDINGS,
    ]
    CSS_PATH = "lens.tcss"

    @dataclass
    class Ready(Message):
        """The worker computed the lens (a :class:`hooks.whatif.lens.Lens`)."""

        lens: Any

    @dataclass
    class Failed(Message):
        """The worker could not compute it: one line."""

        error: str

    @dataclass
    class Attributed(Message):
        """The worker computed a cell's direct logit attribution: lines to show, or why not."""

        lines: list[str]

    def __init__(self, step) -> None:
        super().__init__(step)
        self.lens = None
        self.row = 0
        self.where = "out"

    def compose(self):
        yield Static("logit lens · computing…", id="title", markup=False)
        yield Static("each decoder layer's output through the model's final norm and LM head",
                     id="status", markup=False)
        yield DataTable(id="lens-grid", cursor_type="cell", zebra_stripes=False)
        yield Static("", id="lens-detail", markup=False)
        yield Static("", id="lens-dla", markup=False)
        yield Static(legend(), id="lens-legend")
        yield Static("", id="hint", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        replay = getattr(self.trace, "replay", None)
        if replay is None:
            self.query_one("#title", Static).update("logit lens · not available")
            self.hint("this trace was loaded from disk: it holds no model to run · use mdb lens "
                      "with the model options")
            return
        self._compute(replay)

    @work(thread=True, exclusive=True, exit_on_error=False, group="lens",
          description="compute the logit lens")
    def _compute(self, replay) -> None:
        import torch

        from hooks.batch import Batch
        from hooks.whatif.lens import logit_lens

        batch = Batch(replay.args, replay.kwargs)
        try:
            ids = batch.ids(replay.model)
            labels = (self.trace.meta or {}).get("tokens") or []
            tokens = KnownTokens(ids.reshape(-1).tolist(), labels) if ids is not None else None
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(replay.rng_cpu)
                lens = logit_lens(replay.model, batch, k=TOP_K, tokenizer=tokens)
        except Exception as exc:  # the model raised, or has no layers/norm/head to read
            self.post_message(self.Failed(" ".join(f"{type(exc).__name__}: {exc}".split())))
        else:
            self.post_message(self.Ready(lens))

    def on_lens_screen_failed(self, message: Failed) -> None:
        message.stop()
        self.query_one("#title", Static).update("logit lens · not available")
        self.hint(message.error)

    def on_lens_screen_ready(self, message: Ready) -> None:
        message.stop()
        self.lens = message.lens
        post = "" if self.lens.post == "none" else f" → {self.lens.post}"
        self.query_one("#title", Static).update(printable(
            f"logit lens · {self.lens.norm} → {self.lens.head}{post}"))
        for note in self.lens.notes:
            self.hint(f"⚠ {note}")
        self.draw()

    def draw(self) -> None:
        """Fill the grid for sequence :attr:`row`: one row per layer, one column per
        position."""
        lens = self.lens
        texts, probs = lens.table(self.row, self.where)
        table = self.query_one("#lens-grid", DataTable)
        table.clear(columns=True)
        table.add_column("layer", key="layer")
        inputs = lens.ids[self.row].tolist() if lens.ids is not None else None
        for t in range(len(texts[0]) if texts else 0):
            label = f"{t}" if inputs is None else f"{t} {_cut(lens.text_of(inputs[t]), 3)}"
            table.add_column(Text(label), key=str(t), width=CELL_WIDTH)  # never markup
        for layer, name in enumerate(lens.layers):
            cells = [Text(_cut(tok), style=band_style(float(p)))
                     for tok, p in zip(texts[layer], probs[layer].tolist(), strict=True)]
            table.add_row(Text(printable(".".join(name.split(".")[-2:]))), *cells,
                          key=str(layer))
        b, t = lens.shape
        what = ("mid-block (after attention, before the MLP)" if self.where == "mid"
                else "block outputs")
        self.query_one("#status", Static).update(
            f"{what} · {fmt.sequence(self.row, b)} · {lens.num_layers} layers × {t} positions · "
            "Enter: a cell's top k and logit attribution · m: mid/out · x: next sequence")
        if texts and texts[0]:
            table.move_cursor(row=0, column=1)  # on the first position, not the layer names
        table.focus()

    def _cell(self) -> tuple[int, int] | None:
        table = self.query_one("#lens-grid", DataTable)
        row, col = table.cursor_coordinate
        if self.lens is None or col == 0:
            return None
        return row, col - 1

    def action_top(self) -> None:
        cell = self._cell()
        if cell is None:
            self.hint("select a position (a cell right of the layer names) first"
                      if self.lens is not None else "the lens is still being computed")
            return
        layer, pos = cell
        lens = self.lens
        top = lens.top(layer, pos, TOP_K, row=self.row, where=self.where)
        ids = lens.ids[self.row].tolist() if lens.ids is not None else None
        where = (f" (input {lens.text_of(ids[pos])!r}"
                 + (f" → next {lens.text_of(ids[pos + 1])!r})" if pos + 1 < len(ids) else ")")
                 if ids is not None else "")
        shown = " · ".join(f"{t.text} {t.prob:.3f}" for t in top)
        mid = " (mid-block)" if self.where == "mid" else ""
        self.query_one("#lens-detail", Static).update(
            printable(f"{lens.layers[layer]}{mid} · position {pos}{where}: {shown}"))
        self.query_one("#lens-dla", Static).update("direct logit attribution · computing…")
        self._attribute(pos, top[0].id, top[0].text)

    @work(thread=True, exclusive=True, exit_on_error=False, group="lens-dla",
          description="direct logit attribution of a cell's token")
    def _attribute(self, pos: int, token: int, text: str) -> None:
        import torch

        from hooks.batch import Batch
        from hooks.whatif.dla import logit_attribution

        replay = self.trace.replay
        try:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(replay.rng_cpu)
                att = logit_attribution(replay.model, Batch(replay.args, replay.kwargs),
                                        tokens=token, position=pos)
        except Exception as exc:  # the model raised, or has no parts to attribute
            self.post_message(self.Attributed(
                ["direct logit attribution · not available: "
                 + " ".join(f"{type(exc).__name__}: {exc}".split())]))
        else:
            self.post_message(self.Attributed(attribution_lines(att, self.row, text)))

    def on_lens_screen_attributed(self, message: Attributed) -> None:
        message.stop()
        self.query_one("#lens-dla", Static).update(printable("\n".join(message.lines)))

    def action_toggle_mid(self) -> None:
        if self.lens is None:
            self.hint("the lens is still being computed")
            return
        where = "out" if self.where == "mid" else "mid"
        try:
            self.lens.table(self.row, where)
        except ValueError as exc:
            self.hint(str(exc))
            return
        self.where = where
        self.draw()

    def on_data_table_cell_selected(self, event: DataTable.CellSelected) -> None:
        event.stop()  # Enter on the focused grid
        self.action_top()

    def action_next_row(self) -> None:
        if self.lens is None:
            self.hint("the lens is still being computed")
            return
        b, _ = self.lens.shape
        self.row = (self.row + 1) % b
        self.draw()


#: Heads listed by the attribution line (those that write most, by |share|).
TOP_HEADS = 4


def attribution_lines(att, row: int, text: str) -> list[str]:
    """The lines of :class:`hooks.whatif.dla.LogitAttribution` ``att`` for batch row ``row``:
    the token and its logit, each block's attention and MLP share (or the block's), the heads
    that write most, and what the shares leave over (rounding)."""
    short = [".".join(n.split(".")[-2:]) for n in att.layers]
    lines = [f"direct logit attribution to {text!r} at position {att.position} (final norm's "
             f"scale frozen): logit {float(att.logit[row]):+.3f} = embed "
             f"{float(att.embed[row]):+.3f} + biases {float(att.bias[row]):+.3f} + blocks:"]
    parts = []
    for i, name in enumerate(short):
        if att.attention is not None:
            parts.append(f"{name} attn {float(att.attention[row, i]):+.3f} mlp "
                         f"{float(att.mlp[row, i]):+.3f}")
        else:
            parts.append(f"{name} {float(att.blocks[row, i]):+.3f}")
    lines.append(" · ".join(parts))
    if att.heads is not None:
        h = att.heads[row]
        flat = sorted(((float(h[i, j]), i, j) for i in range(h.shape[0])
                       for j in range(h.shape[1])), key=lambda x: -abs(x[0]))[:TOP_HEADS]
        lines.append("heads: " + " · ".join(f"{short[i]} h{j} {v:+.3f}" for v, i, j in flat))
    lines += [f"⚠ {n}" for n in att.notes]
    return lines
