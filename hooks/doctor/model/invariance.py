"""Checks 21-25: invariances. The model's output at a token must not change under a
transformation that should not change it: padding the row, batching it with other rows,
decoding it with a cache, another attention implementation, packing it after another document.

Each check runs the user's own model on a row of its own batch (the last row: a leak along the
batch reaches it from the rows before) twice, in eval mode without gradients, through
:func:`hooks.doctor.model.invariance_compare.compare`: the largest difference of the logits at
the row's real tokens, against a tolerance from the dtype; when beyond it, both runs again under
:func:`hooks.capture` and the first module where they part (the records side by side, as
``mdb diff`` lines them up); and what usually causes it. One or a few extra forwards, no
backward.

Dimension legend: B batch, T sequence, P pads, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hooks.batch import Batch
from hooks.doctor.model.invariance_compare import Comparison, Segment, compare
from hooks.doctor.model.registry import DoctorOptions, check
from hooks.doctor.model.result import Outcome
from hooks.doctor.model.target import NotApplicable, SkipCheck, Target, fmt

#: Tokens decoded one at a time with the cache after the prefix (cache check).
INCREMENTAL_STEPS = 2


def _decoder(t: Target, what: str) -> None:
    """:class:`NotApplicable` unless the model may be a decoder (declared one, or undeclared)."""
    if t.kind.kind not in ("decoder", "unknown"):
        raise NotApplicable(f"{what} applies to decoder-only models; this one is "
                            f"{t.kind.kind} ({t.kind.reason})")


def _row(t: Target) -> torch.Tensor:
    """(1, T) the batch's last row."""
    return t.need_ids()[-1:]


def _set(t: Target, batch: Batch, **named: Any) -> Batch:
    """``batch`` with arguments set by the forward's parameter name (positional or keyword)."""
    args, kwargs = list(batch.args), dict(batch.kwargs)
    slots = {s.name: s for s in batch.slots(t.model)}
    for name, value in named.items():
        s = slots.get(name)
        if s is not None and isinstance(s.where, int):
            args[s.where] = value
        else:
            kwargs[name] = value
    return batch.replace(args=args, kwargs=kwargs)


def _logits_of(t: Target, batch: Batch, **extra: Any) -> torch.Tensor:
    """(B, T, V) logits of ``batch`` (T: the decoder's positions of an encoder-decoder)."""
    out = t.run(batch, **extra)
    ids = batch.slot("decoder_ids", t.model) if t.kind.kind == "encoder-decoder" else None
    n = batch.get(ids.where).shape[1] if ids is not None else batch.ids(t.model).shape[1]
    return t.need_logits(out, n).detach()


def _runner(t: Target, batch: Batch, **extra: Any) -> Callable[[], torch.Tensor]:
    return lambda: _logits_of(t, batch, **extra)


