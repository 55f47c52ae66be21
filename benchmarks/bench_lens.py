"""Logit lens cost: ``hooks.logit_lens`` against one forward pass of the same model and batch.

Usage: ``python benchmarks/bench_lens.py [--preset default] [--batch-size 2] [--seq-len 64]
[--repeats 30] [--threads 1]``.

Bound (issue 22): ``hooks.logit_lens`` on the default model (what ``mdb step`` builds: minillm
default, 2×64 of samples/alice.txt) costs <= 1.5x one forward. Both sides run without autograd
(the lens needs no gradients; ``torch.no_grad`` forward), interleaved in one run; the medians
and the ratio are printed, with the forward under autograd as a second reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _timing import interleaved, preset_workload, report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import hooks

    workload = preset_workload(args.preset, args.batch_size, args.seq_len)
    model, batch = workload.model, workload.batch

    def forward():
        with torch.no_grad():
            batch.call(model)

    def forward_grad():
        batch.call(model)

    def lens():
        hooks.logit_lens(model, batch)

    times = interleaved({"forward (no_grad)": forward, "forward (autograd)": forward_grad,
                         "hooks.logit_lens": lens}, repeats=args.repeats)
    print(f"{workload.description} · threads {args.threads} · repeats {args.repeats}")
    report(times, "forward (no_grad)")
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["hooks.logit_lens"] / med["forward (no_grad)"]
    verdict = "met" if ratio <= 1.5 else "NOT met"
    print(f"logit lens / forward: {ratio:.3f} (bound <= 1.5: {verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
