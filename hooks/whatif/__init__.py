"""``hooks.whatif``: experiments on top of the capture engine.

* :mod:`hooks.whatif.rerun` — a step re-run with edits and compared with the original;
* :mod:`hooks.whatif.lens` — the logit lens (``hooks.logit_lens``);
* :mod:`hooks.whatif.precision` — a step in low precision against fp32
  (``hooks.precision_diff``).

The public names are exported by ``hooks``; this ``__init__`` imports nothing. Never imports
textual, rich or tui.
"""
