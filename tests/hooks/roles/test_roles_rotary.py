"""RoPE read from the ops of one traced forward (``hooks.modelroles.rotary``): on the layouts
of ``rope_models`` the table's module (whatever it is called, none at all, the model holding a
buffer), the attention it rotates, the channels it rotates (the ``rotary_dim`` the model was
built with) and how it was found; no RoPE where there is none or only half of its signature;
a declaration for what the trace cannot see. ``mdb roles`` prints the q/k norms, the norms and
the RoPE tables in 80 columns, names made printable.

Dimension legend: Dh head dim.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import hooks
from hooks.modelroles import find_roles
from tests.hooks.roles import rope_models as rm
from tui.cli import main

RM = Path(rm.__file__)
LAYERS = [f"blocks.{i}.attn" for i in range(rm.L)]


@pytest.mark.parametrize("layout,tables,how", [
    ("named", [f"{a}.rotary_emb" for a in LAYERS], "returns the table"),
    ("pos", [f"{a}.pos" for a in LAYERS], "returns the table"),
    ("function", LAYERS, "computes the table's cos in its forward"),
    ("complex", [""], "holds the table as freqs_cis"),
])
@pytest.mark.parametrize("rotary_dim", [rm.DH, 4])
def test_the_rope_table_is_traced_whatever_it_is_called(layout, tables, how, rotary_dim):
    model, batch = rm.build(layout, rotary_dim=rotary_dim)
    roles = find_roles(model, batch)
    assert [(r.module, r.how, r.channels) for r in roles.rotary] == [
        (t, "traced", rotary_dim) for t in tables]
    assert [a for r in roles.rotary for a in r.attention] == LAYERS
    style = "complex" if layout == "complex" else "rotate-half"
    for r in roles.rotary:
        assert r.detail.startswith(f"{style} rotation of q and k by a position table "
                                   f"({r.module or '<root>'} {how})")
    assert ("its name rotary_emb agrees" in roles.rotary[0].detail) == (layout == "named")
    want = tables if len(tables) == len(LAYERS) else tables * len(LAYERS)
    assert [roles.attention_of(a).rotary for a in LAYERS] == want


def test_only_the_rotated_side_is_said():
    model, batch = rm.build("pos", "q_only")
    (first, _) = find_roles(model, batch).rotary
    assert first.detail.startswith("rotate-half rotation of q by a position table")


@pytest.mark.parametrize("layout", ["none", "learned", "decoy", "matrix"])
def test_no_rope_is_traced_without_a_rotation_by_a_position_table(layout):
    model, batch = rm.build(layout)
    roles = find_roles(model, batch)
    assert roles.traced and roles.rotary == []
    assert [roles.attention_of(a).rotary for a in LAYERS] == [None, None]


def test_rope_is_declared_where_the_trace_cannot_see_it_and_a_bad_name_is_one_line():
    model, batch = rm.build("matrix")
    roles = hooks.roles(model, batch, rotary="blocks.*.attn")
    assert [(r.module, r.how) for r in roles.rotary] == [(a, "declared") for a in LAYERS]
    with pytest.raises(ValueError, match=re.escape(  # one line, the nearest name offered
            "roles: rotary='blocks.*.atn' matches no module (did you mean blocks.1.attn?)")):
        hooks.roles(rm.build("matrix")[0], rotary="blocks.*.atn")


def test_mdb_roles_prints_qk_norms_norms_and_rope_in_80_columns(capsys):
    assert main(["roles", "--model", f"{RM}:pos_qk_norm"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for a in LAYERS:
        i = next(n for n, line in enumerate(lines) if line.startswith(f"  {a}: traced; "))
        assert lines[i + 1:i + 3] == [f"    q_norm {a}.qn, k_norm {a}.kn,",
                                      f"      RoPE table {a}.pos"]
    start, end = lines.index("norms: 10 module(s)"), lines.index("MoE: 0 block(s)")
    assert lines[start + 1:end] == [
        "  traced: blocks.*.ln1 ×2, blocks.*.ln2 ×2, blocks.*.attn.qn ×2,",
        "    blocks.*.attn.kn ×2, ln_f",
        "  named: extra.n\\x1b]0;pwned\\x07",
        "RoPE: 2 table(s)",
        "  blocks.0.attn.pos: traced; 8 channels per head; for blocks.0.attn",
        "    rotate-half rotation of q and k by a position table (blocks.0.attn.pos",
        "    returns the table)",
        "  blocks.1.attn.pos: traced; 8 channels per head; for blocks.1.attn",
        "    rotate-half rotation of q and k by a position table (blocks.1.attn.pos",
        "    returns the table)"]
    new = lines[start:end] + [line for line in lines
                              if line.startswith(("    q_norm", "      RoPE"))]
    assert max(len(line) for line in new) <= 80
    assert "\x1b" not in out and "\x07" not in out  # piped: plain text, the name escaped
    assert main(["roles", "--model", f"{RM}:pos_qk_norm", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["module"], r["channels"]) for r in data["rotary"]] == [
        (f"{a}.pos", rm.DH) for a in LAYERS]
    assert data["attention"][0]["q_norm"] == "blocks.0.attn.qn"
    assert data["attention"][0]["rotary"] == "blocks.0.attn.pos"


def test_mdb_roles_says_how_to_declare_rope_when_none_is_found(capsys):
    assert main(["roles", "--model", f"{RM}:pos"]) == 0  # found: no hint
    assert "declare it: hooks.roles(model, rotary=" not in capsys.readouterr().out
    from tui.commands.roles import lines

    model, batch = rm.build("matrix")
    got = lines(find_roles(model, batch))
    i = next(n for n, line in enumerate(got) if line.startswith("RoPE: "))
    assert got[i:i + 2] == [
        "RoPE: none found (learned positions, relative biases or none); if the model",
        "  applies RoPE, declare it: hooks.roles(model, rotary='NAME')"]
