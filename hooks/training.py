"""A UI-free training loop with live controls, checkpoints, and the overfit run of ``mdb overfit``.

Two layers:

* :class:`Trainer` — generic over a model and a batch: ``model(**batch)`` must return an object
  with ``loss`` (scalar) and optionally ``ce_loss``, ``aux_loss`` and ``router_logits`` (one
  (N, E) tensor per MoE layer), as :class:`minillm.MiniLLM` and Hugging Face causal LMs do.
  :meth:`Trainer.run` reports every step through a callback (in the training thread) and obeys a
  :class:`TrainControl` (pause / resume / single step / stop / capture the next step's internals)
  that any other thread may drive — a Textual app runs :meth:`Trainer.run` in a thread worker
  and posts a message from the callback. A non-finite loss or gradient stops the run as
  ``failed`` with the step and the module where the first non-finite value appeared.
* :class:`OverfitSession` — seed 000's "memorise a short text" sanity check: builds the model,
  tokenizer, AdamW optimizer and batch from :class:`OverfitOptions`, writes every step to a
  :class:`hooks.runstore.RunStore`, checkpoints (safetensors + JSON, no pickle) at the end and on
  interruption, and resumes from a checkpoint.

An overfit run's checkpoints live in ``<db stem>-checkpoints/<run>/step-<N>/``; the store's
row names the current one and is the commit point (older directories are deleted after it is
updated), so a ``kill -9`` at any moment leaves a checkpoint that matches the database.

Checkpoint layout (a directory, written to ``<dir>.tmp`` and renamed into place)::

    model.safetensors      model state (tied tensors stored once: safetensors.torch.save_model)
    optimizer.safetensors  each tensor of optimizer.state_dict()["state"], key "<param idx>.<name>"
    checkpoint.json        step, seed, RNG state (hex), optimizer param_groups and non-tensor
                           state values, and any caller-supplied fields

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hooks.runstore import MetricRow, RunStore, RunWriter, checkpoint_dir

__all__ = [
    "CHECKPOINT_FORMAT",
    "DEFAULT_TEXT_PATH",
    "NonFiniteInfo",
    "OverfitOptions",
    "OverfitSession",
    "StepReport",
    "TrainControl",
    "TrainResult",
    "Trainer",
    "expert_load",
    "install_stop_signals",
    "load_checkpoint",
    "load_trace",
    "locate_nonfinite",
    "save_checkpoint",
    "signal_exit_code",
]

#: ``checkpoint.json``'s ``format`` value.
CHECKPOINT_FORMAT = "mdb-checkpoint-1"
#: The default overfit text: seed 000's test C sentence ×6, relative to the repository root.
DEFAULT_TEXT_PATH = Path(__file__).resolve().parent.parent / "samples" / "overfit_zh.txt"
#: Seed 000's test C sentence, used when ``samples/overfit_zh.txt`` is not available.
SEED_SENTENCE = "人工智能正在改变世界。"


# ---------------------------------------------------------------------------------------------
# Controls
# ---------------------------------------------------------------------------------------------


class TrainControl:
    """Thread-safe run controls shared by the training thread and a UI (or signal handler).

    Every method may be called from any thread. The training loop checks the controls between
    steps: a stop or pause takes effect after the step in progress.

    Args:
        paused: Start paused (the first step waits for :meth:`resume` or :meth:`step_once`).
    """

    def __init__(self, paused: bool = False) -> None:
        self._cond = threading.Condition()
        self._paused = paused
        self._credits = 0
        self._stop_reason: str | None = None
        self._capture = False
        self._pause_after_capture = False

    # -- commands ----------------------------------------------------------------------------

    def pause(self) -> None:
        """Pause after the current step."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()

    def resume(self) -> None:
        """Resume continuous training."""
        with self._cond:
            self._paused = False
            self._credits = 0
            self._cond.notify_all()

    def toggle_pause(self) -> bool:
        """Pause if running, resume if paused; returns the new paused state."""
        with self._cond:
            self._paused = not self._paused
            self._credits = 0
            self._cond.notify_all()
            return self._paused

    def step_once(self, n: int = 1) -> None:
        """While paused, allow ``n`` more steps (ignored while running)."""
        with self._cond:
            if self._paused:
                self._credits += max(0, int(n))
                self._cond.notify_all()

    def stop(self, reason: str = "stopped") -> None:
        """Stop after the current step; the run ends ``interrupted`` with this reason.

        The first reason wins (a later ``stop`` does not overwrite it).
        """
        with self._cond:
            if self._stop_reason is None:
                self._stop_reason = reason
            self._cond.notify_all()

    def request_capture(self, pause_after: bool = False) -> None:
        """Capture the internals of the next step; optionally pause right after it."""
        with self._cond:
            self._capture = True
            self._pause_after_capture = pause_after
            if self._paused and self._credits == 0:
                self._credits = 1  # the captured step runs even while paused
            self._cond.notify_all()

    # -- state -------------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """Whether continuous training is paused."""
        with self._cond:
            return self._paused

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`stop` was called."""
        with self._cond:
            return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The reason given to the first :meth:`stop`, else ``None``."""
        with self._cond:
            return self._stop_reason

    @property
    def capture_pending(self) -> bool:
        """Whether the next step will be captured on request."""
        with self._cond:
            return self._capture

    # -- used by the loop --------------------------------------------------------------------

    def _decide(self) -> str:
        """``"stop"``, ``"go"`` or ``"wait"`` for the next step (consumes a single-step credit)."""
        with self._cond:
            if self._stop_reason is not None:
                return "stop"
            if not self._paused:
                return "go"
            if self._credits > 0:
                self._credits -= 1
                return "go"
            return "wait"

    def _wait(self, timeout: float) -> None:
        with self._cond:
            if self._stop_reason is None and self._paused and self._credits == 0:
                self._cond.wait(timeout)

    def _take_capture(self) -> tuple[bool, bool]:
        with self._cond:
            cap, pause_after = self._capture, self._pause_after_capture
            self._capture = self._pause_after_capture = False
            return cap, pause_after


