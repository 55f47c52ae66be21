"""Check 21: the init report. Each parameter role's std against the model's declared
initializer range and the residual scaling convention, and the residual stream's std by depth.

GPT-2 (Radford et al. 2019, §2.3; HF ``GPT2PreTrainedModel._init_weights``) initialises every
weight N(0, σ²) with σ = ``initializer_range`` and the projections that *write* to the
residual stream (attention output, MLP output: ``c_proj``) with σ/√(2·L), L the number of
layers, so that the residual's variance does not grow with depth. karpathy/llama2.c #579
scaled ``w3`` (an MLP input, which *reads* the residual) instead of ``w2``: a weight that
reads the residual at σ/√(2·L) is that mistake.

Dimension legend: B batch, T sequence, D hidden size, L layers.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hooks.doctor.model.freshness import training_state
from hooks.doctor.model.param_roles import READS_RESIDUAL, RESIDUAL_OUT, ROLES, param_roles
from hooks.doctor.model.registry import DoctorOptions, check
from hooks.doctor.model.result import Outcome
from hooks.doctor.model.target import Target, fmt

#: A weight whose std is off the declared σ by more than this factor (either way) fails.
DECLARED_FACTOR = 3.0
#: Relative tolerance for "std = σ/√(2L)" (a tensor of n entries has a sample std within
#: ~3/√(2n) of the true one: 2 % at n = 10⁴; 15 % leaves room for a truncated normal).
SCALED_TOL = 0.15
#: Roles whose std the declared initializer range sets directly.
DECLARED_ROLES = frozenset({"embedding", "q", "k", "v", "qkv", "kv", "mlp_in", "router"})


@dataclass
class WeightStat:
    """One weight matrix: its role, std, fan-in and size."""

    name: str
    module: str
    role: str
    std: float
    fan_in: int
    numel: int


def num_layers(t: Target) -> int:
    """L: ``num_hidden_layers`` / ``n_layer`` / ``n_layers`` / ``num_layers`` of the config,
    else the number of attention modules (for an encoder-decoder, all of them)."""
    v = t.cfg("num_hidden_layers", t.cfg("n_layer", t.cfg("n_layers", t.cfg("num_layers"))))
    return int(v) if isinstance(v, int) and v > 0 else max(1, len(t.attention_layers()))


def weight_stats(t: Target) -> list[WeightStat]:
    """The std (over all entries, fp32) of every weight of rank ≥ 2, with its role."""
    params = dict(t.model.named_parameters())
    out = []
    for r in param_roles(t):
        p = params[r.name]
        if r.kind != "weight" or p.dim() < 2 or not p.is_floating_point() or p.numel() < 2:
            continue
        x = p.detach().float()
        fan_in = int(p.shape[-1]) if p.dim() == 2 else int(p.shape[-2])
        out.append(WeightStat(r.name, r.module, r.role, float(x.std()), fan_in, p.numel()))
    return out


def _per_role(stats: list[WeightStat]) -> dict[str, dict[str, Any]]:
    by: dict[str, list[float]] = {}
    for s in stats:
        by.setdefault(s.role, []).append(s.std)
    return {role: dict(tensors=len(v), median_std=statistics.median(v), min_std=min(v),
                       max_std=max(v)) for role in ROLES if (v := by.get(role))}


def _decoder_layers(t: Target) -> list[tuple[str, nn.Module]]:
    """The blocks of the residual stream: the children of a ``ModuleList`` that hold an
    attention module, in order (the first such list: the decoder's, or the only one)."""
    attn = [a.name for a in t.attention_layers()]
    for name, m in t.model.named_modules():
        if not isinstance(m, nn.ModuleList):
            continue
        kids = [(f"{name}.{k}" if name else k, c) for k, c in m.named_children()]
        if kids and any(a.startswith(kids[0][0] + ".") for a in attn):
            return kids
    return []


def residual_stds(t: Target) -> list[tuple[str, float]]:
    """The std of each block's output (the residual stream after it), in eval mode on the
    batch, fp32; [] when the blocks are not found or the forward raises."""
    layers = _decoder_layers(t)
    seen: list[tuple[str, float]] = []

    def hook(name):
        def fn(mod, args, out):
            x = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                seen.append((name, float(x.detach().float().std())))
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in layers]
    try:
        with t.mode(False), torch.no_grad():
            t.run(t.batch, use_cache=False)
    except Exception:  # the other checks report a forward that raises
        return []
    finally:
        for h in handles:
            h.remove()
    return seen


