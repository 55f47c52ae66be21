"""Cost of recording a 2-rank DDP job with ``hooks.run``: the gathering, and rank 0's writing.

Usage: ``python benchmarks/bench_distributed.py [--rounds 6] [--block 150] [--every 50]``
(it starts itself under ``torchrun``: 2 ranks, gloo, CPU, one torch thread each).

Goals (issue 13):

* at ``gather_every=50`` the gathering costs ≤ 2 % of a 2-rank DDP step: the steps/s of blocks
  of the sample's tiny GPT (``samples/own_loop.py``) under DDP, **plain** (no mdb), **gathered**
  (``hooks.run(gather_every=50)``, ``run.log`` every step: rank 0 writes the store, every rank's
  rows reach it every 50 steps) and **watched** (the same plus ``run.watch(ddp, every=10**9)``:
  no captures, but the compute-time hook and the parameter and gradient checksums of every
  gathered step), run in interleaved blocks, the order flipped every round; the medians of the
  blocks' steps/s are compared (each block is a run of its own: its link thread, its process
  group and rank 0's writer are all inside the timing, started a few steps before it);
* rank 0's writing never blocks its training step: the time of rank 0's ``run.log`` calls, on
  gathered steps and on the others (``log`` appends to queues; the store is written by the
  writer thread and the gathering by the link thread), and rank 0's step time on gathered
  steps against the others.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "samples"))
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from own_loop import TinyGPT
    from torch.nn.parallel import DistributedDataParallel

    from hooks.recorder.run import Run

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    text = (ROOT / "samples" / "alice.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    g = torch.Generator().manual_seed(rank)
    bs, seq = 16, 32

    def batch():
        i = torch.randint(len(data) - seq - 1, (bs,), generator=g)
        return (torch.stack([data[j:j + seq] for j in i.tolist()]),
                torch.stack([data[j + 1:j + seq + 1] for j in i.tolist()]))

    torch.manual_seed(0)
    model = TinyGPT(len(chars), block=seq)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    every = args.every
    log_times = {True: [], False: []}  # rank 0's run.log: gathered step?
    step_times = {True: [], False: []}  # rank 0's whole step
    link = {"gathers": 0, "encode_s": 0.0, "collective_s": 0.0, "cpu_s": 0.0,
            "thread_cpu_s": 0.0, "steps": 0, "train_s": 0.0}

    def train(n: int, run=None, record: bool = False) -> float:
        batches = [batch() for _ in range(n)]
        t0 = time.perf_counter()
        for x, y in batches:
            ts = time.perf_counter()
            _, loss = ddp(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if run is not None:
                tl = time.perf_counter()
                run.log(loss=loss, lr=1e-3)
                if record and rank == 0:
                    gathered = run.step % every == 0
                    log_times[gathered].append(time.perf_counter() - tl)
                    step_times[gathered].append(time.perf_counter() - ts)
        return n / (time.perf_counter() - t0)

    def block(side: str, k: int) -> float:
        if side == "plain":
            return train(args.block)
        with Run(f"bench-{side}-{k}", db=args.db, gather_every=every) as run:
            if side == "watched":
                run.watch(ddp, every=10**9)
            train(5, run)  # the run joins the other ranks meanwhile
            rate = train(args.block, run, record=True)
        for k in ("gathers", "encode_s", "collective_s", "cpu_s", "thread_cpu_s"):
            link[k] += run._link.stats[k]
        link["steps"] += args.block + 5
        link["train_s"] += (args.block + 5) / rate
        return rate

    sides = ("plain", "gathered", "watched")
    for side in sides:  # warm-up
        block(side, -1)
    rates = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            rates[side].append(block(side, r))
    if rank == 0:
        _print_rates(rates, log_times, step_times, args.rounds, args.block, bs, seq, every)
    _print_links(link, rank, every, dist)
    dist.destroy_process_group()


def _print_rates(rates: dict, log_times: dict, step_times: dict, rounds: int, block: int,
                 bs: int, seq: int, every: int) -> None:
    """Rank 0's table: steps/s per side, run.log and step times, gathered or not."""
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"2-rank DDP, tiny GPT, batch {bs}×{seq} per rank, gather_every={every}: steps/s, "
          f"median of {rounds} blocks of {block} steps (plain step "
          f"{1e3 / med['plain']:.1f} ms)")
    for side, v in rates.items():
        paired = statistics.median(a / b for a, b in zip(v, rates["plain"], strict=True))
        print(f"  {side:>9}: {med[side]:6.1f} steps/s (min {min(v):.1f}, max {max(v):.1f})  "
              f"ratio of medians {med[side] / med['plain']:.3f}, median of the rounds' "
              f"ratios {paired:.3f}  (goal ≥ 0.98)")
    for gathered in (False, True):
        lt, st = log_times[gathered], step_times[gathered]
        what = "gathered steps" if gathered else "other steps   "
        print(f"  rank 0, {what}: run.log median {statistics.median(lt) * 1e6:7.1f} µs, "
              f"max {max(lt) * 1e6:8.1f} µs; step median {statistics.median(st) * 1e3:.2f}"
              f" ms ({len(lt)} steps)")
    ratio = statistics.median(step_times[True]) / statistics.median(step_times[False])
    print(f"  rank 0's gathered steps take ×{ratio:.3f} the others (the writing and the "
          "gathering run on threads of their own; with watch the checksums are computed "
          "on the training thread at the optimizer step)")


def _print_links(link: dict, rank: int, every: int, dist) -> None:
    """Each rank's link thread: its CPU time per gather, in rank order."""
    for r in range(dist.get_world_size()):  # each rank's link thread, in rank order
        dist.barrier()
        if r == rank and link["gathers"]:
            n = link["gathers"]
            step_s = link["train_s"] / link["steps"]
            per = link["cpu_s"] / n
            print(f"  rank {rank}'s link thread: {n} gathers; per gather {per * 1e3:.2f} ms of "
                  f"its CPU time (encode {link['encode_s'] / n * 1e3:.2f} ms, collectives "
                  f"{link['collective_s'] / n * 1e3:.2f} ms wall) = "
                  f"{100 * per / (every * step_s):.2f} % of the {every} steps it covers "
                  f"({every * step_s * 1e3:.0f} ms; goal ≤ 2 %); the thread's whole CPU time "
                  f"(heartbeats, store polls, rank 0's checks) "
                  f"{100 * link['thread_cpu_s'] / link['train_s']:.2f} % of the training time",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=150)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--db", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", str(Path(__file__).resolve()), "--worker", "--db", str(Path(tmp) / "b.sqlite"),
               "--rounds", str(args.rounds), "--block", str(args.block), "--every",
               str(args.every)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        out = [x for x in proc.stdout.splitlines() if not x.startswith("mdb:")]
        print("\n".join(out))
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
