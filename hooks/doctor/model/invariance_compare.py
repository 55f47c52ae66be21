"""The invariance mechanism: run the model twice, under a transformation that must not change its
output, and say how far the two runs are apart and where they part.

A *reference* run is one forward of one row alone, (1, Ta). A *variant* run is one or more
forwards (a padded batch, a packed row, a prefix and then one token at a time with a cache) whose
positions cover the reference's: each :class:`Segment` says which positions of which call and
row of the variant hold which positions of the reference. Only the real tokens are compared
(never a pad, never the other rows' or documents' tokens).

Tolerance, from the dtype the model computes in (never from one machine's numbers), the rule of
:mod:`hooks.whatif.precision`::

    max |variant - reference|  >  FACTOR · eps(dtype) · max |reference|  (+ FACTOR · tiny)

``eps`` is ``torch.finfo(dtype).eps`` of the parameters' dtype (TF32's 2⁻¹⁰ for float32 on a
CUDA device where ``torch.backends.cuda.matmul.allow_tf32`` is on). A correct model's two runs
differ only by the order of its sums (another batch size, another kernel): a few eps.

Where they part: both runs again under :func:`hooks.capture` with full copies of every module's
outputs kept, the records matched by ``(module, call)`` as ``mdb diff`` matches them
(:meth:`hooks.Trace.diff`), each tensor cut to the compared positions along its batch and
sequence axes (an axis of size Ta in the reference and of the call's length in the variant; a
(B·T, ...) token-flattened tensor is viewed as (B, T, ...)), and the first record that is
beyond tolerance, in the order the reference's calls *finished* (the innermost call where the
difference appeared), is named. Records whose tensors do not line up that way are not compared.

Dimension legend: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hooks.engine.capture import capture
from hooks.trace.trace import Trace

#: Multiples of the dtype's epsilon (relative to the reference's largest |x|) two runs of a
#: correct model may differ by (:data:`hooks.whatif.precision.FACTOR`'s rule). Correct HF
#: families and minillm stay within 2 eps in float32 on CPU (tests/hooks/doctor/model).
FACTOR = 16
#: Budget for full copies of module outputs per trace when locating where two runs part.
KEEP_BYTES = 256 * 2**20
#: Class names of linear maps: when one is where two runs part first, its input already
#: differed, so the difference entered in the enclosing module's own code.
LINEAR_TYPES = ("Linear", "Conv1D", "NonDynamicallyQuantizableLinear")
#: TF32's machine epsilon (10 mantissa bits): float32 matmuls on CUDA with TF32 allowed.
TF32_EPS = 2.0**-10


@dataclass(frozen=True)
class Segment:
    """Which positions of a variant call hold which positions of the reference row.

    Attributes:
        call: the variant's forward call (0 for a single forward; i for the i-th forward of an
            incremental decode).
        row: the row of that call's batch.
        pos: (n,) positions along that call's sequence axis.
        ref_pos: (n,) the reference row's positions they hold.
        label: what this segment is, in words (``left-padded row``).
    """

    call: int
    row: int
    pos: torch.Tensor
    ref_pos: torch.Tensor
    label: str = ""


@dataclass
class Tolerance:
    """How far two runs of a correct model may differ.

    Attributes:
        dtype: the dtype the model computes in, by name (``float32``, ``tf32``, ``bfloat16``).
        eps: its machine epsilon.
        factor: :data:`FACTOR`.
        floor: absolute floor ``FACTOR · smallest normal · eps`` (values near 0).
    """

    dtype: str
    eps: float
    factor: float = FACTOR
    floor: float = 0.0

    def threshold(self, scale: float) -> float:
        """``factor · eps · scale + floor``."""
        return self.factor * self.eps * scale + self.floor

    def text(self) -> str:
        """The rule, in words."""
        return f"{self.factor:g} × eps({self.dtype}) = {self.factor * self.eps:.3g} × max |ref|"


def tolerance_of(model: torch.nn.Module) -> Tolerance:
    """The :class:`Tolerance` of the dtype ``model``'s floating parameters compute in."""
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    dtype = p.dtype if p is not None else torch.float32
    name = str(dtype).replace("torch.", "")
    eps = torch.finfo(dtype).eps
    if (dtype == torch.float32 and p is not None and p.device.type == "cuda"
            and torch.backends.cuda.matmul.allow_tf32):
        name, eps = "tf32", TF32_EPS
    tiny = torch.finfo(dtype).smallest_normal * eps
    return Tolerance(name, eps, FACTOR, FACTOR * tiny)


@dataclass
class Gap:
    """The largest difference between the reference and the variant over one segment's tokens.

    Attributes:
        label: the segment's label.
        max_abs: max |variant - reference| over the compared positions (inf: non-finite on one
            side only).
        scale: max |reference| there.
        threshold: what the dtype explains (:meth:`Tolerance.threshold`).
        position: the reference position of the largest difference.
    """

    label: str
    max_abs: float
    scale: float
    threshold: float
    position: int

    @property
    def over(self) -> bool:
        """Beyond tolerance (or NaN)."""
        return not self.max_abs <= self.threshold


