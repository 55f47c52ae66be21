"""Parameters a model declares it does not use: a layer that borrows another layer's keys and
values (Gemma 3n's ``num_kv_shared_layers`` / ``is_kv_shared_layer``; the cross-layer KV
sharing of transformers #45242) keeps its own k/v projections, which never run and get no
gradient by design. The gradient-flow check reports those as a warning with the declaration,
not as a cut graph.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from hooks.doctor.model.target import Target
from hooks.modelroles.named import KEY_VALUE_NAMES

#: Attribute names that declare KV sharing (on the config, the module or an ancestor).
SHARING = re.compile(r"(kv|key_value).*shar|shar.*(kv|key_value)", re.IGNORECASE)


def _declares(obj: Any) -> tuple[str, Any] | None:
    """The first attribute of ``obj`` (a config or a module: its plain fields) whose name
    declares KV sharing and whose value is set (True, a positive number, a name)."""
    fields = obj if isinstance(obj, dict) else getattr(obj, "__dict__", {})
    for k, v in fields.items():
        if k.startswith("_") or not SHARING.search(k):
            continue
        if v is True or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0) or (
                isinstance(v, str) and v):
            return k, v
    return None


def declared_unused(t: Target, module: str) -> str | None:
    """Why ``module`` (which never ran in the forward) is unused by design, in words, or None:
    it, an ancestor, or the config declares KV sharing and the module is a key or value
    projection (or inside one): by its attention's role, or named like one
    (:data:`hooks.modelroles.named.KEY_VALUE_NAMES`)."""
    roles = t.roles().attention  # its attention's role (declared, named), else its name
    kv = {c for a in roles for c in (getattr(a.k, "module", None), getattr(a.v, "module", None),
                                     a.k_norm) if c}
    leaf = module.rsplit(".", 1)[-1]
    if leaf not in KEY_VALUE_NAMES and not any(module == c or module.startswith(c + ".")
                                               for c in kv):
        return None
    mods = dict(t.model.named_modules())
    parts = module.split(".")
    for i in range(len(parts), -1, -1):
        name = ".".join(parts[:i])
        m = mods.get(name)
        if isinstance(m, nn.Module) and (hit := _declares(m)):
            return f"{name or '<root>'}.{hit[0]} = {hit[1]!r} declares that it borrows " \
                   "another layer's keys and values"
    cfg = t.config
    if cfg is not None and (hit := _declares(cfg.to_dict() if hasattr(cfg, "to_dict")
                                             and not isinstance(cfg, dict) else cfg)):
        return f"config.{hit[0]} = {hit[1]!r} declares layers that borrow another layer's " \
               "keys and values"
    return None
