"""``Trace.diff``: what changed between two traces ("step 0 vs step 300", "GQA vs MHA").

Records are matched by identity, not position: a forward output by ``(module, call_index,
output path)``, a gradient by ``(module, call_index, output path, n)`` (``n`` counts repeats of
the same key, e.g. two backward passes), a parameter by name, a routing record by
``(module, call_index)``. Each matched pair gives ``other - self`` for every scalar statistic
and, where both traces kept the full tensor with the same shape, the max absolute element-wise
difference. Unmatched keys are listed, not dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hooks.tensors.stats import TensorStats, encode_float
from hooks.trace.records import CallRecord, GradRecord, ParamGradRecord, RoutingRecord


class Trace(Protocol):
    """What :func:`diff_traces` reads of a trace (:class:`hooks.Trace` has it all); a protocol,
    so that comparing traces does not need the module that defines them."""

    forward: list[CallRecord]
    backward: list[GradRecord]
    params: dict[str, ParamGradRecord]
    routing: list[RoutingRecord]
    tensors: dict[str, torch.Tensor]

_PARAM_FIELDS = ("grad_norm", "grad_abs_max", "weight_norm", "ratio")


def _sub(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if math.isnan(a) and math.isnan(b):
        return 0.0
    if math.isinf(a) and a == b:
        return 0.0
    return b - a


@dataclass(slots=True)
class TensorDiff:
    """Change of one tensor's statistics between two traces.

    Attributes:
        direction: ``"forward"`` (a module output) or ``"backward"`` (a gradient).
        module: qualified module name.
        module_type: class name (from ``self``).
        call_index: the module's call index.
        tensor: output path (``out``, ``out[0]``...).
        shape_self: shape in ``self``.
        shape_other: shape in ``other`` (differs e.g. for k_proj when GQA became MHA).
        delta: ``other - self`` per statistic (``None`` where either side has no value).
        max_abs_diff: max |other - self| element-wise where both traces kept the tensor with the
            same shape, else None.
        scale: the larger ``abs_max`` of the two sides (what :meth:`relative` divides by), or
            None when neither has statistics.
    """

    direction: str
    module: str
    module_type: str
    call_index: int
    tensor: str
    shape_self: list[int]
    shape_other: list[int]
    delta: dict[str, float | None]
    max_abs_diff: float | None = None
    scale: float | None = None

    @property
    def shape_changed(self) -> bool:
        """Whether the shape differs at all (also when only the row count does)."""
        return self.shape_self != self.shape_other

    @property
    def layout_changed(self) -> bool:
        """Whether a dimension other than the first differs (or the number of dimensions):
        the architecture changed (k_proj of GQA against MHA), not just how many rows a call got
        (an expert that received more tokens)."""
        a, b = self.shape_self, self.shape_other
        return len(a) != len(b) or a[1:] != b[1:]

    def relative(self) -> float:
        """How much the tensor changed, scale-free: the largest |Δ| of mean, std, min and max
        over the larger |x| max of the two sides; ``inf`` when the layout changed
        (:attr:`layout_changed`) or the NaN/Inf counts did, 0.0 when nothing changed. Calls
        whose row count changed are compared by their statistics."""
        if self.layout_changed:
            return math.inf
        if any(self.delta.get(k) for k in ("nan_count", "inf_count")):
            return math.inf
        vals = [abs(self.delta[k]) for k in ("mean", "std", "min", "max")
                if self.delta.get(k) is not None]
        if not vals:
            return 0.0
        if not self.scale or not math.isfinite(self.scale):
            return math.inf if max(vals) > 0 else 0.0
        return max(vals) / self.scale

    def max_abs_delta(self) -> float:
        """Largest |delta| over all statistics (0.0 when all are None)."""
        vals = [abs(v) for v in self.delta.values() if v is not None]
        return max(vals, default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "direction": self.direction,
            "module": self.module,
            "module_type": self.module_type,
            "call_index": self.call_index,
            "tensor": self.tensor,
            "shape_self": self.shape_self,
            "shape_other": self.shape_other,
            "delta": {k: encode_float(v) for k, v in self.delta.items()},
            "max_abs_diff": encode_float(self.max_abs_diff),
            "scale": encode_float(self.scale),
            "relative": encode_float(self.relative()),
        }


@dataclass
class TraceDiff:
    """Result of :meth:`hooks.Trace.diff` (``other - self`` throughout).

    Attributes:
        forward: one :class:`TensorDiff` per matched forward output.
        backward: one :class:`TensorDiff` per matched gradient.
        params: per parameter name, the change of ``grad_norm``, ``grad_abs_max``,
            ``weight_norm`` and ``ratio``.
        routing: per ``(module, call_index)``, the change of ``aux_loss`` and of
            ``tokens_per_expert`` (a list, or None when E differs).
        only_in_self: keys (as strings) present in ``self`` only.
        only_in_other: keys present in ``other`` only.
    """

    forward: list[TensorDiff] = field(default_factory=list)
    backward: list[TensorDiff] = field(default_factory=list)
    params: dict[str, dict[str, float | None]] = field(default_factory=dict)
    routing: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    only_in_self: list[str] = field(default_factory=list)
    only_in_other: list[str] = field(default_factory=list)

    def max_abs_delta(self) -> float:
        """Largest |change| of any statistic, parameter value, aux loss or kept element."""
        vals = [d.max_abs_delta() for d in self.forward + self.backward]
        vals += [d.max_abs_diff for d in self.forward + self.backward if d.max_abs_diff is not None]
        vals += [abs(v) for p in self.params.values() for v in p.values() if v is not None]
        for r in self.routing.values():
            if r["aux_loss"] is not None:
                vals.append(abs(r["aux_loss"]))
            vals += [abs(v) for v in r["tokens_per_expert"] or []]
        return max(vals, default=0.0)

    def is_zero(self, atol: float = 0.0) -> bool:
        """True when every record matched and nothing changed by more than ``atol``."""
        if self.only_in_self or self.only_in_other:
            return False
        if any(d.shape_self != d.shape_other for d in self.forward + self.backward):
            return False
        return self.max_abs_delta() <= atol

    def ranked(self) -> list[TensorDiff]:
        """Forward and backward rows that changed, largest :meth:`TensorDiff.relative` first
        (layout changes and new NaN/Inf on top, forward before backward, then in recording
        order)."""
        rows = [d for d in self.forward + self.backward if d.relative() > 0
                or d.shape_changed or (d.max_abs_diff or 0) > 0]
        order = {id(d): i for i, d in enumerate(self.forward + self.backward)}  # recording order
        rows.sort(key=lambda d: (-d.relative(), d.direction != "forward", order[id(d)]))
        return rows

    def ranked_for_edit(self, edited: Sequence[str], loss: str | None = None
                        ) -> list[TensorDiff]:
        """The rows of :meth:`ranked` for an edit's what-if view: first the loss (the root
        call's output ``loss``, e.g. ``out.loss``, ``out[1]``), then the forward outputs of the
        edited modules themselves (``edited``: an edit's module and the module it hooked, the
        ``o_proj`` of a head), then the rest largest change first, with the calls whose row
        count changed (the experts a changed routing sends more or fewer tokens) last: their
        change is the routing's, already said by the router's own row.

        Args:
            edited: Qualified names of the edited modules.
            loss: The root output's path that holds the loss (``meta["loss_source"]``).
        """
        names = set(edited)

        def group(d: TensorDiff) -> int:
            if loss is not None and d.module == "" and d.tensor == loss:
                return 0
            if d.direction == "forward" and d.module in names:
                return 1
            return 3 if d.shape_changed else 2

        return sorted(self.ranked(), key=group)  # stable: ranked order inside a group

    def top(self, n: int = 10, stat: str = "l2", direction: str = "forward") -> list[TensorDiff]:
        """The ``n`` tensors whose ``stat`` changed most (by absolute change)."""
        rows = self.forward if direction == "forward" else self.backward
        scored = [d for d in rows if d.delta.get(stat) is not None]
        scored.sort(key=lambda d: abs(d.delta[stat]), reverse=True)  # type: ignore[arg-type]
        return scored[:n]

    def to_dict(self) -> dict[str, Any]:
        return {
            "forward": [d.to_dict() for d in self.forward],
            "backward": [d.to_dict() for d in self.backward],
            "params": {
                k: {f: encode_float(v) for f, v in d.items()} for k, d in self.params.items()
            },
            "routing": [
                {"module": m, "call_index": c, **{k: v for k, v in r.items()}}
                for (m, c), r in self.routing.items()
            ],
            "only_in_self": self.only_in_self,
            "only_in_other": self.only_in_other,
        }


def _stats_delta(a: TensorStats | None, b: TensorStats | None) -> dict[str, float | None]:
    if a is None or b is None:
        return {}
    va, vb = a.values(), b.values()
    return {k: _sub(va[k], vb[k]) for k in va}


def _scale(a: TensorStats | None, b: TensorStats | None) -> float | None:
    vals = [s.abs_max for s in (a, b) if s is not None and s.abs_max is not None]
    return max(vals) if vals else None


def _kept_diff(ta: Trace, ka: str | None, tb: Trace, kb: str | None) -> float | None:
    if ka is None or kb is None:
        return None
    xa, xb = ta.tensors.get(ka), tb.tensors.get(kb)
    if xa is None or xb is None or xa.shape != xb.shape:
        return None
    if xa.numel() == 0:
        return 0.0
    d = (xb.double() - xa.double()).abs()
    d = torch.where(torch.isnan(xa) & torch.isnan(xb), torch.zeros_like(d), d)
    return float(d.max())


def _diff_forward(a: Trace, b: Trace, out: TraceDiff) -> None:
    """Add to ``out`` the forward outputs' diffs, matched by (module, call, output path), and
    the outputs found in one trace only."""
    fa = {(r.module, r.call_index, t.path): (r, t) for r in a.forward for t in r.outputs}
    fb = {(r.module, r.call_index, t.path): (r, t) for r in b.forward for t in r.outputs}
    for key, (ra, ta) in fa.items():
        if key not in fb:
            out.only_in_self.append(f"forward {key[0] or '<root>'}#{key[1]} {key[2]}")
            continue
        _, tb = fb[key]
        out.forward.append(
            TensorDiff(
                "forward",
                ra.module,
                ra.module_type,
                ra.call_index,
                ta.path,
                ta.shape,
                tb.shape,
                _stats_delta(ta.stats, tb.stats),
                _kept_diff(a, ta.kept, b, tb.kept),
                _scale(ta.stats, tb.stats),
            )  # fmt: skip
        )
    out.only_in_other += [f"forward {k[0] or '<root>'}#{k[1]} {k[2]}" for k in fb if k not in fa]


def _keyed_backward(tr: Trace) -> dict[tuple, Any]:
    """A trace's backward records by (their key..., n): the n-th record with that key."""
    seen: dict[tuple, int] = {}
    res = {}
    for g in tr.backward:
        k = g.key
        n = seen.get(k, 0)
        seen[k] = n + 1
        res[(*k, n)] = g
    return res