def _positions(mask_BT: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids counting real tokens only (HF's ``cumsum − 1``, pads at 0)."""
    return (mask_BT.long().cumsum(1) - 1).clamp_min(0)


def _verdict(cmp: Comparison, what: str, hint: str, causes: Callable[[str, str], str],
             **data: Any) -> Outcome:
    """The outcome of a comparison: pass, or fail with where the runs part and its cause."""
    if not cmp.finite:
        return Outcome.skip(f"{what}: the row's own logits are not finite, so no difference "
                            "can be judged (see the nonfinite check)")
    w = cmp.worst
    data.update(tolerance=cmp.tolerance.text(), gaps={
        g.label: dict(max_abs=g.max_abs, threshold=g.threshold, position=g.position)
        for g in cmp.gaps})
    if not cmp.over:
        return Outcome.ok(f"{what}: largest difference {fmt(w.max_abs)} ≤ {fmt(w.threshold)} "
                          f"({cmp.tolerance.text()})", **data)
    ev = (f"{what}: the {w.label} differs by {fmt(w.max_abs)} at position {w.position} "
          f"(> {fmt(w.threshold)}, {cmp.tolerance.text()})")
    p = cmp.parting
    if p is not None:
        data.update(parting=dict(module=p.module, module_type=p.module_type, call=p.call,
                                 tensor=p.tensor, max_abs=p.max_abs, label=p.label,
                                 origin=p.origin))
        ev += f"; the runs part first at {p.describe()}"
        hint = causes(p.origin, p.module_type if p.within is None else "") or hint
    else:
        ev += "; " + "; ".join(cmp.notes)
    return Outcome.fail(ev, hint, p.origin if p is not None else None, **data)


def _kind_of(module: str, module_type: str) -> str:
    """``positions``, ``attention``, ``norm``, ``moe`` or ``other``, by name and class."""
    s = f"{module} {module_type}".lower()
    if any(k in s for k in ("rotary", "rope", "position", "wpe", "pos_emb")):
        return "positions"
    if "attn" in s or "attention" in s:
        return "attention"
    if "norm" in s:
        return "norm"
    if any(k in s for k in ("moe", "expert", "router", "gate")):
        return "moe"
    return "other"


# -- padding ------------------------------------------------------------------------------------
def _padding_causes(module: str, module_type: str) -> str:
    k = _kind_of(module, module_type)
    if k == "positions":
        return ("positions are counted from the start of the padded row, not from its first "
                "real token: derive position_ids per row from the attention_mask (cumsum − 1) "
                "(nnsight #672: one position vector shared by the rows of a left-padded batch)")
    if k == "attention":
        return ("the attention_mask does not reach this attention, so real tokens attend to "
                "pads: combine the padding mask with the causal mask in every call, prefill "
                "included (unsloth #3699, fixed by unsloth PR #4100)")
    return ("a real token's output depends on the pads: mask them out of every reduction over "
            "positions (attention, pooling, norms over T) and count positions from real tokens")


@check(21, "padding", "padding invariance")
def padding(t: Target, o: DoctorOptions) -> Outcome:
    """A row alone against the same row left-padded and right-padded in one batch, with its
    ``attention_mask`` (and ``position_ids`` counting real tokens, where the forward takes
    them): the logits at the real tokens must agree within the dtype's tolerance."""
    _decoder(t, "padding invariance")
    if not t.accepts("attention_mask"):
        raise NotApplicable("the forward takes no attention_mask argument: a padded row "
                            "cannot be told apart from its pads")
    row = _row(t)
    pads = max(1, row.shape[1] // 4)
    limit = t.max_positions
    if limit is not None and row.shape[1] + pads > limit:
        row = row[:, :limit - pads]
    n = row.shape[1]
    pad_id = t.cfg("pad_token_id")
    pad_id = pad_id if isinstance(pad_id, int) and 0 <= pad_id < t.vocab_size else 0
    pad = torch.full((1, pads), pad_id, dtype=row.dtype, device=row.device)
    ids = torch.cat([torch.cat([pad, row], 1), torch.cat([row, pad], 1)])  # (2, T + P)
    mask = torch.ones_like(ids)
    mask[0, :pads] = 0
    mask[1, n:] = 0
    named: dict[str, Any] = {"attention_mask": mask}
    if t.accepts("position_ids"):
        named["position_ids"] = _positions(mask)
    alone = t.batch_with(ids=row, targets="logits")
    padded = _set(t, t.batch_with(ids=ids, targets="logits"), **named)
    real = torch.arange(n)
    segs = [Segment(0, 0, real + pads, real, "left-padded row"),
            Segment(0, 1, real, real, "right-padded row")]
    with t.mode(False), torch.no_grad():
        cmp = compare(t.model, _runner(t, alone, use_cache=False),
                      lambda: [_logits_of(t, padded, use_cache=False)], segs)
    what = (f"a row of {n} tokens alone vs left- and right-padded by {pads} (attention_mask"
            f"{', position_ids' if 'position_ids' in named else ''})")
    return _verdict(cmp, what, _padding_causes("", ""), _padding_causes, pads=pads,
                    tokens=n, position_ids="position_ids" in named)


# -- batch composition --------------------------------------------------------------------------
def _batch_causes(module: str, module_type: str) -> str:
    base = ("a row's output depends on the other rows: a reduction over the batch axis (a "
            "norm or mean over dim 0, BatchNorm-like statistics in eval), or rows mixed by a "
            "reshape/transpose that crosses the batch axis")
    if _kind_of(module, module_type) == "moe":
        return base + "; in an MoE block: an expert capacity or a routing decided per batch"
    return base


@check(22, "batch", "batch invariance")
def batch_composition(t: Target, o: DoctorOptions) -> Outcome:
    """A row alone against the same row in a batch with other rows (the batch's own rows, or a
    random second row when it has one): its logits must agree within the dtype's tolerance."""
    ids = t.need_ids()
    dec = t.decoder_ids() if t.kind.kind == "encoder-decoder" else None
    if ids.shape[0] < 2:
        gen = torch.Generator().manual_seed(o.seed)
        ids = torch.cat([torch.randint(0, t.vocab_size, ids.shape, generator=gen).to(ids), ids])
        if dec is not None:
            dec = torch.cat([torch.randint(0, t.vocab_size, dec.shape, generator=gen).to(dec),
                             dec])
    b, n = ids.shape[0], (dec if dec is not None else ids).shape[1]
    alone = t.batch_with(ids=ids[-1:], targets="logits",
                         decoder_ids=None if dec is None else dec[-1:])
    together = t.batch_with(ids=ids, targets="logits", decoder_ids=dec)
    segs = [Segment(0, b - 1, torch.arange(n), torch.arange(n), f"row {b - 1} of {b}")]
    with t.mode(False), torch.no_grad():
        cmp = compare(t.model, _runner(t, alone, use_cache=False),
                      lambda: [_logits_of(t, together, use_cache=False)], segs)
    return _verdict(cmp, f"row {b - 1} alone vs in a batch of {b}", _batch_causes("", ""),
                    _batch_causes, batch_size=b, tokens=n)


# -- cache --------------------------------------------------------------------------------------
def _cache_param(t: Target) -> str | None:
    for name in ("cache", "past_key_values", "past_key_value"):
        if name in t.forward_params:
            return name
    return None


def _cache_of(out: Any) -> Any:
    for name in ("past_key_values", "cache"):
        c = out.get(name) if isinstance(out, dict) else getattr(out, name, None)
        if c is not None:
            return c
    if isinstance(out, (tuple, list)) and len(out) > 1 and not isinstance(out[1], torch.Tensor):
        return out[1]
    return None


def _cache_causes(module: str, module_type: str) -> str:
    if _kind_of(module, module_type) == "positions":
        return ("positions restart at 0 in each incremental call: offset them by the cached "
                "length (cache_position / past length)")
    return ("a layer computes differently with and without the cache: state kept in the cache "
            "object (a layer reading another's K/V from it) is missing when use_cache=False, "
            "or the cache is appended to wrongly; pass shared K/V through the forward itself "
            "(transformers #45242)")


@check(23, "cache", "cache invariance")
def cache(t: Target, o: DoctorOptions) -> Outcome:
    """``use_cache=False`` against ``use_cache=True`` and against incremental decoding (a
    prefix, then :data:`INCREMENTAL_STEPS` tokens one at a time with the returned cache) of the
    same row: the logits must agree within the dtype's tolerance."""
    _decoder(t, "cache invariance")
    name = _cache_param(t)
    if name is None or "use_cache" not in t.forward_params:
        raise NotApplicable("the forward takes no use_cache and past_key_values (no KV cache)")
    row = _row(t)
    n = row.shape[1]
    if n <= INCREMENTAL_STEPS:
        raise SkipCheck(f"the batch's rows have {n} tokens: cannot decode a prefix and "
                        f"{INCREMENTAL_STEPS} more")
    alone = t.batch_with(ids=row, targets="logits")
    cut = n - INCREMENTAL_STEPS
    pieces = [t.batch_with(ids=row[:, a:b], targets="logits")
              for a, b in [(0, cut)] + [(i, i + 1) for i in range(cut, n)]]

    def incremental() -> list[torch.Tensor]:
        out, past = [], None
        for piece in pieces:
            res = t.run(piece, use_cache=True, **({name: past} if past is not None else {}))
            out.append(t.need_logits(res, piece.ids(t.model).shape[1]).detach())
            past = _cache_of(res)
            if past is None:
                raise NotApplicable("use_cache=True returned no past_key_values to decode on")
        return out

    full = [Segment(0, 0, torch.arange(n), torch.arange(n), "use_cache=True run")]
    steps = [Segment(0, 0, torch.arange(cut), torch.arange(cut), "cached prefix")] + [
        Segment(i + 1, 0, torch.zeros(1, dtype=torch.long), torch.tensor([cut + i]),
                f"incremental token {cut + i}") for i in range(INCREMENTAL_STEPS)]
    what = f"use_cache=False vs use_cache=True and incremental decoding ({n} tokens)"
    with t.mode(False), torch.no_grad():
        ref = _runner(t, alone, use_cache=False)
        cmp = compare(t.model, ref, lambda: [_logits_of(t, alone, use_cache=True)], full)
        if not cmp.over:
            inc = compare(t.model, ref, incremental, steps)
            inc.gaps = cmp.gaps + inc.gaps
            cmp = inc
    return _verdict(cmp, what, _cache_causes("", ""), _cache_causes, tokens=n,
                    incremental_steps=INCREMENTAL_STEPS)


# -- attention implementation ------------------------------------------------------------------
@contextlib.contextmanager
def _attn_impl(t: Target, impl: str) -> Iterator[None]:
    """Run the block with attention implementation ``impl`` and restore the previous one: HF's
    ``set_attn_implementation`` (``config._attn_implementation``), else every module's own
    ``attn_implementation`` attribute (minillm) and nanoGPT's ``flash`` flag."""
    setter = getattr(t.model, "set_attn_implementation", None)
    config = t.config
    if callable(setter) and config is not None and hasattr(config, "_attn_implementation"):
        before = config._attn_implementation
        setter(impl)
        try:
            yield
        finally:
            setter(before)
        return
    mods = [m for m in t.model.modules()
            if isinstance(getattr(m, "attn_implementation", None), str)]
    flash = _flash_modules(t)
    saved = [(m, "attn_implementation", m.attn_implementation) for m in mods] + [
        (m, "flash", m.flash) for m in flash]
    for m in mods:
        m.attn_implementation = impl
    for m in flash:
        m.flash = impl == "sdpa"
    try:
        yield
    finally:
        for m, name, v in saved:
            setattr(m, name, v)


def _flash_modules(t: Target) -> list[torch.nn.Module]:
    """nanoGPT's attention modules: a bool ``flash`` (SDPA, else the hand-written softmax) and
    the (1, 1, T, T) causal mask ``bias`` its hand-written path reads (nanoGPT registers it
    only when ``flash`` is off at construction)."""
    return [m for m in t.model.modules() if isinstance(getattr(m, "flash", None), bool)
            and isinstance(getattr(m, "bias", None), torch.Tensor) and m.bias.dim() == 4]


def _has_impl_switch(t: Target) -> str | None:
    if callable(getattr(t.model, "set_attn_implementation", None)) and hasattr(
            t.config, "_attn_implementation"):
        return "config._attn_implementation"
    if any(isinstance(getattr(m, "attn_implementation", None), str) for m in t.model.modules()):
        return "the attention modules' attn_implementation"
    if _flash_modules(t):
        return "nanoGPT's flash flag"
    return None


def _impl_causes(module: str, module_type: str) -> str:
    return ("the eager and SDPA paths compute different attention: a scale (1/√Dh) applied in "
            "one path only, a mask (causal, padding, sliding window) built differently, or "
            "K/V heads repeated in another order; make both paths read the same mask and scale")


@check(24, "attn-impl", "attention implementation invariance")
def attn_impl(t: Target, o: DoctorOptions) -> Outcome:
    """The row under the eager attention implementation against SDPA (flex attention is not
    compared: it compiles on first use), switched through HF's ``set_attn_implementation``,
    the attention modules' ``attn_implementation`` (minillm) or nanoGPT's ``flash`` flag: the
    logits must agree within the dtype's tolerance."""
    t.need_ids()
    how = _has_impl_switch(t)
    if how is None:
        raise NotApplicable("no switch between attention implementations (HF's "
                            "set_attn_implementation / config._attn_implementation, an "
                            "attn_implementation attribute on the attention modules, or "
                            "nanoGPT's flash flag beside its causal-mask buffer bias)")
    row = _row(t)
    alone = t.batch_with(ids=row, targets="logits")

    def under(impl: str) -> torch.Tensor:
        with _attn_impl(t, impl):
            return _logits_of(t, alone, use_cache=False)

    try:
        with _attn_impl(t, "sdpa"):
            pass
    except (ValueError, ImportError) as exc:
        raise NotApplicable(f"the model has no SDPA path: {exc}") from None
    n = row.shape[1]
    segs = [Segment(0, 0, torch.arange(n), torch.arange(n), "SDPA run")]
    with t.mode(False), torch.no_grad():
        cmp = compare(t.model, lambda: under("eager"), lambda: [under("sdpa")], segs)
    return _verdict(cmp, f"eager vs SDPA attention via {how} ({n} tokens)",
                    _impl_causes("", ""), _impl_causes, tokens=n)


# -- packing ------------------------------------------------------------------------------------
def _packing_causes(module: str, module_type: str) -> str:
    if _kind_of(module, module_type) == "positions":
        return ("the packed document's positions do not restart at 0: read position_ids (they "
                "restart at each document) instead of counting from the start of the row")
    return ("a packed document attends to the document before it: build a block-diagonal "
            "causal mask from the position_ids restarts (or the document ids), as HF does for "
            "padding-free packing")


@check(25, "packing", "packing invariance")
def packing(t: Target, o: DoctorOptions) -> Outcome:
    """A document alone against the same document packed after another in one row, with
    ``position_ids`` that restart at 0 at each document (HF's padding-free packing): its logits
    must agree within the dtype's tolerance."""
    _decoder(t, "packing invariance")
    if "position_ids" not in t.forward_params:
        raise NotApplicable("the forward takes no position_ids: documents packed in one row "
                            "cannot be told apart")
    row = _row(t)
    n = row.shape[1]
    m = max(2, n // 2)
    limit = t.max_positions
    if limit is not None and m + n > limit:
        row, n = row[:, :max(1, limit - m)], max(1, limit - m)
    other = torch.randint(0, t.vocab_size, (1, m),
                          generator=torch.Generator().manual_seed(o.seed + 1)).to(row)
    packed_ids = torch.cat([other, row], 1)
    pos = torch.cat([torch.arange(m), torch.arange(n)]).unsqueeze(0).to(row.device)
    alone = _set(t, t.batch_with(ids=row, targets="logits"),
                 position_ids=torch.arange(n, device=row.device).unsqueeze(0))
    packed = _set(t, t.batch_with(ids=packed_ids, targets="logits"), position_ids=pos)
    real = torch.arange(n)
    segs = [Segment(0, 0, real + m, real, "packed document")]
    with t.mode(False), torch.no_grad():
        cmp = compare(t.model, _runner(t, alone, use_cache=False),
                      lambda: [_logits_of(t, packed, use_cache=False)], segs)
    return _verdict(cmp, f"a document of {n} tokens alone vs packed after one of {m} "
                         "(position_ids restarting)", _packing_causes("", ""), _packing_causes,
                    tokens=n, before=m)
