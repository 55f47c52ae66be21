"""Roles from names, the fast path that needs no forward: HF's and nanoGPT's names for the
attention projections (q/k/v, fused q|k|v, o), its heads and its q/k norms,
``get_output_embeddings()`` / ``lm_head``, the final norm's usual names, a norm's class name,
an MoE block's ``experts`` child and its router, the MLP's input and output projections, the
rotary embedding (``*rotary_emb``, a class named like ``Rotary``).

These tuples are mdb's one list of each: the doctor, the edits and the views read roles
through :mod:`hooks.modelroles`, where a name is only a shortcut before what the model
computes (:mod:`hooks.modelroles.traced`) and what is declared.

Dimension legend: H query heads, Hkv key/value heads, Dh head dim, E experts.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hooks.modelroles.found import AttentionRole, Columns, Found, MoERole, Roles, Rotary
from hooks.modelroles.traced import in_width, is_projection, out_width

#: Child names of an attention module's query, key and value projections, tried in order.
Q_NAMES = ("q_proj", "query", "q", "wq", "to_q")
K_NAMES = ("k_proj", "key", "k", "wk", "to_k")
V_NAMES = ("v_proj", "value", "v", "wv", "to_v")
#: Child names of one projection of queries, keys and values together, q|k|v in that order
#: (GPT-2 ``c_attn``, Phi-3 ``qkv_proj``, NeoX ``query_key_value``...).
FUSED_NAMES = ("qkv_proj", "c_attn", "qkv", "Wqkv", "query_key_value", "in_proj")
#: Child names of an attention module's output projection, tried in order.
OUT_PROJ_NAMES = ("o_proj", "out_proj", "c_proj", "dense", "o", "wo", "proj", "to_out")
#: Child names of the norms of the queries and of the keys (Qwen3, OLMoE, Gemma 3...).
Q_NORM_NAMES = ("q_norm", "q_layernorm", "query_layernorm")
K_NORM_NAMES = ("k_norm", "k_layernorm", "key_layernorm")
#: Names of modules that hold keys or values, fused or not (a layer that borrows another
#: layer's keys and values keeps these unused).
KEY_VALUE_NAMES = (*K_NAMES, *V_NAMES, *K_NORM_NAMES, "kv_proj", "wkv")
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
#: Class-name endings of a norm module (beside ``nn.LayerNorm`` and ``nn.RMSNorm``).
NORM_CLASS_ENDINGS = ("RMSNorm", "LayerNorm", "RmsNorm")
#: The name ending of a rotary embedding module (HF's ``model.rotary_emb``).
ROTARY_NAME_ENDING = "rotary_emb"
#: What the class name of a rotary embedding module contains (``LlamaRotaryEmbedding``).
ROTARY_CLASS_PART = "Rotary"
#: Child names of an MoE block's router, tried first.
ROUTER_NAMES = ("gate", "router", "wg", "switch")
#: Names of an MLP's input projections (Llama, GPT-2, Mixtral experts, llama2.c, T5, NeoX).
MLP_IN_NAMES = ("gate_proj", "up_proj", "w1", "w3", "c_fc", "fc1", "fc_in", "wi", "wi_0",
                "wi_1", "gate_up_proj", "dense_h_to_4h")
#: Names of an MLP's output projections.
MLP_OUT_NAMES = ("down_proj", "w2", "fc2", "fc_out", "wo", "dense_4h_to_h")
#: Name prefixes of fused experts' 3-D weights (E, D, F): inputs, then outputs.
EXPERT_IN_PREFIXES = ("gate", "up", "w1", "w3")
EXPERT_OUT_PREFIXES = ("down", "w2")


def looks_like_attention(m: nn.Module) -> bool:
    """Whether ``m`` is attention by its names: its class name says Attention (or Attn), it is
    an ``nn.MultiheadAttention``, or it has q/qkv projections (:data:`QKV_CHILD_NAMES`)."""
    cls = type(m).__name__
    if "Attention" in cls or "Attn" in cls or isinstance(m, nn.MultiheadAttention):
        return True
    return any(hasattr(m, a) for a in QKV_CHILD_NAMES)


def looks_like_norm(m: nn.Module) -> bool:
    """Whether ``m`` is a norm by its class: ``nn.LayerNorm``, ``nn.RMSNorm``, or a class name
    ending like :data:`NORM_CLASS_ENDINGS` (HF's ``LlamaRMSNorm``, ``T5LayerNorm``)."""
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith(
        NORM_CLASS_ENDINGS)


def int_attr(m: nn.Module, names: tuple[str, ...], config: Any = None) -> int | None:
    """The first positive int among ``names`` on ``m``, then on ``m.config``, then on
    ``config`` (the model's)."""
    for owner in (m, getattr(m, "config", None), config):
        for attr in names:
            v = owner.get(attr) if isinstance(owner, dict) else getattr(owner, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _child(m: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    """The first child of ``m`` named like ``names`` that is a projection (or holds one first,
    as diffusers' ``to_out = Sequential(Linear, Dropout)``): (its path under ``m``, it)."""
    for n in names:
        c = getattr(m, n, None)
        if not isinstance(c, nn.Module) or c not in m.children():
            continue
        if is_projection(c):
            return n, c
        inner = next(((s, x) for s, x in c.named_modules() if s and is_projection(x)), None)
        if inner is not None:
            return f"{n}.{inner[0]}", inner[1]
    return None


def named_parts(name: str, m: nn.Module) -> dict[str, str]:
    """The projections of attention module ``m`` (named ``name``) by their names alone:
    qualified name → ``q``, ``k``, ``v``, ``qkv`` (:data:`FUSED_NAMES`) or ``attn_out``
    (:data:`OUT_PROJ_NAMES`); no heads needed."""
    prefix = f"{name}." if name else ""
    out = {}
    for names, part in ((Q_NAMES, "q"), (K_NAMES, "k"), (V_NAMES, "v"), (FUSED_NAMES, "qkv"),
                        (OUT_PROJ_NAMES, "attn_out")):
        hit = _child(m, names)
        if hit is not None:
            out.setdefault(prefix + hit[0], part)
    return out


def _qkv_columns(prefix: str, m: nn.Module, h: int, hkv: int | None, dh: int
                 ) -> tuple[list[Columns | None], int | None]:
    """q, k, v :class:`Columns` by names (separate projections, else one fused q|k|v of
    (H + 2·Hkv)·Dh outputs, q first), and Hkv (given, else from the k or fused width)."""
    sep = [_child(m, names) for names in (Q_NAMES, K_NAMES, V_NAMES)]
    if all(sep):
        widths = [out_width(c) or 0 for _, c in sep]
        if hkv is None and widths[1] % dh == 0:
            hkv = widths[1] // dh
        return [Columns(prefix + n, 0, w) for (n, _), w in zip(sep, widths, strict=True)], hkv
    fused = _child(m, FUSED_NAMES)
    fo = out_width(fused[1]) if fused is not None else None
    if fused is None or not fo or fo % dh:
        return [None, None, None], hkv
    if hkv is None and (fo // dh - h) > 0 and (fo // dh - h) % 2 == 0:
        hkv = (fo // dh - h) // 2
    if hkv is None or fo != (h + 2 * hkv) * dh:
        return [None, None, None], hkv
    bounds = [0, h * dh, (h + hkv) * dh, fo]
    return [Columns(prefix + fused[0], bounds[i], bounds[i + 1]) for i in range(3)], hkv


def _norm_child(prefix: str, m: nn.Module, names: tuple[str, ...]) -> str | None:
    for n in names:
        c = getattr(m, n, None)
        if isinstance(c, nn.Module) and c in m.children():
            return prefix + n
    return None


def named_attention(name: str, m: nn.Module, config: Any = None) -> AttentionRole | str:
    """The attention role of ``m`` by its names, else why not (one phrase): a module that
    :func:`looks_like_attention`, H from :data:`HEAD_ATTRS` (on it, its config, the model's
    ``config``; else its q projection's width over its ``head_dim``), the o projection a child
    named like :data:`OUT_PROJ_NAMES` whose input width H divides; q, k and v from children
    named like :data:`Q_NAMES`, :data:`K_NAMES`, :data:`V_NAMES` or :data:`FUSED_NAMES`, its
    q/k norms from :data:`Q_NORM_NAMES`, :data:`K_NORM_NAMES`."""
    if isinstance(m, nn.MultiheadAttention):
        return ("nn.MultiheadAttention applies out_proj inside one function "
                "(F.multi_head_attention_forward): no per-head input to edit")
    if not looks_like_attention(m):
        return (f"a {type(m).__name__} is not attention by name (a class named *Attention* or "
                f"*Attn*, or a child {', '.join(QKV_CHILD_NAMES[:3])}…)")
    h = int_attr(m, HEAD_ATTRS, config)
    q, hd = _child(m, Q_NAMES), int_attr(m, ("head_dim",))
    if h is None and q is not None and hd and (out_width(q[1]) or 0) % hd == 0:
        h = (out_width(q[1]) or 0) // hd or None
    if h is None:
        return f"its number of heads is not known (none of {', '.join(HEAD_ATTRS)})"
    o = _child(m, OUT_PROJ_NAMES)
    n = in_width(o[1]) if o is not None else None
    if o is None or n is None:
        return (f"no output projection found (a Linear or Conv1D child named "
                f"{', '.join(OUT_PROJ_NAMES[:3])}…)")
    if n % h:
        return f"{o[0]}'s input width {n} is not a multiple of its {h} heads"
    prefix = f"{name}." if name else ""
    cols, hkv = _qkv_columns(prefix, m, h, int_attr(m, KV_HEAD_ATTRS, config), n // h)
    return AttentionRole(name, "named", h, hkv or None, n // h, *cols, o=prefix + o[0],
                         detail=f"{type(m).__name__}: H from its attribute, o projection {o[0]}",
                         q_norm=_norm_child(prefix, m, Q_NORM_NAMES),
                         k_norm=_norm_child(prefix, m, K_NORM_NAMES))


def mlp_part(*names: str) -> str | None:
    """``mlp_in`` or ``mlp_out`` for the first of ``names`` (last parts of a module's or a
    parameter's name) that is an MLP projection's name (:data:`MLP_IN_NAMES`,
    :data:`MLP_OUT_NAMES`), else None."""
    for n in names:
        if n in MLP_IN_NAMES:
            return "mlp_in"
        if n in MLP_OUT_NAMES:
            return "mlp_out"
    return None


def expert_part(leaf: str) -> str | None:
    """``mlp_in``/``mlp_out`` for a fused experts' 3-D weight by its name's start
    (:data:`EXPERT_IN_PREFIXES`, :data:`EXPERT_OUT_PREFIXES`), else None."""
    if leaf.startswith(EXPERT_IN_PREFIXES):
        return "mlp_in"
    return "mlp_out" if leaf.startswith(EXPERT_OUT_PREFIXES) else None


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


def named_rotary(modules: dict[str, nn.Module]) -> list[Rotary]:
    """The modules named like :data:`ROTARY_NAME_ENDING` or whose class name contains
    :data:`ROTARY_CLASS_PART`, in module order."""
    out = []
    for name, m in modules.items():
        if name.endswith(ROTARY_NAME_ENDING):
            out.append(Rotary(name, "named", detail=f"its name {name.rpartition('.')[2]}"))
        elif ROTARY_CLASS_PART in type(m).__name__:
            out.append(Rotary(name, "named", detail=f"a {type(m).__name__}"))
    return out


def named_roles(model: nn.Module) -> Roles:
    """Every role that names alone give."""
    modules = dict(model.named_modules())
    names = {id(m): n for n, m in reversed(list(modules.items()))}
    config = getattr(model, "config", None)
    att = [a for n, m in modules.items()
           if not isinstance(a := named_attention(n, m, config), str)]
    moe = [b for n, m in modules.items() if (b := named_moe(n, m)) is not None]
    norms = [Found(n, "named", f"a {type(m).__name__}") for n, m in modules.items()
             if looks_like_norm(m)]
    return Roles(att, named_lm_head(model, names), named_final_norm(modules), moe, norms=norms,
                 rotary=named_rotary(modules))
