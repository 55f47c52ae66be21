"""Where tracing cannot tell (attention normalised by hand, not by a softmax call): the
message names the module, says what was looked for and gives the line that declares it; the
declaration (``hooks.roles(...)`` or ``__mdb_roles__``) then works and wins; a bad one is one
line. Also: the traced roles are cached per model and traced again when a module changes."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import hooks
from hooks.engine.edits import resolve_edits
from hooks.modelroles import find_roles, traced_roles
from hooks.whatif.lens import logit_lens
from tests.hooks.roles import own_models as om
from tui.cli import main

OWN = Path(om.__file__)
TOL = dict(rtol=1e-5, atol=1e-6)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids)[0]


def test_the_not_found_message_names_the_module_and_gives_the_line_that_declares_it():
    model, ids = om.untraceable()
    with pytest.raises(ValueError) as err:
        resolve_edits(model, ["zero blocks.1.attn head=2"])
    msg = str(err.value)
    assert "\n" not in msg
    assert "blocks.1.attn (ExpAttn)" in msg and "softmax over q·kᵀ" in msg
    assert "hooks.roles(model, attention=['blocks.*.attn'], heads=4)" in msg  # its self.h


@pytest.mark.parametrize("how", ["call", "attribute"])
def test_a_declared_attention_module_is_edited_like_a_traced_one(how):
    model, ids = om.untraceable()
    if how == "call":
        got_roles = hooks.roles(model, attention=["blocks.*.attn"], heads=4, o="proj")
    else:
        model.__mdb_roles__ = {"attention": "blocks.*.attn", "heads": 4, "o": "proj"}
        got_roles = hooks.find_roles(model)
    a = got_roles.attention_of("blocks.1.attn")
    assert (a.how, a.num_heads, a.head_dim, a.o) == ("declared", 4, 8, "blocks.1.attn.proj")
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref.blocks[1].attn.proj.weight[:, 16:24] = 0
    with torch.no_grad(), hooks.capture(model, edits=["zero blocks.1.attn head=2"]):
        got = _logits(model, ids)
    assert torch.allclose(got, _logits(ref, ids), **TOL)


def test_a_declaration_wins_over_the_trace_and_the_names():
    model, ids = om.newcomer()
    with torch.no_grad():
        model.ln_f.weight.mul_(2)  # not the same function as blocks.2.ln2 (both fresh)
    hooks.roles(model, lm_head="head", final_norm="blocks.2.ln2")
    roles = find_roles(model, ids)
    assert (roles.final_norm.module, roles.final_norm.how) == ("blocks.2.ln2", "declared")
    assert roles.attention_of("blocks.0.attn").how == "traced"
    lens = logit_lens(model, ids)  # the declared norm is the one the lens reads
    assert lens.norm == "blocks.2.ln2" and lens.last_layer_error > 0 and lens.notes


@pytest.mark.parametrize("bad, words", [
    (dict(attention="blocks.*.atn"), "matches no module (did you mean"),
    (dict(attention="blocks.*.attn", heads=0), "heads= must be a positive integer"),
    (dict(attention="blocks.*.attn", heads=3, o="proj"), "not a multiple of heads=3"),
    (dict(lm_head=["head"]), "lm_head= takes one module name"),
    (dict(lm_hed="head"), "unknown role 'lm_hed'"),
])
def test_a_bad_declaration_is_one_line(bad, words):
    model, _ = om.newcomer()
    with pytest.raises(ValueError, match=re.escape(words)) as err:
        hooks.roles(model, **bad)
    assert "\n" not in str(err.value)
    assert not hasattr(model, "__mdb_roles__")  # nothing kept


def test_mdb_roles_says_declared_and_refuses_a_bad_declaration_in_one_line(tmp_path, capsys):
    assert main(["roles", "--model", f"{OWN}:untraceable_declared"]) == 0
    out = capsys.readouterr().out
    assert "  blocks.0.attn: declared; H=4, Hkv=4, Dh=8; o blocks.0.attn.proj" in out
    f = tmp_path / "bad.py"
    f.write_text("import torch\nfrom torch import nn\n\n\ndef build():\n"
                 "    m = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5))\n"
                 "    m.__mdb_roles__ = {'lm_head': '9'}\n"
                 "    return m, torch.zeros(1, 3, dtype=torch.long)\n")
    assert main(["roles", "--model", f"{f}:build"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("mdb: error: roles: ") and "lm_head='9' matches no module" in err
    assert err.count("\n") == 1


def test_the_lens_says_how_to_declare_a_head_it_cannot_find():
    class NoHead(nn.Module):  # logits from the embedding's weight: no head module
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(om.V, 8)
            self.blocks = nn.ModuleList([nn.Linear(8, 8)])
            self.ln_f = nn.LayerNorm(8)

        def forward(self, idx):
            x = self.blocks[0](self.emb(idx))
            return torch.nn.functional.linear(self.ln_f(x), self.emb.weight)

    with pytest.raises(ValueError) as err:
        logit_lens(NoHead(), om.ids())
    msg = str(err.value)
    assert "NoHead has no LM head mdb found" in msg and "logits come from no projection" in msg
    assert "hooks.roles(model, lm_head='NAME')" in msg and "\n" not in msg


def test_the_trace_is_cached_per_model_and_redone_when_a_module_changes():
    model, ids = om.newcomer()
    first = traced_roles(model, ids)
    assert traced_roles(model) is first
    model.blocks[0].attn.proj = nn.Linear(32, 32)
    again = traced_roles(model)
    assert again is not first and again.attention_of("blocks.0.attn").o == "blocks.0.attn.proj"


def test_tracing_leaves_the_rng_and_train_flags_as_they_were():
    model, ids = om.newcomer()
    model.train()
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    find_roles(model, ids)
    assert torch.equal(torch.rand(3), want)
    assert all(m.training for m in model.modules())


def test_mdb_roles_on_a_forward_that_raises_is_one_line_naming_the_line(tmp_path, capsys):
    f = tmp_path / "raises.py"
    f.write_text("import torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n"
                 "    def __init__(self):\n        super().__init__()\n"
                 "        self.emb = nn.Embedding(5, 4)\n\n"
                 "    def forward(self, x):\n        raise RuntimeError('boom')\n\n\n"
                 "def build():\n    return Net(), torch.zeros(1, 3, dtype=torch.long)\n")
    assert main(["roles", "--model", f"{f}:build"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mdb: error: ") and "RuntimeError: boom" in err
    assert "raises.py:11" in err and err.count("\n") == 1


def test_a_model_with_nothing_to_trace_on_says_so_and_keeps_its_names():
    model = nn.Sequential(nn.Linear(4, 4))
    model.lm_head = nn.Linear(4, 3)
    roles = find_roles(model)
    assert not roles.traced and "no batch to trace" in roles.notes[0]
    assert (roles.lm_head.module, roles.lm_head.how) == ("lm_head", "named")


class LiarAttention(nn.Module):
    """Says 2 heads (``num_heads``) but computes 4: the names and the trace disagree."""

    num_heads = 2

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, T_, D = x.shape
        q, k, v = (p(x).view(B, T_, 4, D // 4).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T_, D))


def test_the_trace_and_the_names_must_agree_or_the_note_says_so_and_a_declaration_settles_it():
    torch.manual_seed(0)
    model = om.MyGPT(n=2, mixer=lambda d, h: LiarAttention(d))
    ids = om.ids()
    roles = find_roles(model, ids)
    a = roles.attention_of("blocks.0.attn")
    assert (a.how, a.num_heads, a.head_dim) == ("named", 2, 16)  # what the views use
    assert any("blocks.0.attn: the trace and the names disagree (heads: traced 4, named 2; "
               "head dim: traced 8, named 16)" in n for n in roles.notes)
    hooks.roles(model, attention="blocks.*.attn", heads=4)
    a = find_roles(model, ids).attention_of("blocks.0.attn")
    assert (a.how, a.num_heads, a.head_dim, a.o) == ("declared", 4, 8, "blocks.0.attn.o_proj")
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref.blocks[0].attn.o_proj.weight[:, 24:32] = 0
    with torch.no_grad(), hooks.capture(model, edits=["zero blocks.0.attn head=3"]):
        got = _logits(model, ids)
    assert torch.allclose(got, _logits(ref, ids), **TOL)
