"""The doctor reads a model's parts through ``hooks.modelroles``, from what the model computes:
a home-grown GPT whose projections are named like nothing HF uses (``to_query``, one fused
``kv_proj`` of keys and values, ``out``; an MLP of ``grow``/``shrink``; norms of a class
``Unit`` with a ``gain``) gets the same verdicts as the same weights under HF's names
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``up_proj``/``down_proj``, ``RMSNorm.weight``)
on the checks that read those parts: the init report (parameter roles), GQA grouping (the keys'
and values' columns, after the k norm), the per-head norm promise and bf16 numerics (the
norms). A declared role is honoured where the computation cannot tell.

Expected values are computed here: the weights' stds with plain torch, the grouping from the
models' own code, the two models' logits compared.

Dimension legend: B batch, T positions, D hidden size, H query heads, Hkv key/value heads,
Dh head dim, V vocabulary, L layers.
"""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hooks
from hooks.doctor.model import Target, run_checks
from hooks.doctor.model.param_roles import param_roles
from hooks.modelroles import find_roles, module_parts

pytestmark = pytest.mark.usefixtures("one_thread")

V, T, D, H, HKV, L = 61, 16, 32, 4, 2, 2
DH = D // H
SIGMA = 0.02
#: The checks that read the attention projections, the MLP's and the norms.
CHECKS = "init,gqa,shapes,numerics"


def _rms(x: torch.Tensor, scale: torch.Tensor, upcast: bool) -> torch.Tensor:
    h = x.float() if upcast else x
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return y.to(x.dtype) * scale


class RMSNorm(nn.Module):
    """An RMS norm named as HF names them (its scale is ``weight``)."""

    def __init__(self, d: int, upcast: bool = True) -> None:
        super().__init__()
        self.weight, self.upcast = nn.Parameter(torch.ones(d)), upcast

    def forward(self, x):
        return _rms(x, self.weight, self.upcast)


class Unit(nn.Module):
    """The same norm under a name of one's own (its scale is ``gain``)."""

    def __init__(self, d: int, upcast: bool = True) -> None:
        super().__init__()
        self.gain, self.upcast = nn.Parameter(torch.ones(d)), upcast

    def forward(self, x):
        return _rms(x, self.gain, self.upcast)


def _attend(q, k, v, k_norm: nn.Module, o: nn.Module, tiled: bool, exp: bool = False):
    """Causal grouped-query attention of (B, T, H·Dh) q and (B, T, Hkv·Dh) k, v; the keys
    normalised per head; KV heads expanded with ``repeat_interleave`` (``repeat`` when
    ``tiled``: the known mistake); normalised by softmax, or by hand (``exp``/sum) when
    ``exp``."""
    b, t, _ = q.shape
    q = q.view(b, t, H, DH).transpose(1, 2)
    k = k_norm(k.view(b, t, HKV, DH)).transpose(1, 2)
    v = v.view(b, t, HKV, DH).transpose(1, 2)
    rep = H // HKV
    k, v = ((x.repeat(1, rep, 1, 1) if tiled else x.repeat_interleave(rep, dim=1))
            for x in (k, v))
    s = (q @ k.transpose(-2, -1)) / math.sqrt(DH)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    if exp:
        e = (s - s.amax(-1, keepdim=True)).exp()
        p = (e / e.sum(-1, keepdim=True)).to(v.dtype)
    else:
        p = F.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype)
    return o((p @ v).transpose(1, 2).reshape(b, t, H * DH))


class Attention(nn.Module):
    """HF's names: q_proj, k_proj, v_proj, o_proj, k_norm, num_heads, num_key_value_heads."""

    def __init__(self, tiled: bool = False, upcast: bool = True) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = H, HKV, DH
        self.q_proj = nn.Linear(D, H * DH, bias=False)
        self.k_proj = nn.Linear(D, HKV * DH, bias=False)
        self.v_proj = nn.Linear(D, HKV * DH, bias=False)
        self.o_proj = nn.Linear(H * DH, D, bias=False)
        self.k_norm = RMSNorm(DH, upcast)
        self.tiled = tiled

    def forward(self, x):
        return _attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.k_norm,
                       self.o_proj, self.tiled)


class Mixer(nn.Module):
    """The same attention under names of one's own: no head attribute mdb knows, one
    ``kv_proj`` of keys then values, ``out``, ``key_scale``."""

    def __init__(self, tiled: bool = False, upcast: bool = True, exp: bool = False) -> None:
        super().__init__()
        self.groups = H
        self.to_query = nn.Linear(D, H * DH, bias=False)
        self.kv_proj = nn.Linear(D, 2 * HKV * DH, bias=False)
        self.out = nn.Linear(H * DH, D, bias=False)
        self.key_scale = Unit(DH, upcast)
        self.tiled, self.exp = tiled, exp

    def forward(self, x):
        k, v = self.kv_proj(x).split(HKV * DH, dim=-1)
        return _attend(self.to_query(x), k, v, self.key_scale, self.out, self.tiled, self.exp)


