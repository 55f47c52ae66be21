"""What finding MoE blocks from their computation (``hooks.probes.routing_ops``) costs a capture.

Usage: ``python benchmarks/bench_routing_found.py [--preset tiny] [--batch-size 2] [--seq-len 64]
[--repeats 30] [--threads 1]``.

All sides are timed in one run, interleaved (``_timing.interleaved``), each a forward+backward
step:

* on the preset's minillm model (whose blocks have an ``experts`` child, read by the registered
  block probe): the step, the captured step with blocks found by name and declaration only
  (``found_blocks`` replaced by one that finds none: what the capture did before), and the
  captured step as it is (the cached structural walk runs; no ``topk`` is watched). The two
  captures must cost the same;
* ``ExpertsRouting.attach`` alone on that model, both ways (microseconds per capture);
* on an MoE of one's own (``tests/hooks/roles/own_models.py``: router ``scorer``, experts
  ``ffns`` called one by one): the step, the capture without the found blocks (no routing
  recorded) and the capture with them (the ``topk`` watched in each block).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _timing import interleaved, report  # noqa: E402

import hooks  # noqa: E402
from hooks.probes import routing  # noqa: E402
from hooks.probes.base import probes_for  # noqa: E402
from hooks.tensors.walk import named_modules  # noqa: E402


@contextmanager
def names_only():
    """The capture as it was: MoE blocks by name and declaration only."""
    found = routing.found_blocks
    routing.found_blocks = lambda modules: []
    try:
        yield
    finally:
        routing.found_blocks = found


def sides(model, step) -> dict:
    def captured():
        with hooks.capture(model):
            step()

    def old():
        with names_only(), hooks.capture(model):
            step()

    return {"step": step, "capture, names only": old, "capture, + found": captured}


class _Host:
    recording = True

    def add_routing(self, rec):
        pass

    def has_routing(self, module, call_index):
        return False

    def add_note(self, note):
        pass


def attach_sides(model) -> dict:
    def attach():
        mods = named_modules(model)
        for h in routing.ExpertsRouting(_Host()).attach(mods, probes_for):
            h.remove()

    def attach_old():
        with names_only():
            attach()

    return {"attach, names only": attach_old, "attach, + found": attach}


def minillm_step(preset: str, b: int, t: int):
    from minillm import MiniLLM, load_preset

    cfg = load_preset(preset)
    torch.manual_seed(0)
    model = MiniLLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (b, t))

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    return model, step


def own_moe_step(b: int, t: int):
    from tests.hooks.roles import own_models as om

    model, _ = om.own_moe()
    ids = om.ids(b, min(t, om.T))

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, ids)[1].backward()

    return model, step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"preset={a.preset} B={a.batch_size} T={a.seq_len} threads={a.threads} "
          f"repeats={a.repeats}")
    model, step = minillm_step(a.preset, a.batch_size, a.seq_len)
    med = report(interleaved(sides(model, step), a.repeats), "step")
    print(f"capture + found / capture names only (minillm {a.preset}): "
          f"{med['capture, + found'] / med['capture, names only']:.3f}")
    cpu = interleaved(sides(model, step), a.repeats, clock=time.process_time)
    c = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"  process CPU medians: step {c['step'] * 1e3:.2f} ms, names only "
          f"{c['capture, names only'] * 1e3:.2f} ms, + found {c['capture, + found'] * 1e3:.2f} ms"
          f" (ratio {c['capture, + found'] / c['capture, names only']:.3f})")
    at = interleaved(attach_sides(model), a.repeats * 20)
    m = {k: statistics.median(v) * 1e6 for k, v in at.items()}
    print(f"ExpertsRouting.attach medians: names only {m['attach, names only']:.1f} us, "
          f"+ found {m['attach, + found']:.1f} us")
    own, own_step = own_moe_step(a.batch_size, a.seq_len)
    print("MoE of one's own (scorer + ffns, tests/hooks/roles/own_models.py):")
    report(interleaved(sides(own, own_step), a.repeats), "step")
    with hooks.capture(own) as tr:
        own_step()
    print(f"  routing records with the found blocks: {len(tr.routing)}")


if __name__ == "__main__":
    main()
