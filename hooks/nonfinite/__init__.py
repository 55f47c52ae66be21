"""``hooks.nonfinite``: where a non-finite value starts.

* :mod:`hooks.nonfinite.origin` — the first module, op and parameter with a NaN/Inf, found by
  replaying the step under the capture engine; the sentinel that notices one.

This ``__init__`` imports nothing. Never imports textual, rich or tui.
"""
