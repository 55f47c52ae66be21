"""Start-up time of ``mdb step`` and key-press latency of the step view.

Start-up: wall time from process spawn until the loading screen and then the step view (with the
captured default model) are first painted, in a real 80×24 pseudo-terminal; the app logs the
paints to ``$MDB_PAINT_LOG`` and exits right after the step view's (``MDB_EXIT_AFTER_PAINT=1``).
Interleaved with it, in the same run: ``mdb --help`` and a bare ``python -c "import torch"``
(the floor any torch program pays). The budget is 2.5 s on 2 cores.

Key latency: in-process (headless, 80×24) on the default trace, from the key event sent as the
terminal driver sends it to the last frame the compositor drew for it (the action, the
re-render, Textual's layout and compositor included; its 60 fps update timer too), for n (next
call), p (previous call), N/P (next/previous layer), b (backward/forward), r + s (open and close
the router view) and N/P inside the router view: to the first frame drawn after the key (the
new content on screen) and to the last (Textual's second layout pass and the scroll bars
settled); also ``await pilot.press(key)``, which adds Pilot's own idle waits (at least two 20 ms
sleeps). Bounds (issue 25): step view keys ≤ 50 ms, the router view ≤ 100 ms, medians.

Run: ``python benchmarks/bench_startup.py [--runs 5] [--only startup|keys]``.
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


#: Where the children keep mdb's compiled bytecode (see :func:`_env`).
PYCACHE = Path(os.environ.get("TMPDIR", "/tmp")) / "mdb-bench-pycache"


def _env(bytecode: bool = True) -> dict[str, str]:
    """The children's environment. ``bytecode``: mdb's modules are loaded from compiled
    bytecode, as from any installed package (kept under :data:`PYCACHE`, outside the
    repository), whatever ``PYTHONDONTWRITEBYTECODE`` says: torch's own come from their
    ``.pyc`` files, and a shell that forbids writing bytecode would otherwise charge mdb alone
    for compiling its ~100 modules on every start."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TERM", "xterm-256color")
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
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


def bench_startup(runs: int, bytecode: bool = True) -> dict[str, list[float]]:
    import tempfile

    log = Path(tempfile.mkdtemp()) / "paint.log"
    env = _env(bytecode)
    step_env = dict(env, MDB_EXIT_AFTER_PAINT="1", MDB_PAINT_LOG=str(log))
    mdb = [sys.executable, "-m", "tui.cli"]
    times: dict[str, list[float]] = {
        "python -c 'import torch'": [],
        "mdb --help": [],
        "mdb step: loading screen painted": [],
        "mdb step: step view painted": [],
        "mdb step: process exit": [],
    }
    # warm the file cache once (and write the bytecode)
    time_in_pty(mdb + ["step"], step_env, paint_log=log)
    for _ in range(runs):
        times["python -c 'import torch'"].append(
            time_in_pty([sys.executable, "-c", "import torch"], env)["exit"])
        times["mdb --help"].append(time_in_pty(mdb + ["--help"], env)["exit"])
        r = time_in_pty(mdb + ["step"], step_env, paint_log=log)
        times["mdb step: loading screen painted"].append(r["loading"])
        times["mdb step: step view painted"].append(r["step"])
        times["mdb step: process exit"].append(r["exit"])
    return times


#: Key sequences timed in the step view (and in the router view it opens).
KEY_SEQUENCES = {"n": ["n"], "p": ["p"], "N then P (layers)": ["N", "P"],
                 "b (bwd/fwd)": ["b"], "r then s (router view)": ["r", "s"],
                 "router view: N then P": ["N", "P"]}


