"""The story of a spike: what grew first, by how much, and which tokens carry the loss.

Computed once when a step is captured by its trigger (:mod:`hooks.recorder.trigger`), stored
in the capture's ``meta["spike"]`` and read back by ``mdb runs``, ``mdb watch`` and ``mdb
overfit`` (they only show it).

* **Gradient growth** (:func:`gradient_growth`): the per-parameter gradient norms of the last
  steps (:meth:`hooks.recorder.trigger.StepTrigger.norm_history`). For each parameter, its
  running median over the steps before the last :data:`RECENT` is the baseline; the parameter
  whose norm first went above :data:`FACTOR` times it, within those last steps, **grew first**
  (ties: the larger ratio). Also the largest ratio at the spiking step.
* **Internals against earlier captures** (:func:`trace_features`, :func:`grown`): each
  module's output ``max |x|`` (first call), each parameter's gradient norm, each MoE
  layer's largest expert share, each attention call's mean largest probability (when the
  capture records attention), and Adam's update-to-weight ratio per parameter
  (:func:`adam_ratios`), divided by their median over the run's earlier captures; in
  forward order the first module whose output is :data:`FACTOR` times above its median grew
  first.
* **Tokens** (:func:`token_losses`, :func:`top_tokens`): the per-token cross-entropy of the
  replayed logits (B, T, V) against the labels (HF ``labels``: shifted by one, ``-100``
  ignored; nanoGPT ``targets``: as given), the :data:`TOP_TOKENS` largest.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["FACTOR", "RECENT", "TOP_TOKENS", "adam_ratios", "gradient_growth", "grown", "story",
           "story_line", "token_losses", "top_tokens", "trace_features"]

#: A value "grew" above this many times its own running median.
FACTOR = 3.0
#: The last steps in which the first growth is looked for (the median is over the ones before).
RECENT = 10
#: Tokens of the batch with the largest loss that the story names.
TOP_TOKENS = 5


def _logits(output: Any) -> torch.Tensor | None:
    cand = getattr(output, "logits", None)
    if isinstance(cand, torch.Tensor):
        return cand
    if isinstance(output, torch.Tensor):
        return output if output.ndim == 3 else None
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor) and t.ndim == 3
                     and t.is_floating_point()), None)
    return None


def token_losses(output: Any, args: tuple, kwargs: Mapping[str, Any]
                 ) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """Per-token cross-entropy of a forward's logits, in nats.

    Args:
        output: The forward's output: logits (B, T, V) as ``output.logits``, the output
            itself, or the first 3-D floating tensor of a tuple.
        args: The forward's positional arguments (nanoGPT's ``(idx, targets)``).
        kwargs: Its keyword arguments (``labels`` or ``targets``).

    Returns:
        ``(losses, targets, shifted)``: losses (B, T') fp32, ``NaN`` where the label is
        ignored (``-100``), the target ids (B, T'), and whether labels were shifted by one (HF
        ``labels``: position t is scored against ``labels[:, t+1]``, T' = T - 1); ``None``
        without logits or labels of matching shape.
    """
    logits = _logits(output)
    if logits is None:
        return None
    labels, shifted = kwargs.get("labels"), True
    if not isinstance(labels, torch.Tensor):
        labels, shifted = kwargs.get("targets"), False
    if not isinstance(labels, torch.Tensor) and len(args) > 1:
        labels = args[1]
    if not isinstance(labels, torch.Tensor) or labels.ndim != 2 or labels.is_floating_point():
        return None
    logits = logits.detach().float()
    if shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    if tuple(logits.shape[:2]) != tuple(labels.shape):
        return None
    b, t, v = logits.shape
    flat = F.cross_entropy(logits.reshape(b * t, v), labels.reshape(-1).to(logits.device),
                           reduction="none", ignore_index=-100)
    ignored = labels.reshape(-1).to(logits.device) == -100
    flat = flat.masked_fill(ignored, math.nan)
    return flat.reshape(b, t), labels, shifted


def top_tokens(losses: torch.Tensor, targets: torch.Tensor, shifted: bool,
               labels: Sequence[str] | None = None, k: int = TOP_TOKENS) -> list[dict[str, Any]]:
    """The ``k`` tokens (positions) with the largest loss, largest first.

    Args:
        losses: (B, T') per-token losses (NaN: ignored).
        targets: (B, T') target ids.
        shifted: Whether position t predicted token t + 1 of the batch.
        labels: The batch's token strings, flattened (B*T), when known.
        k: How many.

    Returns:
        One dict per token: ``row`` (b), ``position`` (the predicted token's position in the
        batch row), ``target`` (its id), ``token`` (its text, or ``#id``), ``loss`` (nats).
    """
    flat = torch.nan_to_num(losses.float().reshape(-1).cpu(), nan=-math.inf)
    n = min(int(k), int(torch.isfinite(flat).sum()))
    if n <= 0:
        return []
    vals, idx = torch.topk(flat, n)
    t_len = losses.shape[1]
    row_len = t_len + 1 if shifted else t_len
    out = []
    for v, i in zip(vals.tolist(), idx.tolist(), strict=True):
        b, t = divmod(i, t_len)
        pos = t + 1 if shifted else t
        tid = int(targets.reshape(-1)[i])
        flat_pos = b * row_len + pos
        text = labels[flat_pos] if labels is not None and flat_pos < len(labels) else f"#{tid}"
        out.append({"row": b, "position": pos, "target": tid, "token": str(text), "loss": v})
    return out


def gradient_growth(steps: Sequence[int], norms: torch.Tensor | None, names: Sequence[str],
                    factor: float = FACTOR, recent: int = RECENT) -> dict[str, Any] | None:
    """Which parameter's gradient norm grew first within the last ``recent`` steps.

    Args:
        steps: Step numbers, oldest first (S).
        norms: (S, P) gradient norms per step and parameter; the last row is the spiking step.
        names: The P parameter names.
        factor: Growth threshold (times the median).
        recent: Steps looked at (the median is over the rows before them; at least 5 needed).

    Returns:
        ``{"first": {...}, "largest": {...}, "over": n}``, each entry ``{"name", "step",
        "value", "median", "ratio"}`` (``first`` is ``None`` when none grew); ``None`` with
        too few steps.
    """
    if norms is None or norms.shape[0] < recent + 5 or norms.shape[1] != len(names):
        return None
    base = norms[:-recent].median(dim=0).values.clamp_min(1e-30)
    ratios = norms[-recent:] / base  # (recent, P)
    over = ratios > factor
    first = None
    for r in range(recent):
        hit = torch.nonzero(over[r]).reshape(-1)
        if hit.numel():
            j = int(hit[torch.argmax(ratios[r, hit])])
            first = _entry(names[j], steps[len(steps) - recent + r], norms[-recent + r, j],
                           base[j], ratios[r, j])
            break
    j = int(torch.argmax(torch.nan_to_num(ratios[-1], nan=-1.0)))
    largest = _entry(names[j], steps[-1], norms[-1, j], base[j], ratios[-1, j])
    return {"first": first, "largest": largest, "over": int(norms.shape[0] - recent)}


def _entry(name: str, step: int, value: Any, median: Any, ratio: Any) -> dict[str, Any]:
    return {"name": name, "step": int(step), "value": float(value), "median": float(median),
            "ratio": float(ratio)}


def trace_features(trace: Any) -> dict[str, float]:
    """Scalars of a capture to compare across captures: ``out:<module>`` (the first call's
    first output's ``max |x|``), ``grad:<parameter>`` (gradient L2 norm), ``route:<module>``
    (the largest expert's share of routed slots), in execution order."""
    feats: dict[str, float] = {}
    for rec in getattr(trace, "forward", []):
        if rec.call_index != 0 or not rec.outputs or rec.module == "":
            continue
        st = rec.outputs[0].stats
        if st is not None and st.abs_max is not None:
            feats[f"out:{rec.module}"] = float(st.abs_max)
    for name, p in getattr(trace, "params", {}).items():
        if p.grad_norm is not None:
            feats[f"grad:{name}"] = float(p.grad_norm)
    for r in getattr(trace, "routing", []):
        counts = getattr(r, "tokens_per_expert", None)
        if isinstance(counts, torch.Tensor) and counts.numel() and r.call_index == 0:
            feats[f"route:{r.module}"] = float(counts.max()) / max(1.0, float(counts.sum()))
    for a in getattr(trace, "attention", []):
        probs = getattr(a, "probs", None)
        if isinstance(probs, torch.Tensor) and probs.numel() and a.call_index == 0:
            top = torch.nan_to_num(probs.float()).amax(dim=-1)  # (B, H, T_q)
            feats[f"attn:{a.module}"] = float(top.mean())
    return feats


def adam_ratios(optimizer: Any, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Adam's update-to-weight ratio ``‖Δw‖ / ‖w‖`` per parameter for the update the optimizer
    is about to apply (``torch.optim.Adam``/``AdamW``, its gradient and moments: Kingma & Ba
    2015, Algorithm 1, without AdamW's decoupled weight decay), as ``adam:<parameter>``; empty
    for another optimizer. Nothing of the optimizer is changed.

    Args:
        optimizer: The optimizer, before its step.
        named: ``(name, parameter)`` pairs.
    """
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return {}
    names = {id(p): n for n, p in named}
    out: dict[str, float] = {}
    with torch.no_grad():
        for group in optimizer.param_groups:
            b1, b2 = group["betas"]
            lr, eps = float(group["lr"]), group["eps"]
            for p in group["params"]:
                if p.grad is None or id(p) not in names:
                    continue
                g = p.grad.float()
                st = optimizer.state.get(p, {})
                t = float(st.get("step", 0)) + 1
                m = b1 * st["exp_avg"].float() + (1 - b1) * g if "exp_avg" in st else (1 - b1) * g
                v = (b2 * st["exp_avg_sq"].float() + (1 - b2) * g * g if "exp_avg_sq" in st
                     else (1 - b2) * g * g)
                upd = lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
                w = float(p.float().norm())
                if w > 0:
                    out[f"adam:{names[id(p)]}"] = float(upd.norm()) / w
    return out


def grown(now: Mapping[str, float], history: Sequence[Mapping[str, float]],
          factor: float = FACTOR) -> dict[str, Any] | None:
    """Each feature of ``now`` against its median over the earlier captures ``history``.

    Returns:
        ``{"first": {...} | None, "largest": {...}, "captures": n}``: ``first`` is the first
        feature in ``now``'s (execution) order whose ratio is above ``factor``; ``largest`` the
        largest ratio; each ``{"name", "value", "median", "ratio"}``. ``None`` without an
        earlier capture or a comparable feature.
    """
    if not history:
        return None
    rows = []
    for key, v in now.items():
        old = [h[key] for h in history if key in h and math.isfinite(h[key])]
        if not old or not math.isfinite(v):
            continue
        med = statistics.median(old)
        ratio = v / med if med > 0 else (math.inf if v > 0 else 1.0)
        rows.append({"name": key, "value": v, "median": med, "ratio": ratio})
    if not rows:
        return None
    first = next((r for r in rows if r["ratio"] > factor), None)
    largest = max(rows, key=lambda r: r["ratio"])
    return {"first": first, "largest": largest, "captures": len(history)}


def _num(x: Any) -> str:
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return str(x)
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def _what(name: str) -> str:
    kind, _, where = name.partition(":")
    return {"out": f"{where} output max|x|", "grad": f"{where} gradient",
            "route": f"{where} top expert share", "attn": f"{where} attention max p",
            "adam": f"{where} Adam update/weight"}.get(kind, name)


def story_line(s: Mapping[str, Any]) -> str:
    """One line: ``step 266 (loss spike): loss 2.69, 2.7e+03× its median 0.001 · ‖g‖ 25 (85×)
    · grew first: blocks.1.attn.q_proj.weight gradient at step 264, 6.1× its median · top
    token '变' (row 0, position 17) 9.12 nats``."""
    trig = s.get("trigger", {})
    parts = [f"step {trig.get('step')} ({trig.get('reason')})"]
    loss, base = trig.get("loss"), trig.get("loss_baseline")
    if isinstance(loss, float):
        ratio = (f", {loss / base:.3g}× its median {_num(base)}"
                 if isinstance(base, float) and math.isfinite(base) and base > 0 else "")
        parts[0] += f": loss {_num(loss)}{ratio}"
    g, gb = trig.get("grad_norm"), trig.get("grad_baseline")
    if isinstance(g, float):
        ratio = (f" ({g / gb:.3g}× its median)" if isinstance(gb, float) and math.isfinite(gb)
                 and gb > 0 else "")
        parts.append(f"‖g‖ {_num(g)}{ratio}")
    gg = s.get("gradients") or {}
    first = gg.get("first")
    if first:
        parts.append(f"grew first: {first['name']} gradient at step {first['step']}, "
                     f"{first['ratio']:.3g}× its median")
    inner = (s.get("internals") or {}).get("first")
    if inner:
        parts.append(f"{_what(inner['name'])} {inner['ratio']:.3g}× its median over "
                     f"{s['internals']['captures']} capture(s)")
    top = s.get("top_tokens") or []
    if top:
        t = top[0]
        parts.append(f"top token {t['token']!r} (row {t['row']}, position {t['position']}) "
                     f"{_num(t['loss'])} nats")
    return " · ".join(parts)


def story(trigger: Mapping[str, Any], *, gradients: dict[str, Any] | None,
          internals: dict[str, Any] | None, tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``meta["spike"]`` of a triggered capture: the trigger's fields, the gradient growth
    (:func:`gradient_growth`), the internals against earlier captures (:func:`grown`), the top
    tokens (:func:`top_tokens`) and ``line`` (:func:`story_line`)."""
    s = {"trigger": dict(trigger), "gradients": gradients, "internals": internals,
         "top_tokens": tokens}
    s["line"] = story_line(s)
    return s