class Block(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module, norm) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = norm(D), attn, norm(D), mlp

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D,
                                                                                  bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class FF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.grow, self.shrink = nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D, bias=False)

    def forward(self, x):
        return self.shrink(F.gelu(self.grow(x)))


class GPT(nn.Module):
    """Embedding, L blocks, a final norm and a head; ``named``: HF's names, else one's own
    (``tok``, ``Mixer``, ``FF``, ``Unit`` norms, ``final``, ``readout``)."""

    def __init__(self, named: bool, tiled: bool = False, upcast: bool = True,
                 exp: bool = False) -> None:
        super().__init__()
        self.config = SimpleNamespace(initializer_range=SIGMA, n_layer=L)
        norm = (lambda d: RMSNorm(d, upcast)) if named else (lambda d: Unit(d, upcast))
        attn = (lambda: Attention(tiled, upcast)) if named else (lambda: Mixer(tiled, upcast,
                                                                               exp))
        self.named = named
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(attn(), MLP() if named else FF(), norm)
                                    for _ in range(L))
        self.final = norm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, idx, targets=None):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.final(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1),
                                                            targets.flatten())
        return logits, loss


def hf_named(scaled_q: bool = False, **kw) -> GPT:
    """The HF-named model, initialised as GPT-2 does (every weight N(0, σ²), the projections
    that write to the residual stream at σ/√(2L)); ``scaled_q``: the q projections too (the
    scaling given to a weight that reads the residual: karpathy/llama2.c #579's mistake)."""
    torch.manual_seed(0)
    model = GPT(True, **kw)
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            writes = name.endswith(("o_proj.weight", "down_proj.weight"))
            scaled = writes or (scaled_q and name.endswith("q_proj.weight"))
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * SIGMA
                        / (math.sqrt(2 * L) if scaled else 1))
    return model


def own_named(model: GPT, **kw) -> GPT:
    """The same weights under names of one's own (``kv_proj`` = k_proj's rows then v_proj's)."""
    own = GPT(False, **kw)
    sd = model.state_dict()
    new = {"emb.weight": sd["emb.weight"], "head.weight": sd["head.weight"],
           "final.gain": sd["final.weight"]}
    for i in range(L):
        a, b = f"blocks.{i}.attn.", f"blocks.{i}."
        new |= {a + "to_query.weight": sd[a + "q_proj.weight"],
                a + "kv_proj.weight": torch.cat([sd[a + "k_proj.weight"],
                                                 sd[a + "v_proj.weight"]]),
                a + "out.weight": sd[a + "o_proj.weight"],
                a + "key_scale.gain": sd[a + "k_norm.weight"],
                b + "ln1.gain": sd[b + "ln1.weight"], b + "ln2.gain": sd[b + "ln2.weight"],
                b + "mlp.grow.weight": sd[b + "mlp.up_proj.weight"],
                b + "mlp.shrink.weight": sd[b + "mlp.down_proj.weight"]}
    own.load_state_dict(new)
    return own


#: A module of the HF-named model -> the same module of the other.
RENAME = {"q_proj": "to_query", "k_proj": "kv_proj", "v_proj": "kv_proj", "o_proj": "out",
          "k_norm": "key_scale", "up_proj": "grow", "down_proj": "shrink"}


def renamed(name: str | None) -> str | None:
    return None if name is None else ".".join(RENAME.get(p, p) for p in name.split("."))


def batch():
    x = torch.randint(0, V, (2, T + 1), generator=torch.Generator().manual_seed(0))
    return x[:, :-1], x[:, 1:]


def pair(scaled_q: bool = False, **kw) -> tuple[GPT, GPT]:
    named = hf_named(scaled_q, **kw)
    own = own_named(named, **kw)
    idx, _ = batch()
    with torch.no_grad():  # the same model: the same logits
        torch.testing.assert_close(own(idx)[0], named(idx)[0], rtol=1e-5, atol=1e-6)
    return named, own


def verdicts(model: GPT) -> dict[str, tuple[str, str | None]]:
    return {r.key: (r.status, r.module) for r in run_checks(model, batch(), only=CHECKS)}


