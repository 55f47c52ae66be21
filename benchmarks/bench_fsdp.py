"""Cost of watching a 2-rank FSDP2 job: a captured step, and ``hooks.run`` on the other steps.

Usage: ``python benchmarks/bench_fsdp.py [--repeats 20] [--rounds 6] [--block 40]
[--baseline FILE]`` (it starts itself under ``torchrun``: 2 ranks, gloo, CPU, one torch thread
each). ``--baseline FILE`` also times captured steps whose statistics come from ``FILE``, an
older ``hooks/sharded/stats.py`` (``git show REV:hooks/sharded/stats.py > FILE``), in the same
interleaved loop: before and after in one run.

The model is minillm's ``seed-test-c`` preset (D=128, 4 layers, 4 experts top-2), sharded
as ``mdb overfit --fsdp`` shards it (:func:`hooks.train.sharding.shard_fsdp`), AdamW, a batch
of 4 × 64 tokens per rank. Goals (issue 24):

* a **captured step** (forward, backward and the optimizer step under ``hooks.capture``, whose
  exit reduces every statistic across the mesh) costs ≤ 1.3× the **plain step**: the two are
  timed alternately, step by step (the order flipped every round), medians compared;
* **unwatched steps** with ``hooks.run`` (``run.log`` every step, ``run.watch(model,
  every=10**9)``: the sentinel's hooks, the compute-time hook and the cross-rank checksums of
  the gathered steps, no capture) keep ≥ 0.98× the steps/s without it: interleaved blocks of
  ``--block`` steps, the order flipped every round, medians compared.

For scale, the same model and batch are first timed in this process, unsharded, plain and
under ``hooks.capture`` (what a capture costs without a mesh). Two more sides in the captured
loop bound what any exact capture built on eager kernels can cost: "floor" (the hooks a capture
installs, running only ``aminmax``, ``sum`` and ``dot(x, x)`` of each local piece,
``benchmarks/_floor.py``) and "floor+coll" (the floor, then the three collectives a capture's
exit makes on a 1-D mesh, with the same payloads).
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
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hooks.train.sharding import ExpertUse, shard_fsdp
    from minillm import load_preset
    from minillm.model import MiniLLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    config = load_preset("seed-test-c")
    model = MiniLLM(config)
    experts = ExpertUse(model, mesh)
    shard_fsdp(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    bs, seq = 4, 64

    def step(run=None) -> None:
        x = torch.randint(config.vocab_size, (bs, seq), generator=g)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        experts.drop_unused()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if run is not None:
            run.log(loss=out.loss)

    # 1. a captured step against a plain one (and the baseline's), alternately
    times = _captured_vs_plain(model, step, args)
    # 2. unwatched steps with hooks.run against none, in blocks
    rates, cpu = _unwatched(model, step, args)
    if rank == 0:
        _report(times, rates, cpu, args, f"batch {bs}×{seq} per rank")
    dist.destroy_process_group()


def _unwatched(model, step, args: argparse.Namespace
               ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Steps/s of blocks of ``args.block`` plain steps and of steps under ``hooks.run`` (logged
    every step, ``watch`` with no capture due), alternating, after a warm-up block of each; and
    this process's CPU seconds per step in each block (every thread: the model's, mdb's and
    gloo's), which other work on the machine disturbs less than the wall clock."""
    import torch.distributed as dist

    from hooks.recorder.run import Run

    rates: dict[str, list[float]] = {"plain": [], "hooks.run": []}
    cpu: dict[str, list[float]] = {"plain": [], "hooks.run": []}

    def timed(name: str, run=None) -> None:
        for _ in range(5):  # untimed: the run joins the other ranks meanwhile
            step(run)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.block):
            step(run)
        rates[name].append(args.block / (time.perf_counter() - t0))
        cpu[name].append((time.process_time() - c0) / args.block)

    def block(name: str, k: int) -> None:
        dist.barrier()
        if name == "plain":
            timed(name)
            return
        with Run(f"bench-{k}", db=args.db, gather_every=50) as run:
            run.watch(model, every=10**9)
            timed(name, run)

    for name in rates:  # warm-up
        block(name, -1)
    for r in range(args.rounds):
        for name in tuple(rates) if r % 2 == 0 else tuple(rates)[::-1]:
            block(name, r)
    return ({k: v[1:] for k, v in rates.items()}, {k: v[1:] for k, v in cpu.items()})


