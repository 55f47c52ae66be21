"""``mdb overfit``: throughput with a live Textual UI vs ``--headless``, UI responsiveness, and
the run store's costs (write per step, watcher latency).

Usage::

    python benchmarks/bench_overfit_ui.py [--steps 60] [--repeats 5] [--preset seed-test-c]

What it measures (both sides interleaved in one run, medians printed):

1. **Training throughput**: the same overfit session (default config: seed-test-c, the zh text,
   ``--every 50``, samples every 25 steps, every step written to SQLite) run (a) headless with
   the plain-line reporter writing to /dev/null, and (b) in a Textual thread worker under an app
   running headless (``App.run_test``), which receives one message per step and re-renders
   its widgets. Goal: live ≥ 0.90 × headless steps/s. The app is a *stand-in* with the live
   screen's load pattern (a header line, the latest sample, a per-step message) until the real
   live screen is wired; pass ``--app module:factory`` (``factory(session) -> App`` that runs
   ``session.run`` in a thread worker and exits when it returns) to measure the real one.
2. **UI responsiveness while training**: lateness of a 20 ms interval timer on the app's
   event loop (what a key press waits for, at most). Goal: < 100 ms.
3. **Store write cost**: ``RunWriter.log_step`` per step (metrics only, and with a captured
   step's internals), against the training step time.
4. **Watcher latency**: a ``mdb overfit --headless`` writer subprocess, and a reader polling
   ``RunStore.poll`` every 100 ms (as the watch screen does): time from a step's commit to the
   reader seeing it. Goal: < 0.5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from hooks.runstore import RunStore  # noqa: E402
from hooks.training import OverfitOptions, OverfitSession, default_overfit_text  # noqa: E402


def make_session(tmp: Path, preset: str, steps: int, tag: str) -> OverfitSession:
    import minillm

    text, source = default_overfit_text()
    opts = OverfitOptions(
        text=text,
        text_source=source,
        model_config=minillm.load_preset(preset).to_dict(),
        preset=preset,
        steps=steps,
        every=50,
        sample_every=25,
    )
    store = RunStore(tmp / f"{tag}.sqlite", create=True)
    return OverfitSession.create(store, tag, opts)


def run_headless(session: OverfitSession) -> float:
    from tui.commands.overfit import _Reporter

    with open(os.devnull, "w") as devnull:
        reporter = _Reporter(session, stream=devnull)
        t0 = time.perf_counter()
        session.run(on_step=reporter.on_step)
        dt = time.perf_counter() - t0
    session.store.close()
    return dt


def stand_in_app(session: OverfitSession):
    """A Textual app with the live screen's load: a message per step, widgets re-rendered."""
    from dataclasses import dataclass

    from textual.app import App, ComposeResult
    from textual.message import Message
    from textual.widgets import Footer, Header, Static

    @dataclass
    class StepDone(Message):
        report: object

    class StandIn(App):
        BINDINGS = [("p", "pause", "pause"), ("q", "quit", "quit")]

        def __init__(self) -> None:
            super().__init__()
            self.session = session
            self.train_seconds = 0.0
            self.lateness: list[float] = []
            self._next_tick = 0.0

        def compose(self) -> ComposeResult:
            yield Header()
            yield Static(id="line")
            yield Static(id="sample")
            yield Static(id="load")
            yield Footer()

        def on_mount(self) -> None:
            self._next_tick = time.perf_counter() + 0.02
            self.set_interval(0.02, self._tick)
            self.run_worker(self._train, thread=True, exit_on_error=True)

        def _tick(self) -> None:
            now = time.perf_counter()
            self.lateness.append(max(0.0, now - self._next_tick))
            self._next_tick = now + 0.02

        def _train(self) -> None:
            t0 = time.perf_counter()
            self.session.run(on_step=lambda r: self.post_message(StepDone(r)))
            self.train_seconds = time.perf_counter() - t0
            self.call_from_thread(self.exit)

        def on_stand_in_step_done(self, message: StepDone) -> None:  # pragma: no cover
            self._show(message.report)

        def on_step_done(self, message: StepDone) -> None:
            self._show(message.report)

        def _show(self, r) -> None:
            m = r.metrics
            self.query_one("#line", Static).update(
                f"step {m.step}/{self.session.trainer.total_steps}  ce {m.ce:.4f}  "
                f"aux {m.aux:.4f}  |g| {m.grad_norm:.3g}  {m.steps_per_s:.1f} steps/s"
            )
            if r.sample is not None:
                self.query_one("#sample", Static).update("".join(r.sample))
            if m.expert_load:
                self.query_one("#load", Static).update(
                    "  ".join(" ".join(f"{x:.2f}" for x in row) for row in m.expert_load)
                )

    return StandIn()


def run_live(session: OverfitSession, factory) -> tuple[float, list[float]]:
    app = factory(session)

    async def go() -> None:
        async with app.run_test(size=(120, 40)):
            while app.is_running and not getattr(app, "train_seconds", 0):
                await asyncio.sleep(0.05)

    asyncio.run(go())
    session.store.close()
    return app.train_seconds, getattr(app, "lateness", [])