def signal_exit_code(reason: str | None) -> int | None:
    """Conventional exit status for a run stopped by a signal: 128 + the signal number.

    ``"SIGINT"`` → 130, ``"SIGTERM"`` → 143, ``"SIGHUP"`` → 129; ``None`` for other reasons.
    """
    if not reason or not reason.startswith("SIG"):
        return None
    try:
        return 128 + int(signal.Signals[reason])
    except KeyError:
        return None


def install_stop_signals(
    control: TrainControl,
    signals: Iterable[str] = ("SIGINT", "SIGTERM", "SIGHUP"),
    on_signal: Callable[[str], None] | None = None,
) -> Callable[[], None]:
    """Make these signals stop the run gracefully (finish the step, checkpoint, mark interrupted).

    Must be called from the main thread (a Python rule for ``signal.signal``). The stop reason
    is the signal's name (``"SIGTERM"``), which :func:`signal_exit_code` maps to an exit status.
    A second SIGINT while stopping raises ``KeyboardInterrupt`` as usual.

    Args:
        control: The controls to stop.
        signals: Signal names; names this platform lacks are skipped.
        on_signal: Called (in the main thread, inside the handler) with the signal name.

    Returns:
        A function restoring the previous handlers.
    """
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and control.stop_requested:
            raise KeyboardInterrupt
        control.stop(name)
        if on_signal is not None:
            on_signal(name)

    for name in signals:
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        previous[sig] = signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)

    return restore


# ---------------------------------------------------------------------------------------------
# Step results
# ---------------------------------------------------------------------------------------------


@dataclass
class NonFiniteInfo:
    """Where a non-finite value first appeared in a failed step.

    Attributes:
        step: The step whose loss or gradient was non-finite.
        what: ``"loss"`` (forward) or ``"gradient"`` (backward).
        module: Qualified name of the module whose output (forward) or gradient (backward)
            was first non-finite, or a parameter name for a gradient; ``None`` if not located.
        detail: One line describing the offending tensor.
    """

    step: int
    what: str
    module: str | None
    detail: str

    def describe(self) -> str:
        """One line, e.g. ``non-finite loss at step 7, first in model.layers.1.mlp (...)``."""
        where = f", first in {self.module}" if self.module else ""
        return f"non-finite {self.what} at step {self.step}{where}: {self.detail}"


@dataclass
class StepReport:
    """What one training step produced; passed to the ``on_step`` callback.

    Attributes:
        metrics: The step's :class:`hooks.runstore.MetricRow`.
        internals: JSON-serialisable captured statistics when the step was captured
            (``hooks.Trace.to_dict()``).
        internals_tensors: The capture's tensors (routing, attention) as safetensors bytes.
        trace: The capture object itself (a :class:`hooks.Trace` when the hooks engine is
            available) for a step-through view, else ``None``.
        sample: ``(prompt, greedy continuation)`` when generated at this step.
        failure: Set when the loss or gradient was non-finite (the update was skipped).
        paused_after: The loop will pause after this step (capture with ``pause_after``).
    """

    metrics: MetricRow
    internals: dict[str, Any] | None = None
    internals_tensors: bytes | None = None
    trace: Any = None
    sample: tuple[str, str] | None = None
    failure: NonFiniteInfo | None = None
    paused_after: bool = False

    @property
    def step(self) -> int:
        """The step number (1-based)."""
        return self.metrics.step


@dataclass
class TrainResult:
    """How :meth:`Trainer.run` ended.

    Attributes:
        status: ``finished`` (reached ``total_steps``), ``interrupted`` (stopped through the
            controls) or ``failed`` (non-finite loss or gradient).
        last_step: The last completed step (its update applied, except for a failed step).
        reason: ``"finished"``, the stop reason (``"SIGTERM"``, ``"stopped"``), or the failure.
        failure: For ``failed``: where the non-finite value appeared.
    """

    status: str
    last_step: int
    reason: str
    failure: NonFiniteInfo | None = None


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def expert_load(router_logits: Iterable[torch.Tensor], top_k: int) -> list[list[float]]:
    """Fraction of routed slots each expert received, per MoE layer.

    Args:
        router_logits: One (N, E) tensor per MoE layer (N = B·T tokens).
        top_k: k, experts per token.

    Returns:
        (L_moe, E) nested lists: ``count_e / (N·k)`` where ``count_e`` is the number of tokens
        whose top-k includes expert e (ties broken as ``torch.topk``). Rows sum to 1; a
        balanced router gives 1/E everywhere. This is ``f_e`` of the Switch load-balancing loss.
    """
    out = []
    with torch.no_grad():
        for logits in router_logits:
            n, e = logits.shape
            k = min(top_k, e)
            ids = torch.topk(logits.float(), k, dim=-1).indices.reshape(-1)
            counts = torch.bincount(ids, minlength=e).double()
            out.append((counts / max(1, n * k)).tolist())
    return out


def _first_nonfinite_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and not bool(torch.isfinite(obj).all()):
            return obj
        return None
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, (list, tuple)):
        for item in obj:
            t = _first_nonfinite_tensor(item)
            if t is not None:
                return t
    return None


def _describe_tensor(t: torch.Tensor) -> str:
    t = t.detach()
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    return f"{nan} NaN, {inf} Inf of {t.numel()} in a {tuple(t.shape)} tensor"


