"""Deprecated: moved to :mod:`hooks.runs.store` (names still import from here, with a
DeprecationWarning)."""

from hooks._compat import forward

__getattr__ = forward("hooks.runstore", "hooks.runs.store")
