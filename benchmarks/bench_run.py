"""Cost of ``hooks.run`` on the caller's thread: ``run.log``, steps/s with and without ``watch``,
how soon a reader sees a step, and memory over 10,000 steps.

Usage: ``python benchmarks/bench_run.py [--rounds 8] [--block 100] [--every 50]
[--scheduler] [--only-steps] [--doctor-cost STEPS]``.

``--scheduler`` (issue 23, the training-loop doctor): every loop steps a warmup
``LambdaLR`` after each optimizer step, and the watched loop is watched with
``optimizer=`` and ``scheduler=`` (the doctor's hooks in watched steps, its checks at them).
Without it the watched loop has ``optimizer=`` only (which also runs the doctor, less the
scheduler's checks). ``--only-steps``: only the steps/s comparison. ``--doctor-cost STEPS``:
also the doctor's own cost on a watched step (:func:`bench_doctor_cost`).

Goals (issue 11):

* ``run.log`` ≤ 50 µs median on the caller's thread (three scalars, one a 0-dim tensor);
* a loop watched with ``every=50`` (and ``optimizer=``: the NaN checks of the root's output
  and of the gradients before every update) keeps ≥ 0.98× the steps/s of the same loop without mdb —
  the model is the sample's tiny GPT (``samples/own_loop.py``), whose step takes about 10 ms on
  one CPU thread; the three loops (plain, logged, logged + watched) run in interleaved blocks of
  ``--block`` steps, their order flipped every round, and the medians of the blocks' steps/s
  are compared;
* a step is visible to a reader (``RunStore.poll`` from another thread) within 0.5 s of its
  ``log()``;
* memory does not grow over 10,000 steps (``tracemalloc``, a small MLP loop logged and watched
  every 50 steps; the traced memory after 2,000 steps against after 10,000, once the writer has
  committed everything).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "samples"))

from own_loop import TinyGPT  # noqa: E402

import hooks  # noqa: E402
from hooks.store.store import RunStore  # noqa: E402


def _drain(run) -> None:
    """Wait until the writer thread has committed everything queued."""
    while run._queue:
        time.sleep(0.005)
    time.sleep(2 * run.FLUSH_INTERVAL)


def bench_log(db: Path, calls: int) -> float:
    """Median seconds of one ``run.log(loss=<0-dim tensor>, lr=float, acc=float)``."""
    loss = torch.tensor(1.5)
    times = []
    with hooks.run("bench-log", db=db) as run:
        for i in range(calls):
            t0 = time.perf_counter_ns()
            run.log(loss=loss, lr=3e-3, acc=i * 1e-4)
            times.append(time.perf_counter_ns() - t0)
    med = statistics.median(times) / 1e9
    q = statistics.quantiles(times, n=100)
    print(f"run.log: median {med * 1e6:.1f} µs, p90 {q[89] / 1e3:.1f} µs, p99 "
          f"{q[98] / 1e3:.1f} µs over {calls} calls (goal ≤ 50 µs median)")
    return med


def bench_steps(db: Path, rounds: int, block: int, every: int,
                scheduler: bool = False) -> dict[str, float]:
    """Median steps/s of blocks of the plain, logged and watched loops, interleaved."""
    text = (ROOT / "samples" / "alice.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    bs, seq = 16, 32
    g = torch.Generator().manual_seed(0)

    def batch():
        i = torch.randint(len(data) - seq - 1, (bs,), generator=g)
        x = torch.stack([data[j : j + seq] for j in i.tolist()])
        y = torch.stack([data[j + 1 : j + seq + 1] for j in i.tolist()])
        return x, y

    sides = {}
    for name in ("plain", "logged", "watched"):
        torch.manual_seed(0)
        model = TinyGPT(len(chars), block=seq)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 100)) if scheduler else None
        run = None if name == "plain" else hooks.run(f"bench-{name}", db=db)
        if name == "watched":  # as samples/own_loop.py does: the NaN checks on every step
            run.watch(model, every=every, optimizer=opt, scheduler=sched)
        sides[name] = (model, opt, run, sched)

    step_times: dict[bool, list[float]] = {True: [], False: []}  # watched loop: captured?

    def one_block(name: str) -> float:
        model, opt, run, sched = sides[name]
        batches = [batch() for _ in range(block)]
        t0 = time.perf_counter()
        for x, y in batches:
            ts = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad(set_to_none=True)
            if run is not None:
                run.log(loss=loss, lr=1e-3)
                if name == "watched":
                    step_times[run.step % every == 0].append(time.perf_counter() - ts)
        return block / (time.perf_counter() - t0)

    for name in sides:  # warm-up
        one_block(name)
    rates: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            rates[name].append(one_block(name))
    captured = None
    for name, (_, _, run, _) in sides.items():
        if run is not None:
            if name == "watched":
                _drain(run)
                with RunStore(db) as store:
                    captured = len(store.internals_steps(run.id))
            run.finish()
    med = {k: statistics.median(v) for k, v in rates.items()}
    step_ms = 1e3 / med["plain"]
    print(f"steps/s (median of {rounds} blocks of {block} steps; plain step {step_ms:.1f} ms):")
    for name, v in rates.items():
        paired = statistics.median(a / b for a, b in zip(v, rates["plain"], strict=True))
        print(f"  {name:>8}: {med[name]:7.1f} steps/s  (min {min(v):.1f}, max {max(v):.1f})  "
              f"ratio of medians {med[name] / med['plain']:.3f}, median of the rounds' "
              f"ratios {paired:.3f}")
    cap, nocap = (statistics.median(step_times[k]) for k in (True, False))
    expected = every / (every - 1 + cap / nocap)
    print(f"  watched every {every}: {captured} captures stored; a captured step takes "
          f"{cap * 1e3:.1f} ms against {nocap * 1e3:.1f} ms (×{cap / nocap:.2f}), which alone "
          f"gives a ratio of {expected:.3f} (goal: ratio ≥ 0.98)")
    return med


def bench_doctor_cost(db: Path, steps: int) -> dict[str, float]:
    """The training-loop doctor's cost on a watched step: the sample's tiny GPT watched at
    ``every=1`` with a capture only (``watch(model, every=1)``) against the same with
    ``optimizer=`` and ``scheduler=`` (capture + doctor), steps interleaved one by one, median
    step times. Its first three watched steps replay the micro-batch (the accumulation
    check), the later ones only observe; both medians are printed."""
    text = (ROOT / "samples" / "alice.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    bs, seq = 16, 32
    g = torch.Generator().manual_seed(0)
    sides = {}
    for name in ("capture", "doctor"):
        torch.manual_seed(0)
        model = TinyGPT(len(chars), block=seq)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
        run = hooks.run(f"bench-{name}", db=db)
        if name == "doctor":
            run.watch(model, every=1, optimizer=opt, scheduler=sched)
        else:
            run.watch(model, every=1)
        sides[name] = (model, opt, sched, run)
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(steps):
        i = torch.randint(len(data) - seq - 1, (bs,), generator=g).tolist()
        x = torch.stack([data[j : j + seq] for j in i])
        y = torch.stack([data[j + 1 : j + seq + 1] for j in i])
        for name, (model, opt, sched, run) in sides.items():
            t0 = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            run.log(loss=loss)
            times[name].append(time.perf_counter() - t0)
    for _, _, _, run in sides.values():
        run.finish()
    first = {k: statistics.median(v[:3]) for k, v in times.items()}
    later = {k: statistics.median(v[3:]) for k, v in times.items()}
    print(f"a watched step (capture) against a watched step with the loop doctor, median of "
          f"{steps} interleaved steps: {later['capture'] * 1e3:.1f} ms vs "
          f"{later['doctor'] * 1e3:.1f} ms (×{later['doctor'] / later['capture']:.2f}); its "
          f"first 3 (the accumulation check's replay): {first['capture'] * 1e3:.1f} vs "
          f"{first['doctor'] * 1e3:.1f} ms")
    return later


def bench_latency(db: Path, steps: int, interval: float) -> list[float]:
    """Seconds from each ``log()`` to a reader thread seeing the step."""
    logged: dict[int, float] = {}
    seen: dict[int, float] = {}
    done = threading.Event()

    run = hooks.run("bench-latency", db=db)

    def reader() -> None:
        with RunStore(db) as store:
            last = 0
            while not done.is_set() or last < steps:
                info = store.run(run.id)
                if info.last_step > last:
                    now = time.time()
                    for s in range(last + 1, info.last_step + 1):
                        seen[s] = now
                    last = info.last_step
                time.sleep(0.01)

    t = threading.Thread(target=reader)
    t.start()
    for s in range(1, steps + 1):
        time.sleep(interval)  # a "training step"
        logged[s] = time.time()
        run.log(loss=1.0 / s)
    run.finish()
    done.set()
    t.join(60)
    lat = sorted(seen[s] - logged[s] for s in logged if s in seen)
    q = statistics.quantiles(lat, n=100)
    print(f"visible to a reader: median {statistics.median(lat) * 1e3:.0f} ms, p99 "
          f"{q[98] * 1e3:.0f} ms, max {lat[-1] * 1e3:.0f} ms over {len(lat)} steps "
          f"(reader polls every 10 ms; goal ≤ 500 ms)")
    return lat


def bench_memory(db: Path, steps: int, every: int) -> dict[int, int]:
    """Traced memory every 2,000 steps of a small loop logged and watched every ``every``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    marks = {}
    tracemalloc.start()
    with hooks.run("bench-memory", db=db) as run:
        run.watch(model, every=every, optimizer=opt)
        for s in range(1, steps + 1):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.log(loss=loss, lr=1e-3, step_norm=float(s))
            if s % 2000 == 0 or s == steps:
                _drain(run)
                gc.collect()
                marks[s] = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    kib = ", ".join(f"{s}: {m / 1024:.0f}" for s, m in marks.items())
    first, last = marks[min(marks)], marks[max(marks)]
    spread = max(marks.values()) - min(marks.values())
    print(f"traced memory (KiB) by step, watched every {every}: {kib}; first to last "
          f"{(last - first) / 1024:+.0f} KiB, spread {spread / 1024:.0f} KiB")
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=100)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--log-calls", type=int, default=20000)
    parser.add_argument("--latency-steps", type=int, default=300)
    parser.add_argument("--memory-steps", type=int, default=10000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--scheduler", action="store_true",
                        help="a warmup scheduler in every loop, watch(scheduler=) too")
    parser.add_argument("--only-steps", action="store_true",
                        help="only the steps/s comparison (and --doctor-cost)")
    parser.add_argument("--doctor-cost", type=int, default=0, metavar="STEPS",
                        help="also time STEPS watched steps with and without the loop doctor")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.sqlite"
        bench_log(db, args.log_calls)
        bench_steps(db, args.rounds, args.block, args.every, args.scheduler)
        if args.doctor_cost:
            bench_doctor_cost(db, args.doctor_cost)
        if args.only_steps:
            return
        bench_latency(db, args.latency_steps, 0.01)
        bench_memory(db, args.memory_steps, args.every)


if __name__ == "__main__":
    main()
