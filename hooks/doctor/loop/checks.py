"""The checks of the training-loop doctor (:mod:`hooks.doctor.loop.watch`): each takes what the
observer saw and returns findings of the run (the dicts :meth:`hooks.store.store.RunWriter.
add_findings` stores: ``kind``, ``step``, ``subject``, ``line``, ``detail``).

``detail`` always holds ``severity`` (``"error"`` or ``"warning"``) and ``evidence`` (the
numbers, in words), plus the numbers themselves. The public reports each check comes from are
listed in ``docs/loop-doctor.md``.

* :func:`weight_decay_findings` — decay on ndim < 2 parameters (norm weights, biases: an
  error) or on embeddings (a warning) (ServiceNow/Fast-LLM #542, transformers PR#35927).
* :func:`optimizer_param_findings` — trainable parameters the optimizer does not hold, and
  parameters it holds twice.
* :func:`adam_eps_findings` — an Adam ``eps`` that rounds to 0 in its state's dtype
  (pytorch #26218).
* :func:`accumulation_findings` — the accumulated gradient against the gradient of the same
  micro-batches as one batch (transformers #37197, PR#39659).
* :func:`target_alignment` / :func:`label_findings` — which target alignment the loss used,
  read from the gradient of the logits (transformers PR#37830), and pad positions counted
  (transformers #28505).
* :func:`warmup_of` / :func:`scheduler_findings` — a scheduler stepped more often than the
  optimizer (starVLA PR#210).
* :func:`lost_update_findings` — low-precision parameters without an fp32 master copy whose
  updates round away (DeepSpeed #2768).

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

__all__ = [
    "accumulation_findings",
    "adam_eps_findings",
    "dropout_modules",
    "finding",
    "label_findings",
    "low_precision_accumulation",
    "lost_update_findings",
    "optimizer_param_findings",
    "param_names",
    "scheduler_findings",
    "target_alignment",
    "warmup_of",
    "weight_decay_findings",
]

#: Relative deviation of a micro-batch weight (or of the overall scale) tolerated before the
#: accumulation check reports it.
ACCUM_TOL = 0.05
#: The least-squares fit of the accumulated gradient must explain it to this relative residual,
#: else the check says nothing (another loss term, stale gradients).
ACCUM_FIT = 0.05
#: The smallest factor read as an AMP loss scale (GradScaler starts at 2**16 and halves on
#: overflow; no loop accumulates 128 micro-batches into one summed loss by mistake unnoticed).
MIN_LOSS_SCALE = 128
#: Share of positions whose gradient names the token of one alignment for it to be the one.
ALIGN_SHARE = 0.9
#: Names listed in one line at most (the evidence keeps them all).
NAMES_SHOWN = 4


def finding(kind: str, step: int | None, subject: str, line: str, evidence: str, *,
            severity: str = "error", **numbers: Any) -> dict[str, Any]:
    """One finding as the run store keeps it (see the module docstring)."""
    return {"kind": kind, "step": step, "rank": None, "subject": subject, "line": line,
            "detail": {"severity": severity, "evidence": evidence, **numbers}}


def names_listed(names: list[str]) -> str:
    """The first :data:`NAMES_SHOWN` of ``names``, comma-separated, and how many more."""
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f" (+{len(names) - NAMES_SHOWN} more)" if len(names) > NAMES_SHOWN else "")


def param_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter)`` → its qualified name in ``model`` (the first name of a tied one)."""
    out: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), name)
    return out


