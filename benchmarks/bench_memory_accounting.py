"""What memory accounting adds to a capture: ``hooks.capture(model)`` (``memory=True``, the
default) against ``hooks.capture(model, memory=False)``, one forward + backward each.

Usage: ``python benchmarks/bench_memory_accounting.py [--presets tiny seed-test-c default]
[--batch-size 2] [--seq-len 64] [--repeats 40] [--threads 1]``.

Goal (issue 37): memory accounting (saved-tensor hooks, per-call bytes, the timeline, the
parameter, gradient and optimizer-state bytes) adds at most 10% to a capture. Both sides are
timed interleaved in one run (:func:`_timing.interleaved`), per preset; the median ratio is
printed, with the plain step (no capture) beside them for scale. On a machine loaded by other
work the wall clock swings more than the effect; ``--cpu`` times each call by this thread's CPU
time (``time.thread_time``) instead, which the other work disturbs less. Each side also checks
what it measured: the memory side has a ``trace.memory``, the other none.

A fourth side, "floor: alias + version hooks", bounds what any accounting built on
``torch.autograd.graph.saved_tensors_hooks`` costs: the capture without memory, inside saved-tensor
hooks that do only what such hooks must (pack: ``(t.detach(), t._version)``, so that a saved
output does not hold its own ``grad_fn``; unpack: autograd's version check, which autograd
skips once hooks are installed), and count nothing. Its ratio is printed beside the goal.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _timing import interleaved, preset_workload, report  # noqa: E402


def sides(preset: str, batch: int, seq: int) -> dict:
    """The three callables timed for ``preset``: plain step, capture without and with memory."""
    import hooks

    wl = preset_workload(preset, batch, seq)
    model, b = wl.model, wl.batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        b.call(model).loss.backward()

    def cap(memory: bool) -> None:
        model.zero_grad(set_to_none=True)
        with hooks.capture(model, memory=memory, optimizer=opt) as tr:
            b.call(model).loss.backward()
        assert (tr.memory is not None) == memory

    def floor() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(_alias, _checked), \
                hooks.capture(model, memory=False, optimizer=opt):
            b.call(model).loss.backward()

    return {"plain step": plain, "capture, memory=False": lambda: cap(False),
            "capture, memory=True": lambda: cap(True), FLOOR: floor}


FLOOR = "floor: alias + version hooks"


def _alias(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    return t.detach(), t._version


def _checked(saved: tuple[torch.Tensor, int]) -> torch.Tensor:
    t, version = saved
    if t._version != version:
        raise RuntimeError("a saved tensor was modified in place")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "seed-test-c", "default"])
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu", action="store_true",
                    help="time by this thread's CPU time, not the wall clock")
    a = ap.parse_args()
    clock = time.thread_time if a.cpu else time.perf_counter
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), batch {a.batch_size}×{a.seq_len}, "
          f"{a.repeats} interleaved repeats per side, "
          f"{'CPU time of this thread' if a.cpu else 'wall clock'}")
    for preset in a.presets:
        print(f"\npreset {preset}")
        fns = sides(preset, a.batch_size, a.seq_len)
        med = report(interleaved(fns, a.repeats, clock=clock), "capture, memory=False")
        ratio = med["capture, memory=True"] / med["capture, memory=False"]
        print(f"  memory accounting: {ratio:.3f}x a capture without it (goal <= 1.10x); the "
              f"floor of saved-tensor hooks: {med[FLOOR] / med['capture, memory=False']:.3f}x")


if __name__ == "__main__":
    main()
