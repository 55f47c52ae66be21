"""What each parameter of a model is for: its role (embedding, q/k/v, attention output, MLP in
and out, norm, router, LM head), read from the roles of :mod:`hooks.modelroles` (declared,
traced from what the model computes, or named) through
:func:`hooks.modelroles.parts.module_parts`: the q/k/v columns and o projection of each
attention, the routers, the norms and the LM head. The embedding is
:meth:`Target.embeddings`'. The rest is told by the MLP's usual names
(:func:`hooks.modelroles.named.mlp_part`), else by shape: a projection outside attention
reading the hidden width D is an MLP input, one writing D from another width an MLP output.

:func:`param_roles` is the one entry point of the checks that use it.

Dimension legend: D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hooks.doctor.model.target import Target
from hooks.modelroles.named import (  # noqa: F401 (this module's public names, as before)
    MLP_IN_NAMES,
    MLP_OUT_NAMES,
    expert_part,
    mlp_part,
)
from hooks.modelroles.parts import module_parts

#: Every role, in report order (``kv``: one projection of keys and values together).
ROLES = ("embedding", "position", "q", "k", "v", "qkv", "kv", "attn_out", "mlp_in", "mlp_out",
         "router", "norm", "lm_head", "other")
#: Roles whose output is added to the residual stream (GPT-2 scales their init by 1/√(2L)).
RESIDUAL_OUT = frozenset({"attn_out", "mlp_out"})
#: Roles that read the residual stream (never scaled by the residual convention).
READS_RESIDUAL = frozenset({"q", "k", "v", "qkv", "kv", "mlp_in"})


@dataclass(frozen=True)
class ParamRole:
    """One parameter and its role.

    Attributes:
        name: qualified parameter name (``model.named_parameters()``).
        module: qualified name of the module that owns it.
        role: one of :data:`ROLES`.
        kind: ``weight`` (a matrix or embedding table), ``bias`` or ``scale`` (a norm's
            elementwise weight).
    """

    name: str
    module: str
    role: str
    kind: str


def _hidden_width(t: Target) -> int | None:
    d = t.cfg("hidden_size", t.cfg("n_embd", t.cfg("d_model")))
    if isinstance(d, int):
        return d
    emb, _ = t.embeddings()
    return getattr(emb[1], "embedding_dim", None) if emb else None


def _module_roles(t: Target) -> dict[str, str]:
    """Qualified module name -> role, for the modules the roles place
    (:func:`hooks.modelroles.parts.module_parts`), the embeddings and the LM head."""
    roles = module_parts(t.model, t.roles())
    emb, head = t.embeddings()
    for n, m in t.model.named_modules():
        if isinstance(m, nn.Embedding) and n not in roles:
            roles[n] = "position" if emb is None or n != emb[0] else "embedding"
    if emb:
        roles[emb[0]] = "embedding"
    if head:
        roles[head[0]] = "lm_head"
    return roles


def _by_shape(name: str, p: torch.Tensor, mname: str, module: nn.Module | None,
              d: int | None) -> str:
    """The role of a parameter outside the placed modules: by its module's name, else by
    its shape against D."""
    leaf = name.rsplit(".", 1)[-1]
    last = mname.rsplit(".", 1)[-1] if mname else ""
    part = mlp_part(leaf, last)
    if part is not None:
        return part
    if p.dim() == 3 and d:  # fused experts (E, D, F) or (E, F, D) as recent HF MoE blocks
        return expert_part(leaf) or "other"
    if p.dim() != 2 or not d:
        return "other"
    out_f, in_f = p.shape  # nn.Linear stores (out, in)
    if type(module).__name__ == "Conv1D":
        in_f, out_f = p.shape
    if in_f == d and out_f != d:
        return "mlp_in"
    if out_f == d and in_f != d:
        return "mlp_out"
    return "other"


def param_roles(t: Target) -> list[ParamRole]:
    """Every trainable-or-not parameter of ``t.model`` (each once) with its role.

    A parameter tied between two modules (an embedding and an LM head) takes the role of the
    first module that registers it (the embedding). Biases keep the role of their module, with
    ``kind="bias"``; a 1-D parameter of a norm is ``kind="scale"``.

    Returns:
        list[ParamRole], in ``named_parameters()`` order.
    """
    mod_roles = _module_roles(t)
    d = _hidden_width(t)
    owners = t.param_owners()
    modules = dict(t.model.named_modules())
    out = []
    for name, p in t.model.named_parameters():
        mname = owners.get(id(p), [name.rpartition(".")[0]])[0]
        role = next((mod_roles[m] for m in owners.get(id(p), [mname]) if m in mod_roles), None)
        if role is None:
            role = _by_shape(name, p, mname, modules.get(mname), d)
        leaf = name.rsplit(".", 1)[-1]
        kind = ("bias" if leaf.endswith("bias") else
                "scale" if role == "norm" or p.dim() == 1 else "weight")
        out.append(ParamRole(name, mname, role, kind))
    return out