def locate_nonfinite(
    model: nn.Module, forward: Callable[[], Any]
) -> tuple[str | None, str]:
    """Run ``forward()`` with a forward hook on every module; name the first non-finite output.

    A minimal locator used when the :mod:`hooks` capture engine is not available. Forward hooks
    fire when a module *returns*, so among nested modules the innermost one that produced a
    non-finite output is found first; among siblings, the first executed.

    Args:
        model: The model whose submodules are hooked.
        forward: Runs the forward pass (its result is ignored).

    Returns:
        ``(qualified module name or None, one-line description)``.
    """
    found: list[tuple[str, str]] = []
    handles = []

    def make(name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if found:
                return
            bad = _first_nonfinite_tensor(output)
            if bad is not None:
                found.append((name, f"output of {type(module).__name__}: " + _describe_tensor(bad)))

        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(make(name or "<root>")))
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in handles:
            h.remove()
    if found:
        return found[0]
    return None, "no module output was non-finite (the loss itself is)"


def _hooks_capture_available() -> bool:
    try:
        import hooks

        return callable(getattr(hooks, "capture", None))
    except Exception:  # pragma: no cover - a broken hooks package must not stop training
        return False


@contextlib.contextmanager
def _maybe_capture(
    model: nn.Module, step: int | None = None, kwargs: Mapping[str, Any] | None = None
):
    """``hooks.capture(model)`` as a context yielding the Trace, or ``None`` without the engine."""
    if not _hooks_capture_available():
        yield None
        return
    import hooks

    with hooks.capture(model, step=step, **dict(kwargs or {})) as trace:
        yield trace


def _trace_tensors(trace: Any) -> bytes | None:
    """The trace's tensors (``Trace.all_tensors()``) as safetensors bytes, or ``None``."""
    all_tensors = getattr(trace, "all_tensors", None)
    if not callable(all_tensors):
        return None
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in all_tensors().items()}
    if not tensors:
        return None
    from safetensors.torch import save

    return save(tensors)


def load_trace(store: RunStore, run_id: int, step: int):
    """Rebuild the :class:`hooks.Trace` captured at ``step`` of a run from the store.

    Args:
        store: An open :class:`hooks.runstore.RunStore` (a reader is fine).
        run_id: :attr:`hooks.runstore.RunInfo.id`.
        step: A step listed by :meth:`hooks.runstore.RunStore.internals_steps`.

    Returns:
        The trace (statistics, routing and attention tensors), or ``None`` when the step has no
        captured internals.

    Raises:
        hooks.TraceFormatError: The stored internals are not a trace this mdb can read.
    """
    import hooks

    data = store.internals(run_id, step)
    if data is None:
        return None
    blob = store.internals_tensors(run_id, step)
    tensors = {}
    if blob:
        from safetensors.torch import load

        tensors = load(blob)
    return hooks.Trace.from_dict(data, tensors)


