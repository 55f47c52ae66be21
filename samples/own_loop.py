"""Your own training loop, recorded with ``hooks.run``: a tiny character-level GPT on alice.txt.

Run it, then look at the run from another terminal (or afterwards)::

    python samples/own_loop.py                 # ~300 steps, a few seconds on a CPU
    mdb runs                                   # the runs in runs/mdb.sqlite
    mdb watch own-loop                         # live charts; `c` opens the latest capture
    mdb step --run own-loop@300                # step through a recorded step's internals
    mdb export own-loop > own-loop.csv         # every logged metric per step

The model follows nanoGPT's convention: ``model(x, y)`` returns ``(logits, loss)``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import hooks

TEXT = Path(__file__).resolve().parent / "alice.txt"


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, D)
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and an LM head."""

    def __init__(self, vocab: int, d: int = 64, layers: int = 2, heads: int = 4,
                 block: int = 64):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="own-loop", help="run name (default own-loop)")
    parser.add_argument("--db", default=None, help="run database (default runs/mdb.sqlite)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(1)  # a model this small trains fastest on one thread
    text = TEXT.read_text(encoding="utf-8")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    block, batch = 32, 16

    def get_batch(source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.randint(len(source) - block - 1, (batch,))
        x = torch.stack([source[j : j + block] for j in i.tolist()])
        y = torch.stack([source[j + 1 : j + block + 1] for j in i.tolist()])
        return x, y

    model = TinyGPT(len(chars), block=block)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    config = {"lr": args.lr, "batch": batch, "block": block, "params": sum(
        p.numel() for p in model.parameters())}

    with hooks.run(args.run, db=args.db, config=config, total_steps=args.steps) as run:
        run.watch(model, every=50)  # the internals of steps 50, 100, … go to the run store
        for step in range(1, args.steps + 1):
            lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # cosine decay
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = get_batch(train)
            _, loss = model(x, y)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.log(loss=loss, lr=lr, grad_norm=grad_norm)
            if step % 50 == 0:  # a validation loss and accuracy, added to the same step
                model.eval()
                with torch.no_grad():
                    vx, vy = get_batch(val)
                    logits, val_loss = model(vx, vy)
                    acc = (logits.argmax(-1) == vy).float().mean()
                model.train()
                run.log(val_loss=val_loss, val_acc=acc, step=run.step)
    print(f"run {run.name}: {run.status} after {run.step} steps, last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
