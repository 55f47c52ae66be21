"""Your own training loop, recorded with hooks.run: a tiny character-level GPT on alice.txt.

    python samples/own_loop.py          # 300 steps, a few seconds on a CPU
    mdb runs                            # then: mdb watch own-loop, mdb export own-loop
"""

import argparse
import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import hooks


class TinyGPT(nn.Module):
    """Token + position embeddings, causal pre-norm transformer layers, an LM head; like
    nanoGPT, ``model(x, y)`` returns ``(logits, loss)``."""

    def __init__(self, vocab: int, d: int = 64, layers: int = 2, heads: int = 4, block: int = 32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, idx, targets=None):  # idx, targets: (B, T) token ids
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        x = self.blocks(self.wte(idx) + self.wpe(torch.arange(t)), mask=mask, is_causal=True)
        logits = self.lm_head(x)  # (B, T, V)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", default=None)  # default: $MDB_DB, else runs/mdb.sqlite
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)  # a model this small trains fastest on one thread
    text = (Path(__file__).parent / "alice.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    train, val = data[: int(0.9 * len(data))], data[int(0.9 * len(data)) :]

    def batch(source, b=16, t=32):
        i = torch.randint(len(source) - t - 1, (b,)).tolist()
        return (torch.stack([source[j : j + t] for j in i]),
                torch.stack([source[j + 1 : j + t + 1] for j in i]))

    model = TinyGPT(len(chars))
    # weight decay on the weight matrices only, not on norms, biases or embeddings (the loop
    # doctor names those: docs/loop-doctor.md)
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
                  for p in m.parameters()}
    matrices = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings]
    others = [p for p in model.parameters() if p.dim() < 2 or id(p) in embeddings]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                             {"params": others, "weight_decay": 0.0}], lr=3e-3)
    config = {"lr": 3e-3, "batch": 16, "block": 32, "steps": args.steps}

    with hooks.run("own-loop", db=args.db, config=config, total_steps=args.steps) as run:
        # the internals of steps 50, 100, ... go to the run store; with the optimizer, a NaN
        # is traced to where it started before the update spreads it into every weight
        run.watch(model, every=50, optimizer=opt)
        for step in range(1, args.steps + 1):
            lr = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # cosine decay
            for group in opt.param_groups:
                group["lr"] = lr
            _, loss = model(*batch(train))
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.log(loss=loss, lr=lr, grad_norm=grad_norm)  # any names; the step counts itself
            if run.should_stop:  # `mdb stop own-loop`, or x in `mdb watch`
                break
            if step % 50 == 0:  # validation, added to the same step
                model.eval()
                with torch.no_grad():
                    vx, vy = batch(val)
                    logits, val_loss = model(vx, vy)
                model.train()
                run.log(val_loss=val_loss, val_acc=(logits.argmax(-1) == vy).float().mean(),
                        step=run.step)
    print(f"run {run.name}: {run.status} after {run.step} steps, last loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
