"""Which module of a model plays which role — attention (with its heads, q/k/v/o projections,
q/k norms and RoPE table), every norm, the final norm, the LM head, the router and the
experts — read from what the model computes in one traced forward, from a declaration, or
from HF's names.

* :func:`find_roles` (``mdb roles``): every role, each with ``how`` it was found
  (``declared``, ``traced``, ``named``); a declaration wins, and where the trace and the
  names disagree the named role is kept (what the views use) and a note says so.
* :func:`roles` (``hooks.roles``): declare roles (kept on the model as ``__mdb_roles__``) and
  return every role.
* :func:`attention_role`, :func:`lm_head_role`, :func:`final_norm_role`, :func:`moe_role`:
  one role for a view (edits, the logit lens, the doctor), or the one line that says why not
  and how to declare it.
* :func:`module_parts`: the part each module plays (q, k, v, fused qkv or kv, attention
  output, router, norm, LM head), for the doctor's parameter roles.

Names (:mod:`hooks.modelroles.named`) are a shortcut inside this package only: every view
reads roles here, never a list of names of its own.

Reference: TorchLens (Taylor et al., 2023) reads a model's structure from the ops it runs
rather than from names. Never imports textual, rich or tui.
"""

from hooks.modelroles.declare import ATTRIBUTE, KEYS, declaration, declared_roles
from hooks.modelroles.find import find_roles, roles, trace_roles, traced_roles
from hooks.modelroles.found import HOW, AttentionRole, Columns, Found, MoERole, Roles, Rotary
from hooks.modelroles.lookup import attention_role, final_norm_role, lm_head_role, moe_role
from hooks.modelroles.parts import PARTS, module_parts

__all__ = ["ATTRIBUTE", "HOW", "KEYS", "PARTS", "AttentionRole", "Columns", "Found", "MoERole",
           "Roles", "Rotary", "attention_role", "declaration", "declared_roles", "final_norm_role",
           "find_roles", "lm_head_role", "module_parts", "moe_role", "roles", "trace_roles",
           "traced_roles"]
