"""``RouterScreen``: what each MoE layer's router decided, token by token.

For the chosen layer (one :class:`hooks.RoutingRecord`, N = B·T tokens, E experts, top-k):

* per token: its position ``b:t``, its text, its k experts and their routing weights;
* per expert: the tokens that chose it (of N), its share of the N·k top-k *picks* (token, slot
  assignments) against the uniform share 1/E, and a flag: hot or no tokens, by the rule the
  doctor's routing check uses (:func:`hooks.doctor.verdicts.expert_loads`);
* the rule that produced them, as verified against the ids and weights the experts received
  (softmax over E or sigmoid; bias, group-limited top-k, renormalisation, scale), and where the
  ids and weights were read;
* the layer's load-balancing loss ``E·Σ f_e P_e`` (1.0 = balanced) where it is defined (a
  softmax over all E, Switch/Mixtral), else why not, and the model's total ``aux_loss``: shown
  as ``coef × Σ`` of the layers only when that sum reproduces it.

On a padded batch (the model's ``attention_mask`` input holds zeros) the counts and the layer
aux loss here include the pad tokens, which the trace cannot tell apart; the model's own aux
loss (minillm, HF) leaves them out: the view says so, with the model's per-layer values where
it returned them (``aux_losses``).

Where the model has MoE blocks but nothing was recorded, the view names them and says why
(the capture's ``routing`` notes).
"""

from __future__ import annotations

import math

from rich.cells import cell_len
from rich.text import Text
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.visual import visualize
from textual.widgets import DataTable, Static

from hooks.text import printable
from tui.screens.view import VIEW_BINDINGS, LayerViewScreen
from tui.widgets import fmt
from tui.widgets.footer import MdbFooter


def expert_rows(record) -> list:
    """Each expert's load in ``record``, as the doctor counts it
    (:func:`hooks.doctor.verdicts.routing_record_loads`)."""
    from hooks.doctor.verdicts import routing_record_loads

    return routing_record_loads(record)


def padding(trace) -> tuple[int | None, int] | None:
    """Pad tokens of the batch, read from the model's ``attention_mask`` input (its recorded
    statistics: zeros are pads).

    Returns:
        ``(pads, tokens)`` (``pads`` None when its zeros were not counted exactly) for a
        (B, T) mask holding zeros; None when the batch has no such mask or no pad.
    """
    root = next((r for r in trace.forward if r.module == ""), None)
    if root is None:
        return None
    for t in root.inputs:
        if not t.path.endswith("attention_mask") or len(t.shape) != 2 or t.stats is None:
            continue
        if t.stats.min is None or t.stats.min != 0:
            return None
        n = int(t.stats.numel)
        return (round(t.stats.zero_frac * n) if t.stats.zero_exact else None), n
    return None


def source_line(rec) -> str:
    """Where the record's ids and weights were read."""
    if rec.source == "experts":
        return f"ids, weights: what {rec.module or '<root>'}.experts received"
    if rec.source == "router":
        return f"ids, weights: as {rec.router} returned them"
    if rec.source == "topk":
        return f"ids, weights: the block's own topk over {rec.router}'s scores"
    return f"ids, weights: recomputed from {rec.router or 'the router'}'s logits (block's rule)"


def _width(cell) -> int:
    return cell.cell_len if isinstance(cell, Text) else cell_len(cell)


def refill(table: DataTable, labels: list[str], keys: list[str], rows: list[list],
           row_keys: list[str] | None = None) -> None:
    """Show ``rows`` (cells: str or Text) in ``table``, under columns ``labels``/``keys``, rows
    keyed ``row_keys`` (default ``"0"``, ``"1"``, …).

    From one layer to the next mostly the cells change: when the columns, the row keys and
    every column's width (its widest cell or label) are those on show, only the cells that
    differ are updated, in place (the table is neither rebuilt nor measured again) and the
    cursor goes back to the first row, as in a rebuilt table; otherwise the table is rebuilt.
    """
    row_keys = row_keys if row_keys is not None else [str(n) for n in range(len(rows))]
    widths = [max([cell_len(label)] + [_width(r[i]) for r in rows])
              for i, label in enumerate(labels)]
    layout = (labels, keys, row_keys, widths)
    shown = getattr(table, "_mdb_shown", None)
    if shown is not None and shown[0] == layout and table.row_count == len(rows):
        for key, old, new in zip(row_keys, shown[1], rows, strict=True):
            for column, a, b in zip(keys, old, new, strict=True):
                if a is not b and a != b:
                    table.update_cell(key, column, b)
        table.move_cursor(row=0, column=0, animate=False)
        table.scroll_to(0, 0, animate=False)
    else:
        table.clear(columns=True)
        for label, key in zip(labels, keys, strict=True):
            table.add_column(label, key=key)
        for key, cells in zip(row_keys, rows, strict=True):
            table.add_row(*cells, key=key)
    table._mdb_shown = (layout, rows)


