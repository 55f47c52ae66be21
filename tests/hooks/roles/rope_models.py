"""One small GPT with RoPE laid out in the ways people write it, the same weights in each, for
finding RoPE from what the model computes (``hooks.modelroles.rotary``, the doctor's RoPE
check):

* ``named``: a child ``rotary_emb`` of a class ``RotaryEmbedding`` with ``inv_freq`` (what
  names alone find);
* ``pos``: the same table from a child ``pos`` of a class ``Angles`` (no name to go by);
* ``function``: the table and the rotation computed by functions inside the attention's
  forward (no module at all);
* ``complex``: Meta's complex ``freqs_cis`` held by the model as a buffer, rotating
  interleaved pairs by a complex product (another pairing: other scores, same verdicts);
* ``matrix``: each position's rotation as a (Dh, Dh) matrix applied by ``einsum`` (the same
  numbers as ``named``, but no product by a table: the trace cannot tell, a declaration can);
* ``none`` (no positions at all), ``learned`` (a GPT-2 style ``wpe``) and ``decoy`` (the
  queries scaled by a (T, Dh) table of positions, the keys through a ``cat`` over positions:
  each half of RoPE's signature, neither a rotation): no RoPE.

``bug``: ``wrap`` (the table's positions wrap at 8: scores depend on absolute positions),
``q_only`` (the keys are not rotated: scores do not depend on the key's position).
``rotary_dim``: channels rotated per head (the rest pass through), default all Dh.
``qk_norm``: the queries and keys go through a LayerNorm of Dh (``qn``, ``kn``) before RoPE.
Each factory returns ``(model, ids)``; the model has no config (the check tests the batch's
own T positions).

Dimension legend: B batch, T positions, D hidden size, H heads, Dh head dim, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

V, T, D, H, L = 61, 16, 32, 4, 2
DH = D // H
LAYOUTS = ("named", "pos", "function", "complex", "matrix", "none", "learned", "decoy")
#: Where the table's positions wrap under ``bug="wrap"``.
WRAP = 8


def positions(t: int, bug: str | None) -> torch.Tensor:
    """(T,) float positions, wrapped at :data:`WRAP` under ``bug="wrap"``."""
    pos = torch.arange(t).float()
    return pos % WRAP if bug == "wrap" else pos


def inv_freq(rd: int) -> torch.Tensor:
    """(rd/2,) RoPE frequencies of ``rd`` rotated channels."""
    return 1.0 / (10000 ** (torch.arange(0, rd, 2).float() / rd))


def angles(t: int, rd: int, bug: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, rd) of HF's halves layout."""
    ang = torch.outer(positions(t, bug), inv_freq(rd))
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE on the first rd channels of (B, H, T, Dh); the rest pass."""
    rd = cos.shape[-1]
    r, rest = x[..., :rd], x[..., rd:]
    r1, r2 = r[..., : rd // 2], r[..., rd // 2:]
    return torch.cat([r * cos + torch.cat([-r2, r1], -1) * sin, rest], -1)


def rotations(t: int, rd: int, bug: str | None) -> torch.Tensor:
    """(T, Dh, Dh) matrices R with ``x @ R[t]`` = :func:`rotate` of x at position t."""
    cos, sin = angles(t, rd, bug)
    half = rd // 2
    p = torch.zeros(rd, rd)
    p[torch.arange(half) + half, torch.arange(half)] = -1.0
    p[torch.arange(half), torch.arange(half) + half] = 1.0
    r = torch.eye(DH).repeat(t, 1, 1)
    r[:, :rd, :rd] = torch.diag_embed(cos) + p @ torch.diag_embed(sin)
    return r


class RotaryEmbedding(nn.Module):
    """cos and sin of the angles for T positions, under HF's names (``inv_freq``)."""

    def __init__(self, rd: int, bug: str | None) -> None:
        super().__init__()
        self.rd, self.bug = rd, bug
        self.register_buffer("inv_freq", inv_freq(rd), persistent=False)

    def forward(self, t: int):
        return angles(t, self.rd, self.bug)


