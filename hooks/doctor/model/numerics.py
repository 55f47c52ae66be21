"""Check 9: numerics under bf16 — normalisation statistics in fp32, attention softmax in fp32.

Which autocast rules apply (``torch.amp`` op reference; CPU and CUDA lists differ): CUDA
autocast runs ``softmax``, ``log_softmax``, ``pow``, ``rsqrt``, ``sum``, ``layer_norm`` and the
losses in fp32; CPU autocast runs only the losses (``cross_entropy``/``nll_loss``...) and a few
others in fp32 and keeps ``softmax``, ``pow``, ``rsqrt``, ``mean`` in their input's dtype; an
op called with an explicit ``dtype=`` is never autocast. So a softmax that relies on autocast
to upcast it runs in fp32 on CUDA and in bf16 on CPU.

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

from hooks.doctor.model.blame import one_line, raised_by_model
from hooks.doctor.model.registry import DoctorOptions, check
from hooks.doctor.model.result import Outcome
from hooks.doctor.model.target import NotApplicable, SkipCheck, Target, fmt
from hooks.modelroles.parts import norm_scale
from hooks.tensors.walk import ModuleStack

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
        self.events: list[tuple[str, str, str, str, str]] = []
        self._modules = ModuleStack(model)

    def remove(self) -> None:
        self._modules.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in self.watch:
            t_in = next((a for a in args if isinstance(a, torch.Tensor)), None)
            asked = (kwargs or {}).get("dtype")
            self.events.append((self._modules.current or "", name, _dtype(t_in),
                                _dtype(out), str(asked).removeprefix("torch.")
                                if isinstance(asked, torch.dtype) else ""))
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
    w = norm_scale(norm)
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
    half = sorted({op for _, op, _, out, _ in rec.events if op in STAT_OPS and _is_half(out)})
    return dict(half_stats=half, rel_error=err, finite=finite, out_dtype=str(y.dtype))


@check(9, "numerics", "bf16 numerics")
def numerics(t: Target, o: DoctorOptions) -> Outcome:
    """Normalisation statistics and attention softmax under bf16.

    1. Every norm module on a bf16 large-activation input (the activations of a bf16 model):
       statistics ops must run in fp32, the output must be finite and within
       :data:`NORM_REL_TOL` of the fp32 result. Statistics in bf16 fail.
    2. The model under ``torch.autocast(bfloat16)`` on its device, on the batch's first row (up
       to :data:`AUTOCAST_TOKENS` tokens): norms keep fp32 statistics (bf16 fails); each
       softmax inside an attention module is fp32, a fused kernel (SDPA accumulates in fp32),
       or left to autocast (its scores' dtype: CUDA autocast runs softmax in fp32, CPU
       autocast keeps bf16; said in the evidence, not a failure). A softmax asked for in bf16
       (``dtype=``, which no autocast rule changes) fails. Softmax calls elsewhere (a router,
       HF's aux loss at the root, the loss) are not judged. The loss is compared with the fp32
       loss.
    """
    norms = t.norm_modules()
    attn_names = {a.name for a in t.attention_layers()}
    data: dict[str, Any] = {"norms": {}}
    fails: list[tuple[str, str | None]] = []
    warns: list[tuple[str, str | None, str]] = []
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
                          f"(relative) on a bf16 input", name, "compute in fp32 and cast back"))

    model_ev, crashed = _autocast_run(t, {n for n, _ in norms}, attn_names, fails, warns, data)
    data["worst_norm_rel_error"] = worst_err
    norm_ev = (f"{len(norms)} norm(s) keep fp32 statistics on a bf16 input with |x| ≤ "
               f"{30 * LARGE:g} (worst rel. error {fmt(worst_err, 2)})" if norms
               else "no RMSNorm/LayerNorm modules to test")
    ev = f"{norm_ev}; {model_ev}"
    if fails:
        msg, mod = fails[0]
        more = f" (+{len(fails) - 1} more)" if len(fails) > 1 else ""
        hint = ("compute the softmax in fp32: softmax(scores, dim=-1, dtype=torch.float32)"
                ".to(v.dtype), as HF Llama's eager attention does" if mod in attn_names else
                "upcast before the statistics: x.float() for mean(x²)/rsqrt, then cast back "
                "(HF LlamaRMSNorm does)")
        return Outcome.fail(f"{msg}{more}; {ev}", hint, mod, **data)
    if crashed:
        raise SkipCheck(f"{model_ev}; {norm_ev}")
    if warns:
        msg, mod, hint = warns[0]
        more = f" (+{len(warns) - 1} more)" if len(warns) > 1 else ""
        return Outcome.warn(f"{msg}{more}; {ev}", hint, mod, **data)
    if not norms and not attn_names:
        raise NotApplicable(f"no attention and no RMSNorm/LayerNorm modules: nothing whose "
                            f"precision this check judges ({model_ev})")
    return Outcome.ok(ev, **data)


class _AutocastSeen:
    """What the ops recorded under autocast show: the attention/norm modules whose softmax ran
    in fp32, in the scores' dtype (implicit) or in bf16 asked for (forced), those that ran a
    fused SDPA, bf16 softmax calls elsewhere by module, and the count of fused kernels."""

    def __init__(self) -> None:
        self.soft_fp32: set[str] = set()
        self.implicit: set[str] = set()
        self.forced: set[str] = set()
        self.sdpa: set[str] = set()
        self.elsewhere: dict[str, int] = {}
        self.fused = 0


def _judge_autocast_ops(events: list, norm_names: set[str], attn_names: set[str], dev: str,
                        rules: str, fails: list) -> _AutocastSeen:
    """Sort the recorded ops by the module they ran in and their output dtype; a softmax
    forced to bf16 in attention or a norm, and a norm statistic computed in half precision,
    are appended to ``fails``."""
    seen = _AutocastSeen()
    for mod, op, _din, dout, asked in events:
        attn = _under(mod, attn_names)
        norm = _under(mod, norm_names)
        if op in FUSED_OPS:
            seen.fused += 1
            if attn and op == "scaled_dot_product_attention":
                seen.sdpa.add(attn)
            continue
        if op in SOFTMAX_OPS:
            if not _is_half(dout):
                if attn or norm:
                    seen.soft_fp32.add(attn or norm)
                continue
            if not (attn or norm):
                seen.elsewhere[mod or "<root>"] = seen.elsewhere.get(mod or "<root>", 0) + 1
                continue
            owner = attn or norm
            name = op.lstrip("_")
            if asked or dev != "cpu":
                how = (f"{name}(..., dtype={asked}) asked for explicitly" if asked
                       else f"{name} in {dout} under CUDA bf16 autocast")
                fails.append((f"{owner}: {how}: {dout} attention probabilities under CPU and "
                              "CUDA autocast alike (an explicit dtype is never autocast)", owner))
                seen.forced.add(owner)
            else:
                seen.implicit.add(owner)  # CPU autocast keeps it in bf16, CUDA's runs it in fp32
        elif op in STAT_OPS and _is_half(dout) and norm is not None:
            fails.append((f"{norm} computes {op} in {dout} under {rules} bf16 autocast ("
                          f"{rules} autocast keeps {op} in its input's dtype)", norm))
    return seen


def _compare_autocast(t: Target, batch: Any, ref_out: Any, ref_logits: torch.Tensor | None,
                      out: Any, data: dict[str, Any]) -> tuple[bool, float | None]:
    """Compare the bf16 autocast output with the fp32 one: whether the logits are finite and
    the loss's relative difference (None without a loss to compare); the figures go to
    ``data``."""
    logits = t.logits(out)
    finite = logits is None or bool(torch.isfinite(logits.float()).all())
    rel = None
    try:
        ref_loss, loss = t.loss(ref_out, batch), t.loss(out, batch)
    except SkipCheck:
        ref_loss = loss = None
    if ref_loss is not None and loss is not None and not ref_loss.fallback:
        a, b = float(ref_loss.loss), float(loss.loss)
        rel = abs(b - a) / max(abs(a), 1e-12)
        data.update(loss_fp32=a, loss_bf16=b, loss_rel_diff=rel, loss_source=ref_loss.source)
    if logits is not None and ref_logits is not None:
        data.update(logits_max_diff=float((logits.float() - ref_logits.float()).abs().max()),
                    logits_std=float(ref_logits.float().std()))
    return finite, rel


def _autocast_evidence(seen: _AutocastSeen, attn_names: set[str], rules: str,
                       rel: float | None, data: dict[str, Any]) -> str:
    """The evidence text of the autocast run: how each attention's softmax ran, the bf16
    softmax calls outside attention and norms, and the loss against fp32."""
    ran = [f"{len(seen.sdpa)} fused SDPA (fp32 accumulation)"] if seen.sdpa else []
    if seen.soft_fp32:
        ran.append(f"{len(seen.soft_fp32)} softmax in fp32")
    if seen.forced:
        ran.append(f"{len(seen.forced)} softmax in bf16")
    if seen.implicit:
        implicit = seen.implicit
        names = ", ".join(sorted(implicit)[:2]) + (", ..." if len(implicit) > 2 else "")
        ran.append(f"{len(implicit)} softmax in the scores' dtype ({names}): fp32 under CUDA "
                   "autocast (softmax is on its fp32 list), bf16 under CPU autocast (it is not)")
    if attn_names:
        ev = (f"under {rules} bf16 autocast, {len(attn_names)} attention module(s): "
              + ("; ".join(ran) or "no softmax seen"))
    else:
        ev = f"under {rules} bf16 autocast the model ran"
    elsewhere = seen.elsewhere
    if elsewhere:
        ev += (f"; {sum(elsewhere.values())} bf16 softmax call(s) outside attention and norms "
               f"(in {', '.join(sorted(elsewhere)[:2])}: a router or a loss) not judged")
    if rel is not None:
        ev += f"; loss {data['loss_bf16']:.4f} vs {data['loss_fp32']:.4f} fp32 ({100 * rel:.2f}%)"
    return ev


def _autocast_run(t: Target, norm_names: set[str], attn_names: set[str], fails: list,
                  warns: list, data: dict[str, Any]) -> tuple[str, bool]:
    """Part 2 of :func:`numerics`: the batch under bf16 autocast vs fp32. Appends findings to
    ``fails``/``warns`` and measurements to ``data``; returns the evidence text and whether the
    autocast run raised inside the model or PyTorch."""
    dev = t.device.type
    if dev not in ("cpu", "cuda"):
        return f"autocast not tested on device {dev}", False
    rules = dev.upper()
    ids = t.input_ids
    if ids is not None:
        batch = t.batch_with(ids=ids[:1, :AUTOCAST_TOKENS], targets="rewrite")
    elif t.args or t.kwargs:
        batch = t.batch
    else:
        return "autocast not tested (no batch)", False
    with t.mode(False), torch.no_grad():
        ref_out = t.run(batch)
        ref_logits = t.logits(ref_out)
        if ref_logits is not None and not bool(torch.isfinite(ref_logits).all()):
            return "autocast not tested: the fp32 logits are already not finite", False
        rec = OpDtypeRecorder(t.model, STAT_OPS | SOFTMAX_OPS | FUSED_OPS)
        try:
            with rec, torch.autocast(dev, dtype=torch.bfloat16):
                out = t.run(batch)
        except Exception as exc:
            where = raised_by_model(exc, __file__, t.module_names())
            if where is None:
                raise
            data["autocast_error"] = one_line(exc)
            return (f"under {rules} bf16 autocast the model raised {one_line(exc, 120)} "
                    f"({where}): an op PyTorch's {rules} autocast does not support, not a "
                    "mistake in the model"), True
        finally:
            rec.remove()
    seen = _judge_autocast_ops(rec.events, norm_names, attn_names, dev, rules, fails)
    finite, rel = _compare_autocast(t, batch, ref_out, ref_logits, out, data)
    data.update(softmax_fp32_modules=sorted(seen.soft_fp32), sdpa_modules=sorted(seen.sdpa),
                softmax_autocast_dtype=sorted(seen.implicit),
                fused_kernels=seen.fused, softmax_elsewhere=seen.elsewhere, autocast_rules=rules)
    if not finite:
        fails.append(("logits are not finite under bf16 autocast (finite in fp32)", None))
    elif rel is not None and (not math.isfinite(rel) or rel > 0.05):
        warns.append((f"bf16 loss differs from fp32 by {100 * rel:.1f}%", None,
                      "look for ops that lose precision in bf16"))
    return _autocast_evidence(seen, attn_names, rules, rel, data), False
