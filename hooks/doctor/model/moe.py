"""Check 6: routing health of MoE layers over a few batches.

Dimension legend: N tokens, E experts, k experts per token.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hooks.doctor.model.registry import DoctorOptions, check
from hooks.doctor.model.result import Outcome
from hooks.doctor.model.target import MoEInfo, NotApplicable, SkipCheck, Target
from hooks.doctor.verdicts import MAX_LOAD_RATIO, expert_loads, hot_ratio
from hooks.engine.capture import capture

#: Fewest tokens per random batch (so a healthy expert is not "dead" by chance).
MIN_TOKENS = 256
#: Warn when the mean router entropy, as a fraction of ln E, is below this (near one-hot).
MIN_ENTROPY = 0.1


def routing_stats(records: list[Any]) -> dict[str, dict[str, Any]]:
    """Pool routing records per MoE block.

    Args:
        records: :class:`hooks.RoutingRecord` objects (several batches, several layers).

    Returns:
        ``{block: {"counts": [E ints], "tokens": N, "top_k": k, "entropy": mean over tokens of
        -Σ p log p / ln E, or None, "nonfinite": tokens left out}}``; counts are top-k
        assignments per expert, summing to N·k. Tokens whose router probabilities are not
        finite are left out. A router that does not score with a softmax over all E
        (DeepSeek-V3's sigmoid) has no probabilities: its counts come from the ids alone and
        its entropy is None.
    """
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        s = out.setdefault(r.module, {"counts": torch.zeros(r.num_experts, dtype=torch.long),
                                      "tokens": 0, "top_k": r.top_k, "ent_sum": 0.0,
                                      "ent_tokens": 0, "nonfinite": 0})
        ids = r.top_k_ids
        if r.router_probs is not None:
            p = r.router_probs.double()
            ok = torch.isfinite(p).all(dim=-1)  # a NaN row is the non-finite check's business
            p = p[ok]
            ent = -(p * p.clamp_min(1e-300).log()).sum(dim=-1)
            s["ent_sum"] += float(ent.sum())
            s["ent_tokens"] += p.shape[0]
        else:
            w = r.top_k_weights.double()
            ok = torch.isfinite(w).all(dim=-1)
        s["nonfinite"] += int((~ok).sum())
        s["counts"] += torch.bincount(ids[ok].reshape(-1).long(), minlength=r.num_experts)
        s["tokens"] += int(ok.sum())
    for s in out.values():
        e = s["counts"].numel()
        n_ent = s.pop("ent_tokens")
        ent_sum = s.pop("ent_sum")
        s["entropy"] = (None if not n_ent else ent_sum / n_ent / math.log(e) if e > 1 else 1.0)
        s["counts"] = [int(c) for c in s["counts"]]
    return out


def _record_routing(t: Target, o: DoctorOptions, blocks: list[MoEInfo]) -> tuple[list, int]:
    """The routing records of the model's own batch, then of ``routing_batches - 1``
    random-token batches of at least MIN_TOKENS tokens each, and how many records the own
    batch made (they come first). Raises SkipCheck when MoE blocks are found but no probe
    reads their router, NotApplicable for a dense model."""
    ids = t.need_ids()
    b, seq = ids.shape
    rows = max(b, -(-MIN_TOKENS // seq))  # random batches hold at least MIN_TOKENS tokens
    records = []

    def record(batch) -> None:
        with capture(t.model, include=[], inputs=False, grads=False, params=False) as tr:
            t.run(batch, use_cache=False)
        records.extend(tr.routing)

    with t.mode(False), torch.no_grad():
        record(t.batch)
        if not records:
            if blocks:
                raise SkipCheck(
                    f"{len(blocks)} MoE block(s) found ({blocks[0].name}) but hooks.capture "
                    f"recorded no routing for its router {type(blocks[0].router).__name__}: no "
                    "probe reads it yet")
            raise NotApplicable("a dense model: no MoE block (a module with experts and a "
                                "gate/router) and no routing recorded")
        own = len(records)
        for i in range(max(0, o.routing_batches - 1)):
            record(t.batch_with(shape=(rows, seq), seed=o.seed + 60 + i, targets="drop"))
    return records, own


def _tokens_used(t: Target, o: DoctorOptions) -> str:
    """Which tokens the check routed: ``the model's own batch (2×64) and 2 batches of
    uniformly random tokens (4×64)``."""
    b, seq = t.need_ids().shape
    rows = max(b, -(-MIN_TOKENS // seq))
    n = max(0, o.routing_batches - 1)
    rand = f" and {n} batch(es) of uniformly random tokens ({rows}×{seq})" if n else ""
    return f"the model's own batch ({b}×{seq}){rand}"


def _idle_on_own(stats: dict[str, dict[str, Any]]) -> tuple[str, list[int]] | None:
    """The layer with the most experts that got no token of the model's own batch, and
    them; None when every expert got some."""
    worst: tuple[str, list[int]] | None = None
    for block, s in stats.items():
        idle = [e for e, c in enumerate(s["counts"]) if c == 0]
        if idle and (worst is None or len(idle) > len(worst[1])):
            worst = (block, idle)
    return worst


def _judge_layers(stats: dict[str, dict[str, Any]]) -> tuple[
        dict[str, Any], tuple[str, list[int]] | None, tuple[float, str], str | None,
        tuple[float, str]]:
    """Each MoE layer's loads, dead and hot experts and entropy. Returns ``(layers,
    worst_dead, worst_ratio, hot_block, min_ent)``: the per-layer figures, the layer with the
    most dead experts, the largest load ratio and its layer, the layer of the worst hot
    expert (hooks.doctor.verdicts' rule, the router view's too), and the lowest entropy."""
    worst_dead: tuple[str, list[int]] | None = None
    worst_ratio = (0.0, "")
    hot_block: str | None = None
    min_ent = (2.0, "")
    layers: dict[str, Any] = {}
    for block, s in stats.items():
        counts = s["counts"]
        loads = expert_loads(counts, s["tokens"], s["top_k"])
        shares = [x.share for x in loads]
        dead = [x.expert for x in loads if x.flag == "dead"]
        hot = [x.expert for x in loads if x.flag == "hot"]
        ratio = max(x.ratio for x in loads)
        layers[block] = dict(counts=counts, shares=shares, dead=dead, hot=hot, load_ratio=ratio,
                             entropy=s["entropy"], tokens=s["tokens"], top_k=s["top_k"])
        if dead and (worst_dead is None or len(dead) > len(worst_dead[1])):
            worst_dead = (block, dead)
        if ratio > worst_ratio[0]:
            worst_ratio = (ratio, block)
            if hot:
                hot_block = block
        if s["entropy"] is not None and s["entropy"] < min_ent[0]:
            min_ent = (s["entropy"], block)
    return layers, worst_dead, worst_ratio, hot_block, min_ent


@check(6, "routing", "MoE routing health")
def routing(t: Target, o: DoctorOptions) -> Outcome:
    """Load per expert, the largest share, dead experts and router entropy, pooled over the
    model's own batch and ``routing_batches - 1`` random-token batches of the same length;
    the experts the own batch alone leaves without a token are said too (a warning: the
    router view of that step shows them idle)."""
    blocks = t.moe_blocks()
    records, own = _record_routing(t, o, blocks)
    n_batches = max(1, o.routing_batches)
    used = _tokens_used(t, o)
    own_stats = {k: v for k, v in routing_stats(records[:own]).items() if v["tokens"] > 0}
    stats = {k: v for k, v in routing_stats(records).items() if v["tokens"] > 0}
    if not stats:
        raise SkipCheck("router probabilities are not finite (see the non-finite check)")
    layers, worst_dead, worst_ratio, hot_block, min_ent = _judge_layers(stats)
    first = next(iter(stats.values()))
    e = len(first["counts"])
    idle = _idle_on_own(own_stats)
    data = dict(batches=n_batches, layers=layers, tokens_used=used,
                own_batch={k: v["counts"] for k, v in own_stats.items()})
    entropy = (f"router entropy ≥ {min_ent[0]:.2f}·ln E" if min_ent[1] or min_ent[0] <= 1.0
               else "no router entropy (the router scores without a softmax over all E)")
    ev = (f"{len(stats)} MoE layer(s), {first['tokens']} tokens: {used}: "
          f"busiest expert ×{worst_ratio[0]:.2f} its balanced share 1/{e}"
          f" ({worst_ratio[1]}), {entropy}")
    if worst_dead:
        block, dead = worst_dead
        return Outcome.fail(
            f"{block}: expert(s) {dead} received no tokens in {n_batches} batches "
            f"(counts {layers[block]['counts']}); {ev}",
            "a dead expert: its router logit never wins (collapsed or masked router, a bias "
            "pushing it down, or an aux loss that does not reach the router)",
            block or None, **data)
    if hot_block is not None:
        hb = layers[hot_block]
        limit = hot_ratio(len(hb["counts"]), hb["top_k"])
        what = (f"≥{limit:g}× the fair share" if limit == MAX_LOAD_RATIO
                else "every token chose one expert")
        return Outcome.warn(ev, f"load is unbalanced ({what}); check the aux-loss "
                            "coefficient and that it reaches the router", hot_block or None,
                            **data)
    if min_ent[0] < MIN_ENTROPY:
        return Outcome.warn(ev, "router probabilities are nearly one-hot (logits too large?)",
                            min_ent[1] or None, **data)
    if idle is not None:
        block, experts = idle
        return Outcome.warn(
            f"{block}: expert(s) {experts} got no token of the model's own batch (counts "
            f"{own_stats[block]['counts']}), though random tokens reach them; {ev}",
            "experts idle on real data: the router may be collapsing onto a few experts, or "
            "the batch is too small to reach them all", block or None, **data)
    return Outcome.ok(ev + "; no dead experts, every expert got tokens of the model's own "
                      "batch", **data)


