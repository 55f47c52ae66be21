"""Peak memory (RSS) of a captured step against the plain step, each in a fresh process.

Usage: ``python benchmarks/bench_capture_memory.py [--runs 5] [--layers 8] [--hidden 512]
[--batch-size 4] [--seq-len 128]``.

Goal (issue 32, item 14): the peak resident set of a process that runs one forward + backward
of an 8-layer d=512 Llama-style model (minillm, dense SwiGLU MLPs, grouped-query attention)
under :func:`hooks.capture` is at most 1.05x that of a process running the same step without
it, on glibc's default allocator (``MALLOC_*`` variables are removed from the children's
environment unless ``--keep-malloc-env``). Each child builds the model, runs one plain step
(warm-up: both sides hold the same gradients and allocator state before the measured step),
then the measured step, plain or captured, and prints ``ru_maxrss``. The sides alternate,
``--runs`` children each; the medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(side: str, layers: int, hidden: int, batch: int, seq: int) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    import hooks
    from minillm import MiniLLM, MiniLLMConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = MiniLLMConfig(vocab_size=4096, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=8, num_key_value_heads=2, num_local_experts=0,
                        max_position_embeddings=max(256, seq))
    model = MiniLLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator()
                        .manual_seed(1))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    step()  # warm-up: the same on both sides
    if side == "capture":
        with hooks.capture(model) as tr:
            step()
        assert tr.params and tr.backward
    else:
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="children per side (default 5)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--keep-malloc-env", action="store_true",
                    help="pass MALLOC_* variables on to the children")
    ap.add_argument("--child", choices=["plain", "capture"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.layers, a.hidden, a.batch_size, a.seq_len)
        return
    env = dict(os.environ)
    if not a.keep_malloc_env:
        for k in [k for k in env if k.startswith("MALLOC_")]:
            del env[k]
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    args = [sys.executable, __file__, "--layers", str(a.layers), "--hidden", str(a.hidden),
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--child"]
    peaks: dict[str, list[float]] = {"plain": [], "capture": []}
    for _ in range(a.runs):
        for side in peaks:
            out = subprocess.run([*args, side], env=env, capture_output=True, text=True,
                                 check=True)
            peaks[side].append(int(out.stdout.split()[-1]) / 1024)
    malloc = {k: v for k, v in env.items() if k.startswith("MALLOC_")}
    print(f"minillm {a.layers} layers, d={a.hidden}, batch {a.batch_size}x{a.seq_len}; "
          f"allocator env: {malloc or 'glibc defaults'}")
    med = {}
    for side, vals in peaks.items():
        med[side] = statistics.median(vals)
        print(f"  {side:8s} peak RSS median {med[side]:7.1f} MiB   "
              f"({', '.join(f'{v:.0f}' for v in vals)})")
    print(f"  ratio capture / plain: {med['capture'] / med['plain']:.3f}x (goal <= 1.05x)")


if __name__ == "__main__":
    main()
