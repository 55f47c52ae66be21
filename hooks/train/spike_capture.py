"""The built-in trainer's triggered capture (``mdb overfit``): a step whose loss or gradient
norm spikes, or whose gradient turns non-finite, is replayed under the capture before the
optimizer applies it (:mod:`hooks.recorder.trigger`), and stored as that step's capture with
its batch and the spike's story (:mod:`hooks.recorder.story`).

:class:`TrainerSpikes` is what :class:`hooks.train.trainer.Trainer` calls: :meth:`start` at the
start of a step (the RNG state its forward will use), :meth:`check` between the gradient norm
and the update. A step the trainer captures anyway is not replayed: its own trace gets the
story.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hooks.recorder.spike_watch import CAPTURES_KEPT, finish_trace
from hooks.recorder.story import adam_ratios, gradient_growth, trace_features
from hooks.recorder.trigger import StepTrigger, batch_tensors, replay_step

__all__ = ["TrainerSpikes"]


class TrainerSpikes:
    """Spike detection and triggered capture for one trainer.

    Args:
        model: The trained module.
        loss_metric: The name of the run's loss (``total``, ``loss``).
        capture_options: Keyword arguments of :func:`hooks.capture` (the trainer's).
        optimizer: The trainer's optimizer (Adam's update ratios for the story), or ``None``.
    """

    def __init__(self, model: nn.Module, loss_metric: str = "loss",
                 capture_options: dict[str, Any] | None = None, optimizer: Any = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self._adam: dict[str, float] = {}
        self.trigger = StepTrigger(loss_metric)
        self._options = dict(capture_options or {})
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._rng: tuple[torch.Tensor, Any, bool] | None = None
        self._history: deque[dict[str, float]] = deque(maxlen=CAPTURES_KEPT)
        #: The last failure to replay a triggered step, in one line (``None``: none).
        self.error: str | None = None

    def start(self) -> None:
        """Keep the RNG state (CPU, and CUDA where initialised) and train flag the step's
        forward is about to use."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._rng = (torch.get_rng_state(), cuda, self.model.training)

    def remember(self, trace: Any) -> None:
        """Keep a stored capture's internals (the story's medians)."""
        with contextlib.suppress(Exception):
            self._history.append({**trace_features(trace), **self._adam})
        self._adam = {}

    def _norms(self) -> torch.Tensor | None:
        grads = [p.grad for _, p in self._named]
        if not grads or any(g is None for g in grads):
            present = [(i, g) for i, g in enumerate(grads) if g is not None]
            if not present:
                return None
            norms = torch.stack(torch._foreach_norm([g.detach() for _, g in present])).float()
            full = norms.new_zeros(len(grads))
            full[torch.tensor([i for i, _ in present], device=norms.device)] = norms
            return full
        return torch.stack(torch._foreach_norm([g.detach() for g in grads])).float()

    def check(self, step: int, loss: float, grad_norm: float, *, batch: Any,
              run_step: Callable[[], Any], meta: Callable[[], dict[str, Any]], captured: Any = None,
              output: Any = None) -> Any:
        """Observe the step before its update; replay it under the capture when it triggers.

        Args:
            step: The step number.
            loss: Its loss.
            grad_norm: Its global gradient norm (before clipping).
            batch: Its :class:`hooks.Batch`.
            run_step: Runs its forward and backward once, returns the output.
            meta: Returns the capture's ``meta`` (tokens, config): called only when the step
                triggers.
            captured: The step's own trace when the trainer captures it anyway.
            output: That step's output (its logits give the top-loss tokens).

        Returns:
            The triggered trace (``meta["spike"]``, ``batch/<name>`` tensors), ``captured``
            with the story added when given, or ``None`` when the step did not trigger (or its
            replay failed: :attr:`error` says why).
        """
        per = self._norms()
        if per is not None:
            self.trigger.keep_norms(step, per)
        trig = self.trigger.observe(step, loss, grad_norm)
        if trig is None or self._rng is None:
            if captured is not None:  # the story's medians: this capture's update ratios
                self._adam = adam_ratios(self.optimizer, self._named)
            return None
        steps, norms = self.trigger.norm_history()
        gradients = gradient_growth(steps, norms, [n for n, _ in self._named])
        args, kwargs = tuple(batch.args), dict(batch.kwargs)
        if captured is not None:
            trace, out = captured, output
            trace.meta.update(meta())
        else:
            rng_cpu, rng_cuda, training = self._rng
            try:
                trace, out = replay_step(
                    self.model, run_step, rng_cpu=rng_cpu, rng_cuda=rng_cuda,
                    training=training, step=step, meta=meta(),
                    capture_options=self._options)
            except Exception as exc:  # the step itself goes on
                self.error = f"step {step}: the replay failed: {type(exc).__name__}: {exc}"
                return None
        finish_trace(trace, trig, batch_tensors(args, kwargs), out, args, kwargs,
                     gradients=gradients, history=list(self._history),
                     extra=adam_ratios(self.optimizer, self._named))
        return trace
