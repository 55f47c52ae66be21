"""``hooks.precision_diff``: where a bf16 or fp16 run of a model parts from its fp32 run.

The same model, batch and weights are stepped twice (forward and backward, each under
:func:`hooks.capture` with full copies of the outputs and gradients kept): once in fp32, once
under the low dtype, either

* ``"cast"`` — a deep copy of the model with its floating parameters and buffers cast to the
  dtype (``model.to(dtype)``), floating inputs cast too: how a model is run in pure bf16/fp16;
* ``"autocast"`` — the fp32 weights under ``torch.autocast("cpu", dtype)``: mixed precision,
  where the ops autocast lists run in the dtype and the rest in fp32.

Both traces are compared call by call (:class:`hooks.trace.diff.TraceDiff`, A = fp32, B = the
dtype). A call *diverges* when its output (forward, in the order the calls finished, so the
innermost call where the difference appeared comes first) or its gradient (backward, in
autograd's order) differs from fp32 by more than the dtype can explain::

    max |low - fp32|  >  tolerance · scale,   tolerance = FACTOR · eps(dtype)

``scale`` is the largest |x| of the fp32 tensor, ``eps`` the dtype's machine epsilon
(``torch.finfo(dtype).eps``: 2⁻⁷ for bf16, 2⁻¹⁰ for fp16) and :data:`FACTOR` allows for the
rounding a dtype accumulates over a few dozen ops (one rounding is eps/2; measured on the
dense minillm, healthy calls stay within 2.3 eps). Below the dtype's smallest normal number
precision is absolute, so ``FACTOR`` times the smallest subnormal is added (fp16 gradients of
1e-7 hold one significant bit). Where both traces kept the tensor the error is element-wise;
else it is the largest change of the statistics (mean, std, min, max), a lower bound. A
top-k router that picks other experts under the dtype (near-tied logits) makes its MoE block
and everything after it differ: that is said as the cause, and calls whose row count changed
(an expert given other tokens) are not compared element by element.

The classic sources are named where the evidence says so (:func:`classic_source`): a norm that
squares in fp16 (x² overflows fp16 above |x| ≈ 256), a softmax over scores above ≈ 88 in half
precision (exp overflows; fp16's exp already above ≈ 11), RoPE angles computed in low precision
(position · θ for positions ≥ 2,048 in bf16 are off by whole radians), and an epsilon that
rounds to 0 in fp16 (below ≈ 6e-8).

Never imports textual, rich or tui.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hooks.batch import Batch, select_loss
from hooks.engine.capture import capture
from hooks.trace.diff import TensorDiff, TraceDiff
from hooks.trace.trace import Trace

#: Multiples of the dtype's epsilon (relative to the fp32 tensor's largest |x|) a call's
#: output may differ by before it counts as divergent. Healthy calls of the dense minillm
#: stay within 2.3 eps (bf16 and fp16, cast and autocast, forward and backward).
FACTOR = 16
#: Full copies of outputs and gradients kept per trace for the element-wise comparison.
KEEP_BYTES = 512 * 2**20
#: The low dtypes a precision diff runs under, by name.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
#: fp16 squares overflow above this |x| (√65504).
FP16_SQUARE_LIMIT = math.sqrt(torch.finfo(torch.float16).max)
#: exp overflows fp32 and bf16 above this (ln of their largest value).
EXP_LIMIT = math.log(torch.finfo(torch.float32).max)
#: exp overflows fp16 above this.
FP16_EXP_LIMIT = math.log(torch.finfo(torch.float16).max)
#: RoPE angles computed in bf16 from positions at or above this are off by radians.
ROPE_POSITIONS = 2048

_NORM = re.compile(r"norm", re.I)
_ATTN = re.compile(r"attn|attention|softmax", re.I)
_ROPE = re.compile(r"rotary|rope", re.I)
_EPS_NAMES = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "rms_norm_eps")


@dataclass
class Divergence:
    """A call whose output or gradient the dtype does not explain.

    Attributes:
        direction: ``"forward"`` (an output) or ``"backward"`` (a gradient).
        module: qualified module name (``""`` for the root).
        module_type: its class name.
        call_index: which call of it.
        tensor: the output path (``out``, ``out[0]``).
        error: max |low - fp32| (element-wise when ``by == "elements"``).
        scale: the largest |x| of the fp32 tensor.
        threshold: ``tolerance · scale``, what the dtype can explain.
        by: ``"elements"`` or ``"statistics"`` (a lower bound: not both tensors were kept).
        nonfinite: the low run's tensor holds NaN/Inf where fp32's did not.
        cause: the classic source named, in words, or None.
    """

    direction: str
    module: str
    module_type: str
    call_index: int
    tensor: str
    error: float
    scale: float
    threshold: float
    by: str = "elements"
    nonfinite: bool = False
    cause: str | None = None

    @property
    def where(self) -> str:
        """``model.layers.0.input_layernorm#0 out (forward)``."""
        tensor = "" if self.tensor == "out" else f" {self.tensor}"
        return f"{self.module or '<root>'}#{self.call_index}{tensor} ({self.direction})"

    def describe(self) -> str:
        """One line: where, how far and, when named, why."""
        if self.nonfinite:
            what = "holds NaN/Inf where fp32 is finite"
        else:
            ratio = self.error / self.scale if self.scale else math.inf
            what = (f"differs by {self.error:.3g} ({ratio:.2g} of its scale {self.scale:.3g}; "
                    f"the dtype explains {self.threshold:.3g})")
        by = " [from statistics]" if self.by == "statistics" else ""
        cause = f": {self.cause}" if self.cause else ""
        return f"{self.where} ({self.module_type}) {what}{by}{cause}"


