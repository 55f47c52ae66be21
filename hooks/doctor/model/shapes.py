"""Check 22: what the shapes promise. A per-head norm gives every head unit RMS; router
probabilities are a distribution over the E experts of each token (each row in [0, 1],
summing to 1); an aux (load-balancing) loss is ≥ 0; RoPE rotates as many channels per head as
the config asks (``partial_rotary_factor``, ``rotary_pct``, ``rotary_dim``).

Each is measured on the model's own forward: the norm's output through a forward hook, the
router's probabilities as the model computes them (every softmax taken inside an MoE block
whose last dimension is E, seen through a :class:`torch.overrides.TorchFunctionMode`), the
loss from the output, the rotated channels from the rotary module's ``inv_freq`` (one
frequency per rotated pair), else from the distinct frequencies of the table the traced forward
saw rotate the queries or keys.

Dimension legend: N tokens, E experts, H heads, Dh head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from hooks.doctor.model.loss_terms import output_terms
from hooks.doctor.model.registry import DoctorOptions, check
from hooks.doctor.model.result import Outcome
from hooks.doctor.model.target import AttentionInfo, NotApplicable, Target, fmt
from hooks.modelroles.named import K_NORM_NAMES, Q_NORM_NAMES
from hooks.modelroles.parts import norm_scale

#: A per-head RMS this far from 1 (relative) breaks the per-head promise (an RMSNorm's eps
#: moves it by eps/(2·mean x²), ~1e-5 for activations of RMS 0.1).
HEAD_RMS_TOL = 0.05
#: Child names of the query/key norms (hooks.modelroles.named's, kept here as an alias): the
#: norms themselves are the attention roles' ``q_norm``/``k_norm`` (traced or named).
QK_NORM_NAMES = (*Q_NORM_NAMES, *K_NORM_NAMES)
_SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax, torch.nn.functional.softmax}


def _qk_norms(t: Target) -> list[tuple[str, nn.Module, AttentionInfo]]:
    """The q and k norms of every attention module (its role's ``q_norm``, ``k_norm``: the
    norms on the way from the projection to the scores) that have a scale
    (:func:`hooks.modelroles.parts.norm_scale`)."""
    modules = dict(t.model.named_modules())
    roles = t.roles()
    out = []
    for a in t.attention_layers():
        role = roles.attention_of(a.name)
        for n in (role.q_norm, role.k_norm) if role is not None else ():
            m = modules.get(n) if n is not None else None
            if m is not None and norm_scale(m) is not None:
                out.append((n, m, a))
    return out


def head_rms(t: Target) -> tuple[list[str], Outcome | None]:
    """Per-head RMS of each q/k norm's output divided by its weight, on the batch.

    A norm whose weight has Dh entries promises unit RMS per head; one whose weight spans
    every head (H·Dh, OLMoE's) promises it only jointly and is reported as such.

    Returns:
        (lines for the evidence, the failure or None).
    """
    norms = _qk_norms(t)
    if not norms:
        return [], None
    seen: dict[str, torch.Tensor] = {}

    def hook(name, w):
        def fn(mod, args, out):
            y = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(y, torch.Tensor) and y.shape[-1] % w.numel() == 0:
                z = y.detach().float().reshape(-1, w.numel()) / w.detach().float()
                seen[name] = z.pow(2).mean(-1).sqrt()  # (rows·heads,)
        return fn

    handles = []
    for name, m, a in norms:
        w = norm_scale(m)
        if a.head_dim and w.numel() == a.head_dim and bool((w.detach().abs() > 1e-6).all()):
            handles.append(m.register_forward_hook(hook(name, w)))
    try:
        with t.mode(False), torch.no_grad():
            t.run(t.batch, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    lines, worst, first_bad = [], (0.0, "", 0.0, 0.0), None
    for name, rms in seen.items():  # in the order they ran
        dev = float((rms - 1).abs().max())
        if dev > worst[0]:
            worst = (dev, name, float(rms.min()), float(rms.max()))
        if dev > HEAD_RMS_TOL and first_bad is None:
            first_bad = (dev, name, float(rms.min()), float(rms.max()))
    joint = [n for n, m, a in norms if a.head_dim and norm_scale(m).numel() != a.head_dim]
    if seen:
        lines.append(f"{len(seen)} per-head q/k norm(s): per-head RMS within "
                     f"{fmt(worst[0])} of 1")
    if joint:
        lines.append(f"{len(joint)} q/k norm(s) span all heads by declaration ({joint[0]}: "
                     "weight of H·Dh)")
    if first_bad is not None:
        _, name, lo, hi = first_bad
        return lines, Outcome.fail(
            f"{name} has a weight of Dh = {_head_dim_of(norms, name)} entries (a per-head norm) "
            f"but its output's per-head RMS (over Dh, weight divided out) ranges "
            f"{fmt(lo)}..{fmt(hi)}, not 1",
            "the norm is computed across heads (over H·Dh) instead of per head: normalise "
            "the last dimension of the (…, H, Dh) tensor (Qwen3's q_norm/k_norm)", name)
    return lines, None


def _head_dim_of(norms: list, name: str) -> int:
    """Dh of the attention that owns the norm ``name``."""
    return next(a.head_dim for n, _, a in norms if n == name)


class _RouterSoftmax(TorchFunctionMode):
    """Keeps every softmax output whose last dimension is E taken while ``inside`` is set."""

    def __init__(self, widths: set[int]) -> None:
        super().__init__()
        self.widths = widths
        self.inside: list[str] = []
        self.seen: list[tuple[str, torch.Tensor]] = []

    def leave(self) -> None:
        """The MoE block's forward ended (returns None: a forward hook's value would replace
        the block's output)."""
        self.inside.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func in _SOFTMAX and self.inside and isinstance(out, torch.Tensor)
                and out.dim() >= 1 and out.shape[-1] in self.widths):
            self.seen.append((self.inside[-1], out.detach().float()))
        return out


