"""``run.watch(model, every, optimizer=)``'s triggered capture: a step whose loss or gradient
norm spikes, or turns NaN/Inf, is captured before the optimizer applies it.

:class:`SpikeWatch` adds two hooks on the root module and one optimizer step pre-hook:

* the root's forward pre-hook keeps the call's arguments (references) and RNG state (a copy of
  the CPU state, the CUDA states where CUDA is initialised), its forward hook the scalar loss
  the forward returned (``output.loss``, nanoGPT's ``(logits, loss)``: a reference);
* before the optimizer step, the per-parameter gradient norms (one ``torch._foreach_norm``),
  their global norm and the loss are read back in one synchronisation and given to a
  :class:`hooks.recorder.trigger.StepTrigger`. When it triggers, the step is replayed under the
  capture (:func:`hooks.recorder.trigger.replay_step`: same inputs, same RNG state, ``.grad``
  put back) and the trace, with the batch's token ids and the spike's story
  (:mod:`hooks.recorder.story`), becomes the step's capture when ``run.log`` records it.

A step the run captures anyway (``every``) is replayed too, its own capture paused meanwhile:
the triggered trace, with the batch, replaces it. The replay's forward is flagged
(:attr:`SpikeWatch.replaying`) so that the loop doctor skips it.

What it cannot replay (it says so in the trace's notes, or on stderr): a forward whose output
holds no scalar loss (the loss computed outside the model) is replayed forward only; with
gradient accumulation only the last micro-batch is replayed; a loop whose optimizer step runs
the forward itself (Lightning's ``optimizer.step(closure)``) is checked at the callback's
``on_before_optimizer_step`` (:meth:`SpikeWatch.before_update`).

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hooks.doctor.loop.watch import loss_of
from hooks.recorder.story import (
    adam_ratios,
    gradient_growth,
    grown,
    story,
    token_losses,
    top_tokens,
    trace_features,
)
from hooks.recorder.trigger import StepTrigger, Trigger, batch_tensors, replay_step
from hooks.trace.records import Note

__all__ = ["SpikeWatch", "finish_trace"]

#: Earlier captures whose internals the story compares with.
CAPTURES_KEPT = 20


def finish_trace(trace: Any, trig: Trigger, batch: dict[str, torch.Tensor],
                 output: Any, args: tuple, kwargs: dict[str, Any], *,
                 gradients: dict[str, Any] | None,
                 history: list[dict[str, float]], extra: dict[str, float] | None = None) -> None:
    """Add the batch (``trace.tensors["batch/<name>"]``, ``meta["batch"]``), the token texts
    where the caller gave none (``#id``), the trigger and the story (``meta["spike"]``) to a
    triggered capture; ``extra``: more of the step's features (Adam's update ratios)."""
    meta = trace.meta
    for name, t in batch.items():
        trace.tensors[f"batch/{name}"] = t
    meta["batch"] = {name: list(t.shape) for name, t in batch.items()}
    ids = batch.get("input_ids", next(iter(batch.values()), None)) if batch else None
    if "tokens" not in meta and ids is not None and ids.ndim == 2:
        meta["tokens"] = [f"#{i}" for i in ids.reshape(-1).tolist()]
        meta.setdefault("input_shape", list(ids.shape))
    tokens: list[dict[str, Any]] = []
    with contextlib.suppress(Exception):  # a model without logits/labels has no token losses
        per = token_losses(output, args, kwargs)
        if per is not None:
            tokens = top_tokens(per[0], per[1], per[2], meta.get("tokens"))
    meta["trigger"] = trig.to_dict()
    meta["spike"] = story(trig.to_dict(), gradients=gradients,
                          internals=grown({**trace_features(trace), **(extra or {})}, history),
                          tokens=tokens)


class SpikeWatch:
    """The triggered capture of ``run.watch`` (see the module docstring).

    Args:
        model: The root module.
        optimizer: The loop's optimizer (its step pre-hook checks each step), or ``None``
            (only :meth:`before_update` checks).
        next_step: The step number the current step will be logged as.
        busy: True while another part of mdb runs the model (a replay): its forwards are not
            the user's.
        active_capture: The run's capture of the current step, or ``None``.
        capture_options: Keyword arguments of :func:`hooks.capture` (``run.watch``'s).
        say: Prints one line on stderr.
    """

    def __init__(self, model: nn.Module, optimizer: Any, *, next_step: Callable[[], int],
                 busy: Callable[[], bool], active_capture: Callable[[], Any],
                 capture_options: dict[str, Any], say: Callable[[str], None]) -> None:
        self.model = model
        self.optimizer = optimizer
        self.trigger = StepTrigger("loss")
        #: Set by an integration that calls :meth:`before_update` itself (Lightning).
        self.external_step = False
        self._next_step, self._busy, self._active = next_step, busy, active_capture
        self._options = {k: v for k, v in capture_options.items() if k != "edits"}
        self._say = say
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._call: tuple | None = None
        self._loss: torch.Tensor | None = None
        self._forwards = 0
        self._inside = False
        self._pending: tuple[int, Any] | None = None
        self._adam: dict[str, float] = {}  # Adam's update ratios of a step the run captures
        self._history: deque[dict[str, float]] = deque(maxlen=CAPTURES_KEPT)
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post)]
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._on_step))

    @property
    def replaying(self) -> bool:
        """True while a triggered step is replayed under the capture."""
        return self._inside

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._inside or self._busy():
            return
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._call = (tuple(args), dict(kwargs), torch.get_rng_state(), cuda, module.training)
        self._forwards += 1

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._inside or self._busy():
            return
        with contextlib.suppress(Exception):
            loss = loss_of(output)
            self._loss = loss.detach() if loss is not None and loss.is_floating_point() \
                else None

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.external_step:
            self.before_update()

    def before_update(self) -> None:
        """Check the step whose gradients the optimizer is about to apply, and capture it when
        the trigger fires. Never raises (a failure is said once on stderr)."""
        if self._inside:
            return
        try:
            self._check()
        except Exception as exc:  # never break the user's step
            self._say(f"mdb: the spike check failed: {type(exc).__name__}: {exc}"[:300])
        finally:
            self._call, self._loss, self._forwards = None, None, 0

    def _norms(self) -> torch.Tensor | None:
        grads = [(i, p.grad) for i, (_, p) in enumerate(self._named) if p.grad is not None]
        if not grads:
            return None
        norms = torch.stack(torch._foreach_norm([g.detach() for _, g in grads])).float()
        if len(grads) == len(self._named):
            return norms
        full = norms.new_zeros(len(self._named))
        full[torch.tensor([i for i, _ in grads], device=norms.device)] = norms
        return full

    def _check(self) -> None:
        step = self._next_step()
        per = self._norms()
        if per is None:
            return
        vals = [per.norm()]
        if self._loss is not None and self._loss.numel() == 1:
            vals.append(self._loss.reshape(()).float().to(per.device))
        host = torch.stack(vals).tolist()  # the one synchronisation of the check
        self.trigger.keep_norms(step, per)
        trig = self.trigger.observe(step, host[1] if len(host) > 1 else None, host[0])
        if trig is None:
            if self._active() is not None:  # a captured step: its update ratios for the story
                self._adam = adam_ratios(self.optimizer, self._named)
            return
        if self._call is None:
            self._say(f"mdb: step {step}: {trig.reason}, not captured: the model's forward "
                      "was not seen in this step")
            return
        self._capture(trig)

    def _capture(self, trig: Trigger) -> None:
        args, kwargs, rng_cpu, rng_cuda, training = self._call
        model, forwards = self.model, self._forwards
        backward = [False]

        def run_step() -> Any:
            out = model(*args, **kwargs)
            loss = loss_of(out)
            if loss is not None and loss.requires_grad:
                loss.reshape(()).backward()
                backward[0] = True
            return out

        steps, norms = self.trigger.norm_history()
        gradients = gradient_growth(steps, norms, [n for n, _ in self._named])
        meta = {"description": f"step {trig.step} captured before its update: {trig.reason}"}
        cap = self._active()
        self._inside = True
        try:
            with cap.paused() if cap is not None else contextlib.nullcontext():
                trace, out = replay_step(model, run_step, rng_cpu=rng_cpu, rng_cuda=rng_cuda,
                                         training=training, step=trig.step, meta=meta,
                                         capture_options=self._options)
        finally:
            self._inside = False
        if not backward[0]:
            trace.notes.append(Note("spike", "the forward returned no scalar loss: the replay "
                                             "recorded the forward only"))
        if forwards > 1:
            trace.notes.append(Note("spike", f"{forwards} forwards ran before this update "
                                             "(gradient accumulation): the last one is replayed"))
        finish_trace(trace, trig, batch_tensors(args, kwargs), out, args, kwargs,
                     gradients=gradients, history=list(self._history),
                     extra=adam_ratios(self.optimizer, self._named))
        self._pending = (trig.step, trace)

    def remember(self, trace: Any) -> None:
        """Keep the internals of a capture the run stored (the medians the story compares
        with)."""
        with contextlib.suppress(Exception):
            self._history.append({**trace_features(trace), **self._adam})
        self._adam = {}

    def take(self, step: int) -> Any:
        """The triggered trace of ``step`` (once), else ``None``."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == step:
            return pending[1]
        return None

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self._handles:
            with contextlib.suppress(Exception):
                h.remove()
        self._handles = []
