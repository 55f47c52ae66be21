"""A UI-free training loop with live controls: :class:`Trainer` and :class:`TrainControl`.

:class:`Trainer` is generic over a model and a batch: the batch is a :class:`hooks.Batch` (or
what :meth:`hooks.Batch.of` accepts: keyword arguments, positional arguments, a tensor) and the
differentiated scalar is chosen by :func:`hooks.select_loss` — a ``loss_fn(output, batch)`` when
given, else the output's ``loss`` (HF, minillm), else the one 0-dim tensor of a returned tuple
(nanoGPT's ``(logits, loss)``). Where the output also carries ``ce_loss``, ``aux_loss`` and
``router_logits`` (one (N, E) tensor per MoE layer), as :class:`minillm.MiniLLM` and HF MoE models
do, those are recorded too; a step records only the metrics that exist (see
:meth:`Trainer.train_step`).
:meth:`Trainer.run` reports every step through a callback (in the training thread) and obeys a
:class:`TrainControl` (pause / resume / single step / stop / capture the next step's internals)
that any other thread may drive — a Textual app runs :meth:`Trainer.run` in a thread worker and
posts a message from the callback. A non-finite loss or gradient stops the run as ``failed``
with the step and the module where the first non-finite value appeared.

The overfit run of ``mdb overfit`` built on it is :mod:`hooks.train.overfit`; checkpoints are
:mod:`hooks.train.checkpoint`.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hooks.batch import Batch, BatchError, LossChoice, select_loss
from hooks.engine.capture import capture as _capture
from hooks.nonfinite.origin import (
    Origin,
    first_nonfinite_tensor,
    gradient_origin,
    nonfinite_counts,
    parameter_origin,
    trace_origin,
)
from hooks.store.store import MetricRow, RunStore
from hooks.tensors.norms import total_norm  # the global gradient norm (re-exported)
from hooks.train.spike_capture import TrainerSpikes

__all__ = [
    "NonFiniteInfo",
    "StepReport",
    "TrainControl",
    "TrainResult",
    "Trainer",
    "expert_load",
    "install_stop_signals",
    "load_trace",
    "locate_nonfinite",
    "metric_row",
    "signal_exit_code",
    "total_norm",
]



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
    on_repeat: Callable[[str], None] | None = None,
) -> Callable[[], None]:
    """Make these signals stop the run gracefully (finish the step, checkpoint, mark interrupted).

    Must be called from the main thread (a Python rule for ``signal.signal``). The stop reason
    is the signal's name (``"SIGTERM"``), which :func:`signal_exit_code` maps to an exit status.

    A signal that arrives while the run is already stopping (a second Ctrl-C) does not abort
    anything: raising ``KeyboardInterrupt`` there would cut the final checkpoint or the last
    database write short (the run stayed "running", then "gone", and the steps since the last
    periodic checkpoint were lost), or tear an optimizer update in half. The stop already under
    way finishes; ``kill -9`` still ends the process at once, and the run then resumes from its
    last recorded checkpoint.

    A signal this process ignores (``SIG_IGN``: ``nohup`` starts a command with SIGHUP ignored,
    a shell's ``&`` with SIGINT ignored) is left ignored: it was asked not to stop anything.

    Args:
        control: The controls to stop.
        signals: Signal names; names this platform lacks are skipped.
        on_signal: Called (in the main thread, inside the handler) with the signal name, for
            the first signal and for every later one.
        on_repeat: Called (likewise) with the signal name of a signal that arrived while the
            run was already stopping, e.g. to say that it is; keep it signal-safe (``os.write``).

    Returns:
        A function restoring the previous handlers.
    """
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        repeated = control.stop_requested
        control.stop(name)
        if on_signal is not None:
            on_signal(name)
        if repeated and on_repeat is not None:
            on_repeat(name)

    for name in signals:
        sig = getattr(signal, name, None)
        if sig is None or signal.getsignal(sig) is signal.SIG_IGN:
            continue  # nohup's SIGHUP (a shell's & SIGINT): asked to be ignored, it stays so
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
    """Where a non-finite value first appeared in a failed step (see :mod:`hooks.nonfinite.origin`).

    Attributes:
        step: The step whose loss or gradient was non-finite.
        what: The symptom: ``"loss"`` (non-finite loss) or ``"gradient"`` (finite loss,
            non-finite gradients).
        module: Qualified name of the module where it started (``""`` the root module), or
            ``None`` if not located.
        detail: What was non-finite there, e.g. ``its weight holds 1 NaN of 4096 values``.
        located_by: Which locator answered: ``"parameters"`` (a weight held NaN/Inf),
            ``"capture"`` (the step under :func:`hooks.capture`, its own capture or a rerun),
            ``"forward hooks"`` (:func:`locate_nonfinite`, when the capture could not answer),
            ``"gradients"`` (the first parameter whose gradient is non-finite), or ``None``.
        capture_error: One line when the rerun under the capture engine raised (the other
            locators then answered), else ``None``.
        direction: :attr:`hooks.nonfinite.origin.Origin.direction` (``parameter``, ``forward``,
            ``backward``, ``gradient``), ``None`` if not located.
        note: Why the loss stayed finite although a forward output was not, else ``None``.
    """

    step: int
    what: str
    module: str | None
    detail: str
    located_by: str | None = None
    capture_error: str | None = None
    direction: str | None = None
    note: str | None = None

    def describe(self) -> str:
        """One sentence, what, where and when: ``non-finite loss at step 7, first in
        model.layers.1.mlp (forward): its output out[0] (Linear, call 0) holds 4 NaN of 64
        values``; when the capture engine could not answer, which locator did and why."""
        head = f"non-finite {self.what} at step {self.step}"
        if self.module is not None:
            origin = Origin(self.module, self.direction or "?", self.detail, self.note)
            text = f"{head}, {origin.sentence()}"
        else:
            text = f"{head} (not located: {self.detail})"
        if self.capture_error is not None:
            text += (f" (located by {self.located_by or 'nothing'}: the capture raised "
                     f"{self.capture_error})")
        return text


@dataclass
class StepReport:
    """What one training step produced; passed to the ``on_step`` callback.

    Attributes:
        metrics: The step's :class:`hooks.store.store.MetricRow`.
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


_ROW_FIELDS = frozenset(f.name for f in dataclasses.fields(MetricRow))
#: Metrics that have a column of their own in a store without ``MetricRow.values``.
_FIXED_METRICS = ("ce", "aux", "total", "grad_norm", "lr", "step_time", "tokens_per_s",
                  "steps_per_s")


def metric_row(step: int, wall: float, values: Mapping[str, float | None],
               expert_load: list[list[float]] | None = None) -> MetricRow:
    """A :class:`hooks.store.store.MetricRow` holding exactly ``values`` (metric name → value;
    ``None`` = NaN or not measured).

    With a store that keeps any metric by name (``MetricRow.values``) the row carries
    ``values`` as given. With one that has only the fixed columns, the names that have a column
    fill it, and ``loss`` (the back-propagated scalar of a model without a CE/aux split) goes to
    ``total``; the run's config says which names were logged (``config["metrics"]``).
    """
    values = {k: (None if v is None or math.isnan(v) else float(v)) for k, v in values.items()}
    kw: dict[str, Any] = {"step": int(step), "wall": float(wall)}
    if "expert_load" in _ROW_FIELDS:
        kw["expert_load"] = expert_load
    if "values" in _ROW_FIELDS:
        kw["values"] = values
        for name in _FIXED_METRICS:
            if name in _ROW_FIELDS and name in values:
                kw[name] = values[name]
    else:
        fixed = dict(values)
        if "total" not in fixed and "loss" in fixed:
            fixed["total"] = fixed["loss"]
        for name in _FIXED_METRICS:
            if name in _ROW_FIELDS:
                kw[name] = fixed.get(name)
    return MetricRow(**kw)


def _scalar_field(output: Any, name: str) -> torch.Tensor | None:
    """``output.<name>`` or ``output[name]`` when it is a 0-dim floating-point tensor."""
    value = getattr(output, name, None)
    if value is None and isinstance(output, Mapping):
        value = output.get(name)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
        return value
    return None


def router_logits(output: Any) -> tuple[torch.Tensor, ...]:
    """The (N, E) router logits per MoE layer of an output (minillm, HF MoE), or ``()``."""
    value = getattr(output, "router_logits", None)
    if value is None and isinstance(output, Mapping):
        value = output.get("router_logits")
    if not isinstance(value, (list, tuple)):
        return ()
    return tuple(t for t in value if isinstance(t, torch.Tensor) and t.dim() == 2)


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
            bad = first_nonfinite_tensor(output)
            if bad is not None:
                found.append((name, f"its output ({type(module).__name__}) holds "
                                    + nonfinite_counts(bad)))

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
    return None, ("no module output was non-finite: the loss itself is (its function, or "
                  "logits beyond its range)")


@contextlib.contextmanager
def _maybe_capture(
    model: nn.Module, step: int | None = None, kwargs: Mapping[str, Any] | None = None
):
    """``hooks.capture(model)`` as a context yielding the :class:`hooks.Trace`."""
    with _capture(model, step=step, **dict(kwargs or {})) as trace:
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
        store: An open :class:`hooks.store.store.RunStore` (a reader is fine).
        run_id: :attr:`hooks.store.store.RunInfo.id`.
        step: A step listed by :meth:`hooks.store.store.RunStore.internals_steps`.

    Returns:
        The trace (statistics, routing and attention tensors), or ``None`` when the step has no
        captured internals.

    Raises:
        hooks.TraceFormatError: The stored internals are not a trace this mdb can read, or
            their tensors are not a whole safetensors blob (cut, changed outside mdb).
        hooks.store.store.DamagedRunError: The stored JSON does not parse (one line).
    """
    from hooks.trace.trace import Trace, TraceFormatError

    data = store.internals(run_id, step)
    if data is None:
        return None
    blob = store.internals_tensors(run_id, step)
    tensors = {}
    if blob:
        from safetensors.torch import load

        try:
            tensors = load(blob)
        except Exception as exc:  # safetensors' own error types for a cut or garbled blob
            raise TraceFormatError(f"the tensors stored with step {step} are not a valid "
                                   f"safetensors blob ({len(blob):,} bytes): "
                                   f"{str(exc)[:200]}") from None
    return Trace.from_dict(data, tensors)


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


# ---------------------------------------------------------------------------------------------
# The generic trainer
# ---------------------------------------------------------------------------------------------

#: What a trainer's batch may be: a :class:`hooks.Batch`, or what :meth:`hooks.Batch.of`
#: accepts (a mapping of keyword arguments, a tuple of positional arguments, a tensor).
BatchLike = Any


def step_metric_names(output: Any, choice: LossChoice, *, tokens: bool) -> list[str]:
    """The metrics a step of this model records, in the order they are logged.

    The back-propagated scalar is ``total`` when it is the output's own ``loss`` and the output
    also carries ``ce_loss`` (minillm: ``total = ce + aux``), else ``loss``; ``ce`` and ``aux``
    are recorded where the output has ``ce_loss`` / ``aux_loss`` (HF MoE models report their
    router ``aux_loss``); ``tokens_per_s`` only for a batch of token ids.

    Args:
        output: What the model returned.
        choice: :func:`hooks.select_loss`'s choice for it.
        tokens: Whether the batch holds (B, T) token ids.
    """
    ce = _scalar_field(output, "ce_loss") is not None
    aux = _scalar_field(output, "aux_loss") is not None
    split = ce and choice.source in ("out.loss", "out['loss']")
    names = ["ce", "aux", "total"] if split else ["loss"] + (["ce"] if ce else [])
    if aux and "aux" not in names:
        names.append("aux")
    names += ["grad_norm", "lr", "step_time"]
    if tokens:
        names.append("tokens_per_s")
    names.append("steps_per_s")
    return names


class Trainer:
    """Train ``model`` on a batch (or a batch per step) with ``optimizer``; report every step.

    One step: ``batch.call(model)`` → :func:`hooks.select_loss` → check the loss is finite →
    ``loss.backward()`` → global gradient norm (:func:`total_norm`, in fp32 and, only when that
    overflows, scaled in fp64) → check it is finite → optional clipping → ``optimizer.step()``.
    A non-finite loss or gradient skips the update and ends the run ``failed``: the gradients
    are scanned for the first non-finite one before anything clears them, and the step is run
    again under the :mod:`hooks` capture engine to name the first module that produced a
    non-finite value (where that rerun raises, :func:`locate_nonfinite`'s forward hooks or the
    gradients answer instead, and :attr:`NonFiniteInfo.located_by` says which did).

    Args:
        model: Any ``nn.Module``.
        batch: A :class:`hooks.Batch` (or keyword arguments such as ``input_ids`` and
            ``labels`` (B, T), positional arguments, a tensor), or a callable
            ``batch(step) -> batch`` for a batch that changes per step.
        optimizer: A ``torch.optim.Optimizer`` over the model's parameters.
        loss_fn: ``loss_fn(output, batch) -> 0-dim tensor`` (a factory's third value); without
            it the loss is the output's own (:func:`hooks.select_loss`).
        total_steps: Train until this step number (steps are 1-based).
        start_step: Steps already done (resume); the first step run is ``start_step + 1``.
        grad_clip: Clip the global gradient norm to this value (``None``: no clipping).
        capture_every: Capture the internals of every N-th step (0: only on request).
        sample_every: Call ``sample_fn`` every N-th step, at the first step and at the last.
        sample_fn: ``sample_fn(model) -> (prompt, continuation)`` (e.g. a greedy decode).
        top_k: Experts per token for :func:`expert_load` (default:
            ``model.config.num_experts_per_tok`` when present).
        tokens_per_step: Tokens per step for throughput (default: the batch's token ids'
            ``numel()``; none for a batch without token ids).
        lr_at: Optional schedule ``lr_at(step) -> lr`` applied to every param group.
        capture_kwargs: Extra keyword arguments of ``hooks.capture`` (e.g. ``attention=True``).
        capture_meta: ``capture_meta(batch) -> dict`` stored in a captured trace's ``meta``
            (token labels, config); the step's losses are added as ``loss`` (and ``ce_loss``,
            ``aux_loss`` where the output has them) with ``loss_source``.
        spikes: Capture a step whose loss or gradient norm spikes, or whose gradient is
            non-finite, before its update (:mod:`hooks.train.spike_capture`; the training is
            unchanged, bit for bit): its :class:`StepReport` carries the trace, with the batch
            and ``meta["spike"]``.

    Raises:
        ValueError: ``total_steps < start_step`` or a negative interval.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: BatchLike | Callable[[int], BatchLike],
        optimizer: torch.optim.Optimizer,
        *,
        total_steps: int,
        loss_fn: Callable[[Any, Batch], torch.Tensor] | None = None,
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
        spikes: bool = True,
    ) -> None:
        if total_steps < start_step:
            raise ValueError(f"total_steps ({total_steps}) is before start_step ({start_step})")
        if capture_every < 0 or sample_every < 0:
            raise ValueError("capture_every and sample_every must be >= 0")
        self.model = model
        self.batch = batch
        self.optimizer = optimizer
        self.loss_fn = loss_fn
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
        self._fixed: tuple[Any, Batch, int | None] | None = None  # (given, Batch, tokens)
        self.spikes = TrainerSpikes(model, capture_options=self.capture_kwargs,
                                    optimizer=optimizer) if spikes else None
        self._spiked: Any = None  # the current step's triggered trace

    # -- one step ------------------------------------------------------------------------------

    def _batch(self, step: int) -> Batch:
        given = self.batch(step) if callable(self.batch) else self.batch
        fixed = self._fixed
        if fixed is not None and fixed[0] is given:
            return fixed[1]
        batch = Batch.of(given)
        if not callable(self.batch):
            self._fixed = (given, batch, self._count_tokens(batch))
        return batch

    def _count_tokens(self, batch: Batch) -> int | None:
        ids = batch.ids(self.model)
        return int(ids.numel()) if isinstance(ids, torch.Tensor) else None

    def _tokens(self, batch: Batch) -> int | None:
        if self.tokens_per_step is not None:
            return self.tokens_per_step
        fixed = self._fixed
        if fixed is not None and fixed[1] is batch:
            return fixed[2]
        return self._count_tokens(batch)

    def _loss(self, output: Any, batch: Batch) -> LossChoice:
        choice = select_loss(output, self.loss_fn, batch)
        if choice.fallback:
            raise BatchError(
                f"the model returned no loss (only {choice.source.removeprefix('mean(')[:-1]}), "
                "and training on the mean of its output memorises nothing; return "
                "(model, batch, loss_fn)")
        return choice

    def train_step(self, step: int | None = None, capture: bool = False) -> StepReport:
        """Run one step (number ``self.step + 1`` unless given) and advance ``self.step``.

        The step's :class:`hooks.store.store.MetricRow` holds the metrics that exist for this
        model (:func:`step_metric_names`): the loss (``total`` with ``ce`` and ``aux`` for
        minillm; ``loss`` otherwise, plus ``ce``/``aux`` where the output has them),
        ``grad_norm`` (before clipping), ``lr``, ``step_time`` (s), ``tokens_per_s`` (batches
        of token ids), ``steps_per_s``; a NaN is ``None``.

        Args:
            step: Step number (default ``self.step + 1``).
            capture: Run it under the :mod:`hooks` capture engine and return its statistics.

        Returns:
            The :class:`StepReport`; ``failure`` is set (and the update skipped) when the loss
            or gradient norm was non-finite.

        Raises:
            hooks.BatchError: The output holds no loss (and no ``loss_fn`` was given), or
                ``loss_fn`` returned no scalar.
        """
        step = self.step + 1 if step is None else int(step)
        model, opt = self.model, self.optimizer
        model.train()
        batch = self._batch(step)
        self._apply_lr(step)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        cap_ctx = (
            _maybe_capture(model, step, {"optimizer": opt, **self.capture_kwargs}) if capture
            else contextlib.nullcontext()
        )
        if self.spikes is not None:
            self.spikes.start()
        with cap_ctx as trace:
            out = batch.call(model)
            choice = self._loss(out, batch)
            loss = choice.loss
            loss_ok = bool(torch.isfinite(loss.detach()).all())
            if loss_ok:
                loss.backward()
        self._spiked = None
        grad_norm, grad_ok = self._update(
            loss_ok, lambda g: self._check_spike(step, batch, loss, g, trace, out))
        step_time = time.perf_counter() - t0

        tokens = self._tokens(batch)
        names = step_metric_names(out, choice, tokens=tokens is not None)
        loss_value = float(loss.detach())
        values = self._step_values(out, loss_value, grad_norm, step_time, tokens,
                                   total="total" in names)
        routers = router_logits(out)
        metrics = metric_row(
            step, time.time(), {name: values.get(name) for name in names},
            expert_load(routers, self.top_k) if routers else None,
        )
        report = StepReport(metrics=metrics)
        own = trace  # the failure is located as before: its own capture, else a rerun
        if self._spiked is not None:
            trace = self._spiked
        elif trace is not None and self.spikes is not None:
            self.spikes.remember(trace)
        if trace is not None:
            self._attach_trace(report, trace, batch, step, loss_value, choice.source, values)
        if not (loss_ok and grad_ok):
            report.failure = self._locate_failure(step, batch, loss_ok, own)
            opt.zero_grad(set_to_none=True)
        elif self.sample_fn is not None and self._sample_due(step):
            report.sample = self.sample_fn(model)
        self.step = step
        return report

    def _apply_lr(self, step: int) -> None:
        """Set every param group's learning rate to ``lr_at(step)`` when there is a schedule."""
        lr = self.lr_at(step) if self.lr_at is not None else None
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def _check_spike(self, step: int, batch: Batch, loss: torch.Tensor, grad_norm: float,
                     trace: Any, out: Any) -> None:
        """Before the update: the triggered capture of a spiking step
        (:class:`hooks.train.spike_capture.TrainerSpikes`), kept for the step's report."""
        if self.spikes is None:
            return

        def run_step() -> Any:
            output = batch.call(self.model)
            self._loss(output, batch).loss.backward()
            return output

        def meta() -> dict[str, Any]:
            return dict(self.capture_meta(batch)) if self.capture_meta is not None else {}

        self._spiked = self.spikes.check(step, float(loss.detach()), grad_norm, batch=batch,
                                         run_step=run_step, meta=meta, captured=trace,
                                         output=out)

    def _update(self, loss_ok: bool, before: Callable[[float], None] | None = None
                ) -> tuple[float, bool]:
        """``(global gradient norm before clipping, whether it is finite)``; where it is (and
        the loss was), clip the gradients and apply the optimizer step (``before(norm)``
        first). NaN when the loss was not finite (no backward ran)."""
        grad_norm = float("nan")
        grad_ok = False
        if loss_ok:
            grads = [p.grad for p in self._params if p.grad is not None]
            grad_norm = total_norm(grads)
            grad_ok = math.isfinite(grad_norm)
            if before is not None:
                before(grad_norm)
            if grad_ok:
                if self.grad_clip is not None:
                    coef = self.grad_clip / (grad_norm + 1e-6)
                    if coef < 1.0:  # torch.nn.utils.clip_grad_norm_'s rule
                        for g in grads:
                            g.mul_(coef)
                self.optimizer.step()
        return grad_norm, grad_ok

    def _step_values(self, out: Any, loss_value: float, grad_norm: float, step_time: float,
                     tokens: int | None, *, total: bool) -> dict[str, float | None]:
        """Every value a step can record (the loss as ``total`` or ``loss``; ``ce``/``aux``
        where the output has them, ``tokens_per_s`` where the batch has token ids)."""
        ce = _scalar_field(out, "ce_loss")
        aux = _scalar_field(out, "aux_loss")
        values: dict[str, float | None] = {
            "total" if total else "loss": loss_value,
            "grad_norm": grad_norm,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "step_time": step_time,
            "steps_per_s": 1.0 / step_time if step_time > 0 else None,
        }
        if ce is not None:
            values["ce"] = float(ce.detach())
        if aux is not None:
            values["aux"] = float(aux.detach())
        if tokens is not None:
            values["tokens_per_s"] = tokens / step_time if step_time > 0 else None
        return values

    def _attach_trace(self, report: StepReport, trace: Any, batch: Batch, step: int,
                      loss_value: float, loss_source: str,
                      values: Mapping[str, float | None]) -> None:
        """Store the step's losses in the captured ``trace``'s meta (non-finite floats as
        text) and attach it and its internals to ``report``."""
        meta = dict(self.capture_meta(batch)) if self.capture_meta is not None else {}
        meta.update(step=step, loss=loss_value, loss_source=loss_source)
        if "ce" in values:
            meta["ce_loss"] = values["ce"]
        if "aux" in values:
            meta["aux_loss"] = values["aux"]
        meta = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                for k, v in meta.items()}
        if isinstance(getattr(trace, "meta", None), dict):
            trace.meta.update(meta)
        report.trace = trace
        report.internals = _trace_to_internals(trace)
        report.internals_tensors = _trace_tensors(trace)

    def _sample_due(self, step: int) -> bool:
        if self.sample_every <= 0:
            return False
        return step == self.start_step + 1 or step % self.sample_every == 0 or (
            step == self.total_steps
        )

    def _locate_failure(
        self, step: int, batch: Batch, loss_ok: bool, trace: Any
    ) -> NonFiniteInfo:
        """Where the failed step's NaN/Inf started (:mod:`hooks.nonfinite.origin`'s order): a
        parameter, else the first non-finite forward output (also when the loss stayed finite),
        else the first non-finite gradient. The update was not applied, so the weights are the
        ones the forward used."""
        what = "gradient" if loss_ok else "loss"
        stayed = "the loss" if loss_ok else None
        grad_origin = gradient_origin(self.model) if loss_ok else None  # before a rerun
        origin, by = parameter_origin(self.model), "parameters"
        capture_error = None
        if origin is None and trace is not None:
            origin, by = trace_origin(trace, stayed_finite=stayed), "capture"
        if origin is None and trace is None:
            try:
                with _maybe_capture(self.model, step) as tr:
                    out = batch.call(self.model)
                    if loss_ok:
                        self._loss(out, batch).loss.backward()
                origin, by = trace_origin(tr, stayed_finite=stayed), "capture"
            except Exception as exc:  # a broken capture must not hide the failure itself
                capture_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" \
                    if str(exc) else type(exc).__name__
            self.optimizer.zero_grad(set_to_none=True)
        unlocated = ("every gradient is finite, but their global norm exceeds float64's "
                     "range") if loss_ok else ""
        if origin is None:  # a forward origin comes first, also when the loss stayed finite
            module, detail = locate_nonfinite(self.model, lambda: batch.call(self.model))
            unlocated = unlocated or detail
            if module is not None:
                note = ("the loss stayed finite: a later operation returned finite values from "
                        "it" if loss_ok else None)
                origin, by = Origin(module, "forward", detail, note), "forward hooks"
        if origin is None and grad_origin is not None:
            origin, by = grad_origin, "gradients"
        if origin is None:
            return NonFiniteInfo(step, what, None, unlocated, None, capture_error)
        return NonFiniteInfo(step, what, origin.module, origin.detail, by, capture_error,
                             origin.direction, origin.note)

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

