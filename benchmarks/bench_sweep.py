"""Patching sweep cost: ``hooks.patch_sweep`` against TransformerLens's
``patching.get_act_patch_resid_pre`` on the same model, batch and metric.

Usage: ``python benchmarks/bench_sweep.py [--family gpt2|llama|both] [--layers 4] [--hidden 128]
[--seq-len 24] [--batch-size 1] [--repeats 7] [--threads 1]``.

Bound (issue 36): faster than TransformerLens. Both sides sweep L layers × T positions of the
residual stream (TransformerLens the block inputs, mdb the block outputs: the same number of
patched runs), the metric the next-token loss of the clean batch, on a model built tiny from a
config (random weights, no hub) and, for TransformerLens, its ``TransformerBridge`` around a copy
of it (``build_bridge_from_module``). The clean cache of TransformerLens is computed once outside
the timing (its API takes it as an argument); mdb records its clean run inside. Timed interleaved
in one run; the medians and the ratio are printed. Needs the ``test`` extra (transformer-lens).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _timing import interleaved, report  # noqa: E402

ARCH = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


def build(family: str, layers: int, hidden: int, vocab: int = 512):
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers,
                                      n_head=4, n_positions=128)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=hidden * 3, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval()


def bench(family: str, args) -> float:
    from transformer_lens import patching
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    import hooks

    model = build(family, args.layers, args.hidden)
    bridge = build_bridge_from_module(copy.deepcopy(model), ARCH[family], hf_config=model.config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (args.batch_size, args.seq_len), generator=g)
    x = ids.clone()
    x[:, args.seq_len // 3] = (x[:, args.seq_len // 3] + 7) % 512

    def metric(logits):
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                               ids[:, 1:].reshape(-1))

    _, cache = bridge.run_with_cache(ids)

    def tl():
        with torch.no_grad():
            return patching.get_act_patch_resid_pre(bridge, x, cache, metric)

    def mdb():
        return hooks.patch_sweep(model, {"input_ids": ids}, {"input_ids": x})

    # the two agree where they patch the same tensor (mdb's block l output is TL's resid_pre l+1)
    got, ref = mdb().values, tl()
    err = float((got[:-1] - ref[1:]).abs().max())
    print(f"{family}: L={args.layers} D={args.hidden} B={args.batch_size} T={args.seq_len}: "
          f"max |mdb - TransformerLens| on the shared cells {err:.2e}")
    times = interleaved({"transformer_lens": tl, "mdb patch_sweep": mdb}, args.repeats, warmup=1)
    med = report(times, "transformer_lens")
    return med["mdb patch_sweep"] / med["transformer_lens"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("gpt2", "llama", "both"), default="both")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # TransformerLens's progress bar
    torch.set_num_threads(args.threads)
    families = ["gpt2", "llama"] if args.family == "both" else [args.family]
    ratios = {f: bench(f, args) for f in families}
    for f, r in ratios.items():
        print(f"{f}: mdb / TransformerLens median time ratio {r:.3f} "
              f"({'faster' if r < 1 else 'SLOWER'})")
    return 0 if all(r < 1 for r in ratios.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
