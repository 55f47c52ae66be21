"""``hooks.tensors``: what everything else measures tensors and modules with.

* :mod:`hooks.tensors.stats` — :class:`TensorStats` and :func:`summarize_tensor` (one batched
  pass per tensor), the histogram bins, exact float encoding for saved traces;
* :mod:`hooks.tensors.norms` — norms combined exactly across pieces (shards, parameters);
* :mod:`hooks.tensors.walk` — the tensors inside nested outputs, module and parameter names,
  the stack of modules running.

Imports nothing else of ``hooks``; never imports textual, rich or tui.
"""
