"""Global L2 norms of many tensors, exact and overflow-safe: the one definition of ``‖g‖``.

The trainer's ``grad_norm`` (:mod:`hooks.train.trainer`), the gradients view's total and the
doctor read the same functions, so a NaN gradient gives a NaN total everywhere.

* :func:`total_norm` — ``sqrt(Σ_i ‖t_i‖²)`` of tensors (what ``torch.nn.utils.get_total_norm``
  and ``clip_grad_norm_`` compute), without fp32 overflow.
* :func:`combine_norms` — the same total from per-tensor norms already computed (a trace keeps
  one L2 norm per parameter gradient, not the gradients).

Non-finite values propagate: a NaN anywhere gives NaN, else an Inf gives Inf. Finite norms are
combined scaled by the largest, ``m · sqrt(Σ (n_i / m)²)`` (the scaling of LAPACK's
``dnrm2``), so finite norms near float64's limit do not overflow.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

__all__ = ["combine_norms", "total_norm"]


def combine_norms(norms: Iterable[float]) -> float:
    """The global L2 norm ``sqrt(Σ_i n_i²)`` of tensors whose own L2 norms are ``norms``.

    Args:
        norms: per-tensor L2 norms (non-negative floats; NaN or Inf allowed).

    Returns:
        ``0.0`` for none; ``nan`` when any is NaN; else ``inf`` when any is infinite (or the
        total exceeds float64's range); else the total, computed scaled by the largest norm.
    """
    vals = [float(n) for n in norms]
    if any(math.isnan(v) for v in vals):
        return math.nan
    if any(math.isinf(v) for v in vals):
        return math.inf
    vals = [abs(v) for v in vals if v != 0.0]
    if not vals:
        return 0.0
    top = max(vals)
    return top * math.sqrt(math.fsum((v / top) ** 2 for v in vals))


def total_norm(tensors: Sequence[torch.Tensor]) -> float:
    """Global L2 norm ``sqrt(Σ_i ‖t_i‖²)`` of ``tensors`` as a Python float, without overflow.

    ``torch.nn.utils.get_total_norm`` sums squares in the tensors' own dtype, so fp32
    gradients whose elements exceed ~1.8e19 give ``inf`` although every one of them is finite
    (``mdb overfit --lr 5`` hit it at step 5). When that fast path is not finite, every tensor
    is checked: a NaN in any gives ``nan``, else an Inf in any gives ``inf``; if all are
    finite, each norm is recomputed scaled, ``a_i · ‖t_i / a_i‖`` with ``a_i = max |t_i|``, in
    fp64, and combined with :func:`combine_norms`.

    Args:
        tensors: Any floating-point tensors (gradients), any shapes.

    Returns:
        The norm; ``0.0`` for no tensors; ``nan``/``inf`` only when an element is NaN/Inf (or
        the norm exceeds float64's range).
    """
    tensors = [t.detach() for t in tensors]
    if not tensors:
        return 0.0
    fast = float(torch.nn.utils.get_total_norm(tensors))
    if math.isfinite(fast):
        return fast
    bad = [t for t in tensors if t.numel() and not bool(torch.isfinite(t).all())]
    if bad:
        return math.nan if any(bool(torch.isnan(t).any()) for t in bad) else math.inf
    norms = []
    for t in tensors:
        if t.numel() == 0:
            continue
        a = float(t.abs().amax())
        if a > 0.0:
            norms.append(a * float(torch.linalg.vector_norm(t.double() / a)))
    return combine_norms(norms)
