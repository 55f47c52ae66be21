"""``hooks.doctor.loop``: the loop doctor.

* :mod:`hooks.doctor.loop.watch` — :class:`LoopWatch`: what ``run.watch`` attaches to the
  model and the optimizer;
* :mod:`hooks.doctor.loop.checks` — the checks it runs on what it saw (pure functions).

This ``__init__`` imports nothing. Never imports textual, rich or tui.
"""
