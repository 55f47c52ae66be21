"""``hooks.recorder``: ``hooks.run`` — record your own training loop in the run store.

* :mod:`hooks.recorder.run` — :class:`Run` (``hooks.run``, ``hooks.Run``): ``run.log``,
  ``run.watch``, controls;
* :mod:`hooks.recorder.run_process` — the process that owns the run;
  :mod:`hooks.recorder.job_end` — a ``torchrun`` job's final status;
* :mod:`hooks.recorder.trigger`, :mod:`hooks.recorder.spike_watch`,
  :mod:`hooks.recorder.story` — the triggered capture of a spiking step and its story
  (docs/spikes.md).

The public names are exported by ``hooks``; this ``__init__`` imports nothing. Never imports
textual, rich or tui.
"""
