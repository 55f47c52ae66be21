"""Label alignment: which target the model's own loss scores each position's logits against,
and whether, with the batch's targets, that makes it predict the next token.

Two conventions train a next-token model, and mixing them trains another task:

- HF: ``labels = input_ids`` and the model shifts them inside, scoring ``logits[:, t]``
  against ``labels[:, t + 1]``;
- nanoGPT: the data loader shifts (``targets[:, t] = idx[:, t + 1]``) and the model scores
  ``logits[:, t]`` against ``targets[:, t]``.

Targets equal to the inputs on a model that does not shift them train it to copy its input;
shifted targets on a model that shifts them again train it to predict the token two ahead.
Neither shows in the loss's value at initialisation, so the convention is measured: the model
is run on targets chosen so that the two conventions give different cross-entropies
(:func:`separating_targets`), and its own loss is compared with both.

Dimension legend: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hooks.batch import Batch
from hooks.doctor.model.target import Target

#: Relative tolerance of "the model's loss equals this cross-entropy" for fp32 logits (the
#: model and mdb reduce the same fp32 values in different orders); lower precisions get
#: 8 ulps of their dtype.
REL_TOL = 1e-4


@dataclass(frozen=True)
class LabelAlignment:
    """How the model's own loss lines its logits up with the targets.

    Attributes:
        layout: the batch's targets: ``aligned`` (equal to the ids) or ``shifted`` (the next
            ids), :meth:`hooks.Batch.target_layout`.
        shift: 0 when the model scores ``logits[:, t]`` against ``targets[:, t]``, 1 against
            ``targets[:, t + 1]`` (it shifts inside), None when its loss matches neither or
            both (then nothing is claimed).
        loss: the model's own loss (its cross-entropy alone when it reports one) on the probe.
        ce_same: cross-entropy of ``logits[:, t]`` against ``targets[:, t]`` over B·T.
        ce_next: cross-entropy of ``logits[:, t]`` against ``targets[:, t + 1]`` over B·(T-1).
        tolerance: the absolute difference under which the loss "equals" one of them.
    """

    layout: str
    shift: int | None
    loss: float
    ce_same: float
    ce_next: float
    tolerance: float

    @property
    def ahead(self) -> int | None:
        """How many tokens ahead of its input position the model is trained to predict: 1 is
        next-token prediction, 0 copying, 2 the token after next (None: not measured)."""
        if self.shift is None:
            return None
        return self.shift + (1 if self.layout == "shifted" else 0)

    def numbers(self) -> str:
        """``its loss 3.2104 = CE at the same position 3.2104, not 3.9577 at the next``."""
        same, nxt = f"{self.ce_same:.4f}", f"{self.ce_next:.4f}"
        if self.shift == 0:
            return (f"its loss {self.loss:.4f} = CE against the same position's target {same}, "
                    f"not {nxt} against the next one")
        return (f"its loss {self.loss:.4f} = CE against the next position's target {nxt}, not "
                f"{same} against the same one")

    def finding(self) -> tuple[str, str] | None:
        """(evidence, hint) when the model is trained on anything but the next token, else
        None."""
        if self.ahead == 0:
            return (f"the targets equal the input ids and the model does not shift them: its "
                    f"loss scores the logits at position t against targets[:, t] "
                    f"({self.numbers()}), so it is being trained to copy its input, not to "
                    "predict the next token",
                    "pass next-token targets (x, y = data[i:i+T], data[i+1:i+T+1]) or shift "
                    "inside the loss (logits[:, :-1] against targets[:, 1:])")
        if self.ahead == 2:
            return (f"the targets are the input ids shifted by one and the model shifts them "
                    f"again: its loss scores the logits at position t against targets[:, t+1] "
                    f"({self.numbers()}), so it is being trained to predict the token two "
                    "ahead",
                    "pass labels = input_ids (the model shifts them itself), or drop the shift "
                    "in the loss")
        return None

    def to_dict(self) -> dict[str, Any]:
        return dict(layout=self.layout, shift=self.shift, predicts_ahead=self.ahead,
                    loss=self.loss, ce_same=self.ce_same, ce_next=self.ce_next,
                    tolerance=self.tolerance)


def _probe_batch(t: Target, batch: Batch, targets: torch.Tensor) -> Batch | None:
    """``batch`` with ``targets`` in place of its targets (the forward's argument, or what a
    ``loss_fn`` reads); None without targets."""
    slot = batch.slot("targets", t.model)
    if slot is not None:
        old = batch.get(slot.where)
        new = targets.to(old.device, old.dtype)
        if isinstance(slot.where, int):
            args = list(batch.args)
            args[slot.where] = new
            return batch.replace(args=args)
        return batch.replace(kwargs={**batch.kwargs, slot.where: new})
    if isinstance(batch.targets, torch.Tensor) and batch.targets.shape == targets.shape:
        return batch.replace(targets=targets.to(batch.targets.device, batch.targets.dtype))
    return None


def separating_targets(logits: torch.Tensor) -> torch.Tensor:
    """(B, T) targets that push apart the cross-entropies of (B, T, V) ``logits`` scored
    against the same position's target and against the next position's: position 0 gets its
    top token, position t > 0 the token whose logit rises most from position t - 1
    (``argmax_k logits[:, t, k] - logits[:, t-1, k]``), so that the same-position convention
    (which reads it at ``logits[:, t]``) scores it lower than the next-position one (which
    reads it at ``logits[:, t-1]``). Logits that are the same at every position leave the two
    apart only by their first and last terms."""
    lg = logits.float()
    rise = torch.cat([lg[:, :1], lg[:, 1:] - lg[:, :-1]], dim=1)
    return rise.argmax(dim=-1)


def measure_label_alignment(t: Target, shape: tuple[int, int], seed: int) -> LabelAlignment | None:
    """The model's label convention on random ids of ``shape`` (see the module docstring).

    Runs the model (eval mode, no gradients) twice on the same uniformly random ids: once with
    targets rewritten for them to read its logits, once with :func:`separating_targets` of
    those logits; its own loss on the second run is compared with the cross-entropy of that
    run's logits against the same position's targets and against the next position's.

    Returns:
        The :class:`LabelAlignment`, or None when there is nothing to measure: a model that is
        not a decoder, a batch whose targets are neither the ids nor the next ids, a model
        without (B, T, V) logits with its targets, or without a loss of its own.
    """
    layout = t.batch.target_layout(t.model).kind
    if layout not in ("aligned", "shifted") or t.kind.kind != "decoder":
        return None
    batch = t.batch_with(shape=shape, seed=seed, targets="rewrite")
    with t.mode(False), torch.no_grad():
        first = t.logits(t.run(batch, use_cache=False))
        if first is None or tuple(first.shape[:2]) != tuple(shape):
            return None
        y = separating_targets(first)
        probe = _probe_batch(t, batch, y)
        if probe is None:
            return None
        out = t.run(probe, use_cache=False, output_router_logits=False)  # HF MoE: CE alone
        logits = t.logits(out)
        loss = t.ce_loss(out)
        if loss is None:
            choice = t.loss(out, probe)
            if choice.fallback:
                return None
            loss = choice.loss
    if logits is None or tuple(logits.shape[:2]) != tuple(shape):
        return None
    lg = logits.float()
    v = lg.shape[-1]
    ce_same = float(F.cross_entropy(lg.reshape(-1, v), y.reshape(-1)))
    ce_next = float(F.cross_entropy(lg[:, :-1].reshape(-1, v), y[:, 1:].reshape(-1)))
    value = float(loss)
    tol = max(REL_TOL, 8 * torch.finfo(logits.dtype).eps) * max(1.0, abs(value))
    same, nxt = abs(value - ce_same) <= tol, abs(value - ce_next) <= tol
    shift = 0 if same and not nxt else 1 if nxt and not same else None
    return LabelAlignment(layout, shift, value, ce_same, ce_next, tol)

