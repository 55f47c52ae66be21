"""``mdb roles``: which module of the model plays which role, and how mdb knows.

Prints the attention modules (H, Hkv, Dh, the q/k/v projections' columns, the o projection;
below each, its q/k norms and its RoPE table), the LM head, the final norm, every norm, the
RoPE tables and the MoE blocks (router, experts, E, k) of :func:`hooks.find_roles`, each marked
``traced`` (read from one forward's ops), ``named`` (HF's names) or ``declared``
(``hooks.roles(model, ...)`` or ``__mdb_roles__``), then the notes (where the trace and the
names disagree, what could not be traced) and, for a missing role, the line that declares it.
The lines added for norms and RoPE are wrapped at :data:`WIDTH` columns; names from the model
are shown with :func:`hooks.text.printable`. ``--json`` prints :meth:`hooks.Roles.to_dict`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import textwrap

from hooks.text import printable
from tui.errors import MdbError, ModelError

HELP = "which module is attention (heads, q/k/v/o, q/k norms, RoPE), LM head, norms, MoE"
#: Columns the norm and RoPE lines are wrapped at.
WIDTH = 80


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


def _wrap(text: str, indent: str) -> list[str]:
    """Prose ``text`` (names made printable) wrapped at :data:`WIDTH` columns, its
    continuation lines indented by ``indent``; names are never cut."""
    return textwrap.wrap(printable(text), WIDTH, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False)


def _pack(first: str, items: list[str], sep: str, indent: str) -> list[str]:
    """``items`` (made printable) after ``first``, joined by ``sep``, as many on a line as fit
    in :data:`WIDTH` columns (an item longer than a line gets one of its own), continuation
    lines indented by ``indent``; an item is never split."""
    out, line, filled = [], first, False
    for i, item in enumerate(printable(x) for x in items):
        tail = sep if i < len(items) - 1 else ""
        if filled and len(line) + len(item) + len(tail.rstrip()) > WIDTH:
            out.append(line.rstrip())
            line, filled = indent, False
        line += item + tail
        filled = True
    out.append(line.rstrip())
    return out


def _attention_parts(a) -> list[str]:
    """The lines under an attention's: its q/k norms and its RoPE table, when it has any."""
    parts = [f"{p} {n}" for p, n in (("q_norm", a.q_norm), ("k_norm", a.k_norm)) if n]
    if a.rotary is not None:
        parts.append(f"RoPE table {a.rotary or '<root>'}")
    return _pack("    ", parts, ", ", "      ") if parts else []


def _norm_lines(roles) -> list[str]:
    """``norms: N module(s)``, then per how they were found their names, those of several
    layers as one pattern (``blocks.*.ln1 ×4``)."""
    from hooks.modelroles.declare import pattern_of

    out = [f"norms: {len(roles.norms)} module(s)"]
    by_how: dict[str, dict[str, int]] = {}
    for n in roles.norms:
        group = by_how.setdefault(n.how, {})
        key = pattern_of(n.module)
        group[key] = group.get(key, 0) + 1
    for how, names in by_how.items():
        out += _pack(f"  {how}: ", [p if c == 1 else f"{p} ×{c}" for p, c in names.items()],
                     ", ", "    ")
    return out


def _rotary_lines(roles) -> list[str]:
    """``RoPE: N table(s)``, then each table's module, how, channels and evidence; or the line
    that declares one."""
    from hooks.modelroles.declare import declare_line

    if not roles.rotary:
        return _wrap("RoPE: none found (learned positions, relative biases or none); if the "
                     f"model applies RoPE, declare it: {declare_line(rotary='NAME')}", "  ")
    out = [f"RoPE: {len(roles.rotary)} table(s)"]
    for r in roles.rotary:
        facts = [r.how]
        if r.channels:
            facts.append(f"{r.channels} channels per head")
        if r.attention:
            facts.append(f"for {r.attention[0]}" if len(r.attention) == 1 else
                         f"for {len(r.attention)} attention modules")
        out += _pack(f"  {printable(r.module or '<root>')}: ", facts, "; ", "    ")
        if r.detail and r.how != "declared":
            out += _wrap(f"    {r.detail}", "    ")
    return out


def lines(roles) -> list[str]:
    """The printed report of ``roles`` (a :class:`hooks.Roles`), one role per line (an
    attention's q/k norms and RoPE table on the line below it)."""
    from hooks.modelroles.declare import declare_line

    out = [f"attention: {len(roles.attention)} module(s)"]
    for a in roles.attention:
        out += [_attention_line(a), *_attention_parts(a)]
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
    out += _norm_lines(roles) + _rotary_lines(roles)
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
