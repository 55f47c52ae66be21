"""``mdb doctor``'s default run (checks 1-9) on the default config: 1 vs 2 intra-op threads.

Both sides are timed interleaved in one process (``torch.set_num_threads`` switched per call)
on the same model and batch, so machine load lands on both alike. Prints per-side medians and
the ratio, plus the per-check seconds of the last 1-thread run. ``--zoo`` times instead the
checks on each correct model of ``tests/families.py`` (1 thread, median of the repeats), the
per-model cost of ``tests/hooks/doctor/model/test_doctor_families.py``.

``--invariances`` times instead, interleaved with 1 thread, the checks before the invariances
(1-9, today's default run) against the whole default run with the invariance checks 21-25.

``--battery`` times instead the whole default run against checks 1-10 alone (1 thread, both
interleaved): what the later checks (11-14: magnitudes and gradient paths; 21-25: invariances) add.

    python benchmarks/bench_doctor.py [--preset default] [--repeats 5]
    python benchmarks/bench_doctor.py --zoo [--repeats 3]
    python benchmarks/bench_doctor.py --invariances [--repeats 5]
    python benchmarks/bench_doctor.py --battery [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks._timing import interleaved, report  # noqa: E402
from hooks.doctor.model import run_checks  # noqa: E402
from tui.commands.workload import build_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="default")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--zoo", action="store_true", help="time each model of tests/families.py")
    ap.add_argument("--invariances", action="store_true",
                    help="checks 1-9 vs 1-9 + the invariance checks 21-25, 1 thread")
    ap.add_argument("--battery", action="store_true",
                    help="time every check against checks 1-10 alone, interleaved")
    a = ap.parse_args()
    if a.zoo:
        return zoo(a.repeats)
    ns = argparse.Namespace(preset=a.preset, config=None, model=None, text=None, seq_len=64,
                            batch_size=2, seed=0)
    work = build_workload(ns)
    if a.invariances:
        return invariances(work, a.repeats)
    last: dict[str, list] = {}

    def run(threads: int):
        def fn():
            torch.set_num_threads(threads)
            last[threads] = run_checks(work)
        return fn

    if a.battery:
        torch.set_num_threads(1)
        first = ",".join(str(i) for i in range(1, 11))
        times = interleaved({"checks 1-10": lambda: run_checks(work, only=first),
                             "every check": lambda: last.update({1: run_checks(work)})},
                            a.repeats, warmup=1)
        print(f"mdb doctor on preset {a.preset} ({work.description}), 1 thread")
        report(times, "checks 1-10")
        print("per check (last run):", ", ".join(f"{r.key} {r.seconds:.2f}s" for r in last[1]))
        return None
    times = interleaved({"1 thread": run(1), "2 threads": run(2)}, a.repeats, warmup=1)
    print(f"mdb doctor checks 1-9 on preset {a.preset} ({work.description})")
    report(times, "1 thread")
    print("per check (last 1-thread run):",
          ", ".join(f"{r.key} {r.seconds:.2f}s" for r in last[1]))


def invariances(work, repeats: int) -> None:
    torch.set_num_threads(1)
    last: dict[str, list] = {}
    before = ",".join(str(i) for i in range(1, 10))

    def run(only):
        def fn():
            last[only] = run_checks(work, only=only)
        return fn

    after = before + ",21,22,23,24,25"
    times = interleaved({"checks 1-9": run(before), "checks 1-9 + 21-25": run(after)},
                        repeats, warmup=1)
    print(f"mdb doctor on {work.description}, 1 thread")
    report(times, "checks 1-9")
    print("invariance checks (last run):",
          ", ".join(f"{r.key} {r.seconds:.2f}s" for r in last[after] if r.id > 20))


def zoo(repeats: int) -> None:
    import statistics
    import time
    from types import SimpleNamespace

    import hooks
    from tests.families import FAMILIES

    torch.set_num_threads(1)
    rows = []
    for name, fam in FAMILIES.items():
        model, batch, loss_fn = hooks.from_factory(fam.build())
        work = SimpleNamespace(model=model, batch=batch, loss_fn=loss_fn)
        run_checks(work)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run_checks(work)
            times.append(time.perf_counter() - t0)
        rows.append((name, statistics.median(times)))
        print(f"{name:>20}: {rows[-1][1] * 1e3:7.1f} ms", flush=True)
    total = sum(t for _, t in rows)
    slowest = max(rows, key=lambda r: r[1])[0]
    print(f"{'all ' + str(len(rows)):>20}: {total:.2f} s (median per model "
          f"{statistics.median(t for _, t in rows) * 1e3:.0f} ms, slowest {slowest})")


if __name__ == "__main__":
    main()