def _captured_vs_plain(model, step, args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds per step of the plain step, the captured one (and with ``--baseline``, the
    captured one whose statistics are the baseline's), in rotating order, after 3 rounds of
    warm-up."""
    import importlib

    import torch.distributed as dist
    from _floor import floor_hooks

    import hooks

    capture_mod = importlib.import_module("hooks.engine.capture")  # (hooks.capture: the function)
    sides = {"plain": None, "captured": capture_mod.MeshStats, "floor": "floor",
             "floor+coll": "floor+coll"}
    n = _entries_per_capture(model, step)
    if args.baseline:
        sides["baseline"] = _load_baseline(args.baseline).MeshStats
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for i in range(args.repeats + 3):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            if sides[name] is None:
                step()
            elif sides[name] in ("floor", "floor+coll"):
                with floor_hooks(model, reduce=True):
                    step()
                if sides[name] == "floor+coll":
                    _collectives(n)
            else:
                capture_mod.MeshStats = sides[name]
                with hooks.capture(model):
                    step()
            if i >= 3:  # warm-up
                times[name].append(time.perf_counter() - t0)
    capture_mod.MeshStats = sides["captured"]
    return times


def _entries_per_capture(model, step) -> int:
    """How many tensors one captured step reduces across the mesh (its ``MeshStats``
    entries)."""
    import hooks
    from hooks.sharded.stats import MeshStats

    seen: list[int] = []
    finalize = MeshStats.finalize

    def counting(self, trace=None):
        seen.append(len(self._entries))
        return finalize(self, trace)

    MeshStats.finalize = counting
    try:
        with hooks.capture(model):
            step()
    finally:
        MeshStats.finalize = finalize
    return seen[0]


def _collectives(n: int) -> None:
    """The collectives a captured step's exit makes on a 1-D mesh, with the same payloads, and
    nothing else: the probe (an ``all_reduce`` of 8 int64), every rank's numbers (an
    ``all_gather`` of (n, 15) fp64), every rank's histograms (an ``all_gather`` of
    n × (bins + 1) fp64)."""
    import torch
    import torch.distributed as dist

    from hooks.tensors.stats import NUM_BINS

    dist.all_reduce(torch.zeros(8, dtype=torch.int64), op=dist.ReduceOp.MAX)
    for width in (15, NUM_BINS + 1):
        row = torch.zeros(n * width, dtype=torch.float64)
        dist.all_gather([torch.empty_like(row) for _ in range(dist.get_world_size())], row)


def _load_baseline(path: str):
    """``path`` (an older hooks/sharded/stats.py) as a module of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("baseline_dtensor_stats", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _report(times: dict[str, list[float]], rates: dict[str, list[float]],
            cpu: dict[str, list[float]], args: argparse.Namespace, what: str) -> None:
    """Rank 0 prints both comparisons."""
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"2-rank FSDP2 job, minillm seed-test-c (D=128, 4 layers, 4 experts), {what}, "
          "AdamW, gloo on CPU, one thread per rank")
    for name, v in times.items():
        q = statistics.quantiles(v, n=4)
        print(f"  {name:>9} step: median {med[name] * 1e3:7.1f} ms  IQR [{q[0] * 1e3:.1f}, "
              f"{q[2] * 1e3:.1f}] ms  ({len(v)} steps)")
    print(f"  captured / plain: {med['captured'] / med['plain']:.3f}  (goal ≤ 1.3)")
    print(f"  floor / plain: {med['floor'] / med['plain']:.3f}  (the hooks a capture installs, "
          "running only aminmax, sum and dot(x, x) of each local piece: no collective, no "
          "read-back, no bookkeeping)")
    print(f"  floor+coll / plain: {med['floor+coll'] / med['plain']:.3f}  (the floor, then the "
          "three collectives a capture's exit makes, with the same payloads)")
    if "baseline" in med:
        print(f"  baseline captured / plain: {med['baseline'] / med['plain']:.3f}  (--baseline "
              f"{args.baseline})")
    rm = {k: statistics.median(v) for k, v in rates.items()}
    for name, v in rates.items():
        print(f"  {name:>9}: {rm[name]:6.2f} steps/s (min {min(v):.2f}, max {max(v):.2f}) "
              f"over {args.rounds} blocks of {args.block} steps")
    paired = statistics.median(a / b for a, b in zip(rates["hooks.run"], rates["plain"],
                                                     strict=True))
    print(f"  hooks.run / plain steps/s: ratio of medians {rm['hooks.run'] / rm['plain']:.3f}"
          f", median of the rounds' ratios {paired:.3f}  (goal ≥ 0.98)")
    cm = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"  CPU per step (rank 0, every thread): plain {cm['plain'] * 1e3:.1f} ms, hooks.run "
          f"{cm['hooks.run'] * 1e3:.1f} ms, plain / hooks.run {cm['plain'] / cm['hooks.run']:.3f}",
          flush=True)


def _single(repeats: int) -> None:
    """The same model and batch in one process, unsharded: what a capture costs without the
    mesh (the part of the captured step's cost that is not the reduction's)."""
    sys.path.insert(0, str(ROOT))
    import torch

    import hooks
    from minillm import load_preset
    from minillm.model import MiniLLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = load_preset("seed-test-c")
    model = MiniLLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        x = torch.randint(config.vocab_size, (4, 64), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def captured() -> None:
        with hooks.capture(model):
            step()

    from _timing import interleaved

    times = interleaved({"plain": step, "captured": captured}, repeats, warmup=3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"one process, the same model and batch, unsharded: plain {med['plain'] * 1e3:.1f} ms"
          f", captured {med['captured'] * 1e3:.1f} ms, captured / plain "
          f"{med['captured'] / med['plain']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=40)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--db", default=None, help=argparse.SUPPRESS)
    p.add_argument("--baseline", default=None,
                   help="an older hooks/sharded/stats.py: its captured steps timed too")
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    _single(args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", str(Path(__file__).resolve()), "--worker", "--db", str(Path(tmp) / "b.sqlite"),
               "--repeats", str(args.repeats), "--rounds", str(args.rounds), "--block",
               str(args.block)] + (["--baseline", str(Path(args.baseline).resolve())]
                                   if args.baseline else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        out = [x for x in proc.stdout.splitlines() if not x.startswith("mdb:")]
        print("\n".join(out))
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
