"""``mdb roles``: which module of the model plays which role, and how mdb knows.

Prints the attention modules (H, Hkv, Dh, the q/k/v projections' columns, the o projection),
the LM head, the final norm and the MoE blocks (router, experts, E, k) of
:func:`hooks.find_roles`, each marked ``traced`` (read from one forward's ops), ``named``
(HF's names) or ``declared`` (``hooks.roles(model, ...)`` or ``__mdb_roles__``), then the
notes (where the trace and the names disagree, what could not be traced) and, for a missing
role, the line that declares it. ``--json`` prints :meth:`hooks.Roles.to_dict`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from hooks.text import printable
from tui.errors import MdbError, ModelError

HELP = "which module is attention (heads, q/k/v/o), the LM head, final norm, router, experts"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tui.commands.options import add_model_arguments
    from tui.commands.step import add_threads_argument

    add_model_arguments(parser)
    add_threads_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the roles as JSON")


def compute_roles(workload):
    """:func:`hooks.find_roles` of a workload on its batch, its errors as one line.

    Raises:
        MdbError: the model's declaration does not fit it.
        ModelError: the model raised while the roles were read, or in the traced forward.
    """
    from hooks.errors import describe_error
    from hooks.modelroles import find_roles

    try:
        roles = find_roles(workload.model, workload.batch)
    except ValueError as exc:
        raise MdbError(f"roles: {exc}") from None
    except Exception as exc:  # the user's model may raise anything
        raise ModelError(describe_error(exc, workload.model, "reading its roles")) from None
    if roles.trace_error is not None:  # the forward raised: said where, as every command does
        raise ModelError(describe_error(roles.trace_error, workload.model, "the forward pass"))
    return roles


def _attention_line(a) -> str:
    heads = ", ".join(f"{k}={v}" for k, v in (("H", a.num_heads), ("Hkv", a.num_kv_heads),
                                               ("Dh", a.head_dim)) if v is not None)
    proj = ", ".join(f"{p} {c.describe()}" for p, c in (("q", a.q), ("k", a.k), ("v", a.v))
                     if c is not None)
    parts = [f"  {a.name}: {a.how}", heads, proj, f"o {a.o or '(not found)'}"]
    if a.kernel:
        parts.append(a.kernel)
    return "; ".join(p for p in parts if p)


def lines(roles) -> list[str]:
    """The printed report of ``roles`` (a :class:`hooks.Roles`), one role per line."""
    from hooks.modelroles.declare import declare_line

    out = [f"attention: {len(roles.attention)} module(s)"]
    out += [_attention_line(a) for a in roles.attention]
    if not roles.attention:
        out.append(f"  none found; declare them: {declare_line(attention=['NAME'], heads=4)}")
    for title, found, key in (("LM head", roles.lm_head, "lm_head"),
                              ("final norm", roles.final_norm, "final_norm")):
        if found is None:
            out.append(f"{title}: none found; declare it: {declare_line(**{key: 'NAME'})}")
        else:
            out.append(f"{title}: {found.module}: {found.how}"
                       + (f" ({found.detail})" if found.detail and found.how != "declared"
                          else ""))
    out.append(f"MoE: {len(roles.moe)} block(s)")
    for m in roles.moe:
        facts = ", ".join(f"{k} {v}" for k, v in (("router", m.router), ("experts", m.experts),
                                                   ("E", m.num_experts), ("k", m.top_k))
                          if v is not None)
        out.append(f"  {m.name}: {m.how}; {facts}")
    out += [f"note: {n}" for n in roles.notes]
    if not roles.traced and not roles.notes:
        out.append("note: not traced: the roles above come from names and the declaration")
    return out


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb roles``."""
    from tui.commands.step import set_threads
    from tui.commands.workload import build_workload

    set_threads(args)
    # with --json, what the model prints while it is built and traced (nanoGPT prints its
    # parameter count) goes to stderr: stdout holds the JSON alone
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        workload = build_workload(args)
        roles = compute_roles(workload)
    if args.json:
        print(json.dumps(roles.to_dict(), indent=2))
        return 0
    print(printable(workload.description or "the model"))
    for line in lines(roles):
        print(printable(line))
    return 0
