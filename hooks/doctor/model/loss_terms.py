"""Check 23: which parameters each loss term reaches, and how much.

The training loss of an MoE model is a sum of terms: the language-model cross-entropy (LM),
the load-balancing (aux) loss, a router z-loss. Each is differentiated alone
(``torch.autograd.grad`` of each term, the graph kept between them), and the gradient norms are
summed per parameter role (:func:`hooks.doctor.model.param_roles.param_roles`).

The finding it exists for: a router that gets ~0 gradient from the LM term, so only the aux
loss trains it. With top-1 routing whose one weight is renormalised (``w / w.sum()``) the
weight is exactly 1 whatever the router says, so the experts' outputs do not depend on the
router's scores and the LM term cannot reach it (Switch Transformers multiplies by the
un-renormalised probability for that reason: Fedus et al. 2021, §2.1).

Dimension legend: P parameters.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from hooks.doctor.model.param_roles import param_roles
from hooks.doctor.model.registry import DoctorOptions, check
from hooks.doctor.model.result import Outcome
from hooks.doctor.model.target import NotApplicable, SkipCheck, Target, fmt

#: Output fields holding loss terms other than the LM one, by the name reported.
TERM_FIELDS = {"aux_loss": ("aux_loss",), "z_loss": ("z_loss", "router_z_loss")}
#: Config fields of each term's coefficient (HF, Megatron, DeepSeek, minillm names).
COEF_FIELDS = {"aux_loss": ("router_aux_loss_coef", "aux_loss_coef", "aux_loss_alpha",
                            "moe_aux_loss_coeff", "router_aux_loss_coefficient"),
               "z_loss": ("router_z_loss_coef", "z_loss_coef", "moe_z_loss_coeff")}
#: A router whose ‖g_LM‖/‖w‖ is below this fraction of the median over the other parameters
#: the LM term reaches gets "~0" from it (a renormalised top-1 weight leaves rounding, ~1e-8).
ROUTER_FLOOR = 1e-5


def _field(out: Any, name: str) -> Any:
    v = getattr(out, name, None)
    if v is None and isinstance(out, dict):
        v = out.get(name)
    return v


def output_terms(out: Any) -> dict[str, torch.Tensor]:
    """The scalar loss terms an output carries besides its loss: ``aux_loss``, ``z_loss``
    (``router_z_loss``), each a 0-dim floating tensor, by the names of :data:`TERM_FIELDS`."""
    terms = {}
    for name, fields in TERM_FIELDS.items():
        for f in fields:
            v = _field(out, f)
            if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point():
                terms[name] = v
                break
    return terms


def coefficient(t: Target, term: str) -> tuple[float | None, str]:
    """The config's coefficient of ``term`` (``aux_loss``/``z_loss``) and its field name;
    (None, "") when the config declares none."""
    for f in COEF_FIELDS.get(term, ()):
        v = t.cfg(f)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v), f
    return None, ""


def split_loss(t: Target, out: Any, total: torch.Tensor) -> tuple[dict[str, torch.Tensor], str]:
    """The training loss ``total`` as the terms it sums: ``{"lm": ..., "aux_loss": ...,
    "z_loss": ...}`` each as it enters ``total`` (times its coefficient), and how they were
    told apart, in words.

    With the cross-entropy reported apart (minillm's ``ce_loss``), LM is it and the rest of
    ``total`` is the other term (with one other term; with two, each is scaled by its declared
    coefficient). Otherwise each term is scaled by its declared coefficient and LM is what is
    left; a term without a declared coefficient is reported unscaled and LM is ``total``.
    """
    terms = output_terms(out)
    ce = Target.ce_loss(out)
    if ce is not None and len(terms) == 1:
        (name, _), = terms.items()
        return {"lm": ce, name: total - ce}, f"lm = out.ce_loss, {name} = loss - ce_loss"
    comps: dict[str, torch.Tensor] = {}
    how = []
    lm = ce if ce is not None else total
    for name, v in terms.items():
        c, f = coefficient(t, name)
        comps[name] = v * c if c is not None else v
        how.append(f"{name} × {f} ({c:g})" if c is not None else f"{name} (no coefficient)")
        if ce is None and c is not None:
            lm = lm - comps[name]
    return {"lm": lm, **comps}, ", ".join(["lm = " + ("out.ce_loss" if ce is not None else
                                                       "loss - the others")] + how)


def _norms(term: torch.Tensor, params: list[torch.Tensor]) -> list[float | None]:
    if not term.requires_grad:
        return [None] * len(params)
    grads = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
    return [None if g is None else float(g.detach().float().norm()) for g in grads]


def _per_role(roles: list[str], norms: list[float | None]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for role, n in zip(roles, norms, strict=True):
        r = out.setdefault(role, dict(tensors=0, reached=0, sq=0.0))
        r["tensors"] += 1
        if n:
            r["reached"] += 1
            r["sq"] += n * n
    for r in out.values():
        r["grad_norm"] = math.sqrt(r.pop("sq"))
    return out


def _router_finding(t: Target, names: list[str], params: list[torch.Tensor],
                    norms: dict[str, list[float | None]],
                    data: dict[str, Any]) -> Outcome | None:
    """A router that the LM term reaches with ~0 (relative to the rest) while another term
    reaches it, or None (a router no term reaches is a cut graph: the gradient-flow check's)."""
    lm = norms["lm"]
    others = {n for k, v in norms.items() if k != "lm"
              for n, g in zip(names, v, strict=True) if g}
    rel = {n: g / w for n, p, g in zip(names, params, lm, strict=True)
           if g and (w := float(p.detach().float().norm())) > 0}
    if not rel:
        return None
    median = statistics.median(rel.values())
    for b in t.moe_blocks():
        for pn, p in b.router.named_parameters():
            name = f"{b.router_name}.{pn}"
            if name not in names or not p.requires_grad or name not in others:
                continue
            r = rel.get(name, 0.0)
            if r < ROUTER_FLOOR * median:
                k = t.cfg("num_experts_per_tok", t.cfg("top_k", getattr(b.router, "top_k", None)))
                why = (" with top-1 routing: a renormalised top-1 weight w/w.sum() is exactly 1"
                       if k == 1 else "")
                data["router_lm"] = {"param": name, "relative": r, "median": median}
                return Outcome.fail(
                    f"{name} gets ‖g‖/‖w‖ = {fmt(r)} from the LM term, against a median "
                    f"{fmt(median)} over the parameters it reaches: only the aux loss trains "
                    f"the router{why}",
                    "the experts' outputs must be weighted by the router's probabilities: do "
                    "not renormalise a single (top-1) weight to 1, multiply by the softmax "
                    "probability (Switch Transformers) or route top-k ≥ 2",
                    b.router_name or None, **data)
    return None


@check(13, "loss-terms", "Gradient per loss term")
def loss_terms(t: Target, o: DoctorOptions) -> Outcome:
    """Differentiate each loss term (LM, aux, z) alone; per term, which parameter roles it
    reaches and the norm of its gradient there. Fails when a router gets ~0 from the LM term
    (:data:`ROUTER_FLOOR`); n/a for a loss of one term."""
    kwargs = {"output_router_logits": True} if t.accepts("output_router_logits") else {}
    with t.mode(True):
        out = t.run(t.batch, **kwargs)
        choice = t.loss(out)
        if choice.fallback:
            raise SkipCheck(f"{choice.describe()}: no training loss to split into terms")
        comps, how = split_loss(t, out, choice.loss)
        if len(comps) < 2:
            raise NotApplicable("the loss has one term (no aux_loss or z_loss in the output): "
                                "the gradient-flow check covers it")
        roles = param_roles(t)
        params_by = dict(t.model.named_parameters())
        keep = [r for r in roles if params_by[r.name].requires_grad]
        names = [r.name for r in keep]
        params = [params_by[n] for n in names]
        norms = {k: _norms(v, params) for k, v in comps.items()}
    per = {k: _per_role([r.role for r in keep], v) for k, v in norms.items()}
    data: dict[str, Any] = dict(terms={k: float(v.detach()) for k, v in comps.items()},
                                split=how, per_role=per)
    found = _router_finding(t, names, params, norms, data)
    if found is not None:
        return found
    parts = []
    for k, roles_k in per.items():
        reached = sum(r["reached"] for r in roles_k.values())
        top = sorted(((r["grad_norm"], role) for role, r in roles_k.items() if r["reached"]),
                     reverse=True)[:3]
        off = ""
        if k != "lm" and reached == 0 and (c := coefficient(t, k))[0] == 0:
            off = f" (off: {c[1]} = 0)"
        parts.append(f"{k} = {fmt(float(comps[k].detach()))} reaches {reached}/{len(names)} "
                     f"tensors{off}" + (" (" + ", ".join(f"{role} {fmt(g)}" for g, role in top)
                                        + ")" if top else ""))
    return Outcome.ok(f"{how}: " + "; ".join(parts), **data)
