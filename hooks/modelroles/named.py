"""Roles from names, the fast path that needs no forward: HF's and nanoGPT's names for the
attention projections and heads, ``get_output_embeddings()`` / ``lm_head``, the final norm's
usual names, an MoE block's ``experts`` child and its router.

Dimension legend: H query heads, Hkv key/value heads, Dh head dim, E experts.
"""

from __future__ import annotations

from torch import nn

from hooks.modelroles.found import AttentionRole, Found, MoERole, Roles
from hooks.modelroles.traced import in_width

#: Child names of an attention module's output projection, tried in order.
OUT_PROJ_NAMES = ("o_proj", "out_proj", "c_proj", "dense", "o", "wo", "proj")
#: Attributes that hold an attention module's number of query heads (on it, then its config).
HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
#: Attributes that hold its number of key/value heads.
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
#: Children whose presence makes a module attention by name (with a class name saying
#: Attention, or an ``nn.MultiheadAttention``).
QKV_CHILD_NAMES = ("q_proj", "qkv_proj", "c_attn", "Wqkv", "query_key_value")
#: Names of the final norm (Llama ``norm``, GPT-2 ``ln_f``, NeoX ``final_layer_norm``...).
FINAL_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f",
                    "final_norm", "ln_out")
#: Child names of an MoE block's router, tried first.
ROUTER_NAMES = ("gate", "router", "wg", "switch")


def looks_like_attention(m: nn.Module) -> bool:
    """Whether ``m`` is attention by its names: its class name says Attention, it is an
    ``nn.MultiheadAttention``, or it has q/qkv projections (:data:`QKV_CHILD_NAMES`)."""
    if "Attention" in type(m).__name__ or isinstance(m, nn.MultiheadAttention):
        return True
    return any(hasattr(m, a) for a in QKV_CHILD_NAMES)


def int_attr(m: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first positive int among ``names`` on ``m``, then on ``m.config``."""
    for owner in (m, getattr(m, "config", None)):
        for attr in names:
            v = getattr(owner, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def named_attention(name: str, m: nn.Module) -> AttentionRole | str:
    """The attention role of ``m`` by its names, else why not (one phrase): a module that
    :func:`looks_like_attention`, H from :data:`HEAD_ATTRS`, the o projection a child named
    like :data:`OUT_PROJ_NAMES` whose input width H divides."""
    if isinstance(m, nn.MultiheadAttention):
        return ("nn.MultiheadAttention applies out_proj inside one function "
                "(F.multi_head_attention_forward): no per-head input to edit")
    if not looks_like_attention(m):
        return (f"a {type(m).__name__} is not attention by name (a class named *Attention* or a "
                f"child {', '.join(QKV_CHILD_NAMES[:3])}…)")
    h = int_attr(m, HEAD_ATTRS)
    if h is None:
        return f"its number of heads is not known (none of {', '.join(HEAD_ATTRS)})"
    for child in OUT_PROJ_NAMES:
        proj = getattr(m, child, None)
        if isinstance(proj, nn.Module) and proj in m.children():
            n = in_width(proj)
            if n is None:
                continue
            if n % h:
                return f"{child}'s input width {n} is not a multiple of its {h} heads"
            o = f"{name}.{child}" if name else child
            return AttentionRole(name, "named", h, int_attr(m, KV_HEAD_ATTRS) or None, n // h,
                                 o=o, detail=f"{type(m).__name__}: H from its attribute, "
                                 f"o projection {child}")
    return (f"no output projection found (a Linear or Conv1D child named "
            f"{', '.join(OUT_PROJ_NAMES[:3])}…)")


def named_lm_head(model: nn.Module, names: dict[int, str]) -> Found | None:
    """``get_output_embeddings()``, else a child ``lm_head``."""
    head = None
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except Exception:  # a model whose method is not implemented
            head = None
    how = "get_output_embeddings()"
    if not isinstance(head, nn.Module):
        head, how = getattr(model, "lm_head", None), "its name lm_head"
    if isinstance(head, nn.Module) and id(head) in names:
        return Found(names[id(head)], "named", how)
    return None


def named_final_norm(modules: dict[str, nn.Module]) -> Found | None:
    """A module named like :data:`FINAL_NORM_NAMES` at the top or one level down
    (``norm``, ``model.norm``, ``transformer.ln_f``)."""
    for name in modules:
        if name.count(".") <= 1 and name.rpartition(".")[2] in FINAL_NORM_NAMES:
            return Found(name, "named", f"its name {name.rpartition('.')[2]}")
    return None


def named_moe(name: str, m: nn.Module) -> MoERole | None:
    """An MoE block by its ``experts`` child; the router a child named like
    :data:`ROUTER_NAMES`, or one whose weight has E rows."""
    experts = getattr(m, "experts", None)
    if not (isinstance(experts, nn.Module) and experts in m.children()):
        return None
    e = len(experts) if isinstance(experts, (nn.ModuleList, nn.Sequential)) else \
        int_attr(experts, ("num_experts",)) or int_attr(m, ("num_experts", "num_local_experts"))
    prefix = f"{name}." if name else ""
    router = None
    kids = sorted(((n, c) for n, c in m.named_children() if c is not experts),
                  key=lambda nc: nc[0] not in ROUTER_NAMES)
    for n, c in kids:
        w = getattr(c, "weight", None)
        if n in ROUTER_NAMES or (getattr(w, "dim", None) and w.dim() == 2 and e
                                 and int(w.shape[0]) == e):
            router = prefix + n
            break
    return MoERole(name, "named", router, prefix + "experts", e, None,
                   detail=f"{type(m).__name__}: a child named experts")


def named_roles(model: nn.Module) -> Roles:
    """Every role that names alone give."""
    modules = dict(model.named_modules())
    names = {id(m): n for n, m in reversed(list(modules.items()))}
    att = [a for n, m in modules.items() if not isinstance(a := named_attention(n, m), str)]
    moe = [b for n, m in modules.items() if (b := named_moe(n, m)) is not None]
    return Roles(att, named_lm_head(model, names), named_final_norm(modules), moe)