async def _frame_after(app, key: str, frames: list[float], quiet: float) -> tuple[float, float]:
    """Send ``key`` as the terminal would and wait until the app has drawn its last frame for
    it (no new frame for ``quiet`` s and nothing left to draw); seconds from the key to the
    first frame drawn after it (the new content), and to the last (scroll bars and layout
    settled)."""
    from textual import events

    n0 = len(frames)
    t0 = time.perf_counter()
    event = events.Key(key, key if len(key) == 1 else None)
    event.set_sender(app)
    app._driver.send_message(event)
    while True:
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        screen = app.screen
        busy = screen._dirty_widgets or screen._layout_required or screen._repaint_required
        if len(frames) > n0 and not busy and now - frames[-1] > quiet:
            return frames[n0] - t0, frames[-1] - t0
        if now - t0 > 10:
            raise SystemExit(f"no frame drawn within 10 s of key {key!r}")


async def _key_latency(trace, presses: int, quiet: float = 0.06) -> dict[str, tuple]:
    """Per key sequence: (key → first frame, key → last frame, ``await pilot.press``) wall
    seconds, and the process CPU seconds of the pilot presses."""
    from tui.app import make_step_app

    app = make_step_app(trace, exit_after_paint=False)
    frames: list[float] = []
    display = app._display

    def timed_display(screen, renderable) -> None:  # every frame the compositor renders
        display(screen, renderable)
        frames.append(time.perf_counter())

    app._display = timed_display
    out: dict[str, tuple[list[float], ...]] = {}
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        for name, keys in KEY_SEQUENCES.items():
            if name.startswith("router view"):
                await pilot.press("r")
            first, framed, wall, cpu = [], [], [], []
            for _ in range(presses):
                for key in keys:
                    a, b = await _frame_after(app, key, frames, quiet)
                    first.append(a)
                    framed.append(b)
            for _ in range(presses):
                for key in keys:
                    t0, c0 = time.perf_counter(), time.process_time()
                    await pilot.press(key)
                    wall.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
            if name.startswith("router view"):
                await pilot.press("s")
            out[name] = (first, framed, wall, cpu)
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
    parser.add_argument("--only", choices=["startup", "keys"], help="run one half only")
    parser.add_argument("--no-bytecode", action="store_true",
                        help="start-up: keep PYTHONDONTWRITEBYTECODE (mdb's modules compiled "
                             "from source on every start)")
    args = parser.parse_args()
    if args.only != "keys":
        _print_startup(args.runs, not args.no_bytecode)
    if args.only != "startup":
        _print_keys(args.presses)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (other work on this machine "
          "slows every number above)")


def _print_startup(runs: int, bytecode: bool = True) -> None:
    print(f"start-up, {runs} interleaved runs each, 80×24 pty, {os.cpu_count()} CPUs, mdb's "
          f"modules {'from cached bytecode' if bytecode else 'compiled on every start'}")
    times = bench_startup(runs, bytecode)
    for name, ts in times.items():
        print(f"  {name:<38} median {statistics.median(ts):6.3f} s  "
              f"(min {min(ts):.3f}, max {max(ts):.3f})")
    step = statistics.median(times["mdb step: step view painted"])
    floor = statistics.median(times["python -c 'import torch'"])
    print(f"  ratio mdb step / import torch: {step / floor:.2f}×; "
          f"mdb step / budget {BUDGET_S} s: {step / BUDGET_S:.2f}")


def _print_keys(presses: int) -> None:
    print(f"key latency, {presses} presses each (Pilot, headless 80×24, default model):")
    print("  first/last = key event sent → the first / the last frame the compositor drew for "
          "it (new content / layout and scroll bars settled); pilot = await pilot.press (adds "
          "Pilot's idle waits, 2 × 20 ms sleeps at least); cpu = CPU of the pilot presses; "
          "medians in ms")
    for name, (first, framed, wall, cpu) in bench_keys(presses).items():
        a, f, w, c = (statistics.median(x) * 1e3 for x in (first, framed, wall, cpu))
        print(f"  {name:<24} first {a:6.1f}  last {f:6.1f} (max {max(framed) * 1e3:6.1f})  "
              f"pilot {w:6.1f}  cpu {c:5.1f}")


if __name__ == "__main__":
    main()