def router_probs(t: Target) -> tuple[list[str], Outcome | None]:
    """Every softmax over E taken inside an MoE block: rows in [0, 1] summing to 1."""
    blocks = [b for b in t.moe_blocks() if b.num_experts > 1]
    if not blocks:
        return [], None
    mode = _RouterSoftmax({b.num_experts for b in blocks})
    mods = dict(t.model.named_modules())
    handles = []
    for b in blocks:
        m = mods[b.name]
        handles.append(m.register_forward_pre_hook(lambda mod, a, n=b.name: mode.inside.append(n)))
        handles.append(m.register_forward_hook(lambda mod, a, o: mode.leave()))
    try:
        with t.mode(False), torch.no_grad(), mode:
            t.run(t.batch, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if not mode.seen:
        return ["no softmax over the E experts inside the MoE blocks (a sigmoid router, or "
                "one scoring the top-k only)"], None
    for name, p in mode.seen:
        rows = p.reshape(-1, p.shape[-1])
        sums = rows.sum(-1)
        tol = 1e-3 if p.dtype != torch.float64 else 1e-9
        bad_sum = float((sums - 1).abs().max())
        lo, hi = float(rows.min()), float(rows.max())
        if bad_sum > tol or lo < -tol or hi > 1 + tol:
            return [], Outcome.fail(
                f"{name}: router probabilities (a softmax of width E = {p.shape[-1]}) have "
                f"rows summing to {fmt(float(sums.min()))}..{fmt(float(sums.max()))} and "
                f"values in [{fmt(lo)}, {fmt(hi)}]; each token's row must sum to 1",
                "the softmax runs over the wrong dimension (tokens instead of experts: "
                "softmax(router_logits, dim=0) on an (N, E) tensor); take it over the last, "
                "the E axis", name or None)
    return [f"{len(mode.seen)} router softmax(es) over E: rows sum to 1, values in [0, 1]"], None


def aux_sign(t: Target) -> tuple[list[str], Outcome | None]:
    """The output's ``aux_loss`` (and ``z_loss``) is ≥ 0."""
    with t.mode(True), torch.no_grad():
        out = t.run(t.batch, **({"output_router_logits": True}
                                if t.accepts("output_router_logits") else {}))
    terms = {k: v for k, v in output_terms(out).items() if k != "loss"}
    for k, v in terms.items():
        x = float(v)
        if x < -1e-6 * max(1.0, abs(x)):
            return [], Outcome.fail(
                f"{k} = {fmt(x)} < 0: a load-balancing or z-loss is a product of fractions "
                "and probabilities (or a square) and cannot be negative",
                f"a sign error in the {k} (minimising it now rewards imbalance): check its "
                "formula and its coefficient's sign")
    return [f"{k} = {fmt(float(v))} ≥ 0" for k, v in terms.items()], None


def declared_rotary_dim(t: Target, head_dim: int) -> tuple[int, str] | None:
    """Channels per head the config asks RoPE to rotate, and the field that says so."""
    rd = t.cfg("rotary_dim")
    if isinstance(rd, int) and rd > 0:
        return rd, f"rotary_dim = {rd}"
    for field in ("partial_rotary_factor", "rotary_pct"):
        f = t.cfg(field)
        if isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1:
            return int(head_dim * f), f"{field} = {f:g} × head_dim {head_dim}"
    return None


def rotary_channels(t: Target) -> tuple[list[str], Outcome | None]:
    """Channels RoPE rotates per head against the config's rotary dim: 2·len(inv_freq) of the
    rotary module (:meth:`Target.rotary`), else 2 × the distinct frequencies of the table the
    traced forward saw rotate the queries or keys (:class:`hooks.modelroles.Rotary`)."""
    found, rot = t.rotary(), t.rotary_module()
    attn = [a for a in t.attention_layers() if a.head_dim]
    if found is None or rot is None or not attn:
        return [], None
    name = rot[0] or "<root>"
    inv = getattr(rot[1], "inv_freq", None)
    if isinstance(inv, torch.Tensor):
        got, source = 2 * inv.numel(), f"inv_freq has {inv.numel()} frequencies"
    elif found.channels:
        got, source = found.channels, f"its table has {found.channels // 2} frequencies"
    else:
        return [f"{name} has no inv_freq to count its rotated channels"], None
    head_dim = attn[0].head_dim
    want = declared_rotary_dim(t, head_dim)
    if want is None:
        return [f"RoPE rotates {got} of {head_dim} channels per head (no partial rotary "
                "declared)"], None
    n, why = want
    if got != n:
        return [], Outcome.fail(
            f"{name} rotates {got} channels per head ({source}) but the config asks for {n} "
            f"({why})",
            "the rotary table was built for the whole head: build it for head_dim × "
            "partial_rotary_factor channels and rotate only those (HF "
            "apply_rotary_pos_emb splits q into rotated and passed-through parts)",
            rot[0] or None)
    return [f"RoPE rotates {got} of {head_dim} channels per head, as {why}"], None


@check(12, "shapes", "What the shapes promise")
def shapes(t: Target, o: DoctorOptions) -> Outcome:
    """Per-head RMS after a per-head q/k norm, router probability rows, aux loss ≥ 0 and the
    number of channels RoPE rotates (see the module docstring); n/a for a model with none of
    them."""
    lines: list[str] = []
    data: dict[str, Any] = {}
    for name, part in (("head_rms", head_rms), ("router_probs", router_probs),
                       ("aux_sign", aux_sign), ("rotary", rotary_channels)):
        got, failure = part(t)
        data[name] = got
        if failure is not None:
            failure.data.update(data)
            return failure
        lines.extend(got)
    if not lines:
        raise NotApplicable("no per-head norm, MoE router, aux loss or rotary embedding to "
                            "measure")
    return Outcome.ok("; ".join(lines), **data)
