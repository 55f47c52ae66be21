"""``hooks.recorder``: ``hooks.run`` — record your own training loop in the run store.

* :mod:`hooks.recorder.run` — :class:`Run` (``hooks.run``, ``hooks.Run``): ``run.log``,
  ``run.watch``, controls;
* :mod:`hooks.recorder.run_process` — the process that owns the run.

The public names are exported by ``hooks``; this ``__init__`` imports nothing. Never imports
textual, rich or tui.
"""
