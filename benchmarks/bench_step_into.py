"""Stepping into a call: how long until the ops of the default model's attention are shown.

Two numbers on the default config (batch 2×64 of alice.txt, 1 torch thread like ``mdb step``):

* ``Trace.ops`` alone — the replay of the forward with the op recorder armed inside
  ``model.layers.0.self_attn`` (a fresh replay every time), interleaved with a plain
  ``torch.no_grad`` forward of the same batch (the floor a replay cannot go below);
* in the UI (Textual Pilot, headless 80×24): from pressing ``i`` on that call in the step view
  to the op table being filled (the replay runs in a thread worker).

The bound is 0.5 s. Run: ``python benchmarks/bench_step_into.py [--repeats 10]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BOUND_S = 0.5
ATTN = "model.layers.0.self_attn"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    import torch

    from benchmarks._timing import interleaved, report
    from tui.commands.capturing import capture_step
    from tui.commands.options import add_model_arguments
    from tui.commands.workload import build_workload

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    workload = build_workload(parser.parse_args([]))
    trace = capture_step(workload, attention=False)
    model = workload.model

    def replay() -> None:
        trace.ops(ATTN, 0, refresh=True)

    def forward() -> None:
        with torch.no_grad():
            workload.batch.call(model)

    times = interleaved({"Trace.ops (replay)": replay, "plain forward": forward},
                        repeats=args.repeats)
    med = report(times, "plain forward")
    ops = trace.ops(ATTN, 0)
    print(f"{len(ops.ops)} ops recorded in {ATTN}, diverged: {ops.diverged or 'no'}")

    ui = asyncio.run(_ui_times(trace, args.repeats))
    ui_med = statistics.median(ui)
    print(f"{'UI: i -> ops shown':>28}: median {ui_med * 1e3:8.2f} ms  max {max(ui) * 1e3:.2f} ms")
    worst = max(med["Trace.ops (replay)"], ui_med)
    print(f"bound {BOUND_S} s: {'met' if worst <= BOUND_S else 'NOT met'} ({worst:.3f} s)")
    return 0


async def _ui_times(trace, repeats: int) -> list[float]:
    from textual.widgets import DataTable

    from tui.app import make_step_app
    from tui.screens.ops import OpsScreen
    from tui.screens.step import StepScreen

    out = []
    app = make_step_app(trace)
    async with app.run_test(size=(80, 24)) as pilot:
        while not isinstance(app.screen, StepScreen):
            await pilot.pause(0.01)
        app.screen.jump(ATTN)
        await pilot.pause()
        for _ in range(repeats):
            trace.op_traces.clear()
            t0 = time.perf_counter()
            await pilot.press("i")
            while not (isinstance(app.screen, OpsScreen)
                       and app.screen.query_one("#ops", DataTable).row_count):
                await pilot.pause(0.005)
            out.append(time.perf_counter() - t0)
            await pilot.press("u")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
