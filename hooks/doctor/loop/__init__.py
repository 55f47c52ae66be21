"""``hooks.doctor.loop``: the loop doctor.

* :mod:`hooks.doctor.loop.watch` — :class:`LoopWatch`: what ``run.watch`` attaches to the
  model and the optimizer;
* :mod:`hooks.doctor.loop.checks` — the checks it runs on what it saw (pure functions);
* :mod:`hooks.doctor.loop.tape` — the loop's own calls on the model's outputs in a watched
  window (its loss function, replayed; graphs and outputs kept across steps).

This ``__init__`` imports nothing. Never imports textual, rich or tui.
"""
