"""Attention capture cost: ``hooks.capture(attention=True)`` against the same capture without it.

Usage: ``python benchmarks/bench_attention_capture.py [--model minillm|llama|both]
[--batch-size 4] [--seq-len 128] [--repeats 20] [--threads 2] [--mechanism]``.

Goal (issue 9): capture with attention costs <= 1.15x the capture without it, on the default
minillm config and on HF Llama (the default config's sizes: D=256, 4 layers, 8 heads, 2 KV
heads) at 4x128. Both sides run forward + backward, interleaved in one run; medians and the
ratio are printed, with the probabilities' bytes and a check that the recorded probabilities
sum to 1 and that the gradients are identical.

``--mechanism`` adds the measurement behind :mod:`hooks.probes.attention`'s choice: the capture
without attention plus (a) a ``TorchFunctionMode`` that only compares each torch call against
``scaled_dot_product_attention`` and softmax, and (b) no-op wrappers swapped onto
``torch.nn.functional`` / ``torch`` / ``torch.Tensor`` for the step: what each way of
intercepting costs before any probability is computed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _timing import interleaved, report  # noqa: E402


def minillm_model():
    from minillm import MiniLLM, load_preset

    cfg = load_preset("default")
    torch.manual_seed(0)
    return MiniLLM(cfg).train(), cfg.vocab_size


def llama_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from minillm import load_preset

    c = load_preset("default")
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                      intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_hidden_layers,
                      num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads,
                      max_position_embeddings=c.max_position_embeddings)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).train(), c.vocab_size


def mechanism_sides(step):
    """(mode, swap): the capture without attention plus each interception mechanism, no-op."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    sdpa, softmax = F.scaled_dot_product_attention, torch.softmax
    tensor_softmax = torch._C.TensorBase.softmax
    seen = [0]

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is sdpa or func is softmax or func is tensor_softmax:
                seen[0] += 1
            return func(*args, **(kwargs or {}))

    def mode():
        with Mode():
            step(False)

    def swap():
        def w_sdpa(*a, **k):
            seen[0] += 1
            return sdpa(*a, **k)

        def w_softmax(*a, **k):
            seen[0] += 1
            return softmax(*a, **k)

        def w_tensor(self, *a, **k):
            seen[0] += 1
            return tensor_softmax(self, *a, **k)

        F.scaled_dot_product_attention, torch.softmax = w_sdpa, w_softmax
        torch.Tensor.softmax = w_tensor
        try:
            step(False)
        finally:
            F.scaled_dot_product_attention, torch.softmax = sdpa, softmax
            del torch.Tensor.softmax

    return mode, swap


def count_torch_calls(step) -> int:
    from torch.overrides import TorchFunctionMode

    n = [0]

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            n[0] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step(False)
    return n[0]


def bench(name: str, model, vocab: int, args) -> float:
    import hooks

    ids = torch.randint(0, vocab, (args.batch_size, args.seq_len),
                        generator=torch.Generator().manual_seed(0))
    last = {}

    def step(attention: bool) -> None:
        model.zero_grad(set_to_none=True)
        with hooks.capture(model, attention=attention) as trace:
            model(ids, labels=ids).loss.backward()
        last[attention] = trace

    step(False)
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    step(True)
    same = all(torch.equal(ref[n], p.grad) for n, p in model.named_parameters() if n in ref)
    fns = {"capture": lambda: step(False), "capture + attention": lambda: step(True)}
    if args.mechanism:
        mode, swap = mechanism_sides(step)
        fns["capture + no-op TorchFunctionMode"] = mode
        fns["capture + no-op swapped functions"] = swap
    print(f"\n{name}: B={args.batch_size} T={args.seq_len} threads={args.threads} "
          f"repeats={args.repeats} params={sum(p.numel() for p in model.parameters()):,}")
    times = interleaved(fns, repeats=args.repeats)
    med = report(times, baseline="capture")
    ratio = med["capture + attention"] / med["capture"]
    tr = last[True]
    sums = torch.cat([a.probs.sum(-1).reshape(-1) for a in tr.attention])
    print(f"{name}: attention / no attention, wall median {ratio:.3f} (goal <= 1.15); "
          f"min {min(times['capture + attention']) / min(times['capture']):.3f}")
    sources = ", ".join(sorted({a.source for a in tr.attention}))
    print(f"{name}: {len(tr.attention)} attention records ({sources}), "
          f"{sum(a.nbytes() for a in tr.attention) / 1e6:.2f} MB; rows sum to 1 within "
          f"{float((sums - 1).abs().max()):.1e}; gradients identical: {same}")
    if args.mechanism:
        print(f"{name}: torch-function calls per step (what a mode intercepts): "
              f"{count_torch_calls(step):,}")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["minillm", "llama", "both"], default="both")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mechanism", action="store_true",
                        help="also time the two interception mechanisms (no-op)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ratios = {}
    if args.model in ("minillm", "both"):
        ratios["minillm default"] = bench("minillm default", *minillm_model(), args)
    if args.model in ("llama", "both"):
        ratios["HF Llama"] = bench("HF Llama", *llama_model(), args)
    print("\n" + ", ".join(f"{k}: {v:.3f}x" for k, v in ratios.items())
          + f" (goal <= 1.15; median of the two: {statistics.median(ratios.values()):.3f})")


if __name__ == "__main__":
    main()