@dataclass
class PrecisionDiff:
    """The result of :func:`precision_diff`.

    Attributes:
        dtype: ``"bfloat16"`` or ``"float16"``.
        how: ``"cast"`` or ``"autocast"`` (see the module docstring).
        eps: the dtype's machine epsilon.
        tolerance: ``FACTOR · eps``, relative to each fp32 tensor's scale.
        floor: ``FACTOR ·`` the dtype's smallest subnormal, added to every threshold.
        diff: the :class:`~hooks.trace.diff.TraceDiff` of the fp32 trace (A) against the low one
        (B). reference: the fp32 :class:`~hooks.trace.trace.Trace`.
        low: the trace under the dtype.
        first_divergent: the first call beyond tolerance (forward, then backward), or None.
        first_nonfinite: the first call whose low output or gradient holds NaN/Inf while fp32's
            is finite, or None.
        loss: ``{"fp32": ..., dtype: ...}`` the two losses (nan when not finite).
        notes: what else was found (an epsilon that rounds to 0, fp32 already non-finite).
    """

    dtype: str
    how: str
    eps: float
    tolerance: float
    floor: float
    diff: TraceDiff
    reference: Trace
    low: Trace
    first_divergent: Divergence | None = None
    first_nonfinite: Divergence | None = None
    loss: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def threshold_text(self) -> str:
        """How the tolerance is set, in words."""
        floor = f", + {self.floor:.2g}" if self.floor >= 1e-12 else ""  # bf16's: 1.5e-39
        return (f"a call diverges when max |{self.dtype} − fp32| > {FACTOR} × eps({self.dtype}) "
                f"= {self.tolerance:.3g} × the fp32 tensor's largest |x|{floor}")

    def lines(self) -> list[str]:
        """The result in a few lines, for a terminal or a log."""
        how = ("a deep copy cast to " + self.dtype if self.how == "cast"
               else f"fp32 weights under autocast to {self.dtype}")
        out = [f"precision diff: fp32 (A) against {how} (B)", self.threshold_text]
        if self.loss:
            out.append("loss: " + " · ".join(f"{k} {v:.6g}" for k, v in self.loss.items()))
        div, bad = self.first_divergent, self.first_nonfinite
        out.append("first divergent call: " + (div.describe() if div else
                                                "none beyond tolerance"))
        out.append("first non-finite call: " + (bad.describe() if bad else "none"))
        out += [f"note: {n}" for n in self.notes]
        return out