# -- the same verdicts under other names ---------------------------------------------------------
VARIANTS = {"correct": {}, "q scaled like an output": dict(scaled_q=True),
            "kv heads tiled": dict(tiled=True), "norms in bf16": dict(upcast=False)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_own_names_get_the_verdicts_of_hf_names(variant):
    named, own = pair(**VARIANTS[variant])
    want = verdicts(named)
    got = verdicts(own)
    assert got == {k: (s, renamed(m)) for k, (s, m) in want.items()}
    expected = {  # the HF-named model's verdicts, as this file's bugs make them
        "correct": {"init": "pass", "gqa": "pass", "shapes": "pass", "numerics": "pass"},
        "q scaled like an output": {"init": "fail", "gqa": "pass", "shapes": "pass",
                                    "numerics": "pass"},
        "kv heads tiled": {"init": "pass", "gqa": "fail", "shapes": "pass", "numerics": "pass"},
        "norms in bf16": {"init": "pass", "gqa": "pass", "shapes": "pass", "numerics": "fail"},
    }[variant]
    assert {k: s for k, (s, _) in want.items()} == expected


def test_the_init_report_names_the_scaled_query_projection_by_what_it_computes():
    named, own = pair(scaled_q=True)
    (r,) = run_checks(own, batch(), only="init")
    assert r.status == "fail" and r.module == "blocks.0.attn.to_query"
    assert "blocks.0.attn.to_query.weight (q, reads the residual stream)" in r.evidence
    std = float(own.blocks[0].attn.to_query.weight.detach().std())
    assert r.data["weights"]["blocks.0.attn.to_query.weight"] == ["q", pytest.approx(std)]
    assert std == pytest.approx(SIGMA / math.sqrt(2 * L), rel=0.1)
    # the per-role stds are the named model's: q, the fused k|v (k and v there), o, the MLP
    (n,) = run_checks(named, batch(), only="init")
    roles, want = r.data["roles"], n.data["roles"]
    for role in ("q", "attn_out", "mlp_in", "mlp_out", "embedding", "lm_head"):
        assert roles[role]["median_std"] == pytest.approx(want[role]["median_std"], rel=1e-6)
    kv = [float(own.blocks[i].attn.kv_proj.weight.detach().std()) for i in range(L)]
    assert roles["kv"]["tensors"] == L and "k" not in roles and "v" not in roles
    assert roles["kv"]["median_std"] == pytest.approx(statistics.median(kv), rel=1e-6)
    assert statistics.median(kv) == pytest.approx(SIGMA, rel=0.1)


def test_gqa_perturbs_the_kv_columns_after_the_key_norm():
    _, own = pair()
    (r,) = run_checks(own, batch(), only="gqa")
    layer = r.data["layers"]["blocks.0.attn"]
    assert (layer["k_site"], layer["v_site"], layer["layout"]) == ("key_scale", "kv_proj",
                                                                   "separate")
    groups = [[h for h in range(H) if h // (H // HKV) == g] for g in range(HKV)]  # the code's
    assert layer["k_proj"] == layer["v_proj"] == groups == [[0, 1], [2, 3]]
    _, tiled = pair(tiled=True)
    (bad,) = run_checks(tiled, batch(), only="gqa")
    assert bad.status == "fail" and bad.module == "blocks.0.attn"
    assert "`repeat` (tiling) used where `repeat_interleave` belongs" in bad.evidence


def test_the_parts_are_found_from_the_computation():
    _, own = pair()
    roles = find_roles(own, batch()[0])
    a = roles.attention_of("blocks.1.attn")
    assert (a.how, a.num_heads, a.num_kv_heads, a.head_dim, a.o) == (
        "traced", H, HKV, DH, "blocks.1.attn.out")
    assert [(c.module, c.start, c.stop) for c in (a.q, a.k, a.v)] == [
        ("blocks.1.attn.to_query", 0, 32), ("blocks.1.attn.kv_proj", 0, 16),
        ("blocks.1.attn.kv_proj", 16, 32)]
    assert (a.q_norm, a.k_norm) == (None, "blocks.1.attn.key_scale")
    assert [(n.module, n.how) for n in roles.norms] == [
        (f"blocks.{i}.{p}", "traced") for i in range(L)
        for p in ("ln1", "attn.key_scale", "ln2")] + [("final", "traced")]
    parts = module_parts(own, roles)
    assert {k: v for k, v in parts.items() if k.startswith("blocks.0.")} == {
        "blocks.0.attn.to_query": "q", "blocks.0.attn.kv_proj": "kv",
        "blocks.0.attn.out": "attn_out", "blocks.0.attn.key_scale": "norm",
        "blocks.0.ln1": "norm", "blocks.0.ln2": "norm"}
    got = {r.name: r.role for r in param_roles(Target(own, batch()))}
    assert got["blocks.0.mlp.grow.weight"] == "mlp_in"  # D -> 4·D, by its shape
    assert got["blocks.0.mlp.shrink.weight"] == "mlp_out"
    assert got["final.gain"] == "norm" and got["head.weight"] == "lm_head"


# -- a declared role is honoured -------------------------------------------------------------------
class Scaler(nn.Module):
    """A final norm the trace does not see as one (``x.norm``, no rsqrt), computing its
    statistic in the input's dtype."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * (x.shape[-1] ** 0.5) / x.norm(dim=-1, keepdim=True) * self.gain


def untraceable(declare: bool) -> GPT:
    """The own-named model with attention normalised by hand (no softmax, no SDPA: nothing
    to trace) and a :class:`Scaler` final norm; ``declare``: with the roles declared."""
    torch.manual_seed(0)
    model = GPT(False, exp=True)
    model.final = Scaler(D)
    if declare:
        hooks.roles(model, attention="blocks.*.attn", heads=H, kv_heads=HKV, o="out",
                    final_norm="final")
    return model


def test_a_declared_attention_and_final_norm_are_honoured():
    # without the declaration: no softmax, no SDPA, no name to go by
    bare = Target(untraceable(False), batch())
    assert bare.attention_layers() == []
    assert {r.name: r.role for r in param_roles(bare)}["blocks.0.attn.out.weight"] == "other"
    t = Target(untraceable(True), batch())
    a = t.attention_layers()
    assert [(x.name, x.num_heads, x.num_kv_heads, x.head_dim) for x in a] == [
        (f"blocks.{i}.attn", H, HKV, DH) for i in range(L)]
    assert "the projections of its keys and values were not found" in a[0].why
    got = {r.name: r.role for r in param_roles(t)}
    assert got["blocks.0.attn.out.weight"] == "attn_out" and got["final.gain"] == "norm"
    # the final norm computes x.norm in bf16: judged once declared, not before
    (bad,) = run_checks(untraceable(True), batch(), only="numerics")
    assert bad.status == "fail" and bad.module == "final"
    assert "final (Scaler) computes" in bad.evidence and "in bfloat16" in bad.evidence
    (ok,) = run_checks(untraceable(False), batch(), only="numerics")
    assert ok.status == "pass" and "final" not in ok.data["norms"]


# -- the attention role is the module that holds the o projection ------------------------------
class Rotary(nn.Module):
    """cos and sin of the rotary angles for T positions (HF's halves), (T, Dh)."""

    def forward(self, t: int):
        inv = 1.0 / (10000 ** (torch.arange(0, DH, 2).float() / DH))
        ang = torch.outer(torch.arange(t).float(), inv)
        return torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()


def _rotate(x, cos, sin):
    x1, x2 = x[..., : DH // 2], x[..., DH // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Core(nn.Module):
    """q, k, v and SDPA; the heads' output leaves it (B, T, H·Dh) for the wrapper's ``out``."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.rotary_emb = Rotary()

    def forward(self, x):
        b, t, _ = x.shape
        cos, sin = self.rotary_emb(t)
        q, k, v = (w(x).view(b, t, H, DH).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v,
                                           is_causal=True)
        return y.transpose(1, 2).reshape(b, t, D)


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.core, self.out = Core(), nn.Linear(D, D, bias=False)

    def forward(self, x):
        return self.out(self.core(x))


def test_rope_reads_the_probabilities_recorded_inside_the_attention_role():
    torch.manual_seed(0)
    model = GPT(False)
    for b in model.blocks:
        b.attn = Wrapped()
    t = Target(model, batch())
    assert [a.name for a in t.attention_layers()] == ["blocks.0.attn", "blocks.1.attn"]
    (r,) = run_checks(model, batch(), only="rope")
    assert r.status == "pass", r.evidence
    assert (r.data["attention"], r.data["rotary"]) == ("blocks.0.attn",
                                                       "blocks.0.attn.core.rotary_emb")
    assert r.data["compared"] > 0 and r.data["violation"] < 1e-3 * r.data["signal"]


def test_a_declaration_that_does_not_fit_is_said_and_the_found_roles_are_used():
    _, own = pair()
    own.__mdb_roles__ = {"attention": "blocks.*.atn", "heads": H}
    t = Target(own, batch())
    assert t.roles().notes[0].startswith("roles: attention='blocks.*.atn' matches no module")
    assert [(a.name, a.layout, a.num_kv_heads) for a in t.attention_layers()] == [
        (f"blocks.{i}.attn", "separate", HKV) for i in range(L)]
    (r,) = run_checks(own, batch(), only="gqa")
    assert r.status == "pass", r.evidence
