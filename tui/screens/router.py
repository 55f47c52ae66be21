"""``RouterScreen``: what each MoE layer's router decided, token by token.

For the chosen layer (one :class:`hooks.RoutingRecord`, N = B·T tokens, E experts, top-k):

* per token: its position ``b:t``, its text, its k experts and their routing weights;
* per expert: the (token, slot) assignments it received, its share of the N·k assignments
  against the uniform share 1/E, and a flag when it takes far more than its share (at least
  :data:`HOT_VS_UNIFORM` times 1/E; for E=8, top-2 that is half of the tokens) or gets none;
* the rule that produced them, as verified against the ids and weights the experts received
  (softmax over E or sigmoid; bias, group-limited top-k, renormalisation, scale), and where the
  ids and weights were read;
* the layer's load-balancing loss ``E·Σ f_e P_e`` (1.0 = balanced) where it is defined (a
  softmax over all E, Switch/Mixtral), else why not, and the model's total ``aux_loss``.

Where the model has MoE blocks but nothing was recorded, the view names them and says why
(the capture's ``routing`` notes).
"""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Footer, Static

from tui.screens.view import VIEW_BINDINGS, LayerViewScreen
from tui.widgets import fmt

#: An expert whose share of the N·k assignments is at least this many times the uniform share
#: 1/E is flagged "hot" (for E=8, top-2: chosen by at least half of the tokens).
HOT_VS_UNIFORM = 2.0


def expert_rows(record) -> list[dict]:
    """Per expert of ``record``: assignments, share of N·k, share relative to uniform, flag.

    Returns:
        list[dict]: one dict per expert with keys ``expert``, ``count``, ``share`` (of N·k),
        ``vs_uniform`` (share × E), ``token_frac`` (count / N) and ``flag`` (``hot``,
        ``dead`` or ``ok``).
    """
    counts = [int(c) for c in record.tokens_per_expert.tolist()]
    n_tokens = int(record.top_k_ids.shape[0])
    total = max(sum(counts), 1)
    rows = []
    for e, c in enumerate(counts):
        token_frac = c / n_tokens if n_tokens else 0.0
        vs_uniform = c / total * record.num_experts
        kind = "dead" if c == 0 else ("hot" if vs_uniform >= HOT_VS_UNIFORM else "ok")
        rows.append({"expert": e, "count": c, "share": c / total, "vs_uniform": vs_uniform,
                     "token_frac": token_frac, "flag": kind})
    return rows


def source_line(rec) -> str:
    """Where the record's ids and weights were read."""
    if rec.source == "experts":
        return f"ids, weights: what {rec.module or '<root>'}.experts received"
    if rec.source == "router":
        return f"ids, weights: as {rec.router} returned them"
    return f"ids, weights: recomputed from {rec.router or 'the router'}'s logits (block's rule)"


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
                yield Static("", id="router-summary")
        yield Static("", id="hint", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        if not self.records:
            notes = [n for n in self.trace.notes if n.kind == "routing"]
            if notes:
                self.query_one("#title", Static).update(
                    f"router · {len(notes)} MoE block(s), no routing recorded")
                self.query_one("#router-summary", Static).update(
                    "\n".join(f"{n.module}: {n.message}" for n in notes))
            else:
                self.query_one("#title", Static).update(
                    "router · this model has no MoE layer (no module with an experts child)")
            return
        self.show()
        self.query_one("#tokens", DataTable).focus()

    def show(self) -> None:
        """Fill both tables and the summary for the current MoE layer."""
        rec = self.record
        layer = "?" if rec.layer is None else rec.layer
        self.query_one("#title", Static).update(
            f"router · layer {layer} ({self.position + 1}/{len(self.records)}) · {rec.module}"
            f" · E={rec.num_experts} top-{rec.top_k} · N={rec.top_k_ids.shape[0]} tokens"
        )
        self._fill_tokens(rec)
        rows = self._fill_experts(rec)
        self._fill_summary(rec, rows)

    def _fill_tokens(self, rec) -> None:
        table = self.query_one("#tokens", DataTable)
        table.clear(columns=True)
        table.add_column("b:t", key="pos")
        table.add_column("tok", key="tok")
        for j in range(rec.top_k):
            table.add_column(f"e{j + 1}", key=f"e{j}")
            table.add_column(f"w{j + 1}", key=f"w{j}")
        tokens = self.trace.meta.get("tokens") or []
        shape = self.trace.meta.get("input_shape") or [1, rec.top_k_ids.shape[0]]
        seq = int(shape[-1]) if shape else rec.top_k_ids.shape[0]
        ids = rec.top_k_ids.tolist()
        weights = rec.top_k_weights.tolist()
        for n, (row_ids, row_w) in enumerate(zip(ids, weights, strict=True)):
            tok = tokens[n] if n < len(tokens) else "?"
            cells = [f"{n // seq}:{n % seq}", tok[:6]]
            for e, w in zip(row_ids, row_w, strict=True):
                cells += [str(int(e)), f"{w:.2f}"]
            table.add_row(*cells, key=str(n))

    def _fill_experts(self, rec) -> list[dict]:
        table = self.query_one("#experts", DataTable)
        table.clear(columns=True)
        for label, key in (("e", "expert"), ("n", "count"), ("share", "share"),
                           ("", "bar"), ("×1/E", "vs"), ("", "flag")):
            table.add_column(label, key=key)
        rows = expert_rows(rec)
        top = max((r["share"] for r in rows), default=1.0) or 1.0
        for r in rows:
            table.add_row(
                str(r["expert"]), str(r["count"]), fmt.pct(r["share"]),
                fmt.bar(r["share"] / top, 5), f"{r['vs_uniform']:.2f}",
                fmt.flag(r["flag"]) if r["flag"] != "ok" else "", key=str(r["expert"]),
            )
        return rows

    def _fill_summary(self, rec, rows: list[dict]) -> None:
        meta = self.trace.meta
        lines = [f"uniform share 1/E = {fmt.pct(1 / rec.num_experts)}",
                 f"rule: {rec.rule_text()}", source_line(rec)]
        if rec.note:
            lines.append(rec.note)
        if rec.aux_loss is not None:
            lines.append(f"layer aux loss {rec.aux_loss:.4f} (1.0 = balanced)")
        else:
            lines.append(f"aux loss not shown: {rec.aux_loss_reason()}")
        total = meta.get("aux_loss")
        if total is not None:
            coef = (meta.get("config") or {}).get("router_aux_loss_coef")
            if coef is not None and all(r.aux_loss is not None for r in self.records):
                layer_sum = sum(r.aux_loss for r in self.records)
                lines.append(f"total aux_loss {fmt.sci(total)} = {coef} × Σ {layer_sum:.3f}")
            else:
                lines.append(f"model's aux_loss {fmt.sci(total)} (its own definition)")
        hot = [r for r in rows if r["flag"] == "hot"]
        dead = [r for r in rows if r["flag"] == "dead"]
        for r in hot:
            lines.append(f"▲ expert {r['expert']}: {fmt.pct(r['token_frac'])} of tokens, "
                         f"{r['vs_uniform']:.1f}× its share")
        if dead:
            lines.append("✗ no tokens: expert " + ", ".join(str(r["expert"]) for r in dead))
        if not hot and not dead:
            lines.append("✓ no expert dominates or starves")
        self.query_one("#router-summary", Static).update("\n".join(lines))