def _cast_value(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(dtype)
    return x


def _step(model: nn.Module, batch: Batch, loss_fn, *, autocast: torch.dtype | None) -> tuple[
        Trace, float]:
    """One captured forward and backward; the loss as a float."""
    device = next((t.device.type for t in model.parameters()), "cpu")  # CPU or CUDA autocast
    ctx = (torch.autocast(device, dtype=autocast) if autocast is not None
           else torch.autocast(device, enabled=False))
    with capture(model, keep_bytes=KEEP_BYTES) as trace:
        with ctx:
            output = batch.call(model)
            loss = select_loss(output, loss_fn, batch).loss
        if loss.requires_grad:
            loss.backward()
    return trace, float(loss.detach().float())


def _tensor_error(d: TensorDiff, a: Trace, b: Trace) -> tuple[float, str]:
    if d.max_abs_diff is not None:
        return d.max_abs_diff, "elements"
    vals = [abs(d.delta[k]) for k in ("mean", "std", "min", "max")
            if d.delta.get(k) is not None]
    return (max(vals) if vals else 0.0), "statistics"


def _ref_scale(rec_stats) -> float | None:
    if rec_stats is None or rec_stats.abs_max is None or not math.isfinite(rec_stats.abs_max):
        return None
    return rec_stats.abs_max


def _records(trace: Trace, direction: str) -> dict[tuple, Any]:
    """(module, call, tensor path) -> (record, TensorInfo or GradRecord)."""
    if direction == "forward":
        return {(r.module, r.call_index, t.path): (r, t) for r in trace.forward for t in r.outputs}
    return {(g.module, g.call_index, g.output): (g, g) for g in trace.backward}


def _first_over(pd: PrecisionDiff, direction: str) -> tuple[Divergence | None, Divergence | None]:
    """The first divergent and the first newly non-finite call of one direction."""
    ref, low = _records(pd.reference, direction), _records(pd.low, direction)
    rows = pd.diff.forward if direction == "forward" else pd.diff.backward
    if direction == "forward":  # the innermost call where it appeared: the order calls ended
        def order(d):
            r = ref[(d.module, d.call_index, d.tensor)][0]
            return (r.end_order < 0, r.end_order)
        rows = sorted(rows, key=order)
    first = bad = None
    for d in rows:
        key = (d.module, d.call_index, d.tensor)
        if key not in ref or key not in low:
            continue
        ra, rb = ref[key], low[key]
        sa, sb = ra[1].stats, rb[1].stats
        if sa is None or sb is None or not sa.finite:
            continue
        scale = _ref_scale(sa) or 0.0
        nonfinite = not sb.finite
        error, by = _tensor_error(d, pd.reference, pd.low)
        threshold = pd.tolerance * scale + pd.floor
        if d.shape_changed:
            continue
        if not (nonfinite or error > threshold or math.isnan(error)):
            continue
        div = Divergence(direction, d.module, d.module_type, d.call_index, d.tensor,
                         math.inf if nonfinite else error, scale, threshold, by, nonfinite)
        if first is None:
            first = div
        if nonfinite and bad is None:
            bad = div
        if first is not None and bad is not None:
            break
    return first, bad


def _eps_of(module: nn.Module) -> float | None:
    for name in _EPS_NAMES:
        v = getattr(module, name, None)
        if isinstance(v, float) and v > 0:
            return v
    return None


def _rounds_to_zero(eps: float, dtype: torch.dtype) -> bool:
    return float(torch.tensor(eps, dtype=dtype)) == 0.0


def _op_input_max(trace: Trace, module: str, call: int, names: tuple[str, ...]) -> float | None:
    """The largest |x| of the first input of the ops ``names`` inside one call (replayed from
    the fp32 trace), or None when the call has none or cannot be replayed."""
    try:
        ops = trace.ops(module, call).ops
    except Exception:  # a trace that cannot replay, a model that raises on the replay
        return None
    vals = [op.inputs[0].stats.abs_max for op in ops
            if op.short_op.rpartition(".")[2] in names and op.inputs and op.inputs[0].stats
            and op.inputs[0].stats.abs_max is not None]
    return max(vals) if vals else None


def classic_source(div: Divergence, pd: PrecisionDiff, model: nn.Module) -> str | None:
    """Name the classic source of a divergent or non-finite call, where the evidence says so.

    * a norm (class or name with "norm") in fp16 whose fp32 input exceeds |x| ≈ 256: its x²
      overflows fp16 (max 65504);
    * a norm whose epsilon rounds to 0 in the dtype;
    * an attention or softmax call whose exp/softmax input (replayed from the fp32 trace)
      exceeds ≈ 88 (fp32/bf16 exp overflow; ≈ 11 for fp16's exp);
    * RoPE (a rotary module, or cos/sin inside the call) whose angles reach values the dtype
      holds only to more than 0.05 rad (bf16 at positions ≥ 2,048: ±8 rad).

    Returns None when none of these applies (the dtype's rounding, an op not listed).
    """
    if div.direction != "forward":
        return None
    routed = _routing_source(div, pd)
    if routed:
        return routed
    dtype = DTYPES[pd.dtype]
    module = dict(model.named_modules()).get(div.module)
    label = f"{div.module_type} {div.module}"
    if _NORM.search(label):
        rec = pd.reference.call(div.module, div.call_index)
        x_max = max((t.stats.abs_max for t in rec.inputs
                     if t.stats is not None and t.stats.abs_max is not None), default=0.0)
        if dtype == torch.float16 and x_max > FP16_SQUARE_LIMIT:
            return (f"a norm that squares in fp16: its input reaches |x| = {x_max:.4g} and x² "
                    f"overflows fp16 above |x| ≈ {FP16_SQUARE_LIMIT:.0f} (max 65504); compute "
                    "the mean of squares in fp32")
        eps = _eps_of(module) if module is not None else None
        if eps is not None and _rounds_to_zero(eps, dtype):
            return (f"its epsilon {eps:g} rounds to 0 in {pd.dtype} (smallest "
                    f"{torch.finfo(dtype).smallest_normal:.3g}, subnormals to ≈ 6e-8 in fp16): "
                    "a zero variance divides by 0; keep eps in fp32 or use ≥ 1e-5")
    angle = _op_input_max(pd.reference, div.module, div.call_index, ("cos", "sin"))
    if angle is not None and angle * torch.finfo(dtype).eps / 2 > 0.05:
        return (f"RoPE angles computed in {pd.dtype}: position · θ reaches {angle:.4g} rad, which "
                f"{pd.dtype} holds only to ±{angle * torch.finfo(dtype).eps / 2:.2g} rad "
                f"(bf16 at positions ≥ {ROPE_POSITIONS:,}: ±8 rad); compute the angles and "
                "cos/sin in fp32")
    if _ROPE.search(label):
        return (f"RoPE computed in {pd.dtype}: the rotary call differs from fp32; compute "
                "position · θ and cos/sin in fp32")
    if _ATTN.search(label):
        score = _op_input_max(pd.reference, div.module, div.call_index,
                              ("exp", "softmax", "_softmax"))
        limit = FP16_EXP_LIMIT if dtype == torch.float16 else EXP_LIMIT
        if score is not None and score > min(limit, EXP_LIMIT):
            return (f"a softmax over scores up to {score:.4g} in half precision: exp overflows "
                    f"above ≈ {EXP_LIMIT:.0f} ({FP16_EXP_LIMIT:.0f} in fp16) unless the row's "
                    "max is subtracted first; compute the softmax in fp32")
    return None


def _routing_source(div: Divergence, pd: PrecisionDiff) -> str | None:
    """The router whose choices changed under the dtype, when ``div`` is at or after it."""
    for (module, _call), r in pd.diff.routing.items():
        tpe = r.get("tokens_per_expert")
        moved = None if tpe is None else sum(abs(v) for v in tpe) // 2
        if tpe is not None and not moved:
            continue
        ref = pd.reference.call(div.module, div.call_index)
        router = next((c for c in pd.reference.forward if c.module == module), None)
        if router is None or ref.end_order < router.end_order and not (
                module.startswith(div.module + ".") or div.module.startswith(module + ".")):
            continue
        count = f"{moved} token choice(s)" if moved else "its choices"
        return (f"the router of {module} changed {count} under {pd.dtype} (near-tied router "
                "logits flip): a discrete change from rounding, not an overflow; everything "
                "after it differs")
    return None


def _parse_dtype(dtype: Any) -> str:
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", "bfloat16": "bfloat16",
             "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}
    name = names.get(dtype) if isinstance(dtype, (str, torch.dtype)) else None
    if name is None:
        raise ValueError(f"dtype {dtype!r}: a precision diff runs under bfloat16 or float16")
    return name


def _eps_notes(model: nn.Module, dtype: torch.dtype, name: str) -> list[str]:
    zero = [(n, e) for n, m in model.named_modules()
            if (e := _eps_of(m)) is not None and _rounds_to_zero(e, dtype)]
    if not zero:
        return []
    shown = ", ".join(f"{n} ({e:g})" for n, e in zero[:3])
    more = f" and {len(zero) - 3} more" if len(zero) > 3 else ""
    return [f"an epsilon that rounds to 0 in {name}: {shown}{more}; a zero variance (or v = 0 "
            "in Adam) then divides by 0"]


def precision_diff(model: nn.Module, batch: Any, dtype: Any, *, how: str = "cast",
                   loss_fn: Any = None) -> PrecisionDiff:
    """Step ``model`` on ``batch`` in fp32 and under ``dtype``; find where they part.

    Both runs use deep copies of ``model`` (the model itself is not changed and gets no
    gradients) with the same weights and the same RNG state, each stepped forward and backward
    under :func:`hooks.capture` with full copies of the outputs and gradients kept (up to
    :data:`KEEP_BYTES` each).

    Args:
        model: any ``nn.Module`` (minillm, an HF model, a model of one's own).
        batch: what it is called with (tensor, tuple, dict or :class:`hooks.Batch`).
        dtype: ``torch.bfloat16``/``torch.float16`` or ``"bfloat16"``/``"float16"``.
        how: ``"cast"`` (a copy cast to ``dtype``, floating inputs too) or ``"autocast"`` (the
            fp32 copy under ``torch.autocast("cpu", dtype)``).
        loss_fn: ``loss_fn(output, batch)`` when the output holds no loss
            (:func:`hooks.select_loss`).

    Returns:
        A :class:`PrecisionDiff`: the :class:`~hooks.trace.diff.TraceDiff` (A = fp32, B = dtype),
        the first divergent call (forward, then backward; threshold :data:`FACTOR` · eps(dtype) ·
        the fp32 tensor's largest |x|), the first non-finite call, the classic source named
        where the evidence says so, and both losses.

    Raises:
        ValueError: one line: a dtype other than bf16/fp16, an unknown ``how``.
    """
    name = _parse_dtype(dtype)
    if how not in ("cast", "autocast"):
        raise ValueError(f"how={how!r}: give 'cast' (a copy cast to the dtype) or 'autocast'")
    low_dtype = DTYPES[name]
    b = Batch.of(batch)
    rng = torch.get_rng_state()
    ref_model = copy.deepcopy(model).float()
    ref_batch = b.replace([_cast_value(a, torch.float32) for a in b.args],
                          {k: _cast_value(v, torch.float32) for k, v in b.kwargs.items()})
    reference, ref_loss = _step(ref_model, ref_batch, loss_fn, autocast=None)
    torch.set_rng_state(rng)
    if how == "cast":
        low_model = copy.deepcopy(model).to(low_dtype)
        low_batch = b.replace([_cast_value(a, low_dtype) for a in b.args],
                              {k: _cast_value(v, low_dtype) for k, v in b.kwargs.items()})
        low, low_loss = _step(low_model, low_batch, loss_fn, autocast=None)
    else:
        low_model = copy.deepcopy(model).float()
        low, low_loss = _step(low_model, ref_batch, loss_fn, autocast=low_dtype)
    eps = torch.finfo(low_dtype).eps
    tiny = torch.finfo(low_dtype).smallest_normal * eps
    pd = PrecisionDiff(name, how, eps, FACTOR * eps, FACTOR * tiny, reference.diff(low),
                       reference, low, loss={"fp32": ref_loss, name: low_loss})
    _fill(pd, ref_model)
    pd.notes += _eps_notes(model, low_dtype, name)
    return pd


def _fill(pd: PrecisionDiff, model: nn.Module) -> None:
    """Set the first divergent and non-finite calls (forward before backward) and name their
    sources."""
    for direction in ("forward", "backward"):
        first, bad = _first_over(pd, direction)
        pd.first_divergent = pd.first_divergent or first
        pd.first_nonfinite = pd.first_nonfinite or bad
    for div in {id(d): d for d in (pd.first_divergent, pd.first_nonfinite) if d}.values():
        div.cause = classic_source(div, pd, model)
    for direction in ("forward", "backward"):
        ref_bad = pd.reference.first_nonfinite(direction)
        if ref_bad is not None:
            pd.notes.append(f"fp32 itself is not finite ({direction}): {ref_bad.describe()}; "
                            "only calls finite in fp32 are compared")
            break