def _diff_backward(a: Trace, b: Trace, out: TraceDiff) -> None:
    """Add to ``out`` the backward gradients' diffs, matched by key and occurrence, and the
    gradients found in one trace only."""
    ba, bb = _keyed_backward(a), _keyed_backward(b)
    for key, ga in ba.items():
        gb = bb.get(key)
        if gb is None:
            out.only_in_self.append(f"backward {key[0] or '<root>'}#{key[1]} {key[2]} ({key[3]})")
            continue
        out.backward.append(
            TensorDiff(
                "backward",
                ga.module,
                ga.module_type,
                ga.call_index,
                ga.output,
                ga.shape,
                gb.shape,
                _stats_delta(ga.stats, gb.stats),
                _kept_diff(a, ga.kept, b, gb.kept),
                _scale(ga.stats, gb.stats),
            )  # fmt: skip
        )
    out.only_in_other += [
        f"backward {k[0] or '<root>'}#{k[1]} {k[2]} ({k[3]})" for k in bb if k not in ba
    ]


def _diff_params_and_routing(a: Trace, b: Trace, out: TraceDiff) -> None:
    """Add to ``out`` the parameter statistics' differences by name, the routing records'
    aux-loss and tokens-per-expert differences by (module, call), and those in one trace
    only."""
    for name, pa in a.params.items():
        pb = b.params.get(name)
        if pb is None:
            out.only_in_self.append(f"param {name}")
            continue
        out.params[name] = {f: _sub(getattr(pa, f), getattr(pb, f)) for f in _PARAM_FIELDS}
    out.only_in_other += [f"param {n}" for n in b.params if n not in a.params]

    ra_ = {(r.module, r.call_index): r for r in a.routing}
    rb_ = {(r.module, r.call_index): r for r in b.routing}
    for key, r1 in ra_.items():
        r2 = rb_.get(key)
        if r2 is None:
            out.only_in_self.append(f"routing {key[0]}#{key[1]}")
            continue
        tpe = None
        if r1.tokens_per_expert.shape == r2.tokens_per_expert.shape:
            tpe = (r2.tokens_per_expert.long() - r1.tokens_per_expert.long()).tolist()
        out.routing[key] = {"aux_loss": _sub(r1.aux_loss, r2.aux_loss), "tokens_per_expert": tpe}
    out.only_in_other += [f"routing {k[0]}#{k[1]}" for k in rb_ if k not in ra_]


def diff_traces(a: Trace, b: Trace) -> TraceDiff:
    """Compare trace ``a`` (self) with ``b`` (other); see :class:`TraceDiff`."""
    out = TraceDiff()
    _diff_forward(a, b, out)
    _diff_backward(a, b, out)
    _diff_params_and_routing(a, b, out)
    return out