class Angles(nn.Module):
    """The same table under a name of one's own (and no ``inv_freq``)."""

    def __init__(self, rd: int, bug: str | None) -> None:
        super().__init__()
        self.rd, self.bug = rd, bug

    def forward(self, t: int):
        return angles(t, self.rd, self.bug)


class Attention(nn.Module):
    def __init__(self, layout: str, bug: str | None, rd: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.layout, self.bug, self.rd = layout, bug, rd
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
        if qk_norm:
            self.qn, self.kn = nn.LayerNorm(DH), nn.LayerNorm(DH)
        if layout == "named":
            self.rotary_emb = RotaryEmbedding(rd, bug)
        elif layout == "pos":
            self.pos = Angles(rd, bug)

    def _rope(self, x: torch.Tensor, freqs: torch.Tensor | None) -> torch.Tensor:
        t = x.shape[-2]
        if self.layout == "complex":
            b, h = x.shape[:2]
            xc = torch.view_as_complex(x[..., : self.rd].float().reshape(b, h, t, -1, 2))
            rot = torch.view_as_real(xc * freqs).flatten(3)
            return torch.cat([rot, x[..., self.rd:]], -1)
        if self.layout == "matrix":
            return torch.einsum("bhtd,tde->bhte", x, rotations(t, self.rd, self.bug))
        table = (self.rotary_emb(t) if self.layout == "named" else self.pos(t)
                 if self.layout == "pos" else angles(t, self.rd, self.bug))
        return rotate(x, *table)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, H, DH).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if hasattr(self, "qn"):
            q, k = self.qn(q), self.kn(k)
        if self.layout == "decoy":
            q = q * (1 + torch.arange(t).float() / t)[:, None].expand(t, DH)
            k = torch.cat([k[:, :, :1], k[:, :, 1:]], dim=2)
        elif self.layout not in ("none", "learned"):
            q = self._rope(q, freqs)
            if self.bug != "q_only":
                k = self._rope(k, freqs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, D))


class Block(nn.Module):
    def __init__(self, layout: str, bug: str | None, rd: int, qk_norm: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention(layout, bug, rd, qk_norm)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x, freqs=None):
        x = x + self.attn(self.ln1(x), freqs)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token embedding, L blocks, a final LayerNorm and a head; ``wpe`` for ``learned``,
    the complex ``freqs_cis`` buffer for ``complex``."""

    def __init__(self, layout: str, bug: str | None = None, rotary_dim: int = DH,
                 qk_norm: bool = False) -> None:
        super().__init__()
        self.layout = layout
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(layout, bug, rotary_dim, qk_norm) for _ in range(L))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if layout == "learned":
            self.wpe = nn.Embedding(4 * T, D)  # drawn last: the other weights stay the same
        if layout == "complex":
            ang = torch.outer(positions(4 * T, bug), inv_freq(rotary_dim))
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(ang), ang),
                                 persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.embed(idx)
        if self.layout == "learned":
            x = x + self.wpe(torch.arange(t, device=idx.device))
        freqs = self.freqs_cis[:t].view(1, 1, t, -1) if self.layout == "complex" else None
        for b in self.blocks:
            x = b(x, freqs)
        return self.head(self.ln_f(x))


def ids(b: int = 2, t: int = T, seed: int = 0) -> torch.Tensor:
    """(B, T) token ids below V."""
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def build(layout: str, bug: str | None = None, rotary_dim: int = DH,
          qk_norm: bool = False) -> tuple[GPT, torch.Tensor]:
    """The model of ``layout`` (seeded: the same weights in every layout) and a batch."""
    torch.manual_seed(0)
    return GPT(layout, bug, rotary_dim, qk_norm).eval(), ids()


def pos():
    """``mdb --model`` factory: the ``pos`` layout."""
    return build("pos")


def pos_qk_norm():
    """``mdb --model`` factory: the ``pos`` layout with q/k norms (``qn``, ``kn``) and a
    LayerNorm under a name with an escape sequence in it (named by its class, never run)."""
    model, batch = build("pos", qk_norm=True)
    model.extra = nn.ModuleDict({"n\x1b]0;pwned\x07": nn.LayerNorm(D)})
    return model, batch
