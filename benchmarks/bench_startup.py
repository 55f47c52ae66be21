"""Start-up time of ``mdb step`` and key-press latency of the step view.

Start-up: wall time from process spawn until the loading screen and then the step view (with the
captured default model) are first painted, in a real 80×24 pseudo-terminal; the app logs the
paints to ``$MDB_PAINT_LOG`` and exits right after the step view's (``MDB_EXIT_AFTER_PAINT=1``).
Interleaved with it, in the same run: ``mdb --help`` and a bare ``python -c "import torch"``
(the floor any torch program pays). The budget is 2.5 s on 2 cores.

Key latency: in-process with Textual's Pilot (headless, 80×24) on the default trace, the time for
``await pilot.press(key)`` — the key event, the action, the re-render and the refresh — for n
(next call), p (previous call), N (next layer), b (backward/forward) and r + s (open and close
the router view).

Run: ``python benchmarks/bench_startup.py [--runs 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BUDGET_S = 2.5


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TERM", "xterm-256color")
    return env


def time_in_pty(argv: list[str], env: dict[str, str], timeout: float = 120.0,
                paint_log: Path | None = None) -> dict[str, float]:
    """Run ``argv`` in an 80×24 pseudo-terminal; seconds from spawn to exit (``exit``) and,
    from ``paint_log``, to each logged first paint (``loading``, ``step``)."""
    import pexpect

    if paint_log is not None:
        paint_log.unlink(missing_ok=True)
    t_wall = time.time()
    t0 = time.perf_counter()
    child = pexpect.spawn(argv[0], argv[1:], env=env, dimensions=(24, 80), cwd=str(REPO),
                          timeout=timeout)
    child.expect(pexpect.EOF)
    child.close()
    out = {"exit": time.perf_counter() - t0}
    if child.exitstatus != 0:
        raise SystemExit(f"{' '.join(argv)} exited with {child.exitstatus}")
    if paint_log is not None and paint_log.exists():
        for line in paint_log.read_text().splitlines():
            label, stamp = line.split()
            out.setdefault(label, float(stamp) - t_wall)
    return out


def bench_startup(runs: int) -> dict[str, list[float]]:
    import tempfile

    log = Path(tempfile.mkdtemp()) / "paint.log"
    env = _env()
    step_env = dict(env, MDB_EXIT_AFTER_PAINT="1", MDB_PAINT_LOG=str(log))
    mdb = [sys.executable, "-m", "tui.cli"]
    times: dict[str, list[float]] = {
        "python -c 'import torch'": [],
        "mdb --help": [],
        "mdb step: loading screen painted": [],
        "mdb step: step view painted": [],
        "mdb step: process exit": [],
    }
    time_in_pty(mdb + ["step"], step_env, paint_log=log)  # warm the file cache once
    for _ in range(runs):
        times["python -c 'import torch'"].append(
            time_in_pty([sys.executable, "-c", "import torch"], env)["exit"])
        times["mdb --help"].append(time_in_pty(mdb + ["--help"], env)["exit"])
        r = time_in_pty(mdb + ["step"], step_env, paint_log=log)
        times["mdb step: loading screen painted"].append(r["loading"])
        times["mdb step: step view painted"].append(r["step"])
        times["mdb step: process exit"].append(r["exit"])
    return times


async def _key_latency(trace, presses: int) -> dict[str, list[float]]:
    from tui.app import make_step_app

    app = make_step_app(trace, exit_after_paint=False)
    out: dict[str, tuple[list[float], list[float]]] = {}
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        sequences = {"n": ["n"], "p": ["p"], "N (next layer)": ["N"], "b (bwd/fwd)": ["b"],
                     "r then s (router view)": ["r", "s"]}
        for name, keys in sequences.items():
            wall, cpu = [], []
            for _ in range(presses):
                for key in keys:
                    t0, c0 = time.perf_counter(), time.process_time()
                    await pilot.press(key)
                    wall.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
            out[name] = (wall, cpu)
    return out


def bench_keys(presses: int) -> dict[str, tuple[list[float], list[float]]]:
    import argparse as ap

    from tui.commands.capturing import capture_step
    from tui.commands.options import add_model_arguments
    from tui.commands.workload import build_workload

    parser = ap.ArgumentParser()
    add_model_arguments(parser)
    import torch

    torch.set_num_threads(1)  # as mdb step does by default
    trace = capture_step(build_workload(parser.parse_args([])), attention=True)
    return asyncio.run(_key_latency(trace, presses))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--presses", type=int, default=20)
    args = parser.parse_args()
    print(f"start-up, {args.runs} interleaved runs each, 80×24 pty, {os.cpu_count()} CPUs")
    times = bench_startup(args.runs)
    for name, ts in times.items():
        print(f"  {name:<38} median {statistics.median(ts):6.3f} s  "
              f"(min {min(ts):.3f}, max {max(ts):.3f})")
    step = statistics.median(times["mdb step: step view painted"])
    floor = statistics.median(times["python -c 'import torch'"])
    print(f"  ratio mdb step / import torch: {step / floor:.2f}×; "
          f"mdb step / budget {BUDGET_S} s: {step / BUDGET_S:.2f}")
    print(f"key latency, {args.presses} presses each (Pilot, headless 80×24, default model):")
    print("  wall = await pilot.press (includes Pilot's own idle waits); cpu = process CPU time")
    for name, (wall, cpu) in bench_keys(args.presses).items():
        w = statistics.median(wall) * 1e3
        c = statistics.median(cpu) * 1e3
        print(f"  {name:<24} wall median {w:6.1f} ms (max {max(wall) * 1e3:6.1f})  "
              f"cpu median {c:6.1f} ms")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (other work on this machine "
          "slows every number above)")


if __name__ == "__main__":
    main()
