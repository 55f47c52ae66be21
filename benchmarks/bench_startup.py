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

Before/after in one run: ``--baseline DIR`` (a checkout of another commit, e.g. ``git archive
COMMIT | tar -x -C DIR``) is timed alongside this one: its ``mdb step`` in the same interleaved
start-up loop, its keys in child processes alternating with this checkout's (``--rounds``).

Run: ``python benchmarks/bench_startup.py [--runs 5] [--only startup|keys] [--baseline DIR]``.
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
BUDGET_S = 2.5


def _use_repo(argv: list[str]) -> None:
    """``--repo DIR`` (the tree whose mdb is timed; the children of ``--baseline``): set
    :data:`REPO` before any of mdb's modules is imported."""
    global REPO
    if "--repo" in argv:
        REPO = Path(argv[argv.index("--repo") + 1]).resolve()
    sys.path.insert(0, str(REPO))


_use_repo(sys.argv)


#: Where the children keep mdb's compiled bytecode (see :func:`_env`).
PYCACHE = Path(os.environ.get("TMPDIR", "/tmp")) / "mdb-bench-pycache"


def _env(bytecode: bool = True, repo: Path | None = None) -> dict[str, str]:
    """The children's environment (mdb from ``repo``, default :data:`REPO`). ``bytecode``:
    mdb's modules are loaded from compiled bytecode, as from any installed package (kept under
    :data:`PYCACHE`, outside the repository), whatever ``PYTHONDONTWRITEBYTECODE`` says:
    torch's own come from their ``.pyc`` files, and a shell that forbids writing bytecode would
    otherwise charge mdb alone for compiling its ~100 modules on every start."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo or REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TERM", "xterm-256color")
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    return env


def time_in_pty(argv: list[str], env: dict[str, str], timeout: float = 120.0,
                paint_log: Path | None = None, cwd: Path | None = None) -> dict[str, float]:
    """Run ``argv`` in an 80×24 pseudo-terminal (in ``cwd``, default :data:`REPO`); seconds
    from spawn to exit (``exit``) and, from ``paint_log``, to each logged first paint
    (``loading``, ``step``)."""
    import pexpect

    if paint_log is not None:
        paint_log.unlink(missing_ok=True)
    t_wall = time.time()
    t0 = time.perf_counter()
    child = pexpect.spawn(argv[0], argv[1:], env=env, dimensions=(24, 80),
                          cwd=str(cwd or REPO), timeout=timeout)
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


def bench_startup(runs: int, bytecode: bool = True,
                  baseline: Path | None = None) -> dict[str, list[float]]:
    """Seconds per run of each start-up measure, interleaved (``baseline``: its ``mdb step``
    too, in the same loop, its order flipped with this checkout's every run)."""
    import tempfile

    log = Path(tempfile.mkdtemp()) / "paint.log"
    env = _env(bytecode)
    mdb = [sys.executable, "-m", "tui.cli"]
    times: dict[str, list[float]] = {
        "python -c 'import torch'": [],
        "mdb --help": [],
        "mdb step: loading screen painted": [],
        "mdb step: step view painted": [],
        "mdb step: process exit": [],
    }
    sides = {"": REPO}
    if baseline is not None:
        sides["baseline "] = baseline
        times.update({f"baseline mdb step: {what}": [] for what in
                      ("loading screen painted", "step view painted", "process exit")})
    step_env = {prefix: dict(_env(bytecode, repo), MDB_EXIT_AFTER_PAINT="1",
                             MDB_PAINT_LOG=str(log)) for prefix, repo in sides.items()}
    for prefix, repo in sides.items():  # warm the file cache once (and write the bytecode)
        time_in_pty(mdb + ["step"], step_env[prefix], paint_log=log, cwd=repo)
    for i in range(runs):
        times["python -c 'import torch'"].append(
            time_in_pty([sys.executable, "-c", "import torch"], env)["exit"])
        times["mdb --help"].append(time_in_pty(mdb + ["--help"], env)["exit"])
        for prefix in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            r = time_in_pty(mdb + ["step"], step_env[prefix], paint_log=log, cwd=sides[prefix])
            times[f"{prefix}mdb step: loading screen painted"].append(r["loading"])
            times[f"{prefix}mdb step: step view painted"].append(r["step"])
            times[f"{prefix}mdb step: process exit"].append(r["exit"])
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
    parser.add_argument("--baseline", metavar="DIR", type=Path,
                        help="a checkout of another commit, timed alongside this one")
    parser.add_argument("--rounds", type=int, default=4,
                        help="keys with --baseline: child processes per side, alternating")
    parser.add_argument("--repo", metavar="DIR", help="the tree whose mdb is timed (default: "
                        "this checkout)")
    parser.add_argument("--json", metavar="FILE", type=Path,
                        help="keys: also write the raw seconds to FILE (the --baseline runs)")
    args = parser.parse_args()
    if args.only != "keys":
        _print_startup(args.runs, not args.no_bytecode, args.baseline)
    if args.only != "startup":
        if args.baseline is not None:
            _print_keys_against(args.baseline, args.presses, args.rounds)
        else:
            _print_keys(args.presses, args.json)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (other work on this machine "
          "slows every number above)")


def _print_startup(runs: int, bytecode: bool = True, baseline: Path | None = None) -> None:
    print(f"start-up, {runs} interleaved runs each, 80×24 pty, {os.cpu_count()} CPUs, mdb's "
          f"modules {'from cached bytecode' if bytecode else 'compiled on every start'}")
    times = bench_startup(runs, bytecode, baseline)
    for name, ts in times.items():
        print(f"  {name:<38} median {statistics.median(ts):6.3f} s  "
              f"(min {min(ts):.3f}, max {max(ts):.3f})")
    floor = statistics.median(times["python -c 'import torch'"])
    for prefix in ("", "baseline ") if baseline is not None else ("",):
        step = statistics.median(times[f"{prefix}mdb step: step view painted"])
        print(f"  ratio {prefix}mdb step / import torch: {step / floor:.2f}×; "
              f"mdb step / budget {BUDGET_S} s: {step / BUDGET_S:.2f}")


KEYS_LEGEND = ("  first/last = key event sent → the first / the last frame the compositor drew "
               "for it (new content / layout and scroll bars settled); pilot = await "
               "pilot.press (adds Pilot's idle waits, 2 × 20 ms sleeps at least); cpu = CPU of "
               "the pilot presses; medians in ms")


def _print_key_rows(results: dict, prefix: str = "") -> None:
    for name, (first, framed, wall, cpu) in results.items():
        a, f, w, c = (statistics.median(x) * 1e3 for x in (first, framed, wall, cpu))
        print(f"  {prefix}{name:<24} first {a:6.1f}  last {f:6.1f} (max "
              f"{max(framed) * 1e3:6.1f})  pilot {w:6.1f}  cpu {c:5.1f}")


def _print_keys(presses: int, json_out: Path | None = None) -> None:
    print(f"key latency, {presses} presses each (Pilot, headless 80×24, default model):")
    print(KEYS_LEGEND)
    results = bench_keys(presses)
    _print_key_rows(results)
    if json_out is not None:
        import json

        json_out.write_text(json.dumps(results))


def _print_keys_against(baseline: Path, presses: int, rounds: int) -> None:
    """Keys of this checkout and of ``baseline``, each in ``rounds`` child processes run
    alternately (ABAB…, flipped every round); the presses of all rounds pooled per side."""
    import json
    import subprocess
    import tempfile

    print(f"key latency, this checkout against {baseline}: {rounds} alternating rounds per "
          f"side, {presses} presses each a round (Pilot, headless 80×24, default model):")
    print(KEYS_LEGEND)
    out = Path(tempfile.mkdtemp()) / "keys.json"
    sides = {"after   ": REPO, "before  ": baseline.resolve()}
    pooled: dict[str, dict[str, list[list[float]]]] = {name: {} for name in sides}
    for i in range(rounds):
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            subprocess.run([sys.executable, __file__, "--only", "keys", "--presses",
                            str(presses), "--repo", str(sides[name]), "--json", str(out)],
                           check=True, stdout=subprocess.DEVNULL, env=_env(True, sides[name]))
            for key, series in json.loads(out.read_text()).items():
                into = pooled[name].setdefault(key, [[], [], [], []])
                for acc, xs in zip(into, series, strict=True):
                    acc.extend(xs)
    for key in pooled["after   "]:
        for name in sides:
            if key in pooled[name]:
                _print_key_rows({key: pooled[name][key]}, name)


if __name__ == "__main__":
    main()