class RouterScreen(LayerViewScreen):
    """Per-layer routing table, tokens per expert and the load-balancing losses."""

    VIEW = "router"
    LAYER_KIND = "MoE layers"
    BINDINGS = [
        Binding("N,right_square_bracket,right,l", "layer(1)", "next layer", key_display="N",
                id="router.next_layer"),
        Binding("P,left_square_bracket,left,h", "layer(-1)", "prev layer", key_display="P",
                show=False, id="router.prev_layer"),
        Binding("tab", "app.focus_next", "switch table", show=False, id="router.focus"),
        *VIEW_BINDINGS,
    ]

    def __init__(self, step) -> None:
        super().__init__(step)
        self.records = list(self.trace.routing)
        self.start_at_step_layer()

    def compose(self):
        yield Static("", id="title", markup=False)
        with Horizontal(id="router-main"):
            yield DataTable(id="tokens", cursor_type="row", zebra_stripes=True)
            with Vertical(id="router-side"):
                yield DataTable(id="experts", cursor_type="row")
        yield Static("", id="router-summary", markup=False)
        yield Static("", id="hint", markup=False)
        yield MdbFooter()

    def on_mount(self) -> None:
        if not self.records:
            notes = [n for n in self.trace.notes if n.kind == "routing"]
            if notes:
                self.query_one("#title", Static).update(
                    f"router · {len(notes)} MoE block(s), no routing recorded")
                self.query_one("#router-summary", Static).update(
                    "\n".join(printable(f"{n.module}: {n.message}") for n in notes))
            else:
                self.query_one("#title", Static).update(
                    "router · this model has no MoE layer (no module with an experts child, "
                    "none declared, no topk over a router's scores beside E experts)")
            return
        self.show()
        self.query_one("#tokens", DataTable).focus()

    def show(self) -> None:
        """Fill both tables and the summary for the current MoE layer."""
        rec = self.record
        layer = "?" if rec.layer is None else rec.layer
        self.query_one("#title", Static).update(  # one row high (app.tcss): no layout
            printable(f"router · layer {layer} ({self.position + 1}/{len(self.records)}) · "
                      f"{rec.module} · E={rec.num_experts} top-{rec.top_k} · "
                      f"N={rec.top_k_ids.shape[0]} tokens"),
            layout=False,
        )
        self._fill_tokens(rec)
        rows = self._fill_experts(rec)
        self._fill_summary(rec, rows)

    def _token_rows(self, rec) -> list[list[str]]:
        """The cells of the tokens table for ``rec`` (formatted once per layer)."""
        cache = self.__dict__.setdefault("_token_rows_cache", {})
        rows = cache.get(id(rec))
        if rows is None:
            tokens = self.trace.meta.get("tokens") or []
            shape = self.trace.meta.get("input_shape") or [1, rec.top_k_ids.shape[0]]
            seq = int(shape[-1]) if shape else rec.top_k_ids.shape[0]
            ids = rec.top_k_ids.tolist()
            weights = rec.top_k_weights.tolist()
            rows = []
            for n, (row_ids, row_w) in enumerate(zip(ids, weights, strict=True)):
                tok = tokens[n] if n < len(tokens) else "?"
                cells = [f"{n // seq}:{n % seq}", Text(printable(tok[:6]))]  # never markup
                for e, w in zip(row_ids, row_w, strict=True):
                    cells += [str(int(e)), f"{w:.2f}"]
                rows.append(cells)
            cache[id(rec)] = rows
        return rows

    def _fill_tokens(self, rec) -> None:
        labels = ["b:t", "tok"] + [f"{c}{j + 1}" for j in range(rec.top_k) for c in "ew"]
        keys = ["pos", "tok"] + [f"{c}{j}" for j in range(rec.top_k) for c in "ew"]
        refill(self.query_one("#tokens", DataTable), labels, keys, self._token_rows(rec))

    def _fill_experts(self, rec) -> list:
        # "tok": tokens that chose the expert (of N); "picks": its share of the N·k top-k picks
        labels = ["e", "tok", "picks", "", "×1/E", ""]
        keys = ["expert", "tokens", "share", "bar", "vs", "flag"]
        rows = expert_rows(rec)
        top = max((r.share for r in rows), default=1.0) or 1.0
        cells = [[str(r.expert), str(r.tokens), fmt.pct(r.share), fmt.bar(r.share / top, 5),
                  f"{r.ratio:.2f}", fmt.flag(r.flag) if r.flag != "ok" else ""]
                 for r in rows]
        refill(self.query_one("#experts", DataTable), labels, keys, cells,
               [str(r.expert) for r in rows])
        return rows

    def _fill_summary(self, rec, rows: list) -> None:
        """The flags first, then what the columns count, the aux losses, and the routing rule.

        The summary spans the screen's width below the tables and is as tall as its lines
        wrapped to it (app.tcss): a layer whose text wraps to as many lines as the one on
        show is repainted without a layout."""
        meta = self.trace.meta
        n = int(rec.top_k_ids.shape[0])
        lines = []
        hot = [r for r in rows if r.flag == "hot"]
        dead = [r for r in rows if r.flag == "dead"]
        for r in hot:
            lines.append(f"▲ expert {r.expert}: {fmt.pct(r.share)} of the picks "
                         f"({r.ratio:.1f}× 1/E), chosen by {r.tokens} of {n} tokens "
                         f"({fmt.pct(r.token_frac)})")
        if dead:
            lines.append("✗ no tokens: expert " + ", ".join(str(r.expert) for r in dead))
        if not hot and not dead:
            lines.append("✓ no expert dominates or starves")
        lines.append(f"tok: tokens that chose e, of N={n} · picks: its share of the "
                     f"N·k = {n * rec.top_k} top-{rec.top_k} picks (uniform 1/E = "
                     f"{fmt.pct(1 / rec.num_experts)})")
        pads = padding(self.trace)
        if pads is not None:
            count, total = pads
            what = f"{count} of {total}" if count is not None else f"some of {total}"
            lines.append(f"padded batch: {what} tokens are pads (attention_mask); they are in "
                         "these counts and this aux loss, the model's aux loss leaves them out")
        if rec.aux_loss is not None:
            lines.append(f"layer aux loss {rec.aux_loss:.4f} (1.0 = balanced)")
            own = self._model_layer_aux()
            if own is not None and not math.isclose(own, rec.aux_loss, rel_tol=1e-4,
                                                    abs_tol=1e-6):
                lines.append(f"the model's own for this layer: {own:.4f}")
        else:
            lines.append(f"aux loss not shown: {rec.aux_loss_reason()}")
        lines.extend(self._total_lines(meta, pads is not None))
        lines += [f"rule: {rec.rule_text()}", source_line(rec)]
        if rec.note:
            lines.append(rec.note)
        summary = self.query_one("#router-summary", Static)
        text = "\n".join(printable(line) for line in lines)  # names a module, the router
        width, height = summary.content_region.width, summary.content_region.height
        same = width > 0 and visualize(summary, text, markup=False).get_height(
            summary.styles, width) == height
        summary.update(text, layout=not same)

    def _model_layer_aux(self) -> float | None:
        """This layer's aux loss as the model returned it
        (:func:`hooks.doctor.verdicts.model_layer_aux`)."""
        from hooks.doctor.verdicts import model_layer_aux

        return model_layer_aux(self.trace.meta, len(self.records), self.position)

    def _total_lines(self, meta, padded: bool) -> list[str]:
        """The model's total ``aux_loss``; ``= coef × Σ`` of the layers only when it is
        (:func:`hooks.doctor.verdicts.aux_total`)."""
        from hooks.doctor.verdicts import aux_total

        aux = aux_total(self.records, meta)
        if aux is None:
            return []
        if aux.consistent is None:
            return [f"model's aux_loss {fmt.sci(aux.total)} (its own definition)"]
        if aux.consistent:
            return [f"total aux_loss {fmt.sci(aux.total)} = {aux.coef:g} × Σ {aux.layer_sum:.3f}"]
        return [f"model's aux_loss {fmt.sci(aux.total)}; {aux.coef:g} × Σ of these layers = "
                f"{fmt.sci(aux.coef * aux.layer_sum)} "
                + ("(pads left out there)" if padded else "(it computes its own)")]
