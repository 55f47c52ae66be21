"""Deprecated: moved to :mod:`hooks.runs.checkpoint` (names still import from here, with a
DeprecationWarning)."""

from hooks._compat import forward

__getattr__ = forward("hooks.checkpoint", "hooks.runs.checkpoint")
