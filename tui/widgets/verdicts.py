"""Verdicts on parameter gradients: ok, vanishing, exploding, NaN/Inf, None, frozen, stale, zero.

The thresholds are heuristics for a freshly initialised or early-training model in fp32, on the
ratio ``‖grad‖ / ‖weight‖`` (scale-free, so one threshold fits a norm weight of ones and a
projection of small values alike) and on the raw gradient norm.
"""

from __future__ import annotations

import math

#: ``‖g‖/‖w‖`` below this (or a gradient norm below :data:`VANISHING_NORM`): vanishing.
VANISHING_RATIO = 1e-5
#: Gradient L2 norm below this: vanishing.
VANISHING_NORM = 1e-8
#: ``‖g‖/‖w‖`` above this (or a gradient norm above :data:`EXPLODING_NORM`): exploding.
EXPLODING_RATIO = 10.0
#: Gradient L2 norm above this: exploding.
EXPLODING_NORM = 100.0


def param_verdict(p) -> str:
    """The verdict on one :class:`hooks.ParamGradRecord`.

    Returns:
        str: a key of :data:`tui.widgets.fmt.FLAG_TEXT`: ``nan`` (NaN/Inf entries or a
        non-finite norm), ``none`` (``.grad`` is None), ``frozen``, ``stale``, ``zero``,
        ``exploding``, ``vanishing`` or ``ok``, checked in that order.
    """
    if p.nan_count or p.inf_count or (p.grad_norm is not None and not math.isfinite(p.grad_norm)):
        return "nan"
    if p.status in ("none", "frozen", "stale", "zero"):
        return p.status
    g = p.grad_norm
    if g is None:
        return "none"
    r = p.ratio
    if g > EXPLODING_NORM or (r is not None and r > EXPLODING_RATIO):
        return "exploding"
    if g < VANISHING_NORM or (r is not None and r < VANISHING_RATIO):
        return "vanishing"
    return "ok"
