"""Home-grown GPTs of six styles, none with HF's names, for ``hooks.modelroles`` (issue 35):
karpathy's nanoGPT and minGPT (their real files, loaded from where the environment keeps
them, never copied here), a newcomer's fused-qkv GPT, separate q/k/v projections under other
names with grouped KV heads and ``einsum``, a RoPE model with ``head`` + ``ln_f``, and an MoE
of one's own. Each factory returns ``(model, ids)`` for ``mdb --model FILE:FUNCTION``.

Dimension legend: B batch, T positions, D hidden size, H query heads, Hkv key/value heads,
Dh head dim, E experts, V vocabulary.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

V, T = 61, 16

#: Where the real nanoGPT ``model.py`` and minGPT ``mingpt/model.py`` are looked for.
NANOGPT = Path(os.environ.get("MDB_NANOGPT", "/work/ext/nanogpt_model.py"))
MINGPT = Path(os.environ.get("MDB_MINGPT", "/work/ext/mingpt_model.py"))


def ids(b: int = 2, t: int = T, seed: int = 0) -> torch.Tensor:
    """(B, T) token ids below V."""
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def _load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- 1. karpathy's nanoGPT (SDPA, fused c_attn, n_head) ---------------------------------------
def nanogpt():
    """nanoGPT's ``GPT`` (2 layers, 4 heads, D=32) and a batch."""
    mod = _load(NANOGPT, "mdb_test_nanogpt_model")
    torch.manual_seed(0)
    cfg = mod.GPTConfig(block_size=T, vocab_size=V, n_layer=2, n_head=4, n_embd=32,
                        dropout=0.0, bias=True)
    return mod.GPT(cfg), ids()


# -- 2. minGPT (an eager softmax, fused c_attn) -----------------------------------------------
class _CfgNode(types.SimpleNamespace):
    """Stands in for ``mingpt.utils.CfgNode`` (attributes and ``merge_from_dict``)."""

    def merge_from_dict(self, d):
        self.__dict__.update(d)


def mingpt():
    """minGPT's ``GPT`` ('gpt-nano': 3 layers, 3 heads, D=48) and a batch."""
    utils = types.ModuleType("mingpt.utils")
    utils.CfgNode = _CfgNode
    pkg = types.ModuleType("mingpt")
    pkg.utils = utils
    saved = {k: sys.modules.get(k) for k in ("mingpt", "mingpt.utils")}
    sys.modules.update({"mingpt": pkg, "mingpt.utils": utils})
    try:
        mod = _load(MINGPT, "mdb_test_mingpt_model")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    torch.manual_seed(0)
    cfg = mod.GPT.get_default_config()
    cfg.model_type, cfg.vocab_size, cfg.block_size = "gpt-nano", V, T
    cfg.embd_pdrop = cfg.resid_pdrop = cfg.attn_pdrop = 0.0
    return mod.GPT(cfg), ids()


# -- 3. a newcomer's GPT: fused qkv in a class named Attn, heads in self.h ---------------------
class Attn(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T_, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.view(B, T_, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(D // self.h)
        att = att.masked_fill(torch.ones(T_, T_, dtype=torch.bool).triu(1), float("-inf"))
        y = att.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T_, D))


class Block(nn.Module):
    def __init__(self, d: int, mixer: nn.Module, ffn: nn.Module | None = None,
                 norm=nn.LayerNorm) -> None:
        super().__init__()
        self.ln1, self.ln2 = norm(d), norm(d)
        self.attn = mixer
        self.mlp = ffn if ffn is not None else nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MyGPT(nn.Module):
    """Token and position embeddings, blocks, ``ln_f`` and a ``head`` tied to the embedding."""

    def __init__(self, d: int = 32, h: int = 4, n: int = 3, mixer=Attn) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d, mixer(d, h)) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1),
                                                            targets.flatten())
        return logits, loss


def newcomer():
    torch.manual_seed(0)
    return MyGPT(), ids()