def _embedding_ids(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


# -- once: the optimizer's configuration ---------------------------------------------------------
def weight_decay_findings(model: nn.Module, optimizer: torch.optim.Optimizer,
                          step: int | None) -> list[dict[str, Any]]:
    """Parameter groups with ``weight_decay > 0`` that hold parameters with ndim < 2 (norm
    weights, biases: an error; AdamW pulls a norm weight of 1.0 towards 0) or the weight of an
    ``nn.Embedding`` (a warning: some recipes decay embeddings on purpose). One finding per
    group and kind, naming the group's index and its parameters."""
    names = param_names(model)
    embeds = _embedding_ids(model)
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        wd = float(group.get("weight_decay", 0.0) or 0.0)
        if wd <= 0:
            continue
        small = [names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in group["params"]
                 if p.ndim < 2 and p.requires_grad]
        emb = [names.get(id(p), "<embedding>") for p in group["params"] if id(p) in embeds]
        if small:
            out.append(finding(
                "weight_decay", step, f"param group {gi}",
                f"weight decay {wd:g} on {len(small)} norm weight(s)/bias(es) in param group "
                f"{gi}: {names_listed(small)} (put ndim < 2 parameters in a group with "
                "weight_decay=0)",
                f"group {gi}: weight_decay={wd:g}; parameters with ndim < 2 in it: "
                f"{', '.join(small)}", group=gi, weight_decay=wd, params=small))
        if emb:
            out.append(finding(
                "weight_decay", step, f"param group {gi} (embeddings)",
                f"weight decay {wd:g} on embedding(s) in param group {gi}: {names_listed(emb)} "
                "(most LLM recipes do not decay embeddings; ignore if on purpose)",
                f"group {gi}: weight_decay={wd:g}; nn.Embedding weights in it: "
                f"{', '.join(emb)}", severity="warning", group=gi, weight_decay=wd,
                params=emb))
    return out


def optimizer_param_findings(model: nn.Module, optimizer: torch.optim.Optimizer,
                             step: int | None) -> list[dict[str, Any]]:
    """Trainable parameters of ``model`` the optimizer holds in no group (they never change),
    and parameters it holds more than once (each ``step`` updates them twice)."""
    names = param_names(model)
    seen: dict[int, list[int]] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            seen.setdefault(id(p), []).append(gi)
    out = []
    missing = [names[id(p)] for p in dict.fromkeys(model.parameters())
               if p.requires_grad and id(p) not in seen]
    if missing:
        out.append(finding(
            "optimizer_params", step, missing[0] if len(missing) == 1 else "parameters",
            f"{len(missing)} trainable parameter(s) are in no optimizer param group, so they "
            f"never change: {names_listed(missing)}",
            f"not held by {type(optimizer).__name__}: {', '.join(missing)}", params=missing))
    twice = [(names.get(pid, "<not in the model>"), groups) for pid, groups in seen.items()
             if len(groups) > 1]
    if twice:
        listed = [f"{n} (groups {', '.join(map(str, g))})" for n, g in twice]
        out.append(finding(
            "optimizer_params", step, twice[0][0] if len(twice) == 1 else "parameters",
            f"{len(twice)} parameter(s) held twice by the optimizer, updated twice per step: "
            f"{names_listed(listed)}",
            f"held more than once: {', '.join(listed)}", params=[n for n, _ in twice]))
    return out


def _state_dtype(optimizer: torch.optim.Optimizer, group: dict) -> torch.dtype | None:
    for p in group["params"]:
        state = optimizer.state.get(p) or {}
        v = state.get("exp_avg_sq")
        if isinstance(v, torch.Tensor):
            return v.dtype
    for p in group["params"]:
        if p.is_floating_point():
            return p.dtype
    return None


def adam_eps_findings(optimizer: torch.optim.Optimizer,
                      step: int | None) -> list[dict[str, Any]]:
    """Groups of an Adam-family optimizer (a group with ``betas`` and ``eps``) whose ``eps``
    is below the smallest positive value of its state's dtype (the dtype of ``exp_avg_sq``,
    else of the parameters): it rounds to 0 there, and a near-zero second moment divides by 0
    (``float16(1e-8) == 0``; the smallest fp16 subnormal is 5.96e-8)."""
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        if "betas" not in group or "eps" not in group:
            continue
        eps = float(group["eps"])
        dtype = _state_dtype(optimizer, group)
        if dtype is None or not dtype.is_floating_point:
            continue
        info = torch.finfo(dtype)
        smallest = info.tiny * info.eps  # the smallest positive subnormal
        if 0 < eps < smallest or float(torch.tensor(eps, dtype=dtype)) == 0.0:
            out.append(finding(
                "precision", step, f"param group {gi} eps",
                f"Adam eps={eps:g} of param group {gi} rounds to 0 in its state's dtype "
                f"{str(dtype).removeprefix('torch.')} (smallest positive {smallest:.3g}): "
                "keep the optimizer state in fp32, or raise eps",
                f"eps={eps:g}; {dtype}: smallest positive {smallest:.3g}, "
                f"{dtype}({eps:g}) = {float(torch.tensor(eps, dtype=dtype)):g}",
                group=gi, eps=eps, dtype=str(dtype), smallest=smallest))
    return out


# -- the scheduler -------------------------------------------------------------------------------
def _cell(fn: Any, word: str) -> int | None:
    code = getattr(fn, "__code__", None)
    if code is None or not getattr(fn, "__closure__", None):
        return None
    for name, cell in zip(code.co_freevars, fn.__closure__, strict=False):
        if word in name.lower():
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def warmup_of(scheduler: Any) -> int | None:
    """The length of ``scheduler``'s warmup in scheduler steps, when it can be read: HF's
    ``get_*_schedule_with_warmup`` (``num_warmup_steps`` of its ``lr_lambda``), a
    ``LambdaLR`` whose function closes over a ``*warmup*`` integer, ``LinearLR`` rising
    (``total_iters``), ``OneCycleLR`` (its first phase), ``SequentialLR`` (its first
    milestone); else ``None``."""
    sched = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler
    for fn in getattr(sched, "lr_lambdas", []) or []:
        if isinstance(fn, functools.partial) and "num_warmup_steps" in (fn.keywords or {}):
            return int(fn.keywords["num_warmup_steps"])
        found = _cell(fn, "warmup")
        if found is not None:
            return found
    name = type(sched).__name__
    if name == "LinearLR" and getattr(sched, "start_factor", 1) < getattr(sched, "end_factor", 1):
        return int(sched.total_iters)
    if name == "OneCycleLR":
        phases = getattr(sched, "_schedule_phases", None)
        if phases:
            return int(phases[0]["end_step"])
    if name == "SequentialLR":
        ms = getattr(sched, "_milestones", None)
        if ms:
            return int(ms[0])
    return None


def scheduler_findings(step: int, sched_steps: int, opt_steps: int, lrs: list[tuple],
                       scheduler: Any) -> list[dict[str, Any]]:
    """The scheduler stepped more often than the optimizer in one watched step, or the
    learning rate changed between the micro-batches of one optimizer step (``lrs``: each
    micro-batch's learning rates, per param group). Names the warmup it shortens."""
    out = []
    warm = warmup_of(scheduler) if scheduler is not None else None
    if opt_steps >= 1 and sched_steps > opt_steps:
        k = sched_steps / opt_steps
        short = (f": its {warm}-step warmup ends after {math.ceil(warm / k)} optimizer steps"
                 if warm else f": a warmup of W steps ends after W/{k:g} optimizer steps")
        out.append(finding(
            "scheduler_steps", step, type(getattr(scheduler, "scheduler", scheduler)).__name__,
            f"scheduler.step ran {k:g}x per optimizer step at step {step}{short} (step the "
            "scheduler once per optimizer step, after optimizer.step)",
            f"{sched_steps} scheduler.step call(s), {opt_steps} optimizer.step call(s) between "
            f"the log() of step {step - 1} and of step {step}",
            scheduler_steps=sched_steps, optimizer_steps=opt_steps, warmup=warm))
    distinct = list(dict.fromkeys(lrs))
    if len(distinct) > 1:
        seq = ", ".join(f"{lr[0]:.4g}" for lr in lrs)
        out.append(finding(
            "scheduler_steps", step, "learning rate",
            f"the learning rate changed between the {len(lrs)} micro-batches of one optimizer "
            f"step at step {step} ({seq})" + (f": the {warm}-step warmup is shortened" if warm
                                              else "") + " (step the scheduler per optimizer "
            "step, not per micro-batch)",
            f"lr at each micro-batch's forward (group 0): {seq}",
            lrs=[list(x) for x in lrs], warmup=warm))
    return out


# -- gradient accumulation -----------------------------------------------------------------------
def accumulation_findings(step: int, accumulated: torch.Tensor, per_batch: list[torch.Tensor],
                          tokens: list[int], usual: int | None) -> list[dict[str, Any]]:
    """Compare the accumulated gradient with the gradient of the same micro-batches as one
    batch.

    Fits ``accumulated ≈ Σ_i a_i · g_i`` (least squares; ``g_i`` the gradient of micro-batch
    ``i``'s own mean loss, replayed with its RNG state) and compares the weights ``a_i`` with
    those of one batch, ``w_i = n_i / Σ n`` (``n_i`` its token count). Reports micro-batches
    left out (``a_i ≈ 0``), a direction change (``a`` not proportional to ``w``: per-micro-
    batch means of unequal token counts), and a factor (``Σ a_i ≠ 1``: a loss summed, not
    averaged, or a last window of ``m`` micro-batches divided by the usual count).

    Args:
        step: The watched step.
        accumulated: (P,) the real accumulated ``.grad`` of the optimizer's parameters, flat.
        per_batch: k tensors (P,), ``g_i``.
        tokens: k token counts ``n_i``.
        usual: The micro-batch count of an earlier optimizer step (``None``: not known).

    Returns:
        At most one finding (kind ``grad_accumulation``); none when the fit does not explain
        the accumulated gradient to :data:`ACCUM_FIT` (another loss term: nothing to say).
    """
    k = len(per_batch)
    gm = torch.stack([g.double() for g in per_batch])  # (k, P)
    acc = accumulated.double()
    norm = float(acc.norm())
    if k == 0 or norm == 0 or not math.isfinite(norm):
        return []
    a = torch.linalg.lstsq(gm.T, acc.unsqueeze(1)).solution.squeeze(1)  # not the normal
    resid = float((acc - a @ gm).norm()) / norm  # equations: they square the conditioning
    if resid > ACCUM_FIT:
        return []
    total = sum(tokens)
    w = torch.tensor([n / total for n in tokens], dtype=torch.float64)
    scale = float(a.sum())
    loss_scale = _loss_scale(scale)
    if loss_scale > 1:  # a GradScaler's power of two: judge the weights, not the factor
        a, scale = a / loss_scale, scale / loss_scale
    ref = w @ gm
    # the weights are only told apart where the one-batch gradient (at the fitted scale)
    # really misses .grad: nearly parallel micro-batch gradients fit many weight vectors
    misses = float((acc - scale * loss_scale * ref).norm()) / norm > ACCUM_FIT
    cos = float(acc @ ref) / (norm * float(ref.norm()) + 1e-300)
    nums = {"weights": [round(float(x), 6) for x in a], "expected": [round(float(x), 6)
            for x in w], "tokens": tokens, "factor": round(scale, 6), "cosine": round(cos, 8),
            "residual": round(resid, 8)}
    ws = ", ".join(f"{float(x):.3g}" for x in a)
    es = ", ".join(f"{float(x):.3g}" for x in w)
    evidence = (f"{k} micro-batch(es), tokens {tokens}; .grad = Σ a_i·g_i with a = [{ws}]; "
                f"as one batch a = [{es}]; cosine(.grad, one-batch gradient) = {cos:.6f}")
    left = [i for i in range(k) if abs(float(a[i])) < ACCUM_TOL * float(a.abs().max())]
    if left and misses:
        return [finding("grad_accumulation", step, "micro-batches",
                        f"micro-batch(es) {', '.join(str(i + 1) for i in left)} of {k} left "
                        f"out of the accumulated gradient at step {step} (its forward ran, its "
                        "loss never reached .grad)", evidence, **nums)]
    if misses and scale > 0 and float((a / scale - w).abs().max()) > ACCUM_TOL * float(w.max()):
        same = float((a - a.mean()).abs().max()) < ACCUM_TOL * float(a.abs().max())
        why = ("each micro-batch's loss is a mean over its own tokens, and the counts differ: "
               "normalise by the window's total token count" if same and len(set(tokens)) > 1
               else "the micro-batches are not weighted by their token counts")
        if abs(scale - 1) > ACCUM_TOL:
            why += f" (and its scale is {scale:.3g}x)"
        return [finding("grad_accumulation", step, "micro-batch weights",
                        f"the accumulated gradient at step {step} points elsewhere than the "
                        f"one-batch gradient (cosine {cos:.4f}): {why}", evidence, **nums)]
    if abs(scale - 1) > ACCUM_TOL and loss_scale == 1:
        if usual and k < usual and abs(scale - k / usual) < ACCUM_TOL * k / usual:
            why = (f"a last window of {k} micro-batches divided by the full count {usual}: "
                   f"divide by {k}")
        elif k > 1 and abs(scale - k) < ACCUM_TOL * k:
            why = f"the loss is summed over the {k} micro-batches, not averaged"
        else:
            why = "the loss is scaled wrongly before backward"
        return [finding("grad_accumulation", step, "gradient scale",
                        f"the accumulated gradient at step {step} is {scale:.3g}x the "
                        f"one-batch gradient: {why}", evidence, **nums)]
    return []


def _loss_scale(factor: float) -> float:
    """The power of two ≥ :data:`MIN_LOSS_SCALE` that ``factor`` equals (to
    :data:`ACCUM_TOL`): an AMP ``GradScaler``'s loss scale left in ``.grad`` until
    ``unscale_``; else 1. (A summed loss times a loss scale is a power of two too: such a
    factor is not judged.)"""
    if factor < MIN_LOSS_SCALE:
        return 1.0
    power = 2.0 ** round(math.log2(factor))
    return power if abs(factor / power - 1) < ACCUM_TOL else 1.0


def low_precision_accumulation(step: int, accumulated: torch.Tensor,
                               per_batch: list[torch.Tensor],
                               dtype: torch.dtype) -> list[dict[str, Any]]:
    """Gradients accumulated in bf16/fp16 across micro-batches (``.grad`` of ``dtype``, no
    fp32 accumulator): the real accumulated gradient against the best fp64 combination of
    the micro-batches' gradients (least squares, as :func:`accumulation_findings`); a relative
    difference above 1e-3 is reported (DeepSpeed #2768: small contributions rounded away;
    64 additions of 1e-3 to 1.0 stay 1.0 in bf16)."""
    if dtype not in (torch.bfloat16, torch.float16) or len(per_batch) < 2:
        return []
    gm = torch.stack([g.double() for g in per_batch])
    acc = accumulated.double()
    norm = float(acc.norm())
    if norm == 0 or not math.isfinite(norm):
        return []
    a = torch.linalg.lstsq(gm @ gm.T, (gm @ acc).unsqueeze(1)).solution.squeeze(1)
    rel = float((acc - a @ gm).norm()) / norm
    if rel <= 1e-3:
        return []
    name = str(dtype).removeprefix("torch.")
    return [finding(
        "precision", step, "gradient accumulation",
        f"gradients accumulate in {name} over {len(per_batch)} micro-batches at step {step}: "
        f"the accumulated .grad is {rel:.2g} (relative) off the fp32 sum of the "
        "micro-batches' gradients; accumulate in fp32 (fp32 master parameters, or an fp32 "
        "gradient buffer)",
        f".grad dtype {name}; ||.grad − Σ a_i·g_i|| / ||.grad|| = {rel:.3g} (the g_i in "
        "fp32 from the replayed micro-batches)", relative_error=rel, dtype=str(dtype),
        micro_batches=len(per_batch))]


# -- labels and padding, from the gradient of the logits ------------------------------------------
def target_alignment(grad: torch.Tensor, ids: torch.Tensor) -> tuple[int | None, dict]:
    """Which target alignment the loss used, read from the gradient of the logits.

    A cross-entropy's gradient at a position is ``softmax − onehot(target)`` (times a
    weight): its only negative entry is the target. The target of every position with a
    non-zero gradient row is compared with the input ids shifted by 0 (same position), 1
    (next token) and 2 (shifted twice).

    Args:
        grad: (B, T, V) gradient of the logits.
        ids: (B, T) input ids.

    Returns:
        ``(shift, numbers)``: the shift whose ids are the target at ≥ :data:`ALIGN_SHARE` of
        the positions (``None``: no alignment reproduces the loss's targets), and the share
        matched by each shift.
    """
    g = grad.detach()
    live = g.abs().amax(-1) > 0  # (B, T)
    target = g.argmin(-1)  # (B, T)
    t = ids.shape[1]
    shares: dict[str, float] = {}
    best = None
    for s in (0, 1, 2):
        if s >= t:
            continue
        m = live[:, : t - s]
        n = int(m.sum())
        if n == 0:
            continue
        share = float((target[:, : t - s] == ids[:, s:])[m].float().mean())
        shares[str(s)] = round(share, 4)
        if share >= ALIGN_SHARE and (best is None or share > shares[str(best)]):
            best = s
    return best, {"shares": shares, "positions": int(live.sum())}


_ALIGN = {0: "same-position (each logit scored against its own input token: labels not "
             "shifted)", 1: "next-token", 2: "shifted twice (each logit scored against the token "
             "two ahead)"}


def label_findings(step: int, grad: torch.Tensor, ids: torch.Tensor,
                   mask: torch.Tensor | None) -> list[dict[str, Any]]:
    """Label alignment (not next-token for a causal LM) and pad positions counted in the loss,
    from the gradient of the logits (:func:`target_alignment`).

    Args:
        step: The watched step.
        grad: (B, T, V) gradient of the logits of one micro-batch.
        ids: (B, T) its input ids.
        mask: (B, T) its attention mask (1 real, 0 pad), or ``None``.
    """
    out = []
    shift, nums = target_alignment(grad, ids)
    if shift is not None and shift != 1:
        out.append(finding(
            "labels", step, "labels",
            f"the loss at step {step} is {_ALIGN[shift]}, not next-token: "
            + ("shift the labels once (logits[:, :-1] vs labels[:, 1:]), or pass labels=ids "
               "to a model that shifts" if shift == 0 else
               "the labels are shifted before a model that shifts them again: pass labels=ids"),
            f"targets read from the gradient of the logits match the input ids shifted by "
            f"0/1/2 at {nums['shares']} of {nums['positions']} positions",
            alignment=shift, **nums))
    if mask is not None and mask.shape == ids.shape and bool((mask == 0).any()):
        s = 1 if shift is None else shift
        t = ids.shape[1]
        live = grad.detach().abs().amax(-1) > 0
        pad_target = mask[:, s:] == 0 if s else mask == 0
        counted = int((live[:, : t - s] & pad_target).sum())
        pads = int(pad_target.sum())
        if counted:
            out.append(finding(
                "padding", step, "loss",
                f"{counted} of {pads} pad positions (attention_mask 0) count in the loss at "
                f"step {step}: set their labels to -100",
                f"pad targets with a non-zero gradient of the logits: {counted} of {pads} "
                f"(alignment: shift {s})", counted=counted, pads=pads))
    return out


# -- precision -----------------------------------------------------------------------------------
def lost_update_findings(step: int, named: list[tuple[str, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]],
                         lr: float) -> list[dict[str, Any]]:
    """Low-precision (bf16/fp16) parameters the optimizer updates in place, with no fp32
    master copy, whose updates round away.

    Args:
        step: The watched step.
        named: ``(name, before, after, grad)`` of each such parameter: the values before and
            after ``optimizer.step`` and the gradient it applied.
        lr: The learning rate of the first param group.
    """
    lost = total = 0
    worst: list[str] = []
    dtype = None
    for name, before, after, grad in named:
        moved = grad != 0
        n = int(moved.sum())
        if n == 0:
            continue
        k = int(((after == before) & moved).sum())
        lost, total = lost + k, total + n
        dtype = before.dtype
        if k > 0.01 * n:
            worst.append(f"{name} ({k}/{n})")
    if total == 0 or lost <= 0.01 * total:
        return []
    eps = torch.finfo(dtype).eps
    return [finding(
        "precision", step, "parameter updates",
        f"{lost} of {total} updates at step {step} were lost: the optimizer updates "
        f"{str(dtype).removeprefix('torch.')} parameters with no fp32 master copy (a step "
        f"below |w|·{eps:.3g} rounds away); keep fp32 master weights (torch.autocast, or "
        "an fp32 copy the optimizer steps)",
        f"elements with a non-zero gradient left unchanged by optimizer.step (lr {lr:g}): "
        f"{names_listed(worst)}", lost=lost, updated=total, dtype=str(dtype), lr=lr,
        params=[w.rsplit(" (", 1)[0] for w in worst])]


def dropout_modules(model: nn.Module) -> list[str]:
    """Names of the modules whose output depends on train mode through dropout: an
    ``nn.Dropout*`` with ``p > 0``, or a module with a positive ``attention_dropout`` /
    ``dropout_p`` (HF and minillm attention)."""
    out = []
    for name, m in model.named_modules():
        p = getattr(m, "p", 0.0) if isinstance(m, nn.modules.dropout._DropoutNd) else max(
            _num(getattr(m, "attention_dropout", 0.0)), _num(getattr(m, "dropout_p", 0.0)))
        if p > 0:
            out.append(name or "<root>")
    return out


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else 0.0
