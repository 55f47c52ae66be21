"""``hooks.engine``: the capture engine behind :func:`hooks.capture`.

* :mod:`hooks.engine.capture` — :class:`Capture`: module and tensor hooks that build a
  :class:`hooks.Trace`;
* its parts: :mod:`hooks.engine.params` (parameter gradients), :mod:`hooks.engine.recompute`
  (activation checkpointing), :mod:`hooks.engine.replay` (compiled models replayed eagerly),
  :mod:`hooks.engine.compile` (``torch.compile`` unwrapped), :mod:`hooks.engine.fast_path`
  (PyTorch's fused fast paths), :mod:`hooks.engine.env` (environment switches);
* the edits it applies in its hooks: :mod:`hooks.engine.edits` (the specs),
  :mod:`hooks.engine.edit_roles` (where an edit by role lands: a head, q/k/v columns, the
  pattern; the steering vector's file), :mod:`hooks.engine.edit_pattern` (the attention
  probabilities inside one call) and :mod:`hooks.engine.edit_apply` (:class:`Editor`).

The public names are exported by ``hooks`` itself (``hooks.capture``, ``hooks.Capture``); this
``__init__`` imports nothing, so ``hooks.engine.capture`` is the module. Never imports
textual, rich or tui.
"""
