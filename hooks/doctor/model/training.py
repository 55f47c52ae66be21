"""Checks 5, 7 and 10: gradient flow (incl. the router's aux-loss gradient), non-finite values,
and overfitting one batch."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from hooks.doctor.model.loss_terms import coefficient
from hooks.doctor.model.registry import DoctorOptions, check
from hooks.doctor.model.result import Outcome
from hooks.doctor.model.target import MoEInfo, SkipCheck, Target, fmt
from hooks.doctor.model.unused import declared_unused
from hooks.doctor.verdicts import (
    EXPLODING_NORM,
    EXPLODING_RATIO,
    VANISHING_NORM,
    VANISHING_RATIO,
    param_verdict,
)
from hooks.engine.capture import capture
from hooks.tensors.norms import combine_norms


def _aux_loss(out: Any) -> torch.Tensor | None:
    aux = getattr(out, "aux_loss", None)
    if aux is None and isinstance(out, dict):
        aux = out.get("aux_loss")
    return aux if isinstance(aux, torch.Tensor) and aux.dim() == 0 else None


def _grad_kwargs(t: Target) -> dict[str, Any]:
    """HF MoE models return their aux loss only with ``output_router_logits=True``."""
    return {"output_router_logits": True} if "output_router_logits" in t.forward_params else {}


def _first_tensor(out: Any) -> torch.Tensor | None:
    """The first tensor of a module's output (a tensor, a tuple/list, a dict or ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return out
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) \
        else ()
    for x in items:
        t = _first_tensor(x)
        if t is not None:
            return t
    return None


def _out_rows(out: Any) -> int | None:
    """Rows of a module's first output tensor: its leading dimensions
    (``hooks.doctor.verdicts``)."""
    t = _first_tensor(out)
    if t is None:
        return None
    return math.prod(t.shape[:-1]) if t.dim() > 1 else (t.shape[0] if t.dim() else 1)


def _aux_free(moe: list[MoEInfo]) -> str | None:
    """The router of an aux-loss-free MoE (DeepSeek-V3: a score-correction bias balances the
    load, outside the gradient), or None."""
    for b in moe:
        for n, _ in list(b.router.named_parameters()) + list(b.router.named_buffers()):
            if "correction_bias" in n:
                return f"{b.router_name}.{n}"
    return None


def _forward_recording(t: Target) -> tuple[Any, set[str], dict[str, int], int]:
    """Run the model's forward in train mode, recording which modules ran and the rows
    (tokens) each produced. Returns ``(out, called, rows, most)``: ``most`` is the largest
    row count of any one call, the batch's rows for the few-tokens rule."""
    model = t.model
    called: set[str] = set()
    rows: dict[str, int] = {}  # rows (tokens) each module produced: the few-tokens rule
    most = [0]

    def seen(name: str, out: Any) -> None:
        called.add(name)
        n = _out_rows(out)
        if n is not None:
            rows[name] = rows.get(name, 0) + n
            most[0] = max(most[0], n)

    handles = [m.register_forward_hook(lambda mod, a, out, n=n: seen(n, out))
               for n, m in model.named_modules()]
    try:
        with t.mode(True):
            out = t.run(t.batch, **_grad_kwargs(t))
    finally:
        for h in handles:
            h.remove()
    return out, called, rows, most[0]