@dataclass
class Parting:
    """The first module call where the two runs part.

    Attributes:
        module: qualified module name (``""``: the model itself).
        module_type: its class name.
        call: the reference's call index.
        tensor: the output path (``out``, ``out[0]``).
        max_abs: max |variant - reference| over the compared positions.
        threshold: what the dtype explains for that tensor.
        label: the variant segment where it parts.
        compared: how many records were lined up and compared.
        within: the enclosing call's module when ``module`` is a linear layer (a linear map of
            an input that already differed, e.g. an attention's ``o_proj`` after the
            attention's own code: the difference entered in that enclosing module), else None.
    """

    module: str
    module_type: str
    call: int
    tensor: str
    max_abs: float
    threshold: float
    label: str
    compared: int = 0
    within: str | None = None

    @property
    def origin(self) -> str:
        """Where the difference entered: :attr:`within` when set, else :attr:`module`."""
        return self.module if self.within is None else self.within

    def describe(self) -> str:
        """``model.layers.0.self_attn.o_proj (Linear) out: max |Δ| 0.31 > 1.2e-06, its input
        already differed: it entered in model.layers.0.self_attn's own code``."""
        name = self.module or "(the model)"
        text = (f"{name} ({self.module_type}) {self.tensor}: max |Δ| {self.max_abs:.3g} > "
                f"{self.threshold:.2g}")
        if self.within is not None:
            text += (f"; a linear layer, its input already differed: the difference entered "
                     f"in {self.within or '(the model)'}'s own code")
        return text


@dataclass
class Comparison:
    """Two runs compared: the gaps per segment, and where they part when they do.

    Attributes:
        gaps: one :class:`Gap` per segment (logits).
        tolerance: the rule applied.
        parting: the first module where the runs part, None when they do not (or nothing lined
            up).
        notes: what could not be compared, in words.
        finite: whether the reference's logits are all finite (else nothing can be judged).
    """

    gaps: list[Gap]
    tolerance: Tolerance
    parting: Parting | None = None
    notes: list[str] = field(default_factory=list)
    finite: bool = True

    @property
    def worst(self) -> Gap:
        """The gap furthest beyond its threshold (the largest ratio)."""
        return max(self.gaps, key=lambda g: math.inf if not g.max_abs <= g.threshold
                   and g.threshold == 0 else g.max_abs / max(g.threshold, 1e-300))

    @property
    def over(self) -> bool:
        """Whether any segment is beyond tolerance."""
        return any(g.over for g in self.gaps)


def _gap(ref: torch.Tensor, var: torch.Tensor, seg: Segment, tol: Tolerance) -> Gap:
    a = ref.detach().double()
    b = var.detach().double()
    finite = torch.isfinite(a)
    scale = float(a[finite].abs().max()) if bool(finite.any()) else 0.0
    diff = (a - b).abs()
    same_inf = (a == b) & ~finite  # the same inf on both sides is no difference
    diff = torch.where(same_inf, torch.zeros_like(diff), diff)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    per_pos = diff.reshape(diff.shape[0], -1).amax(dim=1) if diff.dim() else diff.reshape(1)
    i = int(per_pos.argmax())
    return Gap(seg.label, float(per_pos[i]), scale, tol.threshold(scale), int(seg.ref_pos[i]))


def logit_gaps(ref_TV: torch.Tensor, var_calls: list[torch.Tensor], segments: list[Segment],
               tol: Tolerance) -> list[Gap]:
    """The largest difference per segment between reference and variant logits.

    Args:
        ref_TV: (1, Ta, V) reference logits.
        var_calls: the variant's (B, Tc, V) logits, one per call.
        segments: what to compare.
        tol: the tolerance.
    """
    out = []
    for s in segments:
        a = ref_TV[0].index_select(0, s.ref_pos.to(ref_TV.device))
        b = var_calls[s.call][s.row].index_select(0, s.pos.to(var_calls[s.call].device))
        out.append(_gap(a, b, s, tol))
    return out


def _cut(x: torch.Tensor, row: int, pos: torch.Tensor, b: int, t: int) -> torch.Tensor | None:
    """``x`` at batch row ``row`` and positions ``pos`` along every sequence axis, for a tensor
    of a call on a (b, t) batch: (b, ..., t, ...), token-flattened (b·t, ...) or shared by
    every row (1, ..., t, ...); None when it has no batch axis of size b (or 1) first, or no
    axis of size t after it."""
    if x.dim() >= 1 and x.shape[0] == b * t != b:
        x = x.reshape(b, t, *x.shape[1:])  # router logits: tokens flattened
    if x.dim() >= 1 and x.shape[0] == 1 < b:
        x = x[0]  # one tensor shared by every row (a position table broadcast over B)
    elif x.dim() < 1 or x.shape[0] != b:
        return None
    else:
        x = x[row]
    seq = [d for d in range(x.dim()) if x.shape[d] == t]
    if not seq:  # no sequence axis: not a per-token tensor (an expert's share of the tokens)
        return None
    for d in seq:
        x = x.index_select(d, pos.to(x.device))
    return x