def _trace_to_internals(trace: Any) -> dict[str, Any] | None:
    """JSON-serialisable statistics of a Trace: its ``to_dict()`` if any, else its records'."""
    if trace is None:
        return None
    to_dict = getattr(trace, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    out: dict[str, Any] = {}
    for attr in ("forward", "backward", "params", "routing"):
        records = getattr(trace, attr, None)
        if records is None:
            continue
        if isinstance(records, Mapping):
            records = list(records.values())
        out[attr] = [r.to_dict() if hasattr(r, "to_dict") else r for r in records]
    return out


def _trace_first_nonfinite(trace: Any, direction: str) -> tuple[str | None, str] | None:
    fn = getattr(trace, "first_nonfinite", None)
    if not callable(fn):
        return None
    nf = fn(direction)
    if nf is None:
        return None
    describe = getattr(nf, "describe", None)
    return getattr(nf, "module", None), describe() if callable(describe) else str(nf)


# ---------------------------------------------------------------------------------------------
# The generic trainer
# ---------------------------------------------------------------------------------------------

Batch = Mapping[str, Any]


class Trainer:
    """Train ``model`` on a batch (or a batch per step) with ``optimizer``; report every step.

    One step: ``model(**batch)`` → check the loss is finite → ``loss.backward()`` → global
    gradient norm (``torch.nn.utils.get_total_norm``) → check it is finite → optional clipping
    → ``optimizer.step()``. A non-finite loss or gradient norm skips the update and ends the run
    ``failed``; the step is run again under the :mod:`hooks` capture engine (or, without it,
    :func:`locate_nonfinite`) to name the first module that produced a non-finite value.

    Args:
        model: Any ``nn.Module`` whose forward returns an object with a scalar ``loss``
            (optionally ``ce_loss``, ``aux_loss``, ``router_logits``).
        batch: Keyword arguments for the model (e.g. ``input_ids`` and ``labels`` (B, T)), or
            a callable ``batch(step) -> mapping`` for a batch that changes per step.
        optimizer: A ``torch.optim.Optimizer`` over the model's parameters.
        total_steps: Train until this step number (steps are 1-based).
        start_step: Steps already done (resume); the first step run is ``start_step + 1``.
        grad_clip: Clip the global gradient norm to this value (``None``: no clipping).
        capture_every: Capture the internals of every N-th step (0: only on request).
        sample_every: Call ``sample_fn`` every N-th step, at the first step and at the last.
        sample_fn: ``sample_fn(model) -> (prompt, continuation)`` (e.g. a greedy decode).
        top_k: Experts per token for :func:`expert_load` (default:
            ``model.config.num_experts_per_tok`` when present).
        tokens_per_step: Tokens per step for throughput (default: ``input_ids.numel()``).
        lr_at: Optional schedule ``lr_at(step) -> lr`` applied to every param group.
        capture_kwargs: Extra keyword arguments of ``hooks.capture`` (e.g. ``attention=True``).
        capture_meta: ``capture_meta(batch) -> dict`` stored in a captured trace's ``meta``
            (token labels, config); the step's losses are added as ``loss``, ``ce_loss``,
            ``aux_loss``.

    Raises:
        ValueError: ``total_steps < start_step`` or a negative interval.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Batch | Callable[[int], Batch],
        optimizer: torch.optim.Optimizer,
        *,
        total_steps: int,
        start_step: int = 0,
        grad_clip: float | None = None,
        capture_every: int = 0,
        sample_every: int = 0,
        sample_fn: Callable[[nn.Module], tuple[str, str]] | None = None,
        top_k: int | None = None,
        tokens_per_step: int | None = None,
        lr_at: Callable[[int], float] | None = None,
        capture_kwargs: Mapping[str, Any] | None = None,
        capture_meta: Callable[[Batch], dict[str, Any]] | None = None,
    ) -> None:
        if total_steps < start_step:
            raise ValueError(f"total_steps ({total_steps}) is before start_step ({start_step})")
        if capture_every < 0 or sample_every < 0:
            raise ValueError("capture_every and sample_every must be >= 0")
        self.model = model
        self.batch = batch
        self.optimizer = optimizer
        self.total_steps = int(total_steps)
        self.step = int(start_step)
        self.start_step = int(start_step)
        self.grad_clip = grad_clip
        self.capture_every = int(capture_every)
        self.sample_every = int(sample_every)
        self.sample_fn = sample_fn
        cfg = getattr(model, "config", None)
        self.top_k = top_k if top_k is not None else getattr(cfg, "num_experts_per_tok", 1)
        self.tokens_per_step = tokens_per_step
        self.lr_at = lr_at
        self.capture_kwargs = dict(capture_kwargs or {})
        self.capture_meta = capture_meta
        self._params = [p for p in model.parameters() if p.requires_grad]

    # -- one step ------------------------------------------------------------------------------

    def _batch(self, step: int) -> Batch:
        return self.batch(step) if callable(self.batch) else self.batch

    def _tokens(self, batch: Batch) -> int:
        if self.tokens_per_step is not None:
            return self.tokens_per_step
        ids = batch.get("input_ids")
        return int(ids.numel()) if isinstance(ids, torch.Tensor) else 0

    def train_step(self, step: int | None = None, capture: bool = False) -> StepReport:
        """Run one step (number ``self.step + 1`` unless given) and advance ``self.step``.

        Args:
            step: Step number (default ``self.step + 1``).
            capture: Run it under the :mod:`hooks` capture engine and return its statistics.

        Returns:
            The :class:`StepReport`; ``failure`` is set (and the update skipped) when the loss
            or gradient norm was non-finite.
        """
        step = self.step + 1 if step is None else int(step)
        model, opt = self.model, self.optimizer
        model.train()
        batch = self._batch(step)
        lr = self.lr_at(step) if self.lr_at is not None else None
        if lr is not None:
            for group in opt.param_groups:
                group["lr"] = lr
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        cap_ctx = (
            _maybe_capture(model, step, self.capture_kwargs) if capture
            else contextlib.nullcontext()
        )
        with cap_ctx as trace:
            out = model(**batch)
            loss = out.loss
            loss_ok = bool(torch.isfinite(loss.detach()).all())
            if loss_ok:
                loss.backward()
        grad_norm = float("nan")
        grad_ok = False
        if loss_ok:
            grads = [p.grad for p in self._params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            grad_norm = float(norm)
            grad_ok = math.isfinite(grad_norm)
            if grad_ok:
                if self.grad_clip is not None:
                    torch.nn.utils.clip_grads_with_norm_(self._params, self.grad_clip, norm)
                opt.step()
        step_time = time.perf_counter() - t0

        ce = getattr(out, "ce_loss", None)
        aux = getattr(out, "aux_loss", None)
        routers = getattr(out, "router_logits", None) or ()
        tokens = self._tokens(batch)
        metrics = MetricRow(
            step=step,
            wall=time.time(),
            ce=float(ce.detach()) if ce is not None else float(loss.detach()),
            aux=float(aux.detach()) if aux is not None else 0.0,
            total=float(loss.detach()),
            grad_norm=grad_norm,
            lr=float(opt.param_groups[0]["lr"]),
            step_time=step_time,
            tokens_per_s=tokens / step_time if step_time > 0 else None,
            steps_per_s=1.0 / step_time if step_time > 0 else None,
            expert_load=expert_load(routers, self.top_k) if routers else None,
        )
        report = StepReport(metrics=metrics)
        if trace is not None:
            meta = dict(self.capture_meta(batch)) if self.capture_meta is not None else {}
            meta.update(step=step, loss=metrics.total, ce_loss=metrics.ce, aux_loss=metrics.aux)
            meta = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                    for k, v in meta.items()}
            if isinstance(getattr(trace, "meta", None), dict):
                trace.meta.update(meta)
            report.trace = trace
            report.internals = _trace_to_internals(trace)
            report.internals_tensors = _trace_tensors(trace)
        if not (loss_ok and grad_ok):
            report.failure = self._locate_failure(step, batch, loss_ok, trace)
            opt.zero_grad(set_to_none=True)
        elif self.sample_fn is not None and self._sample_due(step):
            report.sample = self.sample_fn(model)
        self.step = step
        return report

    def _sample_due(self, step: int) -> bool:
        if self.sample_every <= 0:
            return False
        return step == self.start_step + 1 or step % self.sample_every == 0 or (
            step == self.total_steps
        )

    def _locate_failure(
        self, step: int, batch: Batch, loss_ok: bool, trace: Any
    ) -> NonFiniteInfo:
        what = "gradient" if loss_ok else "loss"
        direction = "backward" if loss_ok else "forward"
        located = _trace_first_nonfinite(trace, direction) if trace is not None else None
        if located is None and _hooks_capture_available():
            try:
                with _maybe_capture(self.model, step) as tr:
                    out = self.model(**batch)
                    if loss_ok:
                        out.loss.backward()
                located = _trace_first_nonfinite(tr, direction)
            except Exception:  # a broken capture must not hide the failure itself
                located = None
            self.optimizer.zero_grad(set_to_none=True)
        if located is None and not loss_ok:
            located = locate_nonfinite(self.model, lambda: self.model(**batch))
        if located is None:  # gradient: the first parameter with a non-finite gradient
            located = (None, "no non-finite gradient found")
            for name, p in self.model.named_parameters():
                if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                    located = (name, "gradient of parameter: " + _describe_tensor(p.grad))
                    break
        module, detail = located
        return NonFiniteInfo(step=step, what=what, module=module, detail=detail)

    # -- the loop ------------------------------------------------------------------------------

    def run(
        self,
        control: TrainControl | None = None,
        on_step: Callable[[StepReport], None] | None = None,
        on_state: Callable[[str], None] | None = None,
    ) -> TrainResult:
        """Train until ``total_steps``, a stop, or a non-finite value.

        Runs in the calling thread; ``on_step`` and ``on_state`` are called in that thread.

        Args:
            control: Pause / single-step / stop / capture controls (a fresh one if ``None``).
            on_step: Called after every step with its :class:`StepReport`.
            on_state: Called with ``"paused"`` when the loop starts waiting and ``"running"``
                when it continues after a pause.

        Returns:
            A :class:`TrainResult`.
        """
        control = control or TrainControl()
        waiting = False
        while self.step < self.total_steps:
            decision = control._decide()
            if decision == "stop":
                break
            if decision == "wait":
                if not waiting:
                    waiting = True
                    if on_state is not None:
                        on_state("paused")
                control._wait(0.5)
                continue
            if waiting and not control.paused:
                waiting = False
                if on_state is not None:
                    on_state("running")
            step = self.step + 1
            requested, pause_after = control._take_capture()
            capture = requested or (self.capture_every > 0 and step % self.capture_every == 0)
            report = self.train_step(step, capture=capture)
            if pause_after:
                control.pause()
                report.paused_after = True
            if on_step is not None:
                on_step(report)
            if report.failure is not None:
                return TrainResult("failed", step, report.failure.describe(), report.failure)
        if waiting and on_state is not None:
            on_state("running")
        if self.step >= self.total_steps:
            return TrainResult("finished", self.step, "finished")
        return TrainResult("interrupted", self.step, control.stop_reason or "stopped")


# ---------------------------------------------------------------------------------------------
# Checkpoints (safetensors + JSON, no pickle)
# ---------------------------------------------------------------------------------------------


def _encode_json(value: Any) -> Any:
    if isinstance(value, tuple):
        return {"__tuple__": [_encode_json(v) for v in value]}
    if isinstance(value, list):
        return [_encode_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode_json(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        raise TypeError("tensors belong in the safetensors file")
    return value


def _decode_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_decode_json(v) for v in value["__tuple__"])
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _decode_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_json(v) for v in value]
    return value


def _step_dir_name(step: int) -> str:
    return f"step-{int(step):08d}"


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    step: int,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write a checkpoint directory atomically (see the module docstring for the layout).

    The files are written into ``<path>.tmp`` and the directory is then renamed into place, so
    a reader (or a resume after ``kill -9``) sees either the previous checkpoint or the new one.

    Args:
        path: Checkpoint directory.
        model: Its ``state_dict`` is saved with ``safetensors.torch.save_model`` (tied weights
            stored once).
        optimizer: Its state tensors go to ``optimizer.safetensors``, the rest to JSON.
        step: Step the checkpoint is taken after.
        extra: JSON-serialisable fields stored in ``checkpoint.json`` (e.g. the run config).

    Returns:
        The checkpoint directory.
    """
    from safetensors.torch import save_file, save_model

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    meta: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "step": int(step),
        "saved": time.time(),
        "torch_rng_state": torch.get_rng_state().numpy().tobytes().hex(),
        "extra": _encode_json(dict(extra or {})),
    }
    if optimizer is not None:
        sd = optimizer.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        other: dict[str, dict[str, Any]] = {}
        for idx, st in sd["state"].items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{idx}.{key}"] = value.detach().contiguous().cpu()
                else:
                    other.setdefault(str(idx), {})[key] = _encode_json(value)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        meta["optimizer"] = {
            "class": type(optimizer).__name__,
            "param_groups": _encode_json(sd["param_groups"]),
            "state_other": other,
        }
    with open(tmp / "checkpoint.json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    return path


def read_checkpoint_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``checkpoint.json`` of a checkpoint directory, decoded.

    Raises:
        FileNotFoundError: No checkpoint there.
        ValueError: Not an mdb checkpoint.
    """
    path = Path(path)
    meta_path = path / "checkpoint.json"
    if not meta_path.exists():
        # an interrupted save leaves the previous checkpoint in <path>.old
        old = path.with_name(path.name + ".old")
        if (old / "checkpoint.json").exists():
            meta_path = old / "checkpoint.json"
        else:
            raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable checkpoint {meta_path}: {exc}") from exc
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{meta_path} is not an mdb checkpoint")
    meta["extra"] = _decode_json(meta.get("extra", {}))
    meta["_dir"] = str(meta_path.parent)
    return meta


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``).

    Args:
        path: Checkpoint directory.
        model: A model of the same architecture; loaded strictly.
        optimizer: An optimizer of the same class over the same parameters, or ``None``.
        restore_rng: Restore torch's global CPU RNG state too.

    Returns:
        The decoded ``checkpoint.json`` (``step``, ``extra`` ...).

    Raises:
        FileNotFoundError: No checkpoint at ``path``.
        ValueError: Not an mdb checkpoint, or it does not fit the model/optimizer.
    """
    from safetensors.torch import load_file, load_model

    meta = read_checkpoint_meta(path)
    d = Path(meta["_dir"])
    try:
        missing, unexpected = load_model(model, str(d / "model.safetensors"), strict=True)
    except (RuntimeError, OSError) as exc:
        raise ValueError(f"checkpoint {d} does not fit the model: {exc}") from exc
    if optimizer is not None:
        info = meta.get("optimizer")
        if info is None:
            raise ValueError(f"checkpoint {d} has no optimizer state")
        if info["class"] != type(optimizer).__name__:
            raise ValueError(
                f"checkpoint {d} holds {info['class']} state, not {type(optimizer).__name__}"
            )
        tensors = load_file(str(d / "optimizer.safetensors"))
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            idx, name = key.split(".", 1)
            state.setdefault(int(idx), {})[name] = value
        for idx, values in info.get("state_other", {}).items():
            for name, value in values.items():
                state.setdefault(int(idx), {})[name] = _decode_json(value)
        groups = _decode_json(info["param_groups"])
        try:
            optimizer.load_state_dict({"state": state, "param_groups": groups})
        except (ValueError, KeyError, RuntimeError) as exc:
            raise ValueError(f"checkpoint {d} does not fit the optimizer: {exc}") from exc
    if restore_rng and meta.get("torch_rng_state"):
        rng = torch.frombuffer(bytearray(bytes.fromhex(meta["torch_rng_state"])), dtype=torch.uint8)
        torch.set_rng_state(rng.clone())
    return meta


# ---------------------------------------------------------------------------------------------
# The overfit run
# ---------------------------------------------------------------------------------------------


@dataclass
class OverfitOptions:
    """Everything that defines an overfit run (stored as the run's config, so it can resume).

    Attributes:
        text: The text to memorise.
        text_source: Where it came from (a path, for display).
        model_config: ``MiniLLMConfig.to_dict()`` of the model *before* ``vocab_size`` is set
            to the tokenizer's size.
        preset: Preset name the config came from, if any (for display).
        steps: Total steps.
        lr: AdamW learning rate (constant).
        weight_decay: AdamW weight decay.
        seq_len: Tokens per sequence; ``None`` (or ≥ the text's length) trains on the whole text.
            Shorter: each step takes ``batch_size`` windows at offsets drawn from a generator
            seeded with ``seed + step`` (so a resumed run sees the same batches).
        batch_size: B, sequences per step.
        seed: Seeds the model's initialisation and the window offsets.
        every: Record internals (hooks statistics) every N steps (0: only on request).
        sample_every: Greedy continuation every N steps (0: never).
        prompt_chars: Characters of the text's beginning used as the sample prompt.
        sample_tokens: Tokens generated per sample.
        checkpoint_every: Also checkpoint every N steps (0: only at the end and on interruption).
        grad_clip: Clip the global gradient norm (``None``: off).
        tokenizer: ``"char"`` (the text's characters, seed 000's) or ``"byte"``.
    """

    text: str
    text_source: str = "samples/overfit_zh.txt"
    model_config: dict[str, Any] = field(default_factory=dict)
    preset: str | None = "seed-test-c"
    steps: int = 300
    lr: float = 3e-3
    weight_decay: float = 0.01
    seq_len: int | None = None
    batch_size: int = 1
    seed: int = 0
    every: int = 0
    sample_every: int = 25
    prompt_chars: int = 4
    sample_tokens: int = 32
    checkpoint_every: int = 0
    grad_clip: float | None = None
    tokenizer: str = "char"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict (the run's stored config)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OverfitOptions:
        """Inverse of :meth:`to_dict`; unknown keys are ignored (a later mdb may add some)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def validate(self) -> None:
        """Raise ``ValueError`` with one line naming the bad option."""
        if not self.text:
            raise ValueError("the text to memorise is empty")
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.seq_len is not None and self.seq_len < 2:
            raise ValueError(f"--seq-len must be at least 2, got {self.seq_len}")
        for name in ("every", "sample_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.tokenizer not in ("char", "byte"):
            raise ValueError(f"tokenizer must be 'char' or 'byte', got {self.tokenizer!r}")


def default_overfit_text() -> tuple[str, str]:
    """``(text, source)`` of the default run: ``samples/overfit_zh.txt`` if present (one trailing
    newline dropped), else the seed sentence ×6."""
    if DEFAULT_TEXT_PATH.exists():
        text = DEFAULT_TEXT_PATH.read_text(encoding="utf-8")
        return text.removesuffix("\n").removesuffix("\r"), "samples/overfit_zh.txt"
    return SEED_SENTENCE * 6, "seed 000 test C sentence ×6"


class OverfitSession:
    """An overfit run bound to a run store: model, optimizer, trainer, writer and checkpoints.

    Build one with :meth:`create` (a new run) or :meth:`resume` (continue an interrupted one),
    then call :meth:`run` — from the main thread for a headless run, or from a worker thread
    under a UI (install signal handlers in the main thread with :func:`install_stop_signals` on
    :attr:`control`).

    Attributes:
        options: The run's :class:`OverfitOptions`.
        model: The :class:`minillm.MiniLLM` being trained.
        tokenizer: Its tokenizer.
        config: The model's ``MiniLLMConfig`` (``vocab_size`` = tokenizer size).
        optimizer: AdamW.
        trainer: The :class:`Trainer`.
        control: The :class:`TrainControl` (pause / step / stop / capture).
        store: The :class:`RunStore`; ``writer``: the :class:`RunWriter` of this run.
        result: The :class:`TrainResult` once :meth:`run` returned.
    """

    def __init__(
        self,
        options: OverfitOptions,
        store: RunStore,
        writer: RunWriter | None,
        *,
        start_step: int = 0,
        checkpoint: str | os.PathLike[str] | None = None,
    ) -> None:
        import minillm

        self.options = options
        self.store = store
        self.writer: RunWriter = writer  # type: ignore[assignment]  (set by create())
        self.name = writer.name if writer is not None else ""
        self.control = TrainControl()
        self.result: TrainResult | None = None
        self.checkpoint_error: str | None = None
        #: The checkpoint directory the store records for this run (``None``: none yet).
        self.last_checkpoint: Path | None = Path(checkpoint) if checkpoint is not None else None
        torch.manual_seed(options.seed)
        if options.tokenizer == "char":
            self.tokenizer: Any = minillm.CharTokenizer.from_text(options.text)
        else:
            self.tokenizer = minillm.ByteTokenizer()
        base = minillm.MiniLLMConfig.from_dict(dict(options.model_config))
        self.config = base.replace(vocab_size=self.tokenizer.vocab_size)
        self.ids = torch.tensor([self.tokenizer.encode(options.text)], dtype=torch.long)
        n = self.ids.shape[1]
        if n < 2:
            raise ValueError("the text must be at least 2 tokens long")
        seq = n if options.seq_len is None else min(options.seq_len, n)
        if seq > self.config.max_position_embeddings:
            raise ValueError(
                f"a sequence of {seq} tokens exceeds the model's max_position_embeddings "
                f"({self.config.max_position_embeddings}); pass a smaller --seq-len"
            )
        self.seq_len = seq
        self.model = minillm.MiniLLM(self.config)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=options.lr, weight_decay=options.weight_decay
        )
        if checkpoint is not None:
            load_checkpoint(checkpoint, self.model, self.optimizer)
        self.trainer = Trainer(
            self.model,
            self._batch_for,
            self.optimizer,
            total_steps=options.steps,
            start_step=start_step,
            grad_clip=options.grad_clip,
            capture_every=options.every,
            sample_every=options.sample_every,
            sample_fn=self.greedy_sample,
            top_k=self.config.num_experts_per_tok,
            capture_kwargs={"attention": True},
            capture_meta=self._capture_meta,
        )
        self._fixed_batch = None
        if seq == n:
            x = self.ids.expand(options.batch_size, n).contiguous()
            self._fixed_batch = {"input_ids": x, "labels": x}

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        store: RunStore,
        name: str,
        options: OverfitOptions,
    ) -> OverfitSession:
        """Register a new run ``name`` in ``store`` and build its session.

        Raises:
            ValueError: Invalid options (one line).
            hooks.runstore.RunStoreError: Bad name or the name exists.
        """
        options.validate()
        session = cls(options, store, None)  # builds (and validates) everything first
        session.writer = store.create_run(
            name,
            {**options.to_dict(), "resolved_model_config": session.config.to_dict()},
            total_steps=options.steps,
        )
        session.name = name
        return session

    @classmethod
    def resume(cls, store: RunStore, name: str, steps: int | None = None) -> OverfitSession:
        """Continue run ``name`` from its last checkpoint (model, optimizer, RNG, step).

        Args:
            store: The store holding the run.
            name: The run.
            steps: A new total step count (default: the stored one).

        Raises:
            hooks.runstore.RunStoreError: No such run, its writer is alive, no checkpoint, or
                it already reached its step target.
            ValueError: The checkpoint is missing or does not fit.
        """
        run = store.run(name)
        options = OverfitOptions.from_dict(run.config)
        if steps is not None:
            options.steps = int(steps)
        options.validate()
        writer = store.resume_run(name, total_steps=options.steps)
        ckpt = Path(run.checkpoint_path or "")
        if not ckpt.is_absolute():
            ckpt = store.path.parent / ckpt
        try:
            meta = read_checkpoint_meta(ckpt)
            if meta["step"] != run.checkpoint_step:
                raise ValueError(
                    f"checkpoint at {ckpt} is of step {meta['step']}, the database says "
                    f"{run.checkpoint_step}"
                )
            session = cls(options, store, writer, start_step=meta["step"], checkpoint=ckpt)
        except BaseException as exc:
            writer.finish("interrupted", reason=f"resume failed: {exc}")
            raise
        writer.update_config(
            {**options.to_dict(), "resolved_model_config": session.config.to_dict()}
        )
        return session

    # -- pieces --------------------------------------------------------------------------------

    def _batch_for(self, step: int) -> dict[str, torch.Tensor]:
        if self._fixed_batch is not None:
            return self._fixed_batch
        n, seq, b = self.ids.shape[1], self.seq_len, self.options.batch_size
        g = torch.Generator().manual_seed(self.options.seed * 1_000_003 + step)
        starts = torch.randint(0, n - seq + 1, (b,), generator=g)
        x = torch.stack([self.ids[0, s : s + seq] for s in starts.tolist()])
        return {"input_ids": x, "labels": x}

    def _capture_meta(self, batch: Batch) -> dict[str, Any]:
        """``meta`` of a captured step, as ``mdb step`` records it (tokens, config, shape)."""
        ids = batch["input_ids"]
        return {
            "description": (
                f"overfit run {self.name} · minillm {self.options.preset or 'custom config'} · "
                f"{self.model.num_parameters():,} params · batch {ids.shape[0]}×{ids.shape[1]} "
                f"of {self.options.text_source}"
            ),
            "tokens": self.tokenizer.token_strings(ids.reshape(-1).tolist()),
            "config": self.config.to_dict(),
            "input_shape": list(ids.shape),
            "run": self.name,
        }

    @property
    def prompt(self) -> str:
        """The sample prompt: the text's first ``prompt_chars`` characters."""
        return self.options.text[: max(1, self.options.prompt_chars)]

    def greedy_sample(self, model: nn.Module | None = None) -> tuple[str, str]:
        """``(prompt, greedy continuation)`` of the text's beginning with the current weights."""
        model = self.model if model is None else model
        prompt_ids = self.tokenizer.encode(self.prompt)
        room = self.config.max_position_embeddings - len(prompt_ids)
        new = max(0, min(self.options.sample_tokens, room))
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        out = model.generate(ids, max_new_tokens=new) if new else ids
        return self.prompt, self.tokenizer.decode(out[0, len(prompt_ids) :].tolist())

    @property
    def checkpoint_root(self) -> Path:
        """This run's directory of checkpoints (beside the database)."""
        return checkpoint_dir(self.store.path, self.name)

    @property
    def checkpoint_path(self) -> Path:
        """The run's latest recorded checkpoint, or its checkpoint root if none was written."""
        return self.last_checkpoint if self.last_checkpoint is not None else self.checkpoint_root

    def save_checkpoint(self) -> Path:
        """Checkpoint the current step and record it in the store.

        Each checkpoint goes to its own ``step-<N>`` directory; the database row is the commit
        point. Older step directories are deleted only after the row names the new one, so a
        ``kill -9`` at any instant leaves the checkpoint the database names intact (a newer,
        unrecorded directory is ignored and removed by the next save).
        """
        step = self.trainer.step
        path = save_checkpoint(
            self.checkpoint_root / _step_dir_name(step),
            self.model,
            self.optimizer,
            step=step,
            extra={"run": self.name, "seed": self.options.seed},
        )
        self.writer.set_checkpoint(step, path)
        self.last_checkpoint = path
        self._prune_checkpoints(keep=path)
        return path

    def _prune_checkpoints(self, keep: Path) -> None:
        """Delete this run's checkpoint directories other than ``keep`` (best effort)."""
        root = self.checkpoint_root
        if not root.is_dir():
            return
        for child in root.iterdir():
            if child.is_dir() and child.name.startswith("step-") and child != keep:
                shutil.rmtree(child, ignore_errors=True)
        # the layout before step directories: files directly in the run's directory
        for name in ("model.safetensors", "optimizer.safetensors", "checkpoint.json"):
            with contextlib.suppress(OSError):
                (root / name).unlink()

    # -- running -------------------------------------------------------------------------------

    def run(
        self,
        on_step: Callable[[StepReport], None] | None = None,
        on_state: Callable[[str], None] | None = None,
        heartbeat_interval: float = 1.0,
    ) -> TrainResult:
        """Train to the end (or a stop / failure), writing every step to the store.

        Each step is committed (metrics, internals, sample) before ``on_step`` is called. At the
        end: a finished or interrupted run is checkpointed and its status set; a failed run
        records the failing step and module. An exception escaping the loop (including a
        second Ctrl-C) marks the run interrupted (with a checkpoint if possible) and re-raises.

        Args:
            on_step: Called after each step (in this thread) with the :class:`StepReport`.
            on_state: Called with ``"paused"`` / ``"running"`` transitions.
            heartbeat_interval: Seconds between heartbeats of the writer's background thread.

        Returns:
            The :class:`TrainResult` (also stored in :attr:`result`).
        """
        writer = self.writer
        every_ckpt = self.options.checkpoint_every

        def step_cb(report: StepReport) -> None:
            writer.log_step(report.metrics, internals=report.internals, sample=report.sample,
                            tensors=report.internals_tensors)
            if every_ckpt and report.failure is None and report.step % every_ckpt == 0:
                self._try_checkpoint()
            if on_step is not None:
                on_step(report)

        def state_cb(state: str) -> None:
            writer.set_paused(state == "paused")
            if on_state is not None:
                on_state(state)

        writer.start_heartbeat(heartbeat_interval)
        try:
            result = self.trainer.run(self.control, on_step=step_cb, on_state=state_cb)
        except BaseException as exc:
            interrupted = isinstance(exc, KeyboardInterrupt)
            reason = "KeyboardInterrupt" if interrupted else f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                if self.trainer.step > self.trainer.start_step:
                    self.save_checkpoint()
            with contextlib.suppress(Exception):
                writer.finish("interrupted" if interrupted else "failed", reason=reason[:500],
                              fail_step=None if interrupted else self.trainer.step + 1)
            raise
        if result.status == "failed":
            f = result.failure
            writer.finish(
                "failed",
                reason=result.reason[:500],
                fail_step=f.step if f else result.last_step,
                fail_module=f.module if f else None,
            )
        else:
            reason = result.reason
            if result.last_step > self.trainer.start_step or not self._has_checkpoint():
                error = self._try_checkpoint()
                if error:
                    reason = f"{reason}; {error}"
                    result.reason = reason
            writer.finish(result.status, reason=reason)
        self.result = result
        return result

    def _try_checkpoint(self) -> str | None:
        """Checkpoint; on a filesystem error return a one-line description instead of raising
        (the run's metrics are safe in the database; :attr:`checkpoint_error` keeps it)."""
        try:
            self.save_checkpoint()
        except OSError as exc:
            self.checkpoint_error = f"checkpoint failed: {exc.strerror or exc}"
            return self.checkpoint_error
        return None

    def _has_checkpoint(self) -> bool:
        return self.last_checkpoint is not None
