"""--model examples: a tiny nanoGPT-style GPT ((logits, loss), a dict, a NaN case), a CNN."""
import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d, h, pad_bug=False):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.h = h
        self.pad_bug = pad_bug

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)
        q = q.view(B, T, self.h, D // self.h).transpose(1, 2)
        k = k.view(B, T, self.h, D // self.h).transpose(1, 2)
        v = v.view(B, T, self.h, D // self.h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D // self.h)
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        if self.pad_bug:  # "mask out the BOS token" -- query 0 then sees no key at all
            mask = mask.clone()
            mask[:, 0] = False
        att = att.masked_fill(~mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, D)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d, h, pad_bug=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, h, pad_bug)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=96, d=64, h=4, n_layer=2, block=32, bug_in_layer=None,
                 return_dict=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.h = nn.ModuleList([Block(d, h, pad_bug=(i == bug_in_layer)) for i in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.return_dict = return_dict

    def forward(self, idx, targets=None):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        if self.return_dict:
            return {"logits": logits, "loss": loss}
        return logits, loss


def _batch(vocab=96, B=2, T=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def nanogpt_tuple():
    """Returns (logits, loss) like nanoGPT/minGPT."""
    torch.manual_seed(0)
    idx, tgt = _batch()
    return TinyGPT(), (idx, tgt)


def nanogpt_dict():
    torch.manual_seed(0)
    idx, tgt = _batch()
    return TinyGPT(return_dict=True), (idx, tgt)


def nanogpt_nan():
    """Layer 1's attention masks key 0 for every query: query 0 has no key -> NaN."""
    torch.manual_seed(0)
    idx, tgt = _batch()
    return TinyGPT(bug_in_layer=1, return_dict=True), (idx, tgt)


def my_cnn():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1))
            self.head = nn.Linear(32, 10)

        def forward(self, x, y=None):
            logits = self.head(self.features(x).flatten(1))
            if y is None:
                return logits
            return {"loss": F.cross_entropy(logits, y), "logits": logits}

    return Net(), (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
