"""Whether a model is freshly initialised or trained, from what any init leaves behind.

Every common init gives each norm a constant scale (1, or 0 for Gemma's ``1 + w``) and a zero
shift: training moves them. And a model that has learnt something scores far below ln V on
its own batch's targets. :func:`training_state` reads both; the init checks
(:func:`hooks.doctor.model.basic.init_loss`, :mod:`hooks.doctor.model.magnitudes`) judge
only a fresh model. A width that is merely wrong (``nn.Embedding``'s N(0, 1)) is not training:
it keeps the norms at their constant and the loss at or above ln V, so a broken init is still
judged.

Dimension legend: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hooks.doctor.model.target import Target, fmt

#: A loss on the batch's own targets below this fraction of ln V means the model has learnt.
TRAINED_LOSS = 0.5


@dataclass
class TrainingState:
    """Measured signs of training.

    Attributes:
        trained: True when any sign is found.
        moved_norms: norm parameters no longer constant (their names).
        norm_params: norm parameters looked at.
        batch_loss: the model's loss on its own batch (nats), or None.
        ln_v: ln V, or None.
        reasons: the signs, in words.
    """

    trained: bool = False
    moved_norms: list[str] = field(default_factory=list)
    norm_params: int = 0
    batch_loss: float | None = None
    ln_v: float | None = None
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(trained=self.trained, moved_norms=self.moved_norms[:8],
                    norm_params=self.norm_params, batch_loss=self.batch_loss, ln_v=self.ln_v,
                    reasons=self.reasons)


def _moved_norms(t: Target) -> tuple[list[str], int]:
    """Names of the norm parameters that are not constant (an init sets each to one value),
    and how many norm parameters there are."""
    moved, n = [], 0
    for mname, m in t.norm_modules():
        for pname, p in m.named_parameters(recurse=False):
            if p.numel() < 2 or not p.is_floating_point():
                continue
            n += 1
            x = p.detach().float()
            spread = float(x.max() - x.min())
            if spread > 1e-6 * max(1.0, float(x.abs().max())):
                moved.append(f"{mname}.{pname}" if mname else pname)
    return moved, n


def _batch_loss(t: Target) -> tuple[float | None, float | None]:
    """(the model's own loss on its batch, ln V), either None when it cannot be had."""
    try:
        with t.mode(False), torch.no_grad():
            choice = t.loss(t.run(t.batch, use_cache=False))
        if choice.fallback:
            return None, None
        loss = float(choice.loss)
        return (loss if math.isfinite(loss) else None), math.log(t.vocab_size)
    except Exception:  # the checks that run the model report why it cannot run
        return None, None


def training_state(t: Target) -> TrainingState:
    """The model's signs of training: norm scales or shifts that are no longer constant, and a
    loss on its own batch below :data:`TRAINED_LOSS`·ln V."""
    s = TrainingState()
    s.moved_norms, s.norm_params = _moved_norms(t)
    if s.moved_norms:
        s.reasons.append(f"{len(s.moved_norms)} of {s.norm_params} norm parameters moved from "
                         f"their constant init ({s.moved_norms[0]})")
    s.batch_loss, s.ln_v = _batch_loss(t)
    if s.batch_loss is not None and s.ln_v and s.batch_loss < TRAINED_LOSS * s.ln_v:
        s.reasons.append(f"its loss on its own batch is {fmt(s.batch_loss)}, far below ln V = "
                         f"{fmt(s.ln_v)}")
    s.trained = bool(s.reasons)
    return s
