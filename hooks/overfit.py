"""Deprecated: moved to :mod:`hooks.runs.overfit` (names still import from here, with a
DeprecationWarning)."""

from hooks._compat import forward

__getattr__ = forward("hooks.overfit", "hooks.runs.overfit")
