"""A DDP loop for the loop doctor's test (tests/hooks/doctor/loop/test_loop_doctor_ddp.py),
started by ``torchrun`` on 2 ranks (gloo, CPU): ``LogitsLM`` wrapped in DDP, the loss
computed outside the model, 4 micro-batches per optimizer step (the first 3 under
``no_sync()``), every rank on batches of its own; watched every 2 steps.

``--bug sum``: ``loss.backward()`` of each micro-batch's mean (the accumulated loss summed,
not averaged); ``--bug none``: ``(loss / 4).backward()``. ``--eval-bug``: rank 1 alone
evaluates after each watched step's ``log()`` without ``model.eval()`` (dropout on).
``--uneven``: 10 steps, and rank 1 runs 3 micro-batches at step 8 (the ranks' counts differ:
rank 0, past its first 3 checks, would skip a count it knows while rank 1 would check a new
one; no rank checks that step, and none waits on a collective the other skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

# run as a script: tests/ (sys.path[0]) must not shadow the hooks package with tests/hooks
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import hooks  # noqa: E402
from tests.loop_models import LogitsLM, V, batches, no_decay_groups  # noqa: E402

GA, EVERY = 4, 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--bug", choices=["sum", "none"], required=True)
    p.add_argument("--eval-bug", action="store_true")
    p.add_argument("--uneven", action="store_true")
    args = p.parse_args()
    steps = 10 if args.uneven else 4
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    inner = LogitsLM(p=0.1)
    model = DistributedDataParallel(inner)
    opt = torch.optim.AdamW(no_decay_groups(inner), lr=1e-2)
    data = batches(GA * steps, seed=rank)
    val = batches(1, seed=100)[0]
    with hooks.run("ddp-doctor", db=args.db, gather_every=EVERY) as run:
        run.watch(model, every=EVERY, optimizer=opt)
        for step in range(1, steps + 1):
            ga = GA - 1 if args.uneven and rank == 1 and step == 8 else GA
            for i in range(ga):
                b = data[(step - 1) * GA + i]
                sync = model.no_sync() if i < ga - 1 else contextlib.nullcontext()
                with sync:
                    logits = model(b["input_ids"][:, :-1])
                    loss = F.cross_entropy(logits.reshape(-1, V), b["labels"][:, 1:].reshape(-1))
                    (loss if args.bug == "sum" else loss / GA).backward()
            opt.step()
            opt.zero_grad()
            run.log(loss=loss)
            if step % EVERY == 0:
                if not (args.eval_bug and rank == 1):
                    inner.eval()
                with torch.no_grad():
                    inner(val["input_ids"])
                inner.train()
        print(f"rank {rank}: accumulation checks {run.loop_doctor._accum_checks}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