# -- 4. separate q/k/v under other names, grouped KV heads, einsum ----------------------------
class Mixer(nn.Module):
    """Queries of ``groups`` heads; keys and values of ``groups // 2`` heads shared by pairs."""

    def __init__(self, d: int, groups: int) -> None:
        super().__init__()
        self.groups, self.kv, self.dh = groups, groups // 2, d // groups
        self.to_query = nn.Linear(d, d, bias=False)
        self.to_key = nn.Linear(d, self.kv * self.dh, bias=False)
        self.to_value = nn.Linear(d, self.kv * self.dh, bias=False)
        self.mix = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T_, D = x.shape
        q = self.to_query(x).view(B, T_, self.groups, self.dh).permute(0, 2, 1, 3)
        k = self.to_key(x).view(B, T_, self.kv, self.dh).permute(0, 2, 1, 3)
        v = self.to_value(x).view(B, T_, self.kv, self.dh).permute(0, 2, 1, 3)
        k, v = (t.repeat_interleave(self.groups // self.kv, dim=1) for t in (k, v))
        s = torch.einsum("bhtd,bhsd->bhts", q, k) * self.dh ** -0.5
        s = s + torch.full((T_, T_), float("-inf")).triu(1)
        y = torch.einsum("bhts,bhsd->bhtd", F.softmax(s, dim=-1), v)
        return self.mix(y.permute(0, 2, 1, 3).flatten(2))


class Stacked(nn.Module):
    """Blocks in ``stack``, the final norm ``final``, the head ``readout``: no usual name."""

    def __init__(self, d: int = 32, h: int = 4, n: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.stack = nn.ModuleList(Block(d, Mixer(d, h)) for _ in range(n))
        self.final = nn.LayerNorm(d)
        self.readout = nn.Linear(d, V)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.stack:
            x = b(x)
        return self.readout(self.final(x))


def separate_qkv():
    torch.manual_seed(0)
    return Stacked(), ids()


# -- 5. RoPE, wq/wk/wv/wo, an RMS norm of one's own, head + ln_f, SDPA ------------------------
class RMS(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary positions (HF's halves) on (B, H, T, Dh)."""
    t, dh = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, dh, 2).float() / dh))
    ang = torch.outer(torch.arange(t).float(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class SelfMix(nn.Module):
    def __init__(self, d: int, nh: int) -> None:
        super().__init__()
        self.nh = nh
        self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T_, D = x.shape
        q, k, v = (w(x).view(B, T_, self.nh, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(_rope(q), _rope(k), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T_, D))


class RopeGPT(nn.Module):
    def __init__(self, d: int = 32, h: int = 4, n: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, d)
        self.layers = nn.ModuleList(Block(d, SelfMix(d, h), norm=RMS) for _ in range(n))
        self.ln_f = RMS(d)
        self.head = nn.Linear(d, V, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.layers:
            x = b(x)
        return self.head(self.ln_f(x))


def rope_head_ln_f():
    torch.manual_seed(0)
    return RopeGPT(), ids()


# -- 6. an MoE of one's own: a scorer, a list of ffns, top-2 -------------------------------------
class Switchy(nn.Module):
    def __init__(self, d: int, e: int = 4, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.scorer = nn.Linear(d, e, bias=False)
        self.ffns = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(),
                                                nn.Linear(2 * d, d)) for _ in range(e))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])  # (N, D)
        w, pick = torch.softmax(self.scorer(flat), dim=-1).topk(self.k, dim=-1)  # (N, k)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, ffn in enumerate(self.ffns):
            rows, slot = (pick == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, ffn(flat[rows]) * w[rows, slot, None])
        return out.view_as(x)


class MoEGPT(MyGPT):
    def __init__(self, d: int = 32, h: int = 4, n: int = 2) -> None:
        super().__init__(d, h, n)
        for b in self.blocks:
            b.mlp = Switchy(d)


def own_moe():
    torch.manual_seed(0)
    return MoEGPT(), ids()


# -- what tracing cannot tell: attention without a softmax call --------------------------------
class ExpAttn(Attn):
    """Attention normalised by hand (``exp`` / sum), a kernel mdb does not trace."""

    def forward(self, x):
        B, T_, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.view(B, T_, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D // self.h)
        s = s.masked_fill(torch.ones(T_, T_, dtype=torch.bool).triu(1), float("-inf"))
        p = (s - s.amax(-1, keepdim=True)).exp()
        y = (p / p.sum(-1, keepdim=True)) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T_, D))


def untraceable():
    torch.manual_seed(0)
    return MyGPT(mixer=ExpAttn), ids()


def untraceable_declared():
    """The same, with the one line its error message gives."""
    import hooks

    model, batch = untraceable()
    hooks.roles(model, attention=["blocks.*.attn"], heads=4, o="proj")
    return model, batch


# -- an MoE whose fused experts take (hidden, ids, weights), under names of its own -------------
class Bank(nn.Module):
    """E experts as one (E, D, D) weight, called as ``bank(hidden (N, D), ids (N, k), weights
    (N, k))`` like transformers 5's experts."""

    def __init__(self, d: int, e: int = 4) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(e, d, d) * 0.1)

    def forward(self, hidden, ids, weights):
        per = torch.einsum("nd,edf->nef", hidden, self.w)  # (N, E, D)
        picked = per.gather(1, ids[..., None].expand(-1, -1, per.shape[-1]))  # (N, k, D)
        return (picked * weights[..., None]).sum(1)


class BankMoE(nn.Module):
    def __init__(self, d: int, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.scorer = nn.Linear(d, 4, bias=False)
        self.bank = Bank(d)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        w, pick = torch.softmax(self.scorer(flat), dim=-1).topk(self.k, dim=-1)
        return self.bank(flat, pick, w / w.sum(-1, keepdim=True)).view_as(x)


def bank_moe():
    torch.manual_seed(0)
    model = MyGPT(n=2)
    for b in model.blocks:
        b.mlp = BankMoE(32)
    return model, ids()
