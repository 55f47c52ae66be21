"""Triggered capture: the step whose loss or gradient norm spikes, or turns non-finite, is
captured before the optimizer applies it, and the training run stays bit for bit the same.

Used by ``run.watch(model, every, optimizer=)`` (:mod:`hooks.recorder.spike_watch`, hence the
HF Trainer and Lightning callbacks) and by the built-in trainer (``mdb overfit``,
:class:`hooks.train.trainer.Trainer`).

* :class:`StepTrigger` watches two values per step, both known before the update: the loss the
  forward returned and the global gradient norm. Each goes through a
  :class:`hooks.store.spikes.SpikeDetector` (the rule the run store applies to the logged loss:
  more than 3× the median of the last 50 values); the first step of an episode of either, and
  the first step whose loss or gradient is NaN/±Inf, **trigger**. It also keeps the
  per-parameter gradient norms of the last :data:`HISTORY` steps (one row a step, on the
  gradients' device) so that the spike's story can say which parameter's gradient grew first
  (:mod:`hooks.recorder.story`).
* :func:`replay_step` re-runs the step's forward and backward under :func:`hooks.capture` on the
  same inputs and with the same RNG state (CPU and CUDA), on clones of the buffers
  (:func:`hooks.engine.replay.held_state`), with the parameters' ``.grad`` set aside meanwhile
  and put back after: the gradients the optimizer then applies are the very tensors the step
  computed, the RNG continues where the step left it, so the update is the one an unwatched run
  applies. The batch's integer tensors (token ids, labels, masks) are kept in the trace
  (``batch/<name>``), so ``mdb step --run NAME@STEP`` opens the step with its inputs.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from hooks.engine.capture import capture
from hooks.engine.replay import held_state
from hooks.store.spikes import SpikeDetector

__all__ = ["HISTORY", "MAX_TRIGGERS", "StepTrigger", "Trigger", "batch_tensors", "replay_step"]

#: Steps of per-parameter gradient norms kept for the story (the running median's window).
HISTORY = 50
#: Triggered captures per run at most (a run that spikes again and again stays cheap).
MAX_TRIGGERS = 10
#: Elements of one batch tensor kept in the trace at most (larger inputs are not token ids).
MAX_BATCH_NUMEL = 1 << 20


@dataclass(frozen=True)
class Trigger:
    """Why a step was captured before its update.

    Attributes:
        step: The step.
        reason: ``"loss spike"``, ``"gradient-norm spike"``, ``"non-finite loss"`` or
            ``"non-finite gradient"`` (the first that applies, in that order).
        loss: The step's loss (NaN when the forward returned none).
        loss_baseline: The loss's running median before the step (NaN before there is one).
        grad_norm: The global L2 norm of the gradients (all parameters, before clipping).
        grad_baseline: Its running median before the step (NaN before there is one).
    """

    step: int
    reason: str
    loss: float
    loss_baseline: float
    grad_norm: float
    grad_baseline: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (non-finite numbers as their text)."""
        return {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                for k, v in asdict(self).items()}


