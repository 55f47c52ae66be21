"""Will it fit? The bytes of a training step at a batch size and sequence length not run,
extrapolated from two small measured steps (:func:`extrapolate`).

Each term by its known scaling (B: batch, T: sequence length):

* parameters, buffers, gradients, optimizer state: constant (taken from the larger run; a
  parameter the optimizer updates counts a gradient of its own size even where the small runs
  gave it none: an expert no token chose);
* eager attention scores and probabilities ``(B, H, T, T)`` (saved tensors whose last two
  dimensions are equal, ``StepMemory.square_bytes``): ``q·B·T²``;
* every other saved activation: ``a·B·T + c·T`` (``c``: what grows with T but not with B,
  such as RoPE's (T, d) cos/sin tables), ``a`` and ``c`` solved exactly from the two runs
  (their B must differ; with equal B, ``a·B·T + c``).

Pick the two sizes' T unlike any dimension of the model (not a power of two: 24 and 48): a
(B, H, T, d) tensor with T = d looks like attention scores.

The figure is parameters + buffers + gradients + optimizer state + every saved activation
(:attr:`hooks.trace.memory.StepMemory.total_bytes`): what the step holds once forward is done
and every gradient exists, an upper bound of its live bytes. Allocator caching, temporaries of
single ops and the framework's own memory are not in it. Never imports textual, rich or tui.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Measured:
    """One measured step: its batch size, sequence length and ``trace.memory``."""

    batch: int
    seq: int
    memory: Any


@dataclass
class Estimate:
    """The extrapolated bytes at ``batch`` × ``seq``.

    Attributes:
        batch, seq: the target size.
        terms: bytes by term: ``param``, ``buffer``, ``grad``, ``optimizer``,
            ``activations`` (a·B·T + c·T), ``attention`` (q·B·T²).
        coefficients: ``a`` (bytes per token), ``c`` (bytes per position, or a constant when
            both runs had the same batch), ``q`` (bytes per B·T²).
        steps: how the figure was reached, one line each.
    """

    batch: int
    seq: int
    terms: dict[str, float] = field(default_factory=dict)
    coefficients: dict[str, float] = field(default_factory=dict)
    steps: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """The figure: the sum of the terms, in bytes."""
        return int(round(sum(self.terms.values())))

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "seq": self.seq, "total_bytes": self.total,
                "terms": {k: int(round(v)) for k, v in self.terms.items()},
                "coefficients": dict(self.coefficients), "steps": list(self.steps)}


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units with 3 significant digits (``1.23 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n >= 100 else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"  # pragma: no cover


def _linear(small: Measured, large: Measured) -> tuple[float, float, str]:
    """``(a, c, basis)`` with the non-square saved bytes = a·B·T + c·(T or 1)."""
    n1 = small.memory.saved_bytes - small.memory.square_bytes
    n2 = large.memory.saved_bytes - large.memory.square_bytes
    x1, x2 = small.batch * small.seq, large.batch * large.seq
    basis = "T" if small.batch != large.batch else "1"
    y1, y2 = (small.seq, large.seq) if basis == "T" else (1, 1)
    det = x1 * y2 - x2 * y1
    if det == 0:  # the same size twice: bytes per token only
        return n2 / x2, 0.0, basis
    a = (n1 * y2 - n2 * y1) / det
    c = (x1 * n2 - x2 * n1) / det
    if a < 0 or c < 0:  # a fit the data does not support: bytes per token from the larger
        return n2 / x2, 0.0, basis
    return a, c, basis


def small_sizes(batch: int, seq: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two sizes ``mdb memory --at`` measures for a target ``batch`` × ``seq``: B = 1 and
    2, T = 24 and 48 (not powers of two), fewer when the target is shorter."""
    t2 = min(seq, 48)
    return (1, max(t2 // 2, 1)), (2, t2)


def extrapolate(small: Measured, large: Measured, batch: int, seq: int) -> Estimate:
    """The :class:`Estimate` at ``batch`` × ``seq`` from two measured steps (see the module).

    Raises:
        ValueError: a run has no memory record, or a size is not positive.
    """
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    for m in (small, large):
        if m.memory is None:
            raise ValueError(f"the run at batch={m.batch}, seq={m.seq} has no memory record")
    big = large.memory
    est = Estimate(batch, seq)
    grads = sum(max(p.grad_bytes, p.bytes if p.optimizer_bytes else 0) for p in big.params)
    est.terms = {"param": big.param_bytes, "buffer": big.buffer_bytes, "grad": grads,
                 "optimizer": big.optimizer_bytes}
    a, c, basis = _linear(small, large)
    q = big.square_bytes / (large.batch * large.seq ** 2)
    est.coefficients = {"a": a, "c": c, "q": q}
    est.terms["activations"] = a * batch * seq + c * (seq if basis == "T" else 1)
    est.terms["attention"] = q * batch * seq * seq
    s = est.steps
    s.append(f"measured B={small.batch}, T={small.seq}: saved "
             f"{human_bytes(small.memory.saved_bytes)} (attention-shaped "
             f"{human_bytes(small.memory.square_bytes)}); B={large.batch}, T={large.seq}: "
             f"saved {human_bytes(big.saved_bytes)} (attention-shaped "
             f"{human_bytes(big.square_bytes)})")
    s.append(f"constant: parameters {human_bytes(big.param_bytes)} + buffers "
             f"{human_bytes(big.buffer_bytes)} + gradients {human_bytes(grads)} + "
             f"optimizer state {human_bytes(big.optimizer_bytes)}"
             + (f" ({big.optimizer})" if big.optimizer else " (no optimizer)")
             + (f"; measured gradients {human_bytes(big.grad_bytes)}, the rest for parameters "
                "the small runs gave none" if grads != big.grad_bytes else ""))
    per = "T" if basis == "T" else ""
    s.append(f"activations = a·B·T + c{('·' + per) if per else ''}: a = {a:.6g} bytes per "
             f"token, c = {c:.6g} → {human_bytes(est.terms['activations'])} at B={batch}, "
             f"T={seq}")
    s.append(f"attention scores = q·B·T² (saved (…, T, T) tensors): q = {q:.6g} → "
             f"{human_bytes(est.terms['attention'])}")
    s.append(f"total = {human_bytes(est.total)} ({est.total:,} bytes)")
    return est
