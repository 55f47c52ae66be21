"""The doctor's RoPE check finds RoPE from what the model computes, not only from a module
named ``*rotary_emb``: the same GPT with its cos/sin table made by a child ``pos`` of a class
``Angles``, or by functions inside the attention's forward (no module at all), gets the verdict
and the measurements of the same weights under HF's layout (``rotary_emb``), correct or broken
(a table that wraps at 8 positions, keys left unrotated); Meta's complex ``freqs_cis`` held by
the model is found too. A model without RoPE (none, learned positions, a decoy with half of
RoPE's signature) stays n/a; one whose rotation mdb cannot see (a matrix per position applied
by ``einsum``) is n/a with the line that declares it, and that line makes it checked.

The reference is the name-found layout (what the check measured before it looked at the ops):
the models are shown to compute the same logits, then to get the same numbers.

Dimension legend: B batch, T positions, Dh head dim.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hooks
from hooks.doctor.model import run_checks
from tests.hooks.roles import rope_models as rm

pytestmark = pytest.mark.usefixtures("one_thread")

#: What the check measured (hooks.doctor.model.attention.relative_position_violation).
MEASURED = ("violation", "signal", "compared", "tested_length")


def check(model, batch, key: str = "rope"):
    (r,) = run_checks(model, batch, only=key)
    return r


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(batch)


@pytest.mark.parametrize("bug", [None, "wrap", "q_only"])
@pytest.mark.parametrize("layout,table", [("pos", "blocks.0.attn.pos"),
                                          ("function", "blocks.0.attn")])
def test_rope_under_another_name_or_in_a_function_gets_the_named_verdict(layout, table, bug):
    named_model, batch = rm.build("named", bug)
    model, _ = rm.build(layout, bug)
    assert torch.equal(logits(model, batch), logits(named_model, batch))  # the same computation
    named, got = check(named_model, batch), check(model, batch)
    assert named.status == ("pass" if bug is None else "fail"), named.evidence
    assert named.data["rotary"] == "blocks.0.attn.rotary_emb"
    assert got.status == named.status, got.evidence
    assert {k: got.data[k] for k in MEASURED} == {k: named.data[k] for k in MEASURED}
    assert got.data["compared"] > 0 and got.data["tested_length"] == rm.T
    assert (got.data["rotary"], got.data["rotary_how"]) == (table, "traced")
    if bug is None:
        assert got.data["violation"] < 1e-3 * got.data["signal"]
        assert got.module == table
        assert "RoPE traced: rotate-half rotation of q and k" in got.evidence
    elif bug == "wrap":  # scores depend on absolute positions: blamed on the table
        assert got.data["violation"] > 0.1 and got.module == table
        assert "scores depend on absolute position" in got.evidence
    else:  # the keys are not rotated: no offset effect at all
        assert got.data["signal"] == 0.0 and got.module == "blocks.0.attn"
        assert "do not depend on the key's position at all" in got.evidence


@pytest.mark.parametrize("bug,status", [(None, "pass"), ("wrap", "fail")])
def test_a_complex_table_held_by_the_model_is_found(bug, status):
    model, batch = rm.build("complex", bug)
    r = check(model, batch)
    assert r.status == status, r.evidence
    assert (r.data["rotary"], r.data["rotary_how"], r.module) == ("", "traced", None)
    if status == "pass":
        assert r.data["violation"] < 1e-3 * r.data["signal"]
        assert r.evidence.endswith("RoPE traced: complex rotation of q and k by a position "
                                   "table (<root> holds the table as freqs_cis)")
    else:
        assert r.data["violation"] > 0.1 and "depend on absolute position" in r.evidence


@pytest.mark.parametrize("layout", ["none", "learned", "decoy"])
def test_a_model_without_rope_stays_na_and_says_how_to_declare_it(layout):
    model, batch = rm.build(layout)
    r = check(model, batch)
    assert r.status == "n/a" and r.evidence.startswith("no rotary embedding: ")
    assert r.evidence.endswith("hooks.roles(model, rotary='blocks.*.attn')")
    assert check(model, batch, "shapes").status == "n/a"


@pytest.mark.parametrize("bug", [None, "wrap"])
def test_rope_the_trace_cannot_see_is_checked_once_declared_with_the_line_given(bug):
    model, batch = rm.build("matrix", bug)
    named_model, _ = rm.build("named", bug)
    assert torch.allclose(logits(model, batch), logits(named_model, batch), atol=1e-5)
    before = check(model, batch)
    assert before.status == "n/a"
    line = before.evidence.rpartition(": ")[2]
    assert line == "hooks.roles(model, rotary='blocks.*.attn')"
    eval(line, {"hooks": hooks, "model": model})  # the line, as the user would run it
    got, named = check(model, batch), check(named_model, batch)
    assert got.status == named.status == ("pass" if bug is None else "fail"), got.evidence
    assert (got.data["rotary"], got.data["rotary_how"]) == ("blocks.0.attn", "declared")
    for k in MEASURED:  # einsum rounds differently from the products: a few ulps apart
        assert got.data[k] == pytest.approx(named.data[k], rel=1e-4, abs=1e-6), k
    if bug is None:
        assert got.evidence.endswith("; RoPE declared (blocks.0.attn)")


@pytest.mark.parametrize("layout", ["named", "pos", "function", "complex"])
@pytest.mark.parametrize("rotary_dim,status", [(4, "pass"), (8, "fail")])
def test_the_channels_rope_rotates_are_counted_from_the_table(layout, rotary_dim, status):
    model, batch = rm.build(layout, rotary_dim=rotary_dim)
    model.config = SimpleNamespace(partial_rotary_factor=0.5)  # asks for 4 of Dh = 8
    r = check(model, batch, "shapes")
    assert r.status == status, r.evidence
    if status == "pass":
        assert "RoPE rotates 4 of 8 channels per head, as partial_rotary_factor = 0.5" \
               in r.evidence
    else:
        source = ("inv_freq has 4 frequencies" if layout == "named" else
                  "its table has 4 frequencies")
        assert f"rotates 8 channels per head ({source}) but the config asks for 4" \
               in r.evidence