class StepTrigger:
    """Decides, from the loss and gradient norm of each step before its update, whether to
    capture it (see the module docstring).

    Args:
        loss_metric: The name spikes of the loss are recorded under (``total``, ``loss``).
        max_triggers: Captures at most (:data:`MAX_TRIGGERS`).
    """

    def __init__(self, loss_metric: str = "loss", *, max_triggers: int = MAX_TRIGGERS) -> None:
        self.loss = SpikeDetector(loss_metric)
        self.grad = SpikeDetector("grad_norm")
        self.max_triggers = int(max_triggers)
        self.fired = 0
        self._nonfinite_seen = False
        self._ring: torch.Tensor | None = None  # (HISTORY, P) per-parameter norms, fp32
        self._steps: deque[int] = deque(maxlen=HISTORY)  # the step of each row, oldest first
        self._row = 0

    def keep_norms(self, step: int, norms: torch.Tensor) -> None:
        """Keep the per-parameter gradient norms (P,) of ``step`` (a copy on their device; no
        synchronisation)."""
        ring = self._ring
        if ring is None or ring.shape[1] != norms.numel() or ring.device != norms.device:
            ring = self._ring = torch.zeros(HISTORY, norms.numel(), device=norms.device)
            self._steps.clear()
            self._row = 0
        ring[self._row].copy_(norms.reshape(-1))
        self._row = (self._row + 1) % HISTORY
        self._steps.append(int(step))

    def norm_history(self) -> tuple[list[int], torch.Tensor | None]:
        """``(steps, norms)``: the kept steps, oldest first, and their per-parameter gradient
        norms (S, P) in the same order (on CPU); ``None`` before the first step."""
        if self._ring is None or not self._steps:
            return [], None
        n = len(self._steps)
        order = [(self._row - n + i) % HISTORY for i in range(n)]
        return list(self._steps), self._ring[order].float().cpu()

    def observe(self, step: int, loss: float | None, grad_norm: float | None) -> Trigger | None:
        """Add the step's values; the :class:`Trigger` when this step is to be captured (the
        first step of a loss or gradient-norm spike episode, or the first non-finite step),
        else ``None``. Both detectors see every step, also past :attr:`max_triggers`."""
        loss_base, grad_base = self.loss.baseline, self.grad.baseline
        lspike = self.loss.observe(step, loss)
        gspike = self.grad.observe(step, grad_norm)
        lv = math.nan if loss is None else float(loss)
        gv = math.nan if grad_norm is None else float(grad_norm)
        reason = None
        if lspike is not None and lspike.step == step:
            reason = "loss spike"
        elif gspike is not None and gspike.step == step:
            reason = "gradient-norm spike"
        elif not self._nonfinite_seen and loss is not None and not math.isfinite(lv):
            reason = "non-finite loss"
        elif not self._nonfinite_seen and grad_norm is not None and not math.isfinite(gv):
            reason = "non-finite gradient"
        if reason is not None and reason.startswith("non-finite"):
            self._nonfinite_seen = True
        if reason is None or self.fired >= self.max_triggers:
            return None
        self.fired += 1
        nan = math.nan
        return Trigger(int(step), reason, lv, nan if loss_base is None else loss_base, gv,
                       nan if grad_base is None else grad_base)


def batch_tensors(args: tuple, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The integer tensors of a forward call (token ids, labels, masks) by name: keyword
    arguments by their name, positional ones as ``arg0``, ``arg1`` …; copies on CPU. Tensors of
    more than :data:`MAX_BATCH_NUMEL` elements are left out."""
    out: dict[str, torch.Tensor] = {}
    named = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    for name, t in named:
        if (isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()
                and t.numel() <= MAX_BATCH_NUMEL):
            out[name] = t.detach().to("cpu", copy=True).contiguous()
    return out


def replay_step(model: nn.Module, run_step: Callable[[], Any], *, rng_cpu: torch.Tensor,
                rng_cuda: list[torch.Tensor] | None, training: bool, step: int,
                meta: dict[str, Any], capture_options: dict[str, Any] | None = None,
                ) -> tuple[Any, Any]:
    """Re-run a step under :func:`hooks.capture` without changing the training run.

    Args:
        model: The root module.
        run_step: Runs the step's forward and backward once (``loss.backward()``) and returns
            the forward's output; called inside the capture, with grad enabled.
        rng_cpu: ``torch.get_rng_state()`` at the start of the step's forward.
        rng_cuda: ``torch.cuda.get_rng_state_all()`` then, or ``None``.
        training: The model's train flag at that forward.
        step: The step number (the trace's ``step``).
        meta: The trace's ``meta``.
        capture_options: More keyword arguments of :func:`hooks.capture`.

    Returns:
        ``(trace, output)``: the :class:`hooks.Trace` of the replay and the replayed output.

    Raises:
        Exception: Whatever the replay raised (``.grad``, buffers, modes and RNG are restored
            first).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None  # the replay's backward writes fresh tensors; the step's are kept aside
    try:
        with held_state(model, rng_cpu, rng_cuda), torch.enable_grad():
            model.train(training)
            cap = capture(model, step=step, meta=meta, **(capture_options or {}))
            with cap as trace:
                output = run_step()
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    return trace, output
