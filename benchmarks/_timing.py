"""Interleaved timing shared by the benchmark scripts: both sides measured in one run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Time each callable ``repeats`` times, alternating A, B, A, B, … (order flipped every
    round) so that machine noise lands on both sides alike. Returns seconds per call, by
    ``clock`` (the wall clock; ``time.thread_time``: this thread's CPU time)."""

    def timed(fn: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            t0 = clock()
            fn()
            return clock() - t0

        return run

    return alternated({name: timed(fn) for name, fn in fns.items()}, repeats, warmup)


def alternated(fns: dict[str, Callable[[], float]], repeats: int,
               warmup: int = 3) -> dict[str, list[float]]:
    """Call each side ``repeats`` times in :func:`interleaved`'s order, after ``warmup``
    rounds, keeping what each call returns: for a side that times only part of its work
    (a block of steps whose batches are made before its clock starts)."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    values: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            values[name].append(fns[name]())
    return values


def report(times: dict[str, list[float]], baseline: str) -> dict[str, float]:
    """Print median and IQR per side and each side's median ratio to ``baseline``."""
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, values in times.items():
        q = statistics.quantiles(values, n=4) if len(values) >= 4 else [min(values), 0, max(values)]
        ratio = med[name] / med[baseline]
        print(
            f"{name:>28}: median {med[name] * 1e3:8.2f} ms  "
            f"IQR [{q[0] * 1e3:.2f}, {q[2] * 1e3:.2f}] ms  ratio to {baseline}: {ratio:.3f}"
        )
    return med


def preset_workload(preset: str, batch_size: int, seq_len: int):
    """The workload ``mdb step --preset PRESET --batch-size B --seq-len T`` builds (model,
    batch, loss): what the step view's benchmarks time."""
    import argparse

    from tui.commands.options import add_model_arguments
    from tui.commands.workload import build_workload

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    return build_workload(parser.parse_args(["--preset", preset, "--batch-size", str(batch_size),
                                             "--seq-len", str(seq_len)]))