def bench_throughput(args, tmp: Path, factory) -> None:
    print(f"\n== training throughput: {args.preset}, {args.steps} steps per run, "
          f"{args.repeats} runs per side, interleaved ==")
    times: dict[str, list[float]] = {"headless": [], "live": []}
    lateness: list[float] = []
    # warm-up (imports, allocator)
    run_headless(make_session(tmp, args.preset, 5, "warm-h"))
    run_live(make_session(tmp, args.preset, 5, "warm-l"), factory)
    for i in range(args.repeats):
        order = ["headless", "live"] if i % 2 == 0 else ["live", "headless"]
        for side in order:
            s = make_session(tmp, args.preset, args.steps, f"{side}-{i}")
            if side == "headless":
                times[side].append(run_headless(s))
            else:
                dt, late = run_live(s, factory)
                times[side].append(dt)
                lateness.extend(late)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:>9}: median {med[k]:.3f} s  ({args.steps / med[k]:.1f} steps/s)  "
              f"all: {', '.join(f'{x:.2f}' for x in v)}")
    print(f"throughput ratio live / headless: {med['headless'] / med['live']:.3f} (goal ≥ 0.90)")
    if lateness:
        lateness.sort()
        p50 = lateness[len(lateness) // 2]
        p99 = lateness[int(len(lateness) * 0.99)]
        print(f"UI event-loop lateness while training (20 ms timer, {len(lateness)} ticks): "
              f"median {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {lateness[-1] * 1e3:.1f} ms"
              " (goal: a key is handled within 100 ms)")


def bench_store(args, tmp: Path) -> None:
    print("\n== run store: cost of one step's transaction ==")
    import hooks

    s = make_session(tmp, args.preset, 3, "store")
    rep = s.trainer.train_step(capture=True)
    internals = rep.internals
    step_time = statistics.median(
        [s.trainer.train_step().metrics.step_time for _ in range(10)]
    )
    w = s.store.create_run("store-bench", {})
    n = 300
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        w.log_step({"step": i, "ce": 1.0, "aux": 0.01, "total": 1.01, "grad_norm": 1.0,
                    "expert_load": [[0.25] * 4] * 4})
    per = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for i in range(n + 1, n + 11):
        w.log_step({"step": i, "ce": 1.0}, internals=internals)
    per_int = (time.perf_counter() - t0) / 10
    import json

    size = len(json.dumps(internals)) if internals else 0
    print(f"log_step, metrics only: {per * 1e3:.3f} ms; with internals ({size / 1e3:.0f} kB "
          f"JSON, hooks {getattr(hooks, '__name__', '?')}): {per_int * 1e3:.2f} ms; "
          f"training step ({args.preset}): {step_time * 1e3:.1f} ms → metrics write = "
          f"{per / step_time * 100:.2f} % of a step")
    s.store.close()


def bench_watch_latency(args, tmp: Path) -> None:
    print("\n== watcher latency: writer subprocess, reader polling every 100 ms ==")
    db = tmp / "watch.sqlite"
    toml = tmp / "tiny.toml"
    toml.write_text(
        "vocab_size = 256\nhidden_size = 16\nintermediate_size = 32\nnum_hidden_layers = 1\n"
        "num_attention_heads = 2\nnum_key_value_heads = 1\nnum_local_experts = 2\n"
        "num_experts_per_tok = 1\nmax_position_embeddings = 128\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tui.cli", "overfit", "--headless", "--config", str(toml),
         "--steps", str(args.watch_steps), "--db", str(db), "--run", "w", "--every", "0",
         "--sample-every", "0"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    while True:
        try:
            store = RunStore(db)
            run = store.run("w")
            break
        except Exception:
            time.sleep(0.05)
    lat: list[float] = []
    cursor = 0
    while True:
        upd = store.poll(run.id, cursor)
        now = time.time()
        lat.extend(now - m.wall for m in upd.metrics)
        cursor = upd.last_step
        if upd.run.status != "running" and not upd.metrics:
            break
        time.sleep(0.1)
    proc.wait()
    lat.sort()
    print(f"{len(lat)} steps seen once each: {cursor == args.watch_steps}; latency median "
          f"{statistics.median(lat) * 1e3:.0f} ms, p99 {lat[int(len(lat) * 0.99)] * 1e3:.0f} ms,"
          f" max {lat[-1] * 1e3:.0f} ms (goal < 500 ms)")
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--preset", default="seed-test-c")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--watch-steps", type=int, default=1000)
    parser.add_argument("--app", default=None, metavar="MODULE:FACTORY",
                        help="the live app to measure (default: the stand-in)")
    parser.add_argument("--only", choices=["throughput", "store", "watch"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    factory = stand_in_app
    if args.app:
        mod, _, fn = args.app.partition(":")
        factory = getattr(importlib.import_module(mod), fn)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.only in (None, "store"):
            bench_store(args, tmp)
        if args.only in (None, "watch"):
            bench_watch_latency(args, tmp)
        if args.only in (None, "throughput"):
            bench_throughput(args, tmp, factory)


if __name__ == "__main__":
    main()
