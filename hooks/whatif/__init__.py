"""``hooks.whatif``: experiments on top of the capture engine.

* :mod:`hooks.whatif.rerun` — a step re-run with edits and compared with the original;
* :mod:`hooks.whatif.lens` — the logit lens (``hooks.logit_lens``), at block outputs and
  mid-block;
* :mod:`hooks.whatif.sweep` — patching sweeps and attribution patching (``hooks.patch_sweep``,
  ``hooks.attribution_patch``), on :mod:`hooks.whatif.resume` (recorded runs, patched copies
  resumed at a block) and :mod:`hooks.whatif.metric` (``loss``, ``logit_diff:A,B``);
* :mod:`hooks.whatif.dla` — direct logit attribution (``hooks.logit_attribution``);
* :mod:`hooks.whatif.stream` — where the residual stream's parts are (blocks, attention, final
  norm, head), found in one place for all of them;
* :mod:`hooks.whatif.precision` — a step in low precision against fp32
  (``hooks.precision_diff``).

The public names are exported by ``hooks``; this ``__init__`` imports nothing. Never imports
textual, rich or tui.
"""
