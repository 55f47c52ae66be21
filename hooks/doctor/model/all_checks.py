"""Imports every check module so that each registers itself in ``CHECKS``."""

from hooks.doctor.model import attention, basic, invariance, moe, numerics, training  # noqa: F401
