"""Imports every check module so that each registers itself in ``CHECKS``."""

from hooks.doctor.model import (  # noqa: F401
    attention,
    basic,
    invariance,
    loss_terms,
    magnitudes,
    moe,
    numerics,
    shapes,
    training,
    user_hooks,
)