def _router_aux_check(moe: list[MoEInfo], out: Any, data: dict[str, Any],
                      coef: tuple[float | None, str] = (None, "")
                      ) -> tuple[list[str], tuple[str, str] | None]:
    """The routers' gradient from the aux loss alone. Returns the messages to report and the
    first failure as ``(message, module)`` or None; stores the per-router grad norms in
    ``data["router_aux_grad_norms"]`` when it computed them. ``coef`` is the config's aux
    coefficient and its field (:func:`hooks.doctor.model.loss_terms.coefficient`): at 0 the
    aux loss is switched off, not detached."""
    router_msgs: list[str] = []
    router_fail = None
    if not moe:
        return router_msgs, router_fail
    aux = _aux_loss(out)
    rparams = [(f"{b.router_name}.{n}", p) for b in moe
               for n, p in b.router.named_parameters() if p.requires_grad]
    free = _aux_free(moe)
    if coef[0] == 0 and rparams:
        router_msgs.append(f"aux loss switched off ({coef[1]} = 0): routers are trained by the "
                           "LM term alone, by configuration")
    elif not rparams:
        router_msgs.append("routers are frozen: aux-loss gradient not checked")
    elif aux is None and free:
        router_msgs.append(f"no aux loss, by design: {free} balances the load without one "
                           "(DeepSeek-V3's aux-loss-free routing); aux-loss gradient n/a")
    elif aux is None:
        router_msgs.append("no aux_loss in the output: routers get no load-balancing signal")
    elif not aux.requires_grad:
        router_fail = (f"aux_loss = {fmt(float(aux))} does not require grad: it is "
                       f"detached from the {len(moe)} router(s)", moe[0].router_name)
    elif rparams:
        grads = torch.autograd.grad(aux, [p for _, p in rparams], retain_graph=True,
                                    allow_unused=True)
        norms = {}
        for (n, _), g in zip(rparams, grads, strict=True):
            gn = None if g is None else float(g.float().norm())
            norms[n] = gn
            if router_fail is None and (gn is None or gn == 0.0 or not math.isfinite(gn)):
                what = "no" if gn is None else ("zero" if gn == 0 else f"non-finite ({gn})")
                router_fail = (f"{n} gets {what} gradient from aux_loss",
                               n.rpartition(".")[0])
        data["router_aux_grad_norms"] = norms
        if router_fail is None:
            vals = [v for v in norms.values() if v is not None]
            router_msgs.append(f"aux_loss reaches all {len(rparams)} router weight(s) "
                               f"(grad norm {fmt(min(vals))}..{fmt(max(vals))})")
    return router_msgs, router_fail


class _ParamGrads:
    """The per-parameter tally of one backward: broken, idle (unused experts), ok and frozen
    tensors, the finite norms, and the parameters flagged by the gradients view's verdict."""

    def __init__(self) -> None:
        self.broken: list[tuple[str, str, str | None]] = []
        self.idle: list[str] = []
        self.n_ok = 0
        self.n_frozen = 0
        self.ok_norms: list[float] = []
        self.flagged: dict[str, list[str]] = {"vanishing": [], "exploding": [], "few": []}
        #: (parameter, why) of those never used by the model's own declaration
        self.by_design: list[tuple[str, str]] = []


def _tally_param_grads(t: Target, moe: list[MoEInfo], called: set[str],
                       rows: dict[str, int], most: int,
                       owners: dict[int, list[str]]) -> _ParamGrads:
    """Judge every trainable parameter's gradient after the backward: missing, all-zero or
    non-finite ones are broken (unless an expert that got no tokens: idle); finite ones are
    judged by :func:`hooks.doctor.verdicts.param_verdict`."""
    expert_prefixes = tuple(f"{b.name}.experts." if b.name else "experts." for b in moe)
    r = _ParamGrads()
    for name, p in t.model.named_parameters():
        if not p.requires_grad:
            r.n_frozen += 1
            continue
        mods = owners.get(id(p), [name.rpartition(".")[0]])
        was_called = any(m in called for m in mods)
        g = p.grad
        if g is None or not bool(g.any()):
            if not was_called and name.startswith(expert_prefixes):
                r.idle.append(name)  # an expert that got no tokens: routing's business
                continue
            why = declared_unused(t, mods[0]) if g is None and not was_called else None
            if why is not None:
                r.by_design.append((name, why))
                continue
            if g is None:
                what = ("no gradient: its module never ran in the forward" if not was_called
                        else "no gradient (not in the loss's graph)")
            else:
                what = "an all-zero gradient"
            r.broken.append((name, what, mods[0] or None))
            continue
        gn = float(g.float().norm())
        if not math.isfinite(gn):
            nan = int(torch.isnan(g).sum())
            r.broken.append((name, f"a non-finite gradient ({nan} NaN of {g.numel()})",
                             mods[0] or None))
            continue
        r.ok_norms.append(gn)
        r.n_ok += 1
        # the gradients view's verdict, on the same numbers (hooks.doctor.verdicts)
        wn = float(p.detach().float().norm())
        verdict = param_verdict(
            _Grad(gn, gn / wn if wn else None),
            rows=sum(rows.get(m, 0) for m in mods) if was_called else None,
            batch_rows=most or None)
        if verdict in r.flagged:
            r.flagged[verdict].append(name)
    return r


