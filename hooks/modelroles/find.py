"""Every role of a model, found once: traced from one forward, declared, or named.

:func:`find_roles` merges three sources, strongest first: the declaration
(:mod:`hooks.modelroles.declare`) wins; then the trace (:mod:`hooks.modelroles.traced`) and
the names (:mod:`hooks.modelroles.named`), which must agree on each role they both find.

Where the trace and the names both find a role and disagree, the named one is kept (the views
take names first, without a forward, so what :func:`find_roles` reports is what they use) and
:attr:`Roles.notes` says so: declare the right one to settle it.

The trace is one forward without gradients in eval mode, with the RNG forked (the caller's
random stream and every module's train flag are left as they were), on the batch given when
it is small (at most :data:`MAX_TRACE_TOKENS` ids), else on a synthetic batch of (2, 8) token
ids drawn below the first ``nn.Embedding``'s rows. It is cached per model instance, and
traced again when the model's modules change (a module added, removed or replaced).

Dimension legend: B batch, T positions, V vocabulary.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from hooks.modelroles.declare import ATTRIBUTE, declaration, declared_roles
from hooks.modelroles.found import AttentionRole, Found, MoERole, Roles, Rotary
from hooks.modelroles.graph import OpGraph
from hooks.modelroles.named import named_roles
from hooks.modelroles.traced import in_width, read_roles

#: The largest batch (B·T ids) traced as given; a larger one is replaced by a synthetic one.
MAX_TRACE_TOKENS = 4096
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _structure(model: nn.Module) -> tuple:
    return tuple((n, id(m)) for n, m in model.named_modules())


def synthetic_batch(model: nn.Module, batch: int = 2, seq: int = 8) -> torch.Tensor | None:
    """(B, T) int64 ids below the first ``nn.Embedding``'s rows (seeded), on its device; None
    for a model without an embedding."""
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        return None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, emb.num_embeddings, (batch, seq), generator=g)
    return ids.to(emb.weight.device)


def logits_of(output: Any) -> torch.Tensor | None:
    """The (B, T, V) float logits of a model's output: ``.logits``, ``["logits"]``, the first
    3-D float tensor of a tuple, or the output itself."""
    cand = getattr(output, "logits", None)
    if cand is None and isinstance(output, dict):
        cand = output.get("logits")
    if cand is None and isinstance(output, (tuple, list)):
        cand = next((x for x in output if isinstance(x, torch.Tensor) and x.dim() == 3
                     and x.is_floating_point()), None)
    if cand is None and isinstance(output, torch.Tensor):
        cand = output
    ok = isinstance(cand, torch.Tensor) and cand.dim() == 3 and cand.is_floating_point()
    return cand if ok else None


def _batches(model: nn.Module, batch: Any) -> list[Any]:
    from hooks.batch import Batch

    out = []
    b = None
    if batch is not None:
        try:
            b = Batch.of(batch)
        except ValueError:  # a batch of a kind Batch does not take: the synthetic one is tried
            b = None
    if b is not None:
        ids = b.ids(model)
        if ids is None or ids.numel() <= MAX_TRACE_TOKENS:
            out.append(b)
    ids = synthetic_batch(model)
    if ids is not None:
        out.append(Batch((ids,)))
    return out


def trace_roles(model: nn.Module, batch: Any = None) -> Roles:
    """The roles read from one traced forward (see the module docstring); never raises: a
    forward that fails, or no batch to run, is said in :attr:`Roles.notes` (``traced`` False).
    """
    tries = _batches(model, batch)
    if not tries:
        return Roles(notes=["no batch to trace one forward on (no batch given and no "
                            "nn.Embedding to draw token ids for)"])
    flags = [(m, m.training) for m in model.modules()]
    why, error = "", None
    for b in tries:
        g = OpGraph(model)
        try:
            model.eval()
            with torch.random.fork_rng(devices=[]), torch.no_grad(), g:
                out = b.call(model)
            logits = logits_of(out)
            return read_roles(g, model, id(logits) if logits is not None else None)
        except Exception as exc:  # the user's forward may raise anything
            why, error = f"{type(exc).__name__}: {exc}".splitlines()[0], exc
        finally:
            g.remove()
            for m, f in flags:
                m.training = f
    return Roles(notes=[f"one forward could not be traced ({why}): roles come from names and "
                        "the declaration only"], trace_error=error)


def traced_roles(model: nn.Module, batch: Any = None) -> Roles:
    """:func:`trace_roles`, cached per model instance while its modules stay the same."""
    key = _structure(model)
    hit = _CACHE.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    roles = trace_roles(model, batch)
    _CACHE[model] = (key, roles)
    return roles


def _disagree(t: AttentionRole, n: AttentionRole) -> str:
    diffs = [f"{what}: traced {a}, named {b}" for what, a, b in (
        ("o projection", t.o, n.o), ("heads", t.num_heads, n.num_heads),
        ("head dim", t.head_dim, n.head_dim)) if a is not None and b is not None and a != b]
    return "; ".join(diffs)


def _merge_attention(d: Roles, t: Roles, n: Roles, notes: list[str],
                     modules: dict[str, nn.Module]) -> list[AttentionRole]:
    out: dict[str, AttentionRole] = {}
    for a in t.attention:
        out[a.name] = a
    for a in n.attention:
        if a.name in out:
            why = _disagree(out[a.name], a)
            if why:
                notes.append(f"{a.name}: the trace and the names disagree ({why}); the named "
                             f"role is used, as the views read it without a forward: declare "
                             f"the right one to settle it")
                out[a.name] = replace(a, rotary=out[a.name].rotary)  # only the trace tells
            else:
                t_ = out[a.name]
                out[a.name] = replace(t_, detail=t_.detail + "; names agree", **{
                    p: getattr(a, p) for p in ("q", "k", "v", "q_norm", "k_norm")
                    if getattr(t_, p) is None and getattr(a, p) is not None})
            continue
        out[a.name] = a
    for a in d.attention:
        base = out.get(a.name)
        if base is not None:
            a.num_heads = a.num_heads or base.num_heads
            a.num_kv_heads = a.num_kv_heads or base.num_kv_heads
            a.o = a.o or base.o
            a.q, a.k, a.v, a.kernel = base.q, base.k, base.v, base.kernel
            a.q_norm, a.k_norm, a.rotary = base.q_norm, base.k_norm, base.rotary
            if a.head_dim is None and a.num_heads == base.num_heads:
                a.head_dim = base.head_dim
        width = in_width(modules[a.o]) if a.o in modules else None
        if a.head_dim is None and a.num_heads and width and width % a.num_heads == 0:
            a.head_dim = width // a.num_heads  # the declared H over the o projection's input
        out[a.name] = a
    return list(out.values())


def _merge_moe(d: Roles, t: Roles, n: Roles) -> list[MoERole]:
    out: dict[str, MoERole] = {m.name: m for m in n.moe}
    out.update({m.name: m for m in t.moe})
    for m in d.moe:
        base = out.get(m.name)
        if base is not None:
            m.router = m.router or base.router
            m.experts = m.experts or base.experts
            m.num_experts = m.num_experts or base.num_experts
            m.top_k = base.top_k
        out[m.name] = m
    return list(out.values())


def _single(d: Found | None, t: Found | None, n: Found | None, what: str,
            notes: list[str]) -> Found | None:
    if t is not None and n is not None:
        if t.module != n.module:
            notes.append(f"{what}: the trace found {t.module}, the names {n.module}; the named "
                         "one is used, as the views read it without a forward: declare the "
                         "right one to settle it")
            t = None
        else:
            t = replace(t, detail=f"{t.detail}; {n.detail} agrees")
    return d or t or n


def _norms(d: Roles, t: Roles, n: Roles, modules: dict[str, nn.Module]) -> list[Found]:
    """Every norm: the declared final norm, the traced, the named (each module once, the
    strongest first), in module order."""
    got: dict[str, Found] = {}
    for f in ([d.final_norm] if d.final_norm else []) + t.norms + n.norms:
        got.setdefault(f.module, f)
    return [got[name] for name in modules if name in got]


def _rotary(d: Roles, t: Roles, n: Roles, modules: dict[str, nn.Module]) -> list[Rotary]:
    """Every RoPE table: the declared, the traced, the named (each module once, the strongest
    first; a traced one its name also gives says so), in module order."""
    got: dict[str, Rotary] = {}
    for r in d.rotary + t.rotary:
        got.setdefault(r.module, r)
    for r in n.rotary:
        have = got.get(r.module)
        if have is None:
            got[r.module] = r
        elif have.how == "traced":
            got[r.module] = replace(have, detail=f"{have.detail}; {r.detail} agrees")
    return [got[name] for name in modules if name in got]


def find_roles(model: nn.Module, batch: Any = None, *, trace: bool = True,
               declared: bool = True) -> Roles:
    """Every role of ``model``: declared, else traced or named, which must agree (see the
    module docstring).

    Args:
        model: any ``nn.Module``.
        batch: what the model is called with (a tensor of ids, a tuple, a dict or a
            :class:`hooks.Batch`), used for the trace when small; None: a synthetic batch.
        trace: False: declared and named roles only (no forward runs).
        declared: False: the declaration is not read (traced and named roles only; what a
            view uses when the declaration does not fit the model, having said so).

    Returns:
        Roles: each role with ``how`` (``declared``, ``traced``, ``named``).

    Raises:
        ValueError: one line, for a declaration that does not fit the model.
    """
    d = declared_roles(model) if declared else Roles()
    t = traced_roles(model, batch) if trace else Roles()
    n = named_roles(model)
    notes = list(t.notes)
    modules = dict(model.named_modules())
    roles = Roles(_merge_attention(d, t, n, notes, modules),
                  _single(d.lm_head, t.lm_head, n.lm_head, "LM head", notes),
                  _single(d.final_norm, t.final_norm, n.final_norm, "final norm", notes),
                  _merge_moe(d, t, n), notes, traced=t.traced, trace_error=t.trace_error,
                  norms=_norms(d, t, n, modules), rotary=_rotary(d, t, n, modules))
    return roles


def roles(model: nn.Module, batch: Any = None, **declared: Any) -> Roles:
    """``hooks.roles``: declare roles of ``model`` (keywords of
    :data:`hooks.modelroles.declare.KEYS`), then return every role of it
    (:func:`find_roles`). The declaration is kept on the model as ``__mdb_roles__`` (merged
    with one already there), so every view reads it; a ``--model`` factory can call this.

    Example::

        hooks.roles(model, attention="blocks.*.attn", heads=4, lm_head="head",
                    final_norm="ln_f", router="blocks.*.moe.gate", experts="blocks.*.moe.ffn")

    Args:
        model: the model.
        batch: the batch a trace runs on (default: a synthetic one).
        **declared: ``attention``, ``heads``, ``kv_heads``, ``o``, ``lm_head``, ``final_norm``,
            ``router``, ``experts``, ``rotary``; none: nothing is declared, the roles are only
            found.

    Raises:
        ValueError: one line: an unknown keyword, a name that matches no module, a bad count.
    """
    if declared:
        merged = {**declaration(model), **{k: v for k, v in declared.items() if v is not None}}
        declared_roles(model, merged)  # checked before it is kept
        setattr(model, ATTRIBUTE, merged)
    return find_roles(model, batch)
