"""``hooks.train``: training loops mdb runs itself — the only package that imports minillm.

* :mod:`hooks.train.trainer` — :class:`Trainer`: a UI-free training loop with live controls;
  its triggered capture of a spiking step in :mod:`hooks.train.spike_capture`;
* :mod:`hooks.train.verdict` — the verdict ``mdb overfit`` ends with;
* :mod:`hooks.train.overfit` — ``mdb overfit``: memorise one batch; its options in
  :mod:`hooks.train.overfit_options`, several ranks in :mod:`hooks.train.ddp_overfit`,
  sharding in :mod:`hooks.train.sharding`;
* :mod:`hooks.train.ablate` — ``mdb ablate``; :mod:`hooks.train.checkpoint` — checkpoints as
  safetensors + JSON.

This ``__init__`` imports nothing. Never imports textual, rich or tui.
"""