def _grad_flow_head(src: str, data: dict[str, Any], r: _ParamGrads) -> str:
    """Fill ``data`` with the tally and return the evidence's first sentence."""
    total = r.n_ok + len(r.broken)
    global_norm = combine_norms(r.ok_norms)
    data.update(trainable=total + len(r.idle), ok=r.n_ok, frozen=r.n_frozen,
                grad_norm=global_norm,
                broken=[{"param": n, "problem": w} for n, w, _ in r.broken],
                idle_experts=r.idle, unused_by_design=[list(x) for x in r.by_design],
                vanishing=r.flagged["vanishing"],
                exploding=r.flagged["exploding"], few_tokens=r.flagged["few"])
    head = f"{src} ({fmt(data['loss'])}): {r.n_ok}/{total} trainable tensors got finite " \
           f"non-zero gradients (global norm {fmt(global_norm)})"
    if r.idle:
        experts = sorted({n.rsplit(".", 2)[0] for n in r.idle})
        head += (f", not counting {len(r.idle)} tensor(s) of {len(experts)} expert(s) that "
                 f"received no tokens in this batch")
    return head


def _broken_outcome(head: str, broken: list[tuple[str, str, str | None]],
                    data: dict[str, Any]) -> Outcome:
    """The failure for the first broken gradient, with a hint by kind (non-finite or cut)."""
    name, what, mod = broken[0]
    more = f" (+{len(broken) - 1} more)" if len(broken) > 1 else ""
    if all("non-finite" in w for _, w, _ in broken):
        hint = ("non-finite values in the forward or backward poison the gradients; the "
                "non-finite check locates where they start")
    else:
        hint = ("a detached tensor (.detach(), .data, torch.no_grad, an in-place op) or an "
                "unused module cuts the graph; follow the module named here")
    return Outcome.fail(f"{head}; {name} has {what}{more}", hint, mod, **data)


def _extremes_outcome(t: Target, moe: list[MoEInfo], head: str, router_msgs: list[str],
                      r: _ParamGrads, owners: dict[int, list[str]],
                      data: dict[str, Any]) -> Outcome:
    """With no failure: warn on exploding gradients or a missing aux loss, else ok; the
    vanishing and few-token tensors are listed without changing the status."""
    flagged = r.flagged
    extremes = []
    if flagged["exploding"]:
        extremes.append(f"{len(flagged['exploding'])} exploding (‖g‖ > {EXPLODING_NORM:g} or "
                        f"‖g‖/‖w‖ > {EXPLODING_RATIO:g}: {flagged['exploding'][0]})")
    if flagged["vanishing"]:
        # not a warning: a bias that a softmax or a norm right after cancels (a key bias, a
        # conv bias before BatchNorm) gets ~0 by design, as in HF's BERT
        router_msgs.append(
            f"{len(flagged['vanishing'])} tensor(s) under the vanishing threshold (‖g‖ < "
            f"{VANISHING_NORM:g} or ‖g‖/‖w‖ < {VANISHING_RATIO:g}: {flagged['vanishing'][0]}; "
            "~0 by design for a bias that a softmax or a norm cancels)")
    if flagged["few"]:
        router_msgs.append(f"{len(flagged['few'])} tensor(s) small only because their module "
                           "got few tokens (fine per token)")
    ev = "; ".join([head] + extremes + router_msgs)
    if extremes:
        name = flagged["exploding"][0]
        mods = owners.get(id(dict(t.model.named_parameters())[name]),
                          [name.rpartition(".")[0]])
        return Outcome.warn(ev, "exploding gradients: an init or logit scale too large, a "
                            "missing norm or residual scaling", mods[0] or None, **data)
    if r.by_design:
        name, why = r.by_design[0]
        more = f" (+{len(r.by_design) - 1} more)" if len(r.by_design) > 1 else ""
        return Outcome.warn(f"{ev}; {name} never ran and got no gradient{more}: {why}",
                            "unused by design (a layer borrowing another's K/V): fine if meant; "
                            "freeze or drop these weights so the optimizer does not hold them",
                            name.rpartition(".")[0] or None, **data)
    if router_msgs and router_msgs[0].startswith("no aux_loss"):
        return Outcome.warn(ev, "return the load-balancing loss (aux_loss) and add it to the "
                            "training loss", moe[0].name or None, **data)
    return Outcome.ok(ev, **data)


