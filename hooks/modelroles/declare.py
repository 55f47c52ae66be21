"""A declaration of roles, for where the computation cannot tell (or to settle a
disagreement): ``hooks.roles(model, attention=..., heads=..., lm_head=..., ...)`` or a
``__mdb_roles__`` dict on the model (an attribute of the instance or of its class), with the
same keys. A declared role wins over a traced or named one.

Keys (:data:`KEYS`):

* ``attention``: module names or ``fnmatch`` patterns (``"blocks.*.attn"``), a string or a
  list; ``heads`` (H), ``kv_heads`` (Hkv, default H) and ``o`` (the child that is the output
  projection, default the traced or named one) apply to each of them;
* ``lm_head``, ``final_norm``: one module name each;
* ``router``, ``experts``: names or patterns; each router pairs with the experts under the
  same parent module (the MoE block);
* ``rotary``: names or patterns of the modules that apply RoPE to the queries and keys: the
  module that makes the cos/sin table, or the attention module whose forward rotates them.

Dimension legend: H query heads, Hkv key/value heads, Dh head dim, E experts.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from typing import Any

from torch import nn

from hooks.modelroles.found import AttentionRole, Found, MoERole, Roles, Rotary
from hooks.modelroles.traced import in_width

#: The keys of a declaration.
KEYS = ("attention", "heads", "kv_heads", "o", "lm_head", "final_norm", "router", "experts",
        "rotary")
#: The attribute of a model that holds its declaration.
ATTRIBUTE = "__mdb_roles__"


def declaration(model: nn.Module) -> dict[str, Any]:
    """The model's declaration (its ``__mdb_roles__``), ``{}`` when none.

    Raises:
        ValueError: ``__mdb_roles__`` is not a dict, or has a key not in :data:`KEYS`.
    """
    d = getattr(model, ATTRIBUTE, None)
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ValueError(f"{type(model).__name__}.{ATTRIBUTE} must be a dict of roles, got "
                         f"{type(d).__name__}")
    bad = sorted(set(d) - set(KEYS))
    if bad:
        raise ValueError(f"{ATTRIBUTE}: unknown role {bad[0]!r} (the keys: {', '.join(KEYS)})")
    return d


def _patterns(value: Any, key: str) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise ValueError(f"roles: {key}= takes a module name or a list of them, got {value!r}")
    return list(items)


def _match(pattern: str, names: list[str], key: str) -> list[str]:
    if pattern in names:
        return [pattern]
    found = [n for n in names if n and fnmatch.fnmatchcase(n, pattern)]
    if found:
        return found
    close = difflib.get_close_matches(pattern, names, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"roles: {key}={pattern!r} matches no module{hint}")


def _positive(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"roles: {key}= must be a positive integer, got {v!r}")
    return v


def _attention(d: dict[str, Any], modules: dict[str, nn.Module]) -> list[AttentionRole]:
    names = list(modules)
    h, hkv = _positive(d, "heads"), _positive(d, "kv_heads")
    o_child = d.get("o")
    if o_child is not None and not isinstance(o_child, str):
        raise ValueError(f"roles: o= is the name of the output projection's child, got "
                         f"{o_child!r}")
    out = []
    for pat in _patterns(d.get("attention"), "attention"):
        for name in _match(pat, names, "attention"):
            o = dh = None
            if o_child is not None:
                o = f"{name}.{o_child}" if name else o_child
                if o not in modules:
                    raise ValueError(f"roles: {name} has no child {o_child!r} (o=)")
                width = in_width(modules[o])
                if h and width and width % h:
                    raise ValueError(f"roles: {o} reads {width} columns, not a multiple of "
                                     f"heads={h}")
                dh = width // h if h and width else None
            out.append(AttentionRole(name, "declared", h, hkv or h, dh, o=o,
                                     detail="declared"))
    return out


def _one(d: dict[str, Any], key: str, modules: dict[str, nn.Module]) -> Found | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ValueError(f"roles: {key}= takes one module name, got {v!r}")
    return Found(_match(v, list(modules), key)[0], "declared", "declared")


def _moe(d: dict[str, Any], modules: dict[str, nn.Module]) -> list[MoERole]:
    names = list(modules)
    routers = [n for p in _patterns(d.get("router"), "router") for n in _match(p, names, "router")]
    experts = [n for p in _patterns(d.get("experts"), "experts")
               for n in _match(p, names, "experts")]
    blocks: dict[str, MoERole] = {}
    for r in routers:
        blocks[r.rpartition(".")[0]] = MoERole(r.rpartition(".")[0], "declared", router=r,
                                               detail="declared")
    for e in experts:
        block = e.rpartition(".")[0]
        role = blocks.setdefault(block, MoERole(block, "declared", detail="declared"))
        role.experts = e
        m = modules[e]
        role.num_experts = len(m) if isinstance(m, (nn.ModuleList, nn.Sequential)) else None
    return list(blocks.values())


def declared_roles(model: nn.Module, d: dict[str, Any] | None = None) -> Roles:
    """The roles a declaration gives (``d``, default the model's :func:`declaration`), checked
    against the model's modules.

    Raises:
        ValueError: one line: an unknown key, a name that matches no module, a count that is
            not a positive integer, an o projection whose width ``heads`` does not divide.
    """
    d = declaration(model) if d is None else d
    if not d:  # nothing declared (every capture asks): no walk of the modules
        return Roles()
    bad = sorted(set(d) - set(KEYS))
    if bad:
        raise ValueError(f"roles: unknown role {bad[0]!r} (the keys: {', '.join(KEYS)})")
    modules = dict(model.named_modules())
    names = list(modules)
    rotary = [Rotary(n, "declared", detail="declared")
              for p in _patterns(d.get("rotary"), "rotary") for n in _match(p, names, "rotary")]
    return Roles(_attention(d, modules), _one(d, "lm_head", modules),
                 _one(d, "final_norm", modules), _moe(d, modules), rotary=rotary)


def pattern_of(name: str) -> str:
    """``blocks.*.attn`` for ``blocks.1.attn``: the layer index replaced by ``*``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)


def declare_line(**roles: Any) -> str:
    """The one line that declares ``roles``: ``hooks.roles(model, attention=["blocks.*.attn"],
    heads=4)``."""
    parts = [f"{k}={v!r}" if not isinstance(v, list) else
             f"{k}=[{', '.join(repr(x) for x in v)}]" for k, v in roles.items()]
    return "hooks.roles(model, " + ", ".join(parts) + ")"
