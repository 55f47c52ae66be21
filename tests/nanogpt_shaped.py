"""A nanoGPT-shaped model, written for the tests: ``GPT.forward(idx, targets=None)`` returns
``(logits, loss)``; without targets only the last position's logits (B, 1, V) and no loss, a
shortcut for generation; with targets every position's logits (B, T, V) and the cross-entropy
of ``logits[:, t]`` against ``targets[:, t]`` (the data loader shifts, the model does not).

Options make the variants the doctor tests need: ``shift_inside`` scores ``logits[:, t]``
against ``targets[:, t + 1]`` instead (HF's convention), and ``leak`` adds ``leak`` to the
logit of token ``idx[:, t + 1]`` at position t (a look-ahead of exactly that size).

The factories (``mdb doctor --model tests/nanogpt_shaped.py:FUNCTION``) return
``(model, batch)``.

Dimension legend: B batch, T sequence, V vocabulary, D embedding width, H heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """Sizes of :class:`GPT`; ``block_size`` is the most positions it takes."""

    block_size: int = 64
    vocab_size: int = 97
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class SelfAttention(nn.Module):
    """Causal multi-head attention with one fused q|k|v projection (``c_attn``)."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.n_head = c.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a GELU MLP, each added to the residual."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd)
        self.attn = SelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(),
                                 nn.Linear(4 * c.n_embd, c.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The model of the module docstring (embedding tied to the LM head, N(0, 0.02²) init)."""

    def __init__(self, c: GPTConfig | None = None, *, shift_inside: bool = False,
                 leak: float = 0.0) -> None:
        super().__init__()
        self.config = c = c or GPTConfig()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd), wpe=nn.Embedding(c.block_size, c.n_embd),
            h=nn.ModuleList([Block(c) for _ in range(c.n_layer)]), ln_f=nn.LayerNorm(c.n_embd)))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.shift_inside = shift_inside
        self.leak = leak
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"{t} positions, block size is {self.config.block_size}")
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t, device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None  # generation: the last position only
        logits = self.lm_head(x)
        if self.leak:
            peek = F.one_hot(idx[:, 1:], logits.shape[-1]).to(logits.dtype) * self.leak
            logits = torch.cat([logits[:, :-1] + peek, logits[:, -1:]], dim=1)
        v = logits.shape[-1]
        if self.shift_inside:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, v), targets[:, 1:].reshape(-1),
                                   ignore_index=-1)
        else:
            # .view, as nanoGPT: the targets mdb passes must be contiguous
            loss = F.cross_entropy(logits.view(-1, v), targets.view(-1), ignore_index=-1)
        return logits, loss


class LastPositionOnly(nn.Module):
    """A generation-only wrapper: ``forward(idx)`` returns :class:`GPT`'s last-position logits
    and takes no targets."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)[0]


def get_batch(b: int = 4, t: int = 32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's ``(x, y)``: ``y`` is ``x`` shifted by one token (both contiguous)."""
    data = torch.randint(0, GPTConfig.vocab_size, (b, t + 1),
                         generator=torch.Generator().manual_seed(seed))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(**kw)


def shifted():
    """Next-token targets, as nanoGPT's data loader makes them."""
    return _model(), get_batch()


def targets_equal_inputs():
    """``(idx, idx)``: the targets are the inputs, which this model does not shift."""
    x, _ = get_batch()
    return _model(), (x, x.clone())


def inputs_only():
    """``idx`` alone."""
    return _model(), get_batch()[0]


def shifted_twice():
    """Next-token targets on a model that shifts them again."""
    return _model(shift_inside=True), get_batch()


def leaking(leak: float = 1e-4):
    """A look-ahead of ``leak`` on the logits, next-token targets."""
    return _model(leak=leak), get_batch()


def last_position_only():
    """A model that returns one position's logits and takes no targets."""
    torch.manual_seed(0)
    return LastPositionOnly(), get_batch()[0]
