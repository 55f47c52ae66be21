"""Cost of the triggered capture (issue 38): the spike detectors on every step, and a triggered
capture against a captured step.

Usage: ``python benchmarks/bench_spikes.py [--rounds 10] [--block 50] [--repeats 30]``.

Goals:

* **An unwatched step that does not spike pays ≤ 2 % for the detectors.** Two loops of the
  sample's tiny GPT (``samples/own_loop.py``, about 10 ms a step on one CPU thread), one with a
  :class:`hooks.recorder.spike_watch.SpikeWatch` attached (its hooks on the root module, its
  optimizer step pre-hook: per-parameter gradient norms, their global norm and the loss read
  back in one synchronisation, both detectors), the other without; blocks of ``--block``
  steps interleaved, their order flipped every round; the medians of the blocks' seconds per
  step are compared. Then the same for the built-in trainer (``mdb overfit``'s
  :class:`hooks.train.trainer.Trainer`, the seed's test C model) with ``spikes=True`` against
  ``spikes=False``. The script checks that nothing triggered in the measured steps.
* **A triggered capture costs ≤ 2× a captured step.** A captured step: forward, backward and
  update under :func:`hooks.capture` (what ``watch(every=N)`` records). A triggered step: the
  plain step's forward and backward, then its replay under the capture
  (:func:`hooks.recorder.trigger.replay_step`) with the batch and the story added
  (:func:`hooks.recorder.spike_watch.finish_trace`), then the update. Timed interleaved,
  ``--repeats`` times each; the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "samples"))

from _timing import alternated, interleaved, report  # noqa: E402
from own_loop import TinyGPT  # noqa: E402

from hooks.engine.capture import capture  # noqa: E402
from hooks.recorder.spike_watch import SpikeWatch, finish_trace  # noqa: E402
from hooks.recorder.trigger import Trigger, batch_tensors, replay_step  # noqa: E402


def _data():
    text = (ROOT / "samples" / "alice.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    g = torch.Generator().manual_seed(0)

    def batch(bs: int = 16, seq: int = 32):
        i = torch.randint(len(data) - seq - 1, (bs,), generator=g)
        x = torch.stack([data[j: j + seq] for j in i.tolist()])
        y = torch.stack([data[j + 1: j + seq + 1] for j in i.tolist()])
        return x, y

    return len(chars), batch


def bench_detectors(rounds: int, block: int) -> float:
    """Median seconds per step, own loop with and without the detectors; returns the ratio."""
    vocab, batch = _data()
    sides = {}
    for name in ("plain", "detectors"):
        torch.manual_seed(0)
        model = TinyGPT(vocab, block=32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        watch = None
        if name == "detectors":
            step = [0]
            watch = SpikeWatch(model, opt, next_step=lambda s=step: s[0] + 1,
                               busy=lambda: False, active_capture=lambda: None,
                               capture_options={}, say=print)
            watch.external_step = True  # called below, timed: the same check as the pre-hook
        sides[name] = (model, opt, watch)
    checks: list[float] = []

    def one_block(name: str) -> float:
        model, opt, watch = sides[name]
        batches = [batch() for _ in range(block)]
        t0 = time.perf_counter()
        for x, y in batches:
            _, loss = model(x, y)
            loss.backward()
            if watch is not None:
                tc = time.perf_counter()
                watch.before_update()
                checks.append(time.perf_counter() - tc)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) / block

    times = alternated({n: partial(one_block, n) for n in sides}, rounds, warmup=1)
    fired = sides["detectors"][2].trigger.fired
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["detectors"] / med["plain"]
    print(f"own loop (TinyGPT, {block}-step blocks × {rounds}): plain {med['plain'] * 1e3:.2f} "
          f"ms/step, with the detectors {med['detectors'] * 1e3:.2f} ms/step: ratio "
          f"{ratio:.4f} (goal ≤ 1.02; triggered captures in the measured steps: {fired})")
    check = statistics.median(checks)
    print(f"  the check before each update alone: {check * 1e6:.0f} µs median = "
          f"{check / med['plain']:.2%} of the plain step")
    return ratio


def bench_trainer(rounds: int, block: int) -> float:
    """The built-in trainer (seed's test C), spikes=True against spikes=False."""
    import tempfile

    from hooks.store.store import RunStore
    from hooks.train.overfit import OverfitOptions, OverfitSession, default_overfit_text
    from minillm import load_preset

    sides = {}
    tmp = tempfile.mkdtemp()
    for name in ("off", "on"):
        store = RunStore(Path(tmp) / f"{name}.sqlite", create=True)
        text, source = default_overfit_text()
        session = OverfitSession.create(store, name, OverfitOptions(
            text=text, text_source=source, model_config=load_preset("seed-test-c").to_dict(),
            steps=10**6, every=0, sample_every=0))
        tr = session.trainer
        tr.spikes = tr.spikes if name == "on" else None
        sides[name] = tr

    def one_block(name: str) -> float:
        tr = sides[name]
        t0 = time.perf_counter()
        for _ in range(block):
            tr.train_step()
        return (time.perf_counter() - t0) / block

    times = alternated({n: partial(one_block, n) for n in sides}, rounds, warmup=1)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["on"] / med["off"]
    fired = sides["on"].spikes.trigger.fired
    print(f"mdb overfit's trainer (seed-test-c, {block}-step blocks × {rounds}): spikes off "
          f"{med['off'] * 1e3:.2f} ms/step, on {med['on'] * 1e3:.2f} ms/step: ratio "
          f"{ratio:.4f} (goal ≤ 1.02; triggered captures in the measured steps: {fired})")
    return ratio


def bench_triggered(repeats: int) -> float:
    """A triggered step (step + replay under the capture) against a captured step."""
    vocab, batch = _data()
    torch.manual_seed(0)
    model = TinyGPT(vocab, block=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: same work each time
    x, y = batch()
    trig = Trigger(1, "loss spike", 5.0, 1.0, 3.0, 1.0)

    def captured() -> None:
        with capture(model, step=1):
            _, loss = model(x, y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def triggered() -> None:
        rng = torch.get_rng_state()
        _, loss = model(x, y)
        loss.backward()

        def run_step():
            out = model(x, y)
            out[1].backward()
            return out

        trace, out = replay_step(model, run_step, rng_cpu=rng, rng_cuda=None, training=True,
                                 step=1, meta={})
        finish_trace(trace, trig, batch_tensors((x, y), {}), out, (x, y), {},
                     gradients=None, history=[])
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = interleaved({"captured step": captured, "triggered step": triggered}, repeats)
    med = report(times, "captured step")
    ratio = med["triggered step"] / med["captured step"]
    print(f"triggered capture / captured step: {ratio:.3f} (goal ≤ 2)")
    return ratio


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--block", type=int, default=50)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", choices=("detectors", "trainer", "triggered"), default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.only in (None, "detectors"):
        bench_detectors(args.rounds, args.block)
    if args.only in (None, "trainer"):  # < 250 steps a side: before the spike at step 266
        bench_trainer(args.rounds, max(1, min(args.block, 240 // (args.rounds + 1))))
    if args.only in (None, "triggered"):
        bench_triggered(args.repeats)


if __name__ == "__main__":
    main()