@check(5, "grad-flow", "Gradient flow")
def grad_flow(t: Target, o: DoctorOptions) -> Outcome:
    """After one backward of the loss every trainable parameter has a finite, non-zero
    gradient; and each MoE router gets a gradient from the aux (load-balancing) loss alone.

    A parameter whose module was never called (an expert that received no tokens in this
    batch) is reported as unused, not as broken. Each finite gradient is also judged by the
    gradients view's rule (:func:`hooks.doctor.verdicts.param_verdict`, knowing the rows that
    reached its module): exploding ones warn; vanishing ones are listed without changing the status
    (a bias that a softmax or a norm cancels, HF BERT's key bias, gets ~0 by design), and so
    are those small only because their module saw few tokens.
    """
    out, called, rows, most = _forward_recording(t)
    choice = t.loss(out)
    loss = choice.loss
    src = choice.describe()
    if not loss.requires_grad:
        raise SkipCheck(f"the loss ({src}) does not require grad: nothing to back-propagate")
    data: dict[str, Any] = dict(loss=float(loss.detach()), loss_source=choice.source,
                                loss_fallback=choice.fallback)

    # the router's gradient from the aux loss alone
    moe = t.moe_blocks()
    router_msgs, router_fail = _router_aux_check(moe, out, data, coefficient(t, "aux_loss"))

    loss.backward()
    owners = t.param_owners()
    r = _tally_param_grads(t, moe, called, rows, most, owners)
    head = _grad_flow_head(src, data, r)
    if r.broken:
        return _broken_outcome(head, r.broken, data)
    if router_fail:
        msg, mod = router_fail
        return Outcome.fail(f"{head}; {msg}",
                            "compute the load-balancing loss from the router logits without "
                            ".detach()/.item()/torch.no_grad, and add it to the loss", mod,
                            **data)
    return _extremes_outcome(t, moe, head, router_msgs, r, owners, data)


class _Grad:
    """The attributes :func:`hooks.doctor.verdicts.param_verdict` reads, for a finite gradient."""

    __slots__ = ("grad_norm", "ratio")
    status = "ok"
    nan_count = inf_count = 0

    def __init__(self, grad_norm: float, ratio: float | None) -> None:
        self.grad_norm = grad_norm
        self.ratio = ratio


