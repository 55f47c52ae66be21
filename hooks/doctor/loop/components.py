"""The accumulation check per loss component: an MoE model's loss is LM + aux, and under
gradient accumulation the aux term must be normalised like the LM term.

:func:`hooks.doctor.loop.checks.accumulation_findings` fits the accumulated gradient with one
weight per micro-batch; an aux term weighted k× too heavily (added whole on every micro-batch
while the LM term is divided over the window: HF's ``num_items_in_batch`` normalises the LM
loss only) is a small part of the gradient and hides under its tolerance. Here each
component gets its own factor: ``.grad ≈ α · Σ_i w_i g_LM,i + β · Σ_i w_i g_aux,i`` (least
squares, ``w_i = n_i / Σ n``), and α must equal β.

Dimension legend: P parameters (flat), k micro-batches.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hooks.doctor.loop.checks import ACCUM_FIT, ACCUM_TOL, finding

__all__ = ["component_accumulation_findings"]


def component_accumulation_findings(step: int, accumulated: torch.Tensor,
                                    per_batch: list[torch.Tensor],
                                    aux_parts: list[tuple[torch.Tensor, float]],
                                    tokens: list[int]) -> list[dict[str, Any]]:
    """Fit the accumulated gradient with one factor per loss component (LM, aux).

    Args:
        step: The watched step.
        accumulated: (P,) the real accumulated ``.grad``, flat.
        per_batch: k tensors (P,): micro-batch i's whole-loss gradient, its LM part rescaled
            to a mean over its own tokens (what the replay returns).
        aux_parts: k pairs ``(g_aux,i, s_i)``: micro-batch i's aux-term gradient as the model
            computed it, and the factor the replay divided the whole gradient by (so that
            ``g_LM,i = per_batch[i] - g_aux,i / s_i``).
        tokens: k token counts n_i.

    Returns:
        At most one finding (kind ``grad_accumulation``, subject ``aux loss normalisation``)
        when β/α is off 1 by more than :data:`ACCUM_TOL`; none when the aux term is zero (a
        coefficient of 0) or the two-factor fit misses ``.grad`` by more than
        :data:`ACCUM_FIT`.
    """
    k = len(per_batch)
    if k < 2 or len(aux_parts) != k or sum(tokens) <= 0:
        return []
    acc = accumulated.double()
    norm = float(acc.norm())
    w = [n / sum(tokens) for n in tokens]
    aux = [g.double() for g, _ in aux_parts]
    lm = [p.double() - a / s for p, a, (_, s) in zip(per_batch, aux, aux_parts, strict=True)]
    g_lm = sum(wi * x for wi, x in zip(w, lm, strict=True))
    g_aux = sum(wi * x for wi, x in zip(w, aux, strict=True))
    if norm == 0 or not math.isfinite(norm) or float(g_aux.norm()) == 0:
        return []
    cols = torch.stack([g_lm, g_aux], dim=1)  # (P, 2)
    sol = torch.linalg.lstsq(cols, acc.unsqueeze(1)).solution.squeeze(1)
    alpha, beta = float(sol[0]), float(sol[1])
    resid = float((acc - cols @ sol).norm()) / norm
    if resid > ACCUM_FIT or alpha <= 0:
        return []
    ratio = beta / alpha
    nums = {"lm_factor": round(alpha, 6), "aux_factor": round(beta, 6),
            "ratio": round(ratio, 6), "micro_batches": k, "tokens": tokens,
            "residual": round(resid, 8)}
    if abs(ratio - 1) <= ACCUM_TOL:
        return []
    if abs(ratio - k) <= ACCUM_TOL * k:
        why = (f"the aux term is added whole on each of the {k} micro-batches while the LM "
               "term is divided over the window (HF's num_items_in_batch normalises the LM "
               "loss only): scale the aux term like the LM term")
    else:
        why = "scale the aux term by the same factor as the LM term before backward"
    return [finding(
        "grad_accumulation", step, "aux loss normalisation",
        f"the aux loss weighs {ratio:.3g}× as much as the LM loss in the accumulated gradient "
        f"at step {step}: {why}",
        f".grad = α·Σ w_i g_LM,i + β·Σ w_i g_aux,i with α = {alpha:.4g} (LM), β = {beta:.4g} "
        f"(aux), w_i = n_i/Σn over {k} micro-batches; fit residual {resid:.2e}", **nums)]
