"""The numbers behind mdb's verdicts, shared by the doctor's checks and the views.

One place for each rule, so the doctor (:mod:`hooks.doctor.model`) and the views (``tui``) cannot
disagree:

* **a parameter's gradient** (:func:`param_verdict`): ok, vanishing, exploding, NaN/Inf, None,
  frozen, stale, zero, and two that need to know how many rows (tokens) reached the parameter's
  module: *few tokens* (a gradient that is small only because its module saw few of the
  batch's rows, e.g. an expert that got one token) and *not called* (an expert that got none);
* **the total gradient norm** of a capture (:func:`grad_total_norm`), exact L2 over every
  recorded ``.grad`` with NaN/Inf propagated (:func:`hooks.tensors.norms.combine_norms`), the number
  the trainer logs as ``grad_norm``;
* **an expert's load** (:func:`expert_loads`): hot, dead or ok, from the top-k assignments.

Gradient thresholds are heuristics for a freshly initialised or early-training model in fp32, on
the ratio ``‖g‖/‖w‖`` (scale-free: one threshold fits a norm weight of ones and a projection of
small values alike) and on the raw norm. With a mean-reduced loss over N rows, a weight's
gradient is a sum of per-row terms each ~1/N, so a module that r of N rows reached has a
gradient ~r/N of what it would have with all of them: the few-tokens rule judges ``‖g‖·N/r``.

Never imports torch, textual, rich or tui; the records are read by attribute.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hooks.tensors.norms import combine_norms

__all__ = [
    "EXPLODING_NORM",
    "EXPLODING_RATIO",
    "MAX_LOAD_RATIO",
    "VANISHING_NORM",
    "VANISHING_RATIO",
    "ExpertLoad",
    "GradTotal",
    "expert_loads",
    "grad_total_norm",
    "hot_ratio",
    "param_verdict",
    "rows_by_module",
]

#: ``‖g‖/‖w‖`` below this (or a gradient norm below :data:`VANISHING_NORM`): vanishing.
VANISHING_RATIO = 1e-5
#: Gradient L2 norm below this: vanishing.
VANISHING_NORM = 1e-8
#: ``‖g‖/‖w‖`` above this (or a gradient norm above :data:`EXPLODING_NORM`): exploding.
EXPLODING_RATIO = 10.0
#: Gradient L2 norm above this: exploding.
EXPLODING_NORM = 100.0

#: An expert whose share of the N·k top-k assignments reaches this many times the uniform share
#: 1/E is hot (the doctor's routing check warns, the router view flags it); where E/k is
#: smaller (E=4, top-2), an expert chosen by every token is hot (:func:`hot_ratio`).
MAX_LOAD_RATIO = 3.0


# -- gradients ------------------------------------------------------------------------------------
def _raw_verdict(g: float, r: float | None) -> str:
    if g > EXPLODING_NORM or (r is not None and r > EXPLODING_RATIO):
        return "exploding"
    if g < VANISHING_NORM or (r is not None and r < VANISHING_RATIO):
        return "vanishing"
    return "ok"


def param_verdict(p: Any, rows: int | None = None, batch_rows: int | None = None) -> str:
    """The verdict on one parameter's gradient.

    Args:
        p: a :class:`hooks.ParamGradRecord` (``status``, ``grad_norm``, ``ratio``,
            ``nan_count``, ``inf_count``).
        rows: rows (tokens) that reached the parameter's module in the captured step (the
            leading dimensions of its outputs, summed over its calls; 0 when it was never
            called), or None when unknown (then the rows are not taken into account).
        batch_rows: rows of the batch that a module reached by every token sees (B·T for a
            language model), or None.

    Returns:
        str: ``nan`` (NaN/Inf entries or a non-finite norm), ``unused`` (no gradient and the
        module was never called), ``none`` (``.grad`` is None), ``frozen``, ``stale``, ``zero``,
        ``exploding``, ``vanishing``, ``few`` (vanishing only as a total: per row reached,
        ``‖g‖·batch_rows/rows`` is not) or ``ok``, checked in that order.
    """
    if p.nan_count or p.inf_count or (p.grad_norm is not None and not math.isfinite(p.grad_norm)):
        return "nan"
    if p.grad_norm is None and rows == 0 and p.status in ("none", "stale"):
        return "unused"
    if p.status in ("none", "frozen", "stale", "zero"):
        return p.status
    g = p.grad_norm
    if g is None:
        return "none"
    verdict = _raw_verdict(g, p.ratio)
    if verdict == "vanishing" and rows and batch_rows and rows < batch_rows:
        scale = batch_rows / rows
        if _raw_verdict(g * scale, None if p.ratio is None else p.ratio * scale) == "ok":
            return "few"
    return verdict


def _rows(shape: Sequence[int]) -> int:
    """Rows of an output: the product of its leading dimensions (all of them for a 1-D one)."""
    dims = [int(d) for d in shape]
    if not dims:
        return 1
    return math.prod(dims[:-1]) if len(dims) > 1 else dims[0]


def rows_by_module(trace: Any) -> tuple[dict[str, int], int | None]:
    """Rows (tokens) that reached each module in a trace, and the batch's rows.

    Args:
        trace: a :class:`hooks.Trace` (``modules``, ``forward`` call records with ``outputs``).

    Returns:
        ``(rows, batch_rows)``: ``rows[module]`` is the sum over the module's forward calls of
        the leading dimensions of its first output (0 for a module of ``trace.modules`` that
        was never called; absent when a call had no tensor output); ``batch_rows`` is the
        largest number of rows a single call produced (B·T for a language model), or None.
    """
    rows: dict[str, int] = {m.name: 0 for m in getattr(trace, "modules", [])}
    unknown: set[str] = set()
    most = None
    for rec in trace.forward:
        if not rec.outputs:
            unknown.add(rec.module)
            continue
        n = _rows(rec.outputs[0].shape)
        rows[rec.module] = rows.get(rec.module, 0) + n
        most = n if most is None else max(most, n)
    for name in unknown:
        rows.pop(name, None)
    return rows, most


@dataclass(frozen=True)
class GradTotal:
    """The global gradient norm of a capture.

    Attributes:
        norm: ``sqrt(Σ ‖g_p‖²)`` over ``counted`` parameters (NaN when any is NaN, Inf when
            any is infinite); None when no parameter has a gradient.
        counted: parameters with a ``.grad`` (tied ones once).
        nonfinite: how many of them have a NaN/Inf gradient (or norm).
    """

    norm: float | None
    counted: int
    nonfinite: int


def grad_total_norm(params: Iterable[Any]) -> GradTotal:
    """The total L2 norm of every recorded parameter gradient, the number
    ``torch.nn.utils.clip_grad_norm_(model.parameters())`` returns for the same ``.grad``.

    Args:
        params: :class:`hooks.ParamGradRecord` objects (``trace.params.values()``).

    Returns:
        :class:`GradTotal`; a parameter without ``.grad`` (None, frozen) is not counted, a
        stale ``.grad`` is (it is what an optimizer step would use).
    """
    norms = []
    bad = 0
    for p in params:
        if p.grad_norm is None:
            continue
        norms.append(p.grad_norm)
        if p.nan_count or p.inf_count or not math.isfinite(p.grad_norm):
            bad += 1
    if not norms:
        return GradTotal(None, 0, 0)
    return GradTotal(combine_norms(norms), len(norms), bad)


# -- experts --------------------------------------------------------------------------------------
def hot_ratio(num_experts: int, top_k: int) -> float:
    """Load ratio (share × E) at which an expert is hot: :data:`MAX_LOAD_RATIO`, or E/k (the
    ratio of an expert chosen by every token) when that is smaller."""
    return min(MAX_LOAD_RATIO, num_experts / max(top_k, 1))


@dataclass(frozen=True)
class ExpertLoad:
    """One expert's load in N tokens routed top-k among E experts.

    Attributes:
        expert: its index e.
        assignments: (token, slot) assignments it received, of the N·k.
        tokens: tokens that chose it among their k (equal to ``assignments`` when each token's
            k experts are distinct, as top-k makes them).
        share: ``assignments / (N·k)``; uniform routing gives 1/E.
        ratio: ``share × E``: 1.0 is its uniform share.
        token_frac: ``tokens / N``; uniform routing gives k/E.
        flag: ``hot`` (``ratio ≥`` :func:`hot_ratio`), ``dead`` (no assignment) or ``ok``.
    """

    expert: int
    assignments: int
    tokens: int
    share: float
    ratio: float
    token_frac: float
    flag: str


def expert_loads(assignments: Sequence[int], n_tokens: int, top_k: int,
                 tokens: Sequence[int] | None = None) -> list[ExpertLoad]:
    """Each expert's load and flag: the one hot/dead rule of the doctor and the router view.

    Args:
        assignments: (E,) top-k assignments per expert (they sum to N·k).
        n_tokens: N, the tokens routed.
        top_k: k.
        tokens: (E,) tokens that chose each expert, when they may differ from
            ``assignments``; default: ``assignments``.

    Returns:
        One :class:`ExpertLoad` per expert, in expert order.
    """
    e = len(assignments)
    total = sum(int(c) for c in assignments)
    hot = hot_ratio(e, top_k)
    out = []
    for i, c in enumerate(assignments):
        c = int(c)
        share = c / total if total else 0.0
        ratio = share * e
        flag = "dead" if c == 0 else ("hot" if ratio >= hot * (1 - 1e-9) else "ok")
        t = c if tokens is None else int(tokens[i])
        out.append(ExpertLoad(i, c, t, share, ratio, t / n_tokens if n_tokens else 0.0, flag))
    return out


def routing_record_loads(record) -> list[ExpertLoad]:
    """Each expert's load in one routing record (:class:`hooks.trace.records.RoutingRecord`): the
    top-k picks it received, its share of the N·k picks against 1/E, its flag, and the tokens
    that chose it (a token that picked an expert twice counts once).

    Args:
        record: A routing record: ``top_k_ids`` (N, k), ``tokens_per_expert`` (E,),
            ``num_experts`` E and ``top_k`` k.

    Returns:
        One :class:`ExpertLoad` per expert, in expert order (:func:`expert_loads`).
    """
    import torch

    ids = record.top_k_ids.long()
    e = record.num_experts
    picks = [int(c) for c in record.tokens_per_expert.tolist()]
    tokens = picks
    if ids.numel() and ids.shape[-1] > 1:  # tokens choosing an expert twice count once
        srt = ids.sort(dim=-1).values
        first = torch.ones_like(srt, dtype=torch.bool)
        first[:, 1:] = srt[:, 1:] != srt[:, :-1]
        tokens = torch.bincount(srt[first], minlength=e).tolist()
    return expert_loads(picks, int(ids.shape[0]), record.top_k, tokens)


@dataclass(frozen=True)
class AuxTotal:
    """A model's total aux loss against the layers' own (``coef × Σ`` of the per-layer
    Switch losses), as the router view shows it.

    Attributes:
        total: The model's ``aux_loss``.
        coef: ``router_aux_loss_coef`` from its config, or ``None``.
        layer_sum: Σ of the recorded layers' aux losses, or ``None`` when one is missing.
        consistent: Whether ``total == coef × layer_sum`` (rel 1e-4, abs 1e-7); ``None``
            when there is no coefficient or layer sum to compare with.
    """

    total: float
    coef: float | None
    layer_sum: float | None
    consistent: bool | None


def aux_total(records: Sequence, meta: Mapping) -> AuxTotal | None:
    """The model's ``aux_loss`` (``meta["aux_loss"]``) checked against ``coef × Σ`` of the
    routing records' layer aux losses (HF's ``router_aux_loss_coef``, Switch Transformer
    eq. 4 per layer); ``None`` when the model reported no total."""
    total = meta.get("aux_loss")
    if not isinstance(total, (int, float)):
        return None
    coef = (meta.get("config") or {}).get("router_aux_loss_coef")
    if coef is None or any(r.aux_loss is None for r in records):
        return AuxTotal(float(total), coef, None, None)
    layer_sum = float(sum(r.aux_loss for r in records))
    ok = math.isclose(coef * layer_sum, total, rel_tol=1e-4, abs_tol=1e-7)
    return AuxTotal(float(total), float(coef), layer_sum, ok)


def model_layer_aux(meta: Mapping, n_layers: int, position: int) -> float | None:
    """Layer ``position``'s aux loss as the model returned it (``meta["aux_losses"]``, one
    per MoE layer in order), or ``None``."""
    own = meta.get("aux_losses")
    if not isinstance(own, list) or len(own) != n_layers:
        return None
    value = own[position]
    return float(value) if isinstance(value, (int, float)) else None