def _scaled_readers(stats: list[WeightStat], sigma: float | None,
                    s: float) -> list[tuple[WeightStat, float]]:
    """Weights that read the residual stream but sit at σ_ref/√(2L): σ_ref the declared σ,
    else the median std of the readers of the same fan-in."""
    readers = [w for w in stats if w.role in READS_RESIDUAL]
    out = []
    for w in readers:
        ref = sigma
        if ref is None:
            peers = [x.std for x in readers if x.fan_in == w.fan_in]
            if len(peers) < 3:
                continue
            ref = statistics.median(peers)
        if ref > 0 and abs(w.std / (ref * s) - 1) < SCALED_TOL:
            out.append((w, ref))
    return out


def _judge(stats: list[WeightStat], sigma: float | None, n_layers: int,
           data: dict[str, Any]) -> Outcome | None:
    """The failure of a fresh model's init, or None."""
    s = 1 / math.sqrt(2 * n_layers)
    scaled = _scaled_readers(stats, sigma, s) if s < 1 - 2 * SCALED_TOL else []
    if scaled:
        w, ref = scaled[0]
        unscaled = [x for x in stats if x.role in RESIDUAL_OUT
                    and abs(x.std / (ref * s) - 1) >= SCALED_TOL]
        data["scaled_readers"] = [x.name for x, _ in scaled]
        also = (f"; while {unscaled[0].name} ({unscaled[0].role}), which writes to it, is not "
                f"({fmt(unscaled[0].std)})" if unscaled else "")
        return Outcome.fail(
            f"{w.name} ({w.role}, reads the residual stream) has std {fmt(w.std)} = "
            f"{fmt(ref)}/√(2·{n_layers}){also}",
            "the residual scaling 1/√(2L) went to the wrong projection: GPT-2 scales the "
            "projections that write to the residual stream (attention output, MLP output: "
            "c_proj / o_proj / down_proj / w2), never q/k/v or the MLP's input (karpathy/"
            "llama2.c #579 scaled w3 instead of w2)", w.module or None, **data)
    if sigma is None:
        return None
    for w in stats:
        if w.role in DECLARED_ROLES and w.std > 0 and (
                w.std > DECLARED_FACTOR * sigma or w.std < sigma / DECLARED_FACTOR):
            return Outcome.fail(
                f"{w.name} ({w.role}) has std {fmt(w.std)}, ×{fmt(w.std / sigma)} the declared "
                f"initializer_range {fmt(sigma)}",
                "this weight was not initialised by the model's init (a module's default "
                "init, e.g. nn.Embedding's N(0, 1), or an init that ignores the config): "
                "initialise it N(0, initializer_range²)", w.module or None, **data)
    return None


@check(11, "init", "Init report per role")
def init_report(t: Target, o: DoctorOptions) -> Outcome:
    """Each parameter role's std (median over its tensors) against ``initializer_range`` and
    the GPT-2 residual convention, and the residual stream's std after each block.

    On a freshly initialised model (:func:`hooks.doctor.model.freshness.training_state`) it
    fails when a weight that reads the residual stream (q/k/v, MLP input) sits at σ/√(2L)
    (the scaling meant for the output projections, karpathy/llama2.c #579), or when a weight
    the declared range sets (embedding, q/k/v, MLP input, router) is more than
    :data:`DECLARED_FACTOR` × off it. A trained model is reported without a verdict.
    """
    stats = weight_stats(t)
    if not stats:
        return Outcome.skip("the model has no weight matrices to report on")
    sigma = t.cfg("initializer_range")
    sigma = float(sigma) if isinstance(sigma, (int, float)) and sigma > 0 else None
    n_layers = num_layers(t)
    roles = _per_role(stats)
    depth = residual_stds(t)
    state = training_state(t)
    data: dict[str, Any] = dict(roles=roles, initializer_range=sigma, layers=n_layers,
                                residual_scale=1 / math.sqrt(2 * n_layers),
                                residual_std=[[n, v] for n, v in depth],
                                weights={w.name: [w.role, w.std] for w in stats},
                                training=state.to_dict())
    table = ", ".join(f"{r} {fmt(v['median_std'])}" for r, v in roles.items())
    outs = [roles[r]["median_std"] for r in RESIDUAL_OUT if r in roles]
    conv = ""
    if sigma and outs:
        ratio = statistics.median(outs) / sigma
        conv = (f"; output projections at ×{fmt(ratio)} σ (GPT-2 scaling 1/√(2·{n_layers}) = "
                f"{fmt(1 / math.sqrt(2 * n_layers))})")
    resid = (f"; residual std by depth {' → '.join(fmt(v, 2) for _, v in depth)}"
             if depth else "")
    declared = f"initializer_range {fmt(sigma)}" if sigma else "no initializer_range declared"
    ev = f"std per role: {table} ({declared}){conv}{resid}"
    if state.trained:
        return Outcome.ok(f"trained model, init not judged ({state.reasons[0]}); {ev}", **data)
    found = _judge(stats, sigma, n_layers, data)
    if found is not None:
        found.evidence = f"{found.evidence}; {ev}"
        return found
    return Outcome.ok(ev, **data)
