"""Checks 3 and 4: RoPE (relative positions, table length, longer inputs) and GQA grouping.

Dimension legend: B batch, T sequence, H query heads, Hkv key/value heads, Dh head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import hooks
from hooks.checks.registry import DoctorOptions, check
from hooks.checks.result import Outcome
from hooks.checks.target import AttentionInfo, SkipCheck, Target, fmt

#: Longest input the RoPE check runs in full (longer configs are tested up to this length).
ROPE_FULL_LIMIT = 1024
#: Offsets d (key = query - d) compared by the relative-position test.
ROPE_OFFSETS = 16


def _one_line(exc: BaseException) -> str:
    msg = " ".join(f"{type(exc).__name__}: {exc}".split())
    return msg if len(msg) <= 160 else msg[:157] + "..."


def _layer0_probs(t: Target, attn: AttentionInfo, ids: torch.Tensor) -> torch.Tensor | None:
    """(H, T, T) attention probabilities of ``attn`` on ``ids`` (batch row 0)."""
    with t.mode(False), torch.no_grad(), hooks.capture(
        t.model, include=[], inputs=False, grads=False, params=False, attention=[attn.name]
    ) as tr:
        t.call(ids, labels=False, use_cache=False)
    recs = [a for a in tr.attention if a.module == attn.name]
    return recs[0].probs[0].float() if recs else None


def relative_position_violation(probs_HTT: torch.Tensor,
                                offsets: int) -> tuple[float, float, int]:
    """How far attention scores on a constant input are from depending on i - j only.

    With every position holding the same token, layer-0 scores are ``S[i, j] = q·R(j-i)·k``
    under RoPE, a function of i - j. Softmax rows differ by a constant, so
    ``log p[i, i-d] - log p[i, i] = S[i, i-d] - S[i, i]`` must not depend on i.

    Args:
        probs_HTT: (H, T, T) causal attention probabilities.
        offsets: the largest d compared.

    Returns:
        (violation, signal, compared): the largest spread over i of that difference (over
        heads and d), the largest |difference| itself (how much scores depend on the offset at
        all), and how many (head, i, d) entries were compared. Entries with zero probability
        (masked) are left out.
    """
    p = probs_HTT.double()
    logp = p.clamp_min(1e-300).log()
    h, seq, _ = logp.shape
    diag = torch.diagonal(logp, dim1=1, dim2=2)  # (H, T)
    pdiag = torch.diagonal(p, dim1=1, dim2=2)
    viol = signal = 0.0
    compared = 0
    for d in range(1, min(offsets, seq - 1) + 1):
        off = torch.diagonal(logp, offset=-d, dim1=1, dim2=2)  # (H, T-d): p[i, i-d], i >= d
        valid = (torch.diagonal(p, offset=-d, dim1=1, dim2=2) > 0) & (pdiag[:, d:] > 0)
        if not bool(valid.any()):
            continue  # masked entries carry no score to compare
        rel = off - diag[:, d:]
        compared += int(valid.sum())
        hi = torch.where(valid, rel, torch.full_like(rel, -math.inf)).amax(dim=1)
        lo = torch.where(valid, rel, torch.full_like(rel, math.inf)).amin(dim=1)
        has = valid.any(dim=1)
        viol = max(viol, float((hi - lo)[has].max()))
        signal = max(signal, float(rel[valid].abs().max()))
    return viol, signal, compared


@check(3, "rope", "RoPE positions")
def rope(t: Target, o: DoctorOptions) -> Outcome:
    """RoPE: relative-position scores, a table covering ``max_position_embeddings``, and
    refusal of a longer input.

    Runs the model on one token repeated ``max_position_embeddings`` times (up to
    :data:`ROPE_FULL_LIMIT`), reads the first attention layer's probabilities and tests that
    scores depend on i - j only over every position (a wrapped or clamped table breaks it; a
    table that is too short raises); then feeds ``max_position_embeddings + 1`` tokens, which
    the model should refuse.
    """
    rot = t.rotary_module()
    if rot is None:
        raise SkipCheck("no rotary embedding module (learned or no position embeddings)")
    attns = t.attention_modules()
    if not attns:
        raise SkipCheck("no attention module with q_proj/k_proj/v_proj/o_proj found")
    attn = attns[0]
    ids = t.need_ids()
    maxpos = t.max_positions
    token = int(ids[0, 0])
    # without a configured limit only the batch's own length is known to be valid
    full = min(maxpos, ROPE_FULL_LIMIT) if maxpos else ids.shape[1]
    data: dict[str, Any] = dict(rotary=rot[0], attention=attn.name,
                                max_position_embeddings=maxpos, tested_length=full)
    rep = torch.full((1, full), token, dtype=ids.dtype, device=ids.device)
    try:
        probs = _layer0_probs(t, attn, rep)
    except Exception as exc:
        data["error"] = _one_line(exc)
        return Outcome.fail(
            f"an input of {full} positions (max_position_embeddings = {maxpos}) raised "
            f"{_one_line(exc)}",
            "the RoPE cos/sin table is shorter than max_position_embeddings: build it for "
            "every position the config allows", rot[0], **data)
    problems: list[str] = []
    warns: list[str] = []
    module = None
    if probs is None:
        warns.append("no attention probabilities recorded: relative positions not tested")
    else:
        viol, signal, compared = relative_position_violation(probs, ROPE_OFFSETS)
        data.update(violation=viol, signal=signal, compared=compared)
        if not (math.isfinite(viol) and math.isfinite(signal)):
            raise SkipCheck("attention probabilities are not finite (see the non-finite check)")
        if compared == 0:
            warns.append(f"relative positions not measurable: {attn.name} gives every earlier "
                         f"key zero weight (see the causality check)")
            module = attn.name
        elif signal < 1e-7:
            problems.append(f"layer-0 scores do not depend on the key's position at all "
                            f"(offset effect {fmt(signal)})")
            module = attn.name
        elif viol > 1e-3 * signal + 1e-6:
            problems.append(
                f"scores depend on absolute position: log-prob differences at a fixed offset "
                f"vary by {fmt(viol)} across positions (offset effect {fmt(signal)})")
            module = rot[0]
    longer = None
    if maxpos and maxpos <= ROPE_FULL_LIMIT:
        too_long = torch.full((1, maxpos + 1), token, dtype=ids.dtype, device=ids.device)
        try:
            with t.mode(False), torch.no_grad():
                t.call(too_long, labels=False, use_cache=False)
        except Exception as exc:
            longer = _one_line(exc)
        data["longer_input"] = longer or "accepted"
        if longer is None:
            warns.append(f"an input of {maxpos + 1} tokens was accepted (positions past "
                         f"max_position_embeddings are extrapolated silently)")
    parts = []
    if probs is not None and not problems and data.get("compared"):
        parts.append(f"repeated token over {full} positions: scores depend on i-j only "
                     f"(spread {fmt(data.get('violation'))} vs offset effect "
                     f"{fmt(data.get('signal'))})")
    if longer:
        parts.append(f"{maxpos + 1} tokens refused ({longer.split(':')[0]})")
    elif not maxpos:
        parts.append("no max_position_embeddings in the config: table length and refusal of "
                     "longer inputs not tested")
    elif maxpos > ROPE_FULL_LIMIT:
        parts.append(f"tested {full} of {maxpos} positions; refusal of longer inputs not "
                     f"tested (too long to run)")
    ev = "; ".join(parts)
    if problems:
        return Outcome.fail("; ".join(problems + warns + parts),
                            "RoPE must rotate both q and k by their own positions with one "
                            "table; a wrapped/clamped table or rotating only q breaks this (or "
                            "q/k projections are all zero)",
                            module or attn.name, **data)
    if warns:
        return Outcome.warn("; ".join(warns + parts),
                            "check the rotary embedding and the input-length validation",
                            module or rot[0], **data)
    return Outcome.ok(ev, rot[0], **data)


# ---------------------------------------------------------------------------------------------
def _attention_inputs(t: Target, ids: torch.Tensor,
                      attns: list[AttentionInfo]) -> dict[str, tuple[tuple, dict]]:
    """The (args, kwargs) each attention module was called with in one forward on ``ids``."""
    got: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for a in attns:
        def pre(mod, args, kwargs, name=a.name):
            got.setdefault(name, (args, dict(kwargs)))
        handles.append(a.module.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with t.mode(False), torch.no_grad():
            t.call(ids, labels=False, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return got


def head_mapping(a: AttentionInfo, args: tuple, kwargs: dict, proj: str,
                 seed: int = 0) -> tuple[list[list[int]], list[float]]:
    """Which query heads read each KV head, measured.

    For each KV head g, adds noise to the output columns ``[g·Dh, (g+1)·Dh)`` of ``proj``
    (``k_proj`` or ``v_proj``) with a forward hook, re-runs the attention module on the same
    inputs and lists the query heads whose slice of the ``o_proj`` input (the per-head
    attention outputs, (B, T, H·Dh)) changed.

    Returns:
        (heads, deltas): ``heads[g]`` the changed query heads for KV head g; ``deltas`` the
        largest change of any head, per g.
    """
    mod = a.module
    dh, h = a.head_dim, a.num_heads
    seen: list[torch.Tensor] = []

    def grab(m, args):
        seen.append(args[0].detach().clone())

    gen = torch.Generator().manual_seed(seed)
    hk = mod.o_proj.register_forward_pre_hook(grab)
    try:
        with torch.no_grad():
            mod(*args, **kwargs)
            base = seen.pop()
            heads, deltas = [], []
            for g in range(a.num_kv_heads):
                def bump(m, inp, out, g=g):
                    out = out.clone()
                    sl = out[..., g * dh:(g + 1) * dh]
                    noise = torch.randn(sl.shape, generator=gen).to(sl)
                    out[..., g * dh:(g + 1) * dh] = sl + noise * (1.0 + float(sl.float().std()))
                    return out

                hb = getattr(mod, proj).register_forward_hook(bump)
                try:
                    mod(*args, **kwargs)
                finally:
                    hb.remove()
                pert = seen.pop()
                d_H = (pert.float() - base.float()).abs().reshape(-1, h, dh).amax(dim=(0, 2))
                top = float(d_H.max())
                heads.append([i for i in range(h) if top > 0 and float(d_H[i]) > 1e-3 * top])
                deltas.append(top)
    finally:
        hk.remove()
    return heads, deltas


@check(4, "gqa", "GQA head grouping")
def gqa(t: Target, o: DoctorOptions) -> Outcome:
    """Query head h must read KV head h // n_rep (``repeat_interleave``, HF ``repeat_kv``).

    Measured per attention layer with :func:`head_mapping` on the keys and on the values.
    """
    attns = t.attention_modules()
    if not attns:
        raise SkipCheck("no attention module with q_proj/k_proj/v_proj/o_proj found")
    ids = t.need_ids()[:1, : min(t.need_ids().shape[1], 16)]
    if ids.shape[1] < 2:
        raise SkipCheck("need at least 2 positions")
    inputs = _attention_inputs(t, ids, attns)
    data: dict[str, Any] = {"layers": {}}
    for a in attns:
        if a.name not in inputs:
            continue
        args, kwargs = inputs[a.name]
        expected = [[h for h in range(a.num_heads) if h // a.n_rep == g]
                    for g in range(a.num_kv_heads)]
        layer = {"heads": a.num_heads, "kv_heads": a.num_kv_heads, "expected": expected}
        for proj in ("k_proj", "v_proj"):
            got, deltas = head_mapping(a, args, kwargs, proj, seed=o.seed + 4)
            layer[proj] = got
            if not all(math.isfinite(d) for d in deltas):
                raise SkipCheck(f"{a.name}: attention outputs are not finite "
                                "(see the non-finite check)")
            if got != expected:
                data["layers"][a.name] = layer
                modulo = [[h for h in range(a.num_heads) if h % a.num_kv_heads == g]
                          for g in range(a.num_kv_heads)]
                what = ("h % Hkv: `repeat` used where `repeat_interleave` belongs"
                        if got == modulo else "neither h // n_rep nor h % Hkv")
                g = next(i for i in range(a.num_kv_heads) if got[i] != expected[i])
                return Outcome.fail(
                    f"{a.name}: perturbing {proj[0]} of KV head {g} changed query heads "
                    f"{got[g]}, expected {expected[g]} (h // n_rep, n_rep = {a.n_rep}); the "
                    f"mapping is {what}",
                    "expand KV heads with repeat_interleave(n_rep, dim=head) (HF repeat_kv), "
                    "so pretrained checkpoints and SDPA enable_gqa agree", a.name, **data)
        data["layers"][a.name] = layer
    if not data["layers"]:
        raise SkipCheck("no attention module ran in the forward pass")
    a = attns[0]
    return Outcome.ok(
        f"{len(data['layers'])} attention layer(s): perturbing K or V of KV head g changed "
        f"exactly query heads h with h // {a.n_rep} == g (H={a.num_heads}, "
        f"Hkv={a.num_kv_heads})", a.name, **data)
