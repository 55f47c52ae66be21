"""``hooks.doctor``: what is wrong, measured.

* :mod:`hooks.doctor.model` — ``mdb doctor``: the battery of checks on a model and a batch;
* :mod:`hooks.doctor.loop` — the loop doctor: ``run.watch(..., optimizer=)`` checks a user's
  training loop;
* :mod:`hooks.doctor.verdicts` — the rules (exploding, vanishing gradients, expert load) the
  doctor and the views share.

Built on the capture engine; this ``__init__`` imports nothing. Never imports textual, rich
or tui.
"""
