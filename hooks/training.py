"""Deprecated: moved to :mod:`hooks.runs.trainer` (names still import from here, with a
DeprecationWarning)."""

from hooks._compat import forward

__getattr__ = forward("hooks.training", "hooks.runs.trainer", {
    "OverfitOptions": "hooks.runs.overfit",
    "OverfitSession": "hooks.runs.overfit",
    "default_overfit_text": "hooks.runs.overfit",
    "DEFAULT_TEXT_PATH": "hooks.runs.overfit",
    "SEED_SENTENCE": "hooks.runs.overfit",
    "CHECKPOINT_FORMAT": "hooks.runs.checkpoint",
    "save_checkpoint": "hooks.runs.checkpoint",
    "load_checkpoint": "hooks.runs.checkpoint",
    "read_checkpoint_meta": "hooks.runs.checkpoint",
})
