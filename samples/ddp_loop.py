"""A DDP job recorded with hooks.run as one run: the tiny GPT of own_loop.py on two ranks.

    torchrun --standalone --nproc-per-node 2 samples/ddp_loop.py   # gloo on CPU
    mdb watch ddp-loop                      # every rank: k opens them all
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hooks

sys.path.insert(0, str(Path(__file__).parent))
from own_loop import TinyGPT  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", default=None)  # default: $MDB_DB, else runs/mdb.sqlite
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # before hooks.run: torchrun set RANK, WORLD_SIZE, ...
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's)
    torch.set_num_threads(1)
    text = (Path(__file__).parent / "alice.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    g = torch.Generator().manual_seed(rank)  # each rank draws batches of its own

    def batch(b=16, t=32):
        i = torch.randint(len(data) - t - 1, (b,), generator=g).tolist()
        return (torch.stack([data[j : j + t] for j in i]),
                torch.stack([data[j + 1 : j + t + 1] for j in i]))

    model = DistributedDataParallel(TinyGPT(len(chars)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    # on every rank: one run for the job; rank 0 writes it, the others' steps reach it
    with hooks.run("ddp-loop", db=args.db, total_steps=args.steps, gather_every=25) as run:
        run.watch(model, every=100)  # captures on every rank, compute time, cross-rank checks
        for _ in range(args.steps):
            _, loss = model(*batch())
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.log(loss=loss, grad_norm=grad_norm)  # every rank logs its own values
    if rank == 0:
        print(f"run {run.name}: {run.status} after {run.step} steps on "
              f"{dist.get_world_size()} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