def _tensor_gap(a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> tuple[float, float]:
    """(max |b - a|, threshold) over two tensors of as many elements (inf: non-finite on one
    side only)."""
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    finite = torch.isfinite(a)
    scale = float(a[finite].abs().max()) if bool(finite.any()) else 0.0
    diff = torch.where((a == b) & ~finite, torch.zeros_like(a), (a - b).abs())
    err = float(torch.nan_to_num(diff, nan=math.inf).max())
    return err, tol.threshold(scale)


def _within(trace: Trace, rec: Any) -> str | None:
    """The enclosing call's module of a linear layer's call, else None."""
    if rec.parent is None or rec.module_type not in LINEAR_TYPES:
        return None
    return trace.forward[rec.parent].module


def _outputs(trace: Trace) -> dict[tuple[str, int, str], tuple[Any, torch.Tensor]]:
    out = {}
    for r in trace.forward:
        for ti in r.outputs:
            if ti.kept is not None and ti.kept in trace.tensors:
                t = trace.tensors[ti.kept]
                if t.is_floating_point():
                    out[(r.module, r.call_index, ti.path)] = (r, t)
    return out


def first_parting(ref: Trace, var: Trace, segments: list[Segment], ref_shape: tuple[int, int],
                  var_shapes: list[tuple[int, int]], tol: Tolerance) -> tuple[Parting | None, int]:
    """The first reference call (in the order calls finished) whose output differs from the
    variant's beyond tolerance over a segment's positions.

    Args:
        ref: the reference run's trace (full outputs kept).
        var: the variant's.
        segments: what to compare.
        ref_shape: (1, Ta) of the reference batch.
        var_shapes: (B, Tc) of each variant call.
        tol: the tolerance.

    Returns:
        (parting or None, how many tensor pairs were compared).
    """
    a_out, b_out = _outputs(ref), _outputs(var)
    keys = sorted(a_out, key=lambda k: (a_out[k][0].end_order < 0, a_out[k][0].end_order))
    per_forward: dict[str, int] = {}  # a module called twice per forward: calls 2i, 2i+1
    for r in ref.forward:
        per_forward[r.module] = max(per_forward.get(r.module, 0), r.call_index + 1)
    compared = 0
    for module, call, path in keys:
        rec, a_full = a_out[(module, call, path)]
        for s in segments:
            hit = b_out.get((module, call + s.call * per_forward[module], path))
            if hit is None:
                continue
            b, t = var_shapes[s.call]
            a = _cut(a_full, 0, s.ref_pos, *ref_shape)
            bt = _cut(hit[1], s.row, s.pos, b, t)
            if a is None or bt is None or a.numel() != bt.numel() or a.numel() == 0:
                continue
            compared += 1
            err, thr = _tensor_gap(a, bt, tol)
            if not err <= thr:
                return Parting(module, rec.module_type, call, path, err, thr, s.label,
                               compared, _within(ref, rec)), compared
    return None, compared


def compare(model: torch.nn.Module, reference: Callable[[], torch.Tensor],
            variant: Callable[[], list[torch.Tensor]], segments: list[Segment],
            locate: bool = True) -> Comparison:
    """Run ``reference`` and ``variant`` (each returning logits), compare them over
    ``segments``; when they differ beyond tolerance and ``locate``, run both again under
    :func:`hooks.capture` and name the first module where they part.

    Args:
        model: the model both callables run (for the dtype and the capture).
        reference: runs the model on the row alone; returns (1, Ta, V) logits.
        variant: runs the transformed input; returns the (B, Tc, V) logits of each call.
        segments: the positions to compare.
        locate: look for the first module where the runs part when they differ.

    Returns:
        The :class:`Comparison`.
    """
    tol = tolerance_of(model)
    ref_lg = reference()
    var_lg = variant()
    cmp = Comparison(logit_gaps(ref_lg, var_lg, segments, tol), tol)
    cmp.finite = bool(torch.isfinite(ref_lg).all())
    if not (cmp.over and locate and cmp.finite):
        return cmp
    opts = dict(keep_bytes=KEEP_BYTES, inputs=False, grads=False, params=False, probes=False)
    with capture(model, **opts) as tr_ref:
        ref_lg = reference()
    with capture(model, **opts) as tr_var:
        var_lg = variant()
    shapes = [(int(x.shape[0]), int(x.shape[1])) for x in var_lg]
    cmp.parting, n = first_parting(tr_ref, tr_var, segments,
                                   (int(ref_lg.shape[0]), int(ref_lg.shape[1])), shapes, tol)
    if cmp.parting is None:
        cmp.notes.append(f"no module output lines up beyond tolerance ({n} compared)")
    return cmp
