"""The memory records of a captured step (:class:`StepMemory`, ``Trace.memory``): where every
byte of the step goes, as :mod:`hooks.engine.memory` measured it.

Kinds of bytes (all in bytes, never rounded):

* ``param``: the parameters (each distinct tensor once, tied ones once) and the buffers;
* ``grad``: the parameters' ``.grad`` tensors;
* ``optimizer``: the optimizer's state per parameter (Adam's ``exp_avg``/``exp_avg_sq``/``step``,
  SGD's ``momentum_buffer``) and its master copies (parameters the optimizer updates that the
  model does not hold);
* ``saved``: the activations autograd saved for backward
  (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once, against the call
  that saved it; a saved parameter or buffer is counted as ``param``, a view against its base
  storage.

The timeline's ``live_bytes`` = param + buffer + optimizer + grad bytes allocated so far + saved
activation bytes autograd still holds. Never imports textual, rich or tui.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class CallMemory:
    """The bytes of one forward call (``Trace.forward[call]``).

    Attributes:
        call: index of the :class:`~hooks.trace.records.CallRecord`.
        saved_bytes: activation storages autograd saved during this call and not in a
            recorded child call (each storage counted once in the step, at its first save).
        square_bytes: the part of ``saved_bytes`` whose tensors are ``(..., T, T)`` with at
            least 3 dimensions (eager attention scores and probabilities: B·H·T²).
        param_saved_bytes: parameter and buffer storages saved during this call (counted as
            ``param``, not in ``saved_bytes``).
        output_bytes: the distinct storages of its output tensors.
        retained_bytes: what the call left alive when it returned: the distinct storages
            autograd saved during it (children included) and still held, and its outputs,
            less its inputs' storages (the memory the call added to the step; what
            checkpointing it would give back, outputs aside).
    """

    call: int
    saved_bytes: int = 0
    square_bytes: int = 0
    param_saved_bytes: int = 0
    output_bytes: int = 0
    retained_bytes: int = 0


@dataclass(slots=True)
class ParamMemory:
    """The bytes of one parameter (tied ones once, under their first name).

    Attributes:
        name: qualified parameter name.
        bytes: ``numel × element_size`` of the parameter.
        grad_bytes: of its ``.grad`` at the end of the capture (0: none).
        optimizer_bytes: of its optimizer state (measured, or estimated when ``estimated``).
        state: the names of that state (``exp_avg``, ``exp_avg_sq``, ``step``).
        estimated: True when the optimizer had not allocated its state yet (before its first
            ``step()``) and the bytes are its known layout (Adam: two tensors like the
            parameter, plus ``step``; SGD with momentum: one).
    """

    name: str
    bytes: int
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    state: list[str] = field(default_factory=list)
    estimated: bool = False


@dataclass(slots=True)
class MemoryPoint:
    """One point of the step's timeline of live bytes.

    Attributes:
        phase: ``"start"``, ``"forward"`` (after a forward call), ``"backward"`` (after a
            gradient of a call's output arrived, or a parameter's gradient was accumulated),
            ``"end"``.
        call: the forward call it follows (``Trace.forward`` index), else None.
        param: the parameter whose gradient was accumulated, else None.
        live_bytes: bytes alive at this point (see the module docstring).
        saved_bytes: of which saved activations autograd holds.
        grad_bytes: of which parameter gradients.
        seq: order of the saves and releases up to this point (what was alive at the point).
    """

    phase: str
    call: int | None
    param: str | None
    live_bytes: int
    saved_bytes: int
    grad_bytes: int
    seq: int = 0


@dataclass(slots=True)
class AliveBytes:
    """Saved activation bytes of one call that autograd held at the peak."""

    call: int
    bytes: int


@dataclass(slots=True)
class StepMemory:
    """Where the bytes of one captured step go (``Trace.memory``).

    Attributes:
        calls: per forward call (only calls with bytes are listed).
        params: per parameter.
        timeline: live bytes after each forward call and each backward event, in order.
        peak_bytes: the largest ``live_bytes`` of the timeline.
        peak_point: index of that point in ``timeline``.
        at_peak: saved activation bytes alive at the peak, by call (largest first).
        param_bytes: all parameters (distinct tensors).
        buffer_bytes: all buffers.
        grad_bytes: all parameter gradients at the end of the capture.
        optimizer_bytes: all optimizer state, master copies included.
        master_bytes: of which master copies (parameters the optimizer updates that the model
            does not hold) and their state.
        saved_bytes: every activation storage autograd saved during the capture.
        square_bytes: of which ``(..., T, T)`` tensors (eager attention: B·H·T²).
        unattributed_bytes: of which saved outside any recorded call.
        optimizer: the optimizer's class name, None when none was given.
    """

    calls: list[CallMemory] = field(default_factory=list)
    params: list[ParamMemory] = field(default_factory=list)
    timeline: list[MemoryPoint] = field(default_factory=list)
    peak_bytes: int = 0
    peak_point: int = 0
    at_peak: list[AliveBytes] = field(default_factory=list)
    param_bytes: int = 0
    buffer_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    master_bytes: int = 0
    saved_bytes: int = 0
    square_bytes: int = 0
    unattributed_bytes: int = 0
    optimizer: str | None = None

    @property
    def total_bytes(self) -> int:
        """parameters + buffers + gradients + optimizer state + every saved activation: what
        the step holds once forward is done and every gradient allocated (an upper bound of
        the timeline's peak)."""
        return (self.param_bytes + self.buffer_bytes + self.grad_bytes + self.optimizer_bytes
                + self.saved_bytes)

    def call_bytes(self) -> dict[int, CallMemory]:
        """``calls`` by forward index."""
        return {c.call: c for c in self.calls}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepMemory:
        """Inverse of :meth:`to_dict`; types are checked by :func:`hooks.trace.check.check_trace`.

        Raises:
            KeyError, TypeError: a field is missing or not an object.
        """
        simple = {k: v for k, v in d.items()
                  if k not in ("calls", "params", "timeline", "at_peak")}
        return cls(
            calls=[CallMemory(**c) for c in d["calls"]],
            params=[ParamMemory(**p) for p in d["params"]],
            timeline=[MemoryPoint(**p) for p in d["timeline"]],
            at_peak=[AliveBytes(**a) for a in d["at_peak"]],
            **simple,
        )
