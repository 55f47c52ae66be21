"""Check 9: numerics under bf16 — normalisation statistics and softmax must run in fp32.

Measured, not read from source: a ``TorchFunctionMode`` records the dtype every reduction
(``mean``, ``sum``, ``var``, ``rsqrt``...) and every softmax actually produced, attributed to
the innermost module running at the time. (A function mode rather than a dispatch mode: the
first ``TorchDispatchMode`` imports ``torch._dynamo``, about 4 s.)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from hooks.checks.registry import DoctorOptions, check
from hooks.checks.result import Outcome
from hooks.checks.target import SkipCheck, Target, fmt

#: Functions that compute normalisation statistics when they run inside a norm module.
STAT_OPS = frozenset({"mean", "sum", "var", "var_mean", "std", "std_mean", "rsqrt", "sqrt",
                      "pow", "__pow__", "square", "norm", "vector_norm", "linalg_vector_norm"})
#: Softmax-family functions (cross-entropy contains a log-softmax).
SOFTMAX_OPS = frozenset({"softmax", "log_softmax", "_softmax", "_log_softmax", "cross_entropy"})
#: Fused kernels that accumulate in fp32 internally whatever their input dtype.
FUSED_OPS = frozenset({"scaled_dot_product_attention", "rms_norm", "layer_norm"})
#: Relative error (to the output's largest magnitude) above which a bf16 norm output warns.
NORM_REL_TOL = 2.0**-6
#: Tokens (one row of the batch) run under autocast; enough for every op to show its dtype.
AUTOCAST_TOKENS = 32
#: Scale of the large-activation input fed to each norm (one channel 30× larger still).
LARGE = 1e3


def _dtype(x: Any) -> str:
    if isinstance(x, (tuple, list)) and x:
        x = x[0]
    return str(x.dtype).removeprefix("torch.") if isinstance(x, torch.Tensor) else ""


class OpDtypeRecorder(TorchFunctionMode):
    """Record ``(module, function, input dtype, output dtype)`` for watched torch functions.

    Args:
        model: the modules whose calls set the "current module" (pre/post forward hooks).
        watch: function names (``func.__name__``: ``mean``, ``softmax``...) to record.
    """

    def __init__(self, model: torch.nn.Module, watch: frozenset[str]) -> None:
        super().__init__()
        self.watch = watch
        self.events: list[tuple[str, str, str, str]] = []
        self._stack: list[str] = []
        self._handles = []
        for name, m in model.named_modules():
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, args, n=name: self._stack.append(n)))
            self._handles.append(m.register_forward_hook(
                lambda mod, args, out, n=name: self._pop(n)))

    def _pop(self, name: str) -> None:
        if self._stack and self._stack[-1] == name:
            self._stack.pop()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in self.watch:
            t_in = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self.events.append((self._stack[-1] if self._stack else "", name, _dtype(t_in),
                                _dtype(out)))
        return out


def _is_half(dtype_name: str) -> bool:
    return dtype_name in ("bfloat16", "float16")


def _under(name: str, roots: set[str]) -> str | None:
    for r in roots:
        if name == r or name.startswith(r + "."):
            return r
    return None


def norm_under_bf16(name: str, norm: torch.nn.Module, seed: int) -> dict[str, Any]:
    """Feed one norm module a bf16 input with large activations (|x| up to 3·10⁴).

    Returns:
        dict with ``half_stats`` (ops that computed statistics in 16-bit), ``rel_error``
        (max |y_bf16 - y_fp32| / max |y_fp32|, the fp32 reference being the same module on the
        same values upcast) and ``finite``.
    """
    w = getattr(norm, "weight", None)
    if isinstance(w, torch.Tensor):
        d = w.shape[-1]
    else:
        shape = getattr(norm, "normalized_shape", None)
        if not shape:
            raise SkipCheck(f"{name}: cannot tell the normalised size")
        d = int(shape[-1])
    dev = w.device if isinstance(w, torch.Tensor) else torch.device("cpu")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 8, d, generator=g) * LARGE
    x[..., 0] *= 30.0
    xb = x.to(dev, torch.bfloat16)
    with torch.no_grad():
        ref = norm(xb.float()).float()
        rec = OpDtypeRecorder(norm, STAT_OPS | FUSED_OPS)
        try:
            with rec:
                y = norm(xb)
        finally:
            rec.remove()
    y = y.float()
    finite = bool(torch.isfinite(y).all())
    denom = float(ref.abs().max()) or 1.0
    err = float((y - ref).abs().max()) / denom if finite else float("inf")
    half = sorted({op for _, op, _, out in rec.events if op in STAT_OPS and _is_half(out)})
    return dict(half_stats=half, rel_error=err, finite=finite, out_dtype=str(y.dtype))


@check(9, "numerics", "bf16 numerics")
def numerics(t: Target, o: DoctorOptions) -> Outcome:
    """Normalisation statistics and softmax in fp32 when activations are bf16.

    1. Every norm module on a bf16 large-activation input: statistics ops must run in fp32,
       the output must be finite and within :data:`NORM_REL_TOL` of the fp32 result.
    2. The model under ``torch.autocast(bfloat16)`` on the batch's first row (up to
       :data:`AUTOCAST_TOKENS` tokens): every softmax must produce
       fp32 (or run in a fused fp32-accumulating kernel), norms keep fp32 statistics, the logits
       stay finite; the loss is compared with the fp32 loss.
    """
    norms = t.norm_modules()
    data: dict[str, Any] = {"norms": {}}
    fails: list[tuple[str, str | None]] = []
    warns: list[tuple[str, str | None]] = []
    worst_err = 0.0
    for i, (name, m) in enumerate(norms):
        r = norm_under_bf16(name, m, o.seed + 90 + i)
        data["norms"][name] = r
        worst_err = max(worst_err, r["rel_error"])
        if r["half_stats"]:
            fails.append((f"{name} ({type(m).__name__}) computes {', '.join(r['half_stats'])} "
                          f"in bfloat16 for a bfloat16 input", name))
        elif not r["finite"]:
            fails.append((f"{name} overflows on a bf16 input with |x| ≤ {30 * LARGE:g}", name))
        elif r["rel_error"] > NORM_REL_TOL:
            warns.append((f"{name} differs from its fp32 result by {fmt(r['rel_error'])} "
                          f"(relative) on a bf16 input", name))

    model_ev = _autocast_run(t, {n for n, _ in norms}, fails, warns, data)
    data["worst_norm_rel_error"] = worst_err
    ev = (f"{len(norms)} norm(s) keep fp32 statistics on a bf16 input with |x| ≤ "
          f"{30 * LARGE:g} (worst rel. error {fmt(worst_err, 2)}); {model_ev}")
    if fails:
        msg, mod = fails[0]
        more = f" (+{len(fails) - 1} more)" if len(fails) > 1 else ""
        return Outcome.fail(msg + more,
                            "upcast before statistics and softmax: x.float() for mean(x²)/rsqrt "
                            "and softmax(scores.float()), then cast back (HF LlamaRMSNorm does)",
                            mod, **data)
    if warns:
        msg, mod = warns[0]
        return Outcome.warn(f"{msg}; {ev}", "compute in fp32 and cast back", mod, **data)
    if not norms and not data.get("softmax_fp32_modules") and not data.get("fused_kernels"):
        return Outcome.warn(ev, "no norm module and no softmax recorded: nothing was measured",
                            **data)
    return Outcome.ok(ev, **data)


def _autocast_run(t: Target, norm_names: set[str], fails: list, warns: list,
                  data: dict[str, Any]) -> str:
    """Part 2 of :func:`numerics`: the batch under bf16 autocast vs fp32. Appends findings to
    ``fails``/``warns`` and measurements to ``data``; returns the evidence text."""
    dev = t.device.type
    if dev not in ("cpu", "cuda"):
        return f"autocast not tested on device {dev}"
    if t.input_ids is None and not t.args and not t.kwargs:
        return "autocast not tested (no batch)"
    labels = True if t.accepts("labels") and t.input_ids is not None else None
    ids = t.input_ids[:1, :AUTOCAST_TOKENS] if t.input_ids is not None else None
    with t.mode(False), torch.no_grad():
        ref_out = t.call(ids, labels=labels)
        ref_logits = t.logits(ref_out)
        if ref_logits is None:
            return "autocast not tested (the output has no logits)"
        ref_logits = ref_logits.float()
        if not bool(torch.isfinite(ref_logits).all()):
            return "autocast not tested: the fp32 logits are already not finite"
        rec = OpDtypeRecorder(t.model, STAT_OPS | SOFTMAX_OPS | FUSED_OPS)
        try:
            with rec, torch.autocast(dev, dtype=torch.bfloat16):
                out = t.call(ids, labels=labels)
        finally:
            rec.remove()
        logits = t.need_logits(out).float()
    soft_fp32 = set()
    fused = 0
    for mod, op, _din, dout in rec.events:
        if op in FUSED_OPS:
            fused += 1
        elif op in SOFTMAX_OPS:
            if _is_half(dout):
                msg = f"{op.lstrip('_')} in {dout} inside {mod or '<root>'} under bf16 autocast"
                if op in ("_log_softmax", "log_softmax", "cross_entropy") and not mod:
                    warns.append((msg + " (cross-entropy on 16-bit logits)", mod or None))
                else:
                    fails.append((msg, mod or None))
            else:
                soft_fp32.add(mod)
        elif op in STAT_OPS and _is_half(dout):
            owner = _under(mod, norm_names)
            if owner is not None:
                fails.append((f"{owner} computes {op} in {dout} under bf16 autocast", owner))
    finite = bool(torch.isfinite(logits).all())
    ref_loss = Target.ce_loss(ref_out)
    loss = Target.ce_loss(out)
    rel = None
    if ref_loss is not None and loss is not None:
        a, b = float(ref_loss), float(loss)
        rel = abs(b - a) / max(abs(a), 1e-12)
        data.update(loss_fp32=a, loss_bf16=b, loss_rel_diff=rel)
    data.update(logits_max_diff=float((logits - ref_logits).abs().max()),
                logits_std=float(ref_logits.std()), softmax_fp32_modules=sorted(soft_fp32),
                fused_kernels=fused)
    if not finite:
        fails.append(("logits are not finite under bf16 autocast (finite in fp32)", None))
    elif rel is not None and (not math.isfinite(rel) or rel > 0.05):
        warns.append((f"bf16 loss differs from fp32 by {100 * rel:.1f}%", None))
    ev = (f"under bf16 autocast {len(soft_fp32)} module(s) run softmax in fp32, {fused} fused "
          f"SDPA/norm kernel call(s)")
    if rel is not None:
        ev += f"; CE {data['loss_bf16']:.4f} vs {data['loss_fp32']:.4f} fp32 ({100 * rel:.2f}%)"
    return ev
