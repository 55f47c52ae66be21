"""What each parameter of a model is for: its role (embedding, q/k/v, attention output, MLP in
and out, norm, router, LM head), read from the structure the doctor already recognises
(:class:`hooks.doctor.model.target.Target`: attention modules and their q/k/v/o children, MoE
blocks and their router, norms, the embedding and the LM head), and for the rest from shapes:
a linear layer outside attention reading the hidden width D is an MLP input, one writing D
from another width an MLP output.

:func:`param_roles` is the one entry point, so that a fuller recogniser (a ``hooks.roles``
package) can replace it without touching the checks that use it.

Dimension legend: D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hooks.doctor.model.target import FUSED_NAMES, K_NAMES, O_NAMES, Q_NAMES, V_NAMES, Target

#: Every role, in report order.
ROLES = ("embedding", "position", "q", "k", "v", "qkv", "attn_out", "mlp_in", "mlp_out",
         "router", "norm", "lm_head", "other")
#: Roles whose output is added to the residual stream (GPT-2 scales their init by 1/√(2L)).
RESIDUAL_OUT = frozenset({"attn_out", "mlp_out"})
#: Roles that read the residual stream (never scaled by the residual convention).
READS_RESIDUAL = frozenset({"q", "k", "v", "qkv", "mlp_in"})
#: Child names of MLP input and output projections (Llama, GPT-2, Mixtral experts, llama2.c).
MLP_IN_NAMES = ("gate_proj", "up_proj", "w1", "w3", "c_fc", "fc1", "fc_in", "wi", "wi_0",
                "wi_1", "gate_up_proj", "dense_h_to_4h")
MLP_OUT_NAMES = ("down_proj", "w2", "fc2", "fc_out", "wo", "dense_4h_to_h")


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
    """Qualified module name -> role, for the modules recognised by structure."""
    roles: dict[str, str] = {}
    emb, head = t.embeddings()
    for a in t.attention_layers():
        for names, role in ((Q_NAMES, "q"), (K_NAMES, "k"), (V_NAMES, "v"),
                            (FUSED_NAMES, "qkv"), (O_NAMES, "attn_out")):
            for n in names:
                c = getattr(a.module, n, None)
                if isinstance(c, nn.Module):
                    full = f"{a.name}.{n}" if a.name else n
                    roles.setdefault(full, role)
                    for sub, _ in c.named_modules():  # to_out = Sequential(Linear, Dropout)
                        if sub:
                            roles.setdefault(f"{full}.{sub}", role)
                    break
    for b in t.moe_blocks():
        roles[b.router_name] = "router"
    for n, _ in t.norm_modules():
        roles[n] = "norm"
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
    """The role of a parameter outside the recognised modules: by its module's name, else by
    its shape against D."""
    leaf = name.rsplit(".", 1)[-1]
    last = mname.rsplit(".", 1)[-1] if mname else ""
    for n in (leaf, last):
        if n in MLP_IN_NAMES:
            return "mlp_in"
        if n in MLP_OUT_NAMES:
            return "mlp_out"
    if p.dim() == 3 and d:  # fused experts (E, D, F) or (E, F, D) as recent HF MoE blocks
        return "mlp_in" if leaf.startswith(("gate", "up", "w1", "w3")) else (
            "mlp_out" if leaf.startswith(("down", "w2")) else "other")
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
