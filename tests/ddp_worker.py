"""A small DDP job for the tests of distributed runs, started by ``torchrun`` (gloo, CPU).

Each rank trains the same two-layer MLP on its own seeded batches, records the job with
``hooks.run`` on every rank, and appends what it logged to ``<out>/rank<R>.jsonl`` (one line
per step, flushed at once): the independent record the tests compare the run store against.

Scenarios (``--scenario a,b``): ``perturb`` (rank 1 adds 1e-3 to ``2.bias`` after the optimizer
step of step 10), ``perturb_late`` (rank 1 adds 1e-3 to ``0.bias`` after step 30),
``nosync`` (the backward of step 20 runs under ``no_sync()`` on every rank:
its gradients are not all-reduced), ``nan`` (rank 1 logs a NaN loss at step 28).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

# run as a script: tests/ (sys.path[0]) must not shadow the hooks package with tests/hooks
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import hooks  # noqa: E402
from hooks.dist.distributed import RankLink  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--watch-every", type=int, default=10)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--stale", type=float, default=None)
    p.add_argument("--scenario", default="")
    args = p.parse_args()
    scenario = set(filter(None, args.scenario.split(",")))
    if args.stale is not None:
        RankLink.STALE_AFTER = args.stale
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1000 + rank)
    out = Path(args.out) / f"rank{rank}.jsonl"
    with open(out, "w", encoding="utf-8") as ref, hooks.run(
        args.name, db=args.db, total_steps=args.steps, gather_every=args.every
    ) as run:
        ref.write(json.dumps({"pid": os.getpid(), "rank": rank}) + "\n")
        ref.flush()
        run.watch(ddp, every=args.watch_every)
        for step in range(1, args.steps + 1):
            x = torch.randn(16, 8, generator=g)
            y = torch.randn(16, 4, generator=g)
            sync = ddp.no_sync() if ("nosync" in scenario and step == 20) else \
                contextlib.nullcontext()
            with sync:
                loss = F.mse_loss(ddp(x), y)
                loss.backward()
            grad_norm = torch.linalg.vector_norm(
                torch.stack([q.grad.norm() for q in ddp.parameters()]))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if "nanweight" in scenario and step == 18 and rank == 1:
                with torch.no_grad():  # rank 1 alone: its next forward goes non-finite
                    model[0].weight[0, 0] = float("nan")
            if "perturb" in scenario and step == 10 and rank == 1:
                with torch.no_grad():
                    model[2].bias.add_(1e-3)
            if "perturb_late" in scenario and step == 30 and rank == 1:
                with torch.no_grad():
                    model[0].bias.add_(1e-3)
            values = {"loss": loss.item(), "grad_norm": grad_norm.item()}
            if "nan" in scenario and step == 28 and rank == 1:
                values["loss"] = float("nan")
            run.log(**values)
            ref.write(json.dumps({"step": step, **values}) + "\n")
            ref.flush()
            if args.sleep:
                time.sleep(args.sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
