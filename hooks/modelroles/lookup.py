"""One role at a time, for the views that need one (edits, the logit lens, the doctor): the
declaration first, then the names (no forward runs), then the traced roles of
:func:`hooks.modelroles.find_roles` (one forward, cached per model). Each answer is the role,
or one line that names the module, says what was looked for and gives the line that declares
it.

A module that cannot play the role by its structure (attention without a projection inside
it: a Linear itself, a norm; an MoE block without a list of experts or a 3-D weight) is
refused without a forward.

Dimension legend: H query heads, Dh head dim, E experts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hooks.modelroles.declare import declare_line, declared_roles, pattern_of
from hooks.modelroles.find import find_roles
from hooks.modelroles.found import AttentionRole, Found, MoERole
from hooks.modelroles.named import int_attr, named_attention, named_moe
from hooks.modelroles.traced import is_projection


def _complete(a: AttentionRole | None) -> bool:
    return a is not None and bool(a.num_heads and a.head_dim and a.o)


def attention_hint(name: str, heads: int | None = None) -> str:
    """The line that declares ``name`` (and the modules of its other layers) attention."""
    return declare_line(attention=[pattern_of(name)], heads=heads or "H").replace("'H'", "H")


def attention_role(model: nn.Module, name: str, batch: Any = None) -> AttentionRole | str:
    """The attention role of module ``name`` with its heads and o projection, or one line
    saying why not.

    Returns:
        AttentionRole with ``num_heads`` (H), ``head_dim`` (Dh) and ``o`` set (how:
        ``declared``, ``named`` or ``traced``), else the reason: what was looked for and the
        line that declares it.

    Raises:
        ValueError: the model's declaration does not fit it (one line).
    """
    modules = dict(model.named_modules())
    m = modules.get(name)
    if m is None:
        return f"no module {name!r}"
    declared = declared_roles(model).attention_of(name)
    named = named_attention(name, m, getattr(model, "config", None))
    if _complete(declared):
        return declared
    if declared is None and not isinstance(named, str):
        return named
    kind = type(m).__name__
    if not any(is_projection(c) for c in m.modules() if c is not m):
        return (f"{name} ({kind}) is not attention: it holds no projection (looked for a "
                f"softmax over q·kᵀ of two projections' outputs, or F.scaled_dot_product_"
                f"attention, inside it); if it is, declare it: {attention_hint(name)}")
    roles = find_roles(model, batch)
    found = roles.attention_of(name)
    if _complete(found):
        return found
    why = "".join(f" ({n})" for n in roles.notes)
    heads = int_attr(m, ("h", "n_heads", "heads", "num_heads", "n_head"))
    if found is not None:
        line = attention_hint(name, found.num_heads)
        if found.o is None:
            line = line[:-1] + ", o='CHILD')"
        return (f"{name} ({kind}) is attention ({found.detail}), but its "
                f"{'o projection' if found.o is None else 'heads'} could not be read; declare "
                f"it: {line}")
    return (f"{name} ({kind}) is not an attention module mdb found: looked for a softmax over "
            f"q·kᵀ scores of two projections' outputs, or an F.scaled_dot_product_attention "
            f"call, in one forward{why}, and for HF's names ({named}); if it is attention, "
            f"declare it: {attention_hint(name, heads)}")


def lm_head_role(model: nn.Module, batch: Any = None) -> Found | str:
    """The LM head (declared, named, traced), or one line saying why not and how to declare
    it."""
    from hooks.modelroles.named import named_lm_head

    d = declared_roles(model).lm_head
    if d is not None:
        return d
    names = {id(m): n for n, m in reversed(list(model.named_modules()))}
    n = named_lm_head(model, names)
    if n is not None:
        return n
    roles = find_roles(model, batch)
    if roles.lm_head is not None:
        return roles.lm_head
    why = "".join(f" ({n})" for n in roles.notes)
    return (f"{type(model).__name__} has no LM head mdb found: looked for the projection whose "
            f"output is the logits the model returns, in one forward{why}, then "
            f"get_output_embeddings() and a child lm_head; declare it: "
            f"{declare_line(lm_head='NAME')}")


def final_norm_role(model: nn.Module, batch: Any = None) -> Found | str:
    """The final norm (declared, traced when the head is not named, named), or one line."""
    from hooks.modelroles.named import named_final_norm

    d = declared_roles(model).final_norm
    if d is not None:
        return d
    n = named_final_norm(dict(model.named_modules()))
    if n is not None:
        return n
    roles = find_roles(model, batch)
    if roles.final_norm is not None:
        return roles.final_norm
    why = "".join(f" ({n})" for n in roles.notes)
    return (f"{type(model).__name__} has no final norm mdb found: looked for the norm whose "
            f"output the LM head reads, in one forward{why}, and for a module named norm, "
            f"ln_f, final_layer_norm…; declare it: {declare_line(final_norm='NAME')}")


def _may_hold_experts(m: nn.Module) -> bool:
    return any(isinstance(c, nn.ModuleList) or any(
        isinstance(p, torch.Tensor) and p.dim() == 3 for p in c.parameters(recurse=False))
        for c in m.modules())


def moe_role(model: nn.Module, name: str, batch: Any = None) -> MoERole | str:
    """The MoE block that module ``name`` is (or whose experts or router it is): declared,
    named (an ``experts`` child), traced; else one line saying why not."""
    modules = dict(model.named_modules())
    m = modules.get(name)
    if m is None:
        return f"no module {name!r}"
    d = declared_roles(model).moe_of(name)
    if d is not None and d.experts:
        return d
    parent = name.rpartition(".")[0]
    for bname in (name, parent):
        block = modules.get(bname)
        n = named_moe(bname, block) if block is not None else None
        if n is not None and name in (n.name, n.experts, n.router):
            return n
    kind = type(m).__name__
    looked = ("looked for a topk over a projection's scores beside a list of E experts, in one "
              "forward")
    line = declare_line(router=[pattern_of(f"{name}.ROUTER")],
                        experts=[pattern_of(f"{name}.EXPERTS")])
    if not _may_hold_experts(m):
        return (f"{name} ({kind}) is not an MoE block: it holds no list of experts ({looked}, "
                f"and for a child named experts); if it is one, declare it: {line}")
    found = find_roles(model, batch).moe_of(name)
    if found is not None and found.experts:
        return found
    return (f"{name} ({kind}) is not an MoE block mdb found ({looked}, and for a child named "
            f"experts); if it is one, declare it: {line}")
