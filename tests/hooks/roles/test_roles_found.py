"""Roles found with no declaration on six styles of home-grown model (issue 35): the attention
modules with their heads and o projection, the LM head and final norm, the router and the
experts; on each, ``zero MODULE head=H`` equals the model with that head's columns of the o
projection's input zeroed by hand (its weight's columns: the same product), the logit lens's
last layer equals the logits, and ``mdb roles`` prints the modules.

References are computed here from plain torch on copies of the model, never by mdb."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import hooks
from hooks.modelroles import find_roles
from hooks.whatif.lens import logit_lens
from tests.hooks.roles import own_models as om
from tui.cli import main

OWN = Path(om.__file__)
#: fp32 on any machine: the same ops in the same order, a few ulps at most
TOL = dict(rtol=1e-5, atol=1e-6)

# factory, attention modules, H, Hkv, Dh, o child, LM head, final norm, MoE (block, router, experts)
STYLES = {
    "nanogpt": (["transformer.h.0.attn", "transformer.h.1.attn"], 4, 4, 8, "c_proj", "lm_head",
                "transformer.ln_f", []),
    "mingpt": ([f"transformer.h.{i}.attn" for i in range(3)], 3, 3, 16, "c_proj", "lm_head",
               "transformer.ln_f", []),
    "newcomer": ([f"blocks.{i}.attn" for i in range(3)], 4, 4, 8, "proj", "head", "ln_f", []),
    "separate_qkv": (["stack.0.attn", "stack.1.attn"], 4, 2, 8, "mix", "readout", "final", []),
    "rope_head_ln_f": (["layers.0.attn", "layers.1.attn"], 4, 4, 8, "wo", "head", "ln_f", []),
    "own_moe": (["blocks.0.attn", "blocks.1.attn"], 4, 4, 8, "proj", "head", "ln_f",
                [(f"blocks.{i}.mlp", f"blocks.{i}.mlp.scorer", f"blocks.{i}.mlp.ffns")
                 for i in range(2)]),
}


def build(style: str):
    path = {"nanogpt": om.NANOGPT, "mingpt": om.MINGPT}.get(style)
    if path is not None and not path.exists():
        pytest.skip(f"{style}'s real model file is not at {path} (set MDB_"
                    f"{style.upper()} to its path): it is fetched for testing, never copied here")
    model, ids = getattr(om, style)()
    return model.eval(), ids


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("style", STYLES)
def test_roles_are_traced_without_a_declaration(style):
    model, ids = build(style)
    names, h, hkv, dh, o, head, norm, moe = STYLES[style]
    roles = find_roles(model, ids)
    assert roles.traced and not roles.notes
    assert [a.name for a in roles.attention] == names
    for a in roles.attention:
        assert (a.how, a.num_heads, a.num_kv_heads, a.head_dim, a.o) == \
            ("traced", h, hkv, dh, f"{a.name}.{o}")
        assert a.q is not None and a.q.width == h * dh and a.k.width == a.v.width == hkv * dh
    assert (roles.lm_head.module, roles.lm_head.how) == (head, "traced")
    assert (roles.final_norm.module, roles.final_norm.how) == (norm, "traced")
    assert [(m.name, m.router, m.experts, m.num_experts, m.top_k) for m in roles.moe] == \
        [(b, r, e, 4, 2) for b, r, e in moe]


def test_fused_qkv_columns_are_read_from_the_split():
    model, ids = build("newcomer")
    a = find_roles(model, ids).attention_of("blocks.1.attn")
    assert [(c.module, c.start, c.stop) for c in (a.q, a.k, a.v)] == [
        ("blocks.1.attn.qkv", 0, 32), ("blocks.1.attn.qkv", 32, 64),
        ("blocks.1.attn.qkv", 64, 96)]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("head", [0, 2])
def test_a_head_edit_equals_its_o_projection_columns_zeroed_by_hand(style, head):
    model, ids = build(style)
    names, h, _, dh, o, *_ = STYLES[style]
    layer = names[1]
    ref = copy.deepcopy(model)
    with torch.no_grad():  # o(x) with x[..., cols] = 0 is o with its weight's cols zeroed
        ref.get_submodule(f"{layer}.{o}").weight[:, head * dh:(head + 1) * dh] = 0
    want = logits(ref, ids)
    with torch.no_grad(), hooks.capture(model, edits=[f"zero {layer} head={head}"]) as trace:
        got = logits(model, ids)
    assert trace.edits[0].changed == 1
    assert torch.allclose(got, want, **TOL), float((got - want).abs().max())
    assert not torch.allclose(logits(model, ids), want, **TOL)  # the edit did something


def test_an_expert_edit_on_an_moe_of_ones_own_equals_the_expert_zeroed_by_hand():
    model, ids = build("own_moe")
    ref = copy.deepcopy(model)
    with torch.no_grad():
        last = ref.blocks[1].mlp.ffns[1][2]
        last.weight.zero_()
        last.bias.zero_()
    want = logits(ref, ids)
    with torch.no_grad(), hooks.capture(model, edits=["zero blocks.1.mlp expert=1"]):
        got = logits(model, ids)
    assert torch.allclose(got, want, **TOL), float((got - want).abs().max())
    assert not torch.allclose(logits(model, ids), want, **TOL)


@pytest.mark.parametrize("style", STYLES)
def test_the_lens_last_layer_is_the_logits(style):
    model, ids = build(style)
    lens = logit_lens(model, ids)
    _, _, _, _, _, head, norm, _ = STYLES[style]
    assert (lens.head, lens.norm) == (head, norm)
    want = logits(model, ids)
    got = lens.logits(-1)
    if style == "nanogpt":  # nanoGPT returns the last position's logits without targets
        got = got[:, -1:]
    assert torch.allclose(got, want, **TOL), float((got - want).abs().max())


@pytest.mark.parametrize("style", ["newcomer", "separate_qkv", "own_moe", "nanogpt"])
def test_mdb_roles_prints_each_role_and_how(style, capsys):
    build(style)  # skips without the file
    names, h, hkv, dh, o, head, norm, moe = STYLES[style]
    assert main(["roles", "--model", f"{OWN}:{style}"]) == 0
    out = capsys.readouterr().out
    for name in names:
        assert f"  {name}: traced; H={h}, Hkv={hkv}, Dh={dh};" in out
        assert f"o {name}.{o}; " in out
    assert f"LM head: {head}: traced" in out and f"final norm: {norm}: traced" in out
    for block, router, experts in moe:
        assert f"  {block}: traced; router {router}, experts {experts}, E 4, k 2" in out
    assert main(["roles", "--model", f"{OWN}:{style}", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert [a["name"] for a in data["attention"]] == names
    assert data["lm_head"] == {"module": head, "how": "traced",
                               "detail": data["lm_head"]["detail"]}