# ---------------------------------------------------------------------------------------------
@check(7, "nonfinite", "Non-finite values")
def nonfinite(t: Target, o: DoctorOptions) -> Outcome:
    """No NaN/Inf in the weights, the forward activations, the loss or the gradients; if any,
    the innermost module where they first appear (``Trace.first_nonfinite``)."""
    model = t.model
    bad_w = [(n, int((~torch.isfinite(p)).sum())) for n, p in model.named_parameters()
             if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if bad_w:
        n, k = bad_w[0]
        return Outcome.fail(f"weight {n} holds {k} NaN/Inf values"
                            + (f" (+{len(bad_w) - 1} more tensors)" if len(bad_w) > 1 else ""),
                            "the weights were already broken (a diverged step or a bad load)",
                            n.rpartition(".")[0] or None, weights=[b[0] for b in bad_w])
    with t.mode(False), capture(model, inputs=True, grads=True, params=False) as tr:
        out = t.run(t.batch)
        choice = t.loss(out)
        loss, src = choice.loss, choice.source
        if loss.requires_grad:
            loss.backward()
    lval = float(loss.detach())
    fwd = tr.first_nonfinite("forward")
    bwd = tr.first_nonfinite("backward")
    data: dict[str, Any] = dict(calls=len(tr.forward), grads=len(tr.backward), loss=lval,
                                loss_source=src)
    if fwd is not None:
        data["first"] = fwd.describe()
        return Outcome.fail(
            f"forward: first non-finite output at {fwd.module or '<root>'} ({fwd.module_type}) "
            f"{fwd.tensor}: {fwd.stats.nan_count} NaN, {fwd.stats.inf_count} Inf of "
            f"{fwd.stats.numel}, with finite inputs",
            "look at this module's ops: log/sqrt of negatives, division by ~0 (missing eps), "
            "exp overflow, 0·inf", fwd.module or None, **data)
    if lval is not None and not math.isfinite(lval):
        return Outcome.fail(f"the loss is {lval} while every module output is finite",
                            "the loss computation itself (log of 0? labels out of range?)",
                            None, **data)
    if bwd is not None:
        data["first"] = bwd.describe()
        return Outcome.fail(
            f"backward: first non-finite gradient at the output of {bwd.module or '<root>'} "
            f"({bwd.module_type}): {bwd.stats.nan_count} NaN, {bwd.stats.inf_count} Inf",
            "a backward-only overflow: an op whose derivative blows up (sqrt at 0, "
            "division by a tiny norm)", bwd.module or None, **data)
    return Outcome.ok(f"{len(tr.forward)} module outputs and {len(tr.backward)} gradients "
                      f"finite; {choice.describe()} = {fmt(lval)}", **data)


# ---------------------------------------------------------------------------------------------
@check(10, "overfit", "Overfit one batch", slow=True)
def overfit(t: Target, o: DoctorOptions) -> Outcome:
    """Train a copy of the model on the batch with AdamW until the cross-entropy falls by
    ``overfit_drop`` (90 %) or ``overfit_steps`` steps pass. The original model is untouched.

    The optimizer minimises the loss :func:`hooks.select_loss` chooses (a ``loss_fn``,
    ``out.loss`` with the aux loss included, the scalar of a ``(logits, loss)`` tuple); the
    progress is measured on ``output.ce_loss`` when the model reports it (minillm), else on
    that loss.
    """
    with t.mode(False), torch.no_grad():
        first_choice = t.loss(t.run(t.batch))
    if first_choice.fallback:
        raise SkipCheck(f"{first_choice.describe()}: nothing to overfit; return a loss (pass "
                        "labels/targets in the batch) or (model, batch, loss_fn)")
    try:
        model = copy.deepcopy(t.model)
    except Exception as exc:
        raise SkipCheck(
            f"cannot copy the model to train it: {type(exc).__name__}: {exc}") from None
    copy_t = Target(model, t.batch, t.loss_fn)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                            lr=o.overfit_lr, weight_decay=0.0)
    model.train()
    history: list[float] = []
    first = None
    reached = None
    for step in range(o.overfit_steps + 1):
        out = copy_t.run()
        loss = copy_t.loss(out).loss
        ce = Target.ce_loss(out)
        value = float((ce if ce is not None else loss).detach())
        history.append(value)
        if first is None:
            first = value
        if not math.isfinite(value):
            break
        if value <= (1 - o.overfit_drop) * first:
            reached = step
            break
        if step == o.overfit_steps:
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    last = history[-1]
    best = min(history)
    drop = 1 - best / first if first else 0.0
    stride = max(1, len(history) // 20)
    shape = t.input_ids.shape if t.input_ids is not None else None
    data = dict(first=first, best=best, last=last, steps=len(history) - 1, reached_at=reached,
                lr=o.overfit_lr, drop=drop, history=history[::stride],
                batch=list(shape) if shape is not None else None,
                loss_source=first_choice.source)
    what = ("cross-entropy" if Target.ce_loss(out) is not None
            else f"the loss ({first_choice.source})")
    batch = f", batch {shape[0]}×{shape[1]}" if shape is not None else ""
    setting = f"AdamW lr {o.overfit_lr:g}{batch}"
    if reached is not None:
        return Outcome.ok(f"{what} fell from {first:.3f} to {history[-1]:.3f} "
                          f"(-{100 * drop:.0f}%) in {reached} steps ({setting})", **data)
    if not math.isfinite(last):
        return Outcome.fail(f"{what} became {last} after {len(history) - 1} steps "
                            f"({setting}); it started at {first:.3f}",
                            "training diverged: see the non-finite and numerics checks", **data)
    return Outcome.fail(
        f"{what} fell only {100 * drop:.0f}% ({first:.3f} -> best {best:.3f}) in "
        f"{o.overfit_steps} steps ({setting}); needed {100 * o.overfit_drop:.0f}%",
        "a model that cannot memorise one batch has a broken forward/backward (detached "
        "graph, frozen weights, a mask hiding the inputs) or a bad learning rate", **data)
