"""A small FSDP2 job for the tests of sharded runs, started by ``torchrun`` (gloo, CPU).

Each rank trains the model of ``tests/dtensor_worker.py`` (``fully_shard`` per block and on the
root) with SGD on its own rows of each step's global batch, records the job with ``hooks.run``
(``run.watch`` every ``--watch-every`` steps) and appends what it logged to
``<out>/rank<R>.jsonl`` (its pid first, then one line per step, flushed at once).

Scenarios (``--scenario``): ``nan`` (after the optimizer step of step 6, rank 1 writes a NaN into
its shard of ``blocks.1.w2.weight``; the job stops at the first non-finite loss), ``hsdp`` (an
HSDP mesh of 2 replicas × 1 shard; rank 1 adds 1e-3 to its replica of ``blocks.0.w1.bias``
after step 3).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

# run as a script: tests/ (sys.path[0]) must not shadow the hooks package with tests/hooks
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hooks
    from tests.dtensor_worker import ROWS, batch, build

    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--watch-every", type=int, default=5)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--scenario", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.scenario == "hsdp":
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    model = build()
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = ROWS // world
    out = Path(args.out) / f"rank{rank}.jsonl"
    with open(out, "w", encoding="utf-8") as ref, hooks.run(
        args.name, db=args.db, total_steps=args.steps, gather_every=args.every
    ) as run:
        ref.write(json.dumps({"pid": os.getpid(), "rank": rank}) + "\n")
        ref.flush()
        run.watch(model, every=args.watch_every)
        for step in range(1, args.steps + 1):
            x, y = batch(step)
            x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
            loss = F.mse_loss(model(x), y)
            loss.backward()
            ok = math.isfinite(loss.item())
            if ok:
                opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                if args.scenario == "nan" and step == 6 and rank == 1:
                    model.blocks[1].w2.weight.to_local()[0, 0] = float("nan")
                if args.scenario == "hsdp" and step == 3 and rank == 1:
                    model.blocks[0].w1.bias.to_local().add_(1e-3)
            run.log(loss=loss.item())
            ref.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            ref.flush()
            if not ok:
                break
            if args.sleep:
                time.sleep(args.sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
