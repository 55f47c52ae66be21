"""Checks 3 and 4: RoPE (relative positions, table length, longer inputs) and GQA grouping.

Dimension legend: B batch, T sequence, H query heads, Hkv key/value heads, Dh head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hooks.doctor.model.blame import model_fault, one_line
from hooks.doctor.model.registry import DoctorOptions, check
from hooks.doctor.model.result import Outcome
from hooks.doctor.model.target import AttentionInfo, NotApplicable, SkipCheck, Target, fmt
from hooks.engine.capture import capture
from hooks.modelroles.found import Rotary

#: Longest input the RoPE check runs in full (longer configs are tested up to this length).
ROPE_FULL_LIMIT = 1024
#: Offsets d (key = query - d) compared by the relative-position test.
ROPE_OFFSETS = 16


def _layer0_probs(t: Target, attn: AttentionInfo, ids: torch.Tensor) -> torch.Tensor | None:
    """(H, T, T) attention probabilities of ``attn`` on ``ids`` (batch row 0), as
    :func:`hooks.capture` records them, or None when it records none for this module."""
    batch = t.batch_with(ids=ids, targets="drop")
    with t.mode(False), torch.no_grad(), capture(
        t.model, include=[], inputs=False, grads=False, params=False, attention=[attn.name]
    ) as tr:
        t.run(batch, use_cache=False)
    recs = [a for a in tr.attention  # the role's module, or one inside it running the softmax
            if a.module == attn.name or a.module.startswith(attn.name + ".") or not attn.name]
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


def _no_rotary(t: Target) -> NotApplicable:
    """Why the model has no RoPE to check: what was looked for (names, the traced ops) and the
    line that declares it where mdb could not see it."""
    from hooks.modelroles.declare import declare_line, pattern_of

    roles = t.roles()
    if roles.traced:
        seen = ("one traced forward multiplies no attention's queries or keys by a position "
                "table (cos/sin or complex) paired back by a rotate-half cat, a stack or "
                "view_as_complex")
    else:
        seen = f"no forward was traced to look for one ({roles.notes[0] if roles.notes else ''})"
    attns = t.attention_layers()
    where = pattern_of(attns[0].name) if attns and attns[0].name else "NAME"
    return NotApplicable(
        f"no rotary embedding: none named *rotary_emb or of a Rotary class, and {seen}: "
        f"positions are learned, relative biases or absent; if the model applies RoPE, declare "
        f"the module that does (the one making the cos/sin table, or the attention rotating q "
        f"and k): {declare_line(rotary=where)}")


def _rope_attention(t: Target, attns: list[AttentionInfo]) -> AttentionInfo:
    """The first attention whose queries or keys the trace saw rotated (its role's
    ``rotary``), else the first attention."""
    roles = t.roles()
    for a in attns:
        role = roles.attention_of(a.name)
        if role is not None and role.rotary is not None:
            return a
    return attns[0]


def _tested(full: int, maxpos: int | None) -> str:
    """How many positions the check ran, in words."""
    if maxpos is None:
        return f"no max_position_embeddings in the config: tested the batch's own {full} positions"
    if maxpos > ROPE_FULL_LIMIT:
        return f"tested {full} of {maxpos} positions"
    return f"{full} positions (all max_position_embeddings) ran"


def _found_by(found: Rotary) -> str:
    """How the RoPE table was found, for the evidence (nothing when by its name, as before)."""
    if found.how == "named":
        return ""
    if found.how == "declared":
        return f"; RoPE declared ({found.module or '<root>'})"
    return f"; RoPE traced: {found.detail}"


@check(3, "rope", "RoPE positions")
def rope(t: Target, o: DoctorOptions) -> Outcome:
    """RoPE: relative-position scores over every position ``max_position_embeddings`` allows.

    Applies where the model has a RoPE table (:meth:`Target.rotary`: declared, named, or seen
    in one traced forward rotating an attention's queries or keys, whatever its modules are
    called; n/a otherwise, with the line that declares it). Runs the model on one token
    repeated ``max_position_embeddings`` times (up to :data:`ROPE_FULL_LIMIT`), reads the
    probabilities of the first attention layer RoPE rotates as :func:`hooks.capture` records
    them and tests that scores depend on i - j only over every position (a wrapped or clamped
    table breaks it; a table that is too short raises). Inputs longer than
    ``max_position_embeddings`` are not judged: HF models compute RoPE on the fly and accept
    them by design.
    """
    ids = t.need_ids()
    found = t.rotary()
    if found is None:
        raise _no_rotary(t)
    rot = t.rotary_module()
    attns = t.attention_layers()
    if not attns:
        raise NotApplicable("no attention module found")
    attn = _rope_attention(t, attns)
    maxpos = t.max_positions
    token = int(ids[0, 0])
    # without a configured limit only the batch's own length is known to be valid
    full = min(maxpos, ROPE_FULL_LIMIT) if maxpos else ids.shape[1]
    data: dict[str, Any] = dict(rotary=rot[0], rotary_how=found.how, attention=attn.name,
                                max_position_embeddings=maxpos, tested_length=full)
    rep = torch.full((1, full), token, dtype=ids.dtype, device=ids.device)
    try:
        probs = _layer0_probs(t, attn, rep)
    except (SkipCheck, NotApplicable):
        raise
    except Exception as exc:
        fault = model_fault(exc, __file__, t.module_names())
        if fault is None:
            raise
        if fault.module is not None and not ((rot[0] and fault.module.startswith(rot[0]))
                                             or t.attention_of(fault.module)):
            raise  # raised elsewhere in the model: the runner reports it as a skip
        data["error"] = one_line(exc, 160)
        return Outcome.fail(
            f"an input of {full} positions (max_position_embeddings = {maxpos}) raised "
            f"{one_line(exc, 160)}",
            "the RoPE cos/sin table is shorter than max_position_embeddings: build it for "
            "every position the config allows", rot[0] or None, **data)
    limit = _tested(full, maxpos)
    if probs is None:
        raise SkipCheck(f"relative positions not measured: hooks.capture records no attention "
                        f"probabilities for {attn.name} ({type(attn.module).__name__}); {limit}")
    viol, signal, compared = relative_position_violation(probs, ROPE_OFFSETS)
    data.update(violation=viol, signal=signal, compared=compared)
    if not (math.isfinite(viol) and math.isfinite(signal)):
        raise SkipCheck("attention probabilities are not finite (see the non-finite check)")
    if compared == 0:
        return Outcome.warn(f"relative positions not measurable: {attn.name} gives every earlier "
                            f"key zero weight on a repeated token; {limit}",
                            "see the causality check: the mask may hide every earlier position",
                            attn.name, **data)
    if signal < 1e-7:
        return Outcome.fail(
            f"{attn.name}: layer-0 scores on a repeated token do not depend on the key's "
            f"position at all (offset effect {fmt(signal)}); {limit}",
            "RoPE must rotate both q and k by their own positions; rotating only q (or "
            "all-zero q/k projections) removes the position signal", attn.name, **data)
    if viol > 1e-3 * signal + 1e-6:
        return Outcome.fail(
            f"{attn.name}: scores depend on absolute position: log-prob differences at a fixed "
            f"offset vary by {fmt(viol)} across positions (offset effect {fmt(signal)}); "
            f"{limit}",
            "a wrapped or clamped cos/sin table, or q and k rotated by different positions; "
            "look at the rotary embedding's table and position ids", rot[0] or None, **data)
    return Outcome.ok(f"repeated token over {full} positions: {attn.name}'s scores depend on "
                      f"i-j only (spread {fmt(viol)} vs offset effect {fmt(signal)}); {limit}"
                      f"{_found_by(found)}", rot[0] or None, **data)


# ---------------------------------------------------------------------------------------------
def _attention_inputs(t: Target, batch: Any,
                      attns: list[AttentionInfo]) -> dict[str, tuple[tuple, dict]]:
    """The (args, kwargs) each attention module was called with in one forward on ``batch``."""
    got: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for a in attns:
        def pre(mod, args, kwargs, name=a.name):
            got.setdefault(name, (args, dict(kwargs)))
        handles.append(a.module.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with t.mode(False), torch.no_grad():
            t.run(batch, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return got


def _bump_head(out: torch.Tensor, g: int, a: AttentionInfo, offset: int,
               gen: torch.Generator) -> torch.Tensor:
    """``out`` with noise on KV head g: columns ``offset + [g·Dh, (g+1)·Dh)`` of the last
    dimension, or ``out[..., g, :]`` when the output is laid out (..., Hkv, Dh)."""
    out = out.clone()
    dh = a.head_dim
    if out.dim() >= 2 and out.shape[-1] == dh and out.shape[-2] == a.num_kv_heads and offset == 0:
        sl = out[..., g, :]
        noise = torch.randn(sl.shape, generator=gen).to(sl)
        out[..., g, :] = sl + noise * (1.0 + float(sl.float().std()))
        return out
    lo = offset + g * dh
    sl = out[..., lo:lo + dh]
    noise = torch.randn(sl.shape, generator=gen).to(sl)
    out[..., lo:lo + dh] = sl + noise * (1.0 + float(sl.float().std()))
    return out


def head_mapping(a: AttentionInfo, args: tuple, kwargs: dict, which: str,
                 seed: int = 0) -> tuple[list[list[int]], list[float]]:
    """Which query heads read each KV head, measured.

    For each KV head g, adds noise to the keys (``which="k"``) or values (``"v"``) of head g
    where :class:`AttentionInfo` says they are (a ``k_proj``/``v_proj`` output, a ``k_norm``
    output, the k or v part of a fused q|k|v projection) with a forward hook, re-runs the
    attention module on the same inputs and lists the query heads whose slice of the per-head
    attention output (the input of the output projection, (B, T, H·Dh)) changed.

    Returns:
        (heads, deltas): ``heads[g]`` the changed query heads for KV head g; ``deltas`` the
        largest change of any head, per g.
    """
    mod = a.module
    dh, h = a.head_dim, a.num_heads
    site, offset = a.k_site if which == "k" else a.v_site
    seen: list[torch.Tensor] = []

    def grab(m, args):
        seen.append(args[0].detach().clone())

    gen = torch.Generator().manual_seed(seed)
    hk = a.out_site.register_forward_pre_hook(grab)
    try:
        with torch.no_grad():
            mod(*args, **kwargs)
            base = seen.pop()
            heads, deltas = [], []
            for g in range(a.num_kv_heads):
                hb = site.register_forward_hook(
                    lambda m, inp, out, g=g: _bump_head(out, g, a, offset, gen))
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


def _site_name(t: Target, a: AttentionInfo, which: str) -> str:
    site, _ = a.k_site if which == "k" else a.v_site
    rel = t.module_names().get(id(site), "?")
    return rel[len(a.name) + 1:] if rel.startswith(a.name + ".") else rel


@check(4, "gqa", "GQA head grouping")
def gqa(t: Target, o: DoctorOptions) -> Outcome:
    """Query head h must read KV head h // n_rep (``repeat_interleave``, HF ``repeat_kv``).

    Measured per attention layer with :func:`head_mapping` on the keys and on the values:
    after ``k_norm`` when the keys are normalised (OLMoE's spans every KV head), in the k/v part
    of a fused q|k|v projection (Phi-3). n/a when every attention has as many key/value heads
    as query heads (MHA: no grouping to test) or no per-KV-head projection to perturb (MLA).
    """
    t.need_ids()
    layers = t.attention_layers()
    if not layers:
        raise NotApplicable("no attention module found")
    attns = [a for a in layers if a.layout in ("separate", "fused")]
    others = [a for a in layers if a not in attns]
    if not attns:
        first = others[0]
        if all(a.layout == "mha" for a in others):
            raise NotApplicable(f"multi-head attention, no grouping to test: {first.why} "
                                f"({len(others)} attention module(s))")
        raise NotApplicable(f"no KV-head projections to perturb: {first.why}")
    ids = t.need_ids()[:1, : min(t.need_ids().shape[1], 16)]
    if ids.shape[1] < 2:
        raise SkipCheck("need at least 2 positions")
    inputs = _attention_inputs(t, t.batch_with(ids=ids, targets="drop"), attns)
    data: dict[str, Any] = {"layers": {},
                            "not_tested": {a.name: a.why for a in others}}
    for a in attns:
        if a.name not in inputs:
            continue
        args, kwargs = inputs[a.name]
        expected = [[h for h in range(a.num_heads) if h // a.n_rep == g]
                    for g in range(a.num_kv_heads)]
        layer = {"heads": a.num_heads, "kv_heads": a.num_kv_heads, "expected": expected,
                 "layout": a.layout, "k_site": _site_name(t, a, "k"),
                 "v_site": _site_name(t, a, "v")}
        for which in ("k", "v"):
            got, deltas = head_mapping(a, args, kwargs, which, seed=o.seed + 4)
            layer[f"{which}_proj"] = got
            if not all(math.isfinite(d) for d in deltas):
                raise SkipCheck(f"{a.name}: attention outputs are not finite "
                                "(see the non-finite check)")
            if got != expected:
                data["layers"][a.name] = layer
                modulo = [[h for h in range(a.num_heads) if h % a.num_kv_heads == g]
                          for g in range(a.num_kv_heads)]
                what = ("h % Hkv: `repeat` (tiling) used where `repeat_interleave` belongs"
                        if got == modulo else "neither h // n_rep nor h % Hkv")
                g = next(i for i in range(a.num_kv_heads) if got[i] != expected[i])
                return Outcome.fail(
                    f"{a.name}: perturbing {which} of KV head {g} (at {layer[f'{which}_site']}) "
                    f"changed query heads {got[g]}, expected {expected[g]} (h // n_rep, "
                    f"n_rep = {a.n_rep}); the mapping is {what}",
                    "expand KV heads with repeat_interleave(n_rep, dim=head) (HF repeat_kv), "
                    "so pretrained checkpoints and SDPA enable_gqa agree", a.name, **data)
        data["layers"][a.name] = layer
    if not data["layers"]:
        raise SkipCheck("no attention module ran in the forward pass")
    a = attns[0]
    k_at, v_at = _site_name(t, a, "k"), _site_name(t, a, "v")
    norm = a.k_site[0] if a.k_site else None
    w = getattr(norm, "weight", None)
    if k_at.endswith("k_norm") and isinstance(w, torch.Tensor) and a.num_kv_heads > 1 \
            and w.numel() == a.num_kv_heads * a.head_dim:
        k_at = f"after {k_at}, which normalises every KV head jointly"
    elif a.layout == "fused":
        k_at, v_at = f"k part of {k_at}", f"v part of {v_at}"
    return Outcome.ok(
        f"{len(data['layers'])} attention layer(s): perturbing K ({k_at}) or V ({v_at}) of KV "
        f"head g changed exactly query heads h with h // {a.n_rep} == g (H={a.num_heads}, "
        f"Hkv={a.num_kv_heads})", a.name, **data)
