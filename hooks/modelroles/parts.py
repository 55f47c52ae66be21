"""What part each module plays, from the roles (:func:`hooks.modelroles.find_roles`): the
projections of queries, keys and values (separate, fused q|k|v, fused k|v), the attention
output, the router, the norms and the LM head. The doctor labels every parameter by it (its
init report, its gradient per loss term).

The parts of an attention module come from its role's q/k/v columns and o projection
(declared, traced or named); where the role does not give one, from the module's children's
names (:func:`hooks.modelroles.named.named_parts`), and for modules that look like attention
by name but have no role, from those names alone. ``nn.MultiheadAttention`` holds its own
q|k|v weight (``in_proj_weight``) and its ``out_proj``.

Dimension legend: D hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from hooks.modelroles.found import AttentionRole, Roles
from hooks.modelroles.named import looks_like_attention, named_parts

#: The parts of :func:`module_parts`, beside the MLP's (``mlp_in``, ``mlp_out``).
PARTS = ("q", "k", "v", "qkv", "kv", "attn_out", "router", "norm", "lm_head")


def _qkv_part(parts: set[str]) -> str:
    """``q``, ``k``, ``v`` for one; ``kv`` for keys and values together; ``qkv`` otherwise."""
    if len(parts) == 1:
        return next(iter(parts))
    return "kv" if parts == {"k", "v"} else "qkv"


def _attention_parts(a: AttentionRole, m: nn.Module | None) -> dict[str, str]:
    held: dict[str, set[str]] = {}
    for p in ("q", "k", "v"):
        c = getattr(a, p)
        if c is not None:
            held.setdefault(c.module, set()).add(p)
    out = {mod: _qkv_part(ps) for mod, ps in held.items()}
    if a.o is not None:
        out[a.o] = "attn_out"
    found = set().union(*held.values()) if held else set()
    if m is not None and (len(found) < 3 or a.o is None):  # names fill what the role lacks
        for mod, part in named_parts(a.name, m).items():
            missing = part == "attn_out" and a.o is None or part != "attn_out" and not (
                set(part) & found)
            if missing:
                out.setdefault(mod, part)
    return out


def _inside(name: str, roots: list[str]) -> bool:
    return any(name == r or name.startswith(r + ".") or r.startswith(name + ".")
               or r == "" or name == "" for r in roots)


def module_parts(model: nn.Module, roles: Roles) -> dict[str, str]:
    """Qualified module name → its part (:data:`PARTS`) for the modules ``roles`` place.

    A module under a placed one takes its part (diffusers' ``to_out = Sequential(Linear,
    Dropout)``). A module that is two parts takes the later one of: attention parts, router,
    norm, LM head.

    Returns:
        dict[str, str]; the modules no role places are absent (the MLP's projections among
        them: :func:`hooks.modelroles.named.mlp_part` and their shapes tell those).
    """
    modules = dict(model.named_modules())
    out: dict[str, str] = {}

    def put(name: str, part: str, overwrite: bool = False) -> None:
        m = modules.get(name)
        if m is None:
            return
        for sub, _ in m.named_modules():
            full = f"{name}.{sub}" if name and sub else (sub or name)
            if overwrite:
                out[full] = part
            else:
                out.setdefault(full, part)

    for a in roles.attention:
        for mod, part in _attention_parts(a, modules.get(a.name)).items():
            put(mod, part)
    placed = [a.name for a in roles.attention]
    for name, m in modules.items():
        if isinstance(m, nn.MultiheadAttention):
            out.setdefault(name, "qkv")  # its in_proj_weight (3·D, D)
            put(f"{name}.out_proj" if name else "out_proj", "attn_out")
        elif looks_like_attention(m) and not _inside(name, placed):
            for mod, part in named_parts(name, m).items():
                put(mod, part)
    for b in roles.moe:
        if b.router is not None:
            put(b.router, "router", overwrite=True)
    for n in roles.norms:
        put(n.module, "norm", overwrite=True)
    if roles.lm_head is not None:
        put(roles.lm_head.module, "lm_head", overwrite=True)
    return out


def norm_scale(m: nn.Module) -> torch.Tensor | None:
    """A norm's elementwise scale: its ``weight``, else its one 1-D parameter (one's own
    ``gain``, ``scale``, ``g``); None when it has none (or several)."""
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor):
        return w
    ones = [p for p in m.parameters(recurse=False) if p.dim() == 1]
    return ones[0] if len(ones) == 1 else None


__all__ = ["PARTS", "module_parts", "norm_scale"]
