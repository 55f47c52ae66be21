"""minillm vs HF ``MixtralForCausalLM``: forward + backward time of the same config and weights.

Usage: ``python benchmarks/bench_model.py [--batch-size 4] [--seq-len 128] [--repeats 30]``.
Goal (issue 2): minillm ≤ 0.8 × HF's time on a 2-core CPU. Prints medians and the ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved, report  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--hf-experts",
        default="grouped_mm",
        choices=["grouped_mm", "eager", "batched_mm"],
        help="HF's experts implementation (transformers 5 defaults to grouped_mm)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import MixtralConfig, MixtralForCausalLM

    from minillm import MiniLLM, MiniLLMConfig

    ours_cfg = MiniLLMConfig()
    hf_cfg = MixtralConfig(
        vocab_size=ours_cfg.vocab_size,
        hidden_size=ours_cfg.hidden_size,
        intermediate_size=ours_cfg.intermediate_size,
        num_hidden_layers=ours_cfg.num_hidden_layers,
        num_attention_heads=ours_cfg.num_attention_heads,
        num_key_value_heads=ours_cfg.num_key_value_heads,
        num_local_experts=ours_cfg.num_local_experts,
        num_experts_per_tok=ours_cfg.num_experts_per_tok,
        max_position_embeddings=ours_cfg.max_position_embeddings,
        rms_norm_eps=ours_cfg.rms_norm_eps,
        rope_theta=ours_cfg.rope_theta,
        router_aux_loss_coef=ours_cfg.router_aux_loss_coef,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = MixtralForCausalLM(hf_cfg).train()
    if hasattr(hf.config, "_experts_implementation"):
        hf.config._experts_implementation = args.hf_experts
    ours = MiniLLM.from_hf(hf).train()
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())

    ids = torch.randint(0, ours_cfg.vocab_size, (args.batch_size, args.seq_len))

    def step_ours() -> None:
        ours.zero_grad(set_to_none=True)
        ours(ids, labels=ids).loss.backward()

    def step_hf() -> None:
        hf.zero_grad(set_to_none=True)
        hf(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()

    with torch.no_grad():
        diff = (ours(ids).logits - hf(input_ids=ids).logits).abs().max().item()
    print(
        f"config: default (19.8M params), batch {args.batch_size} x seq {args.seq_len}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, HF experts "
        f"{getattr(hf.config, '_experts_implementation', 'n/a')}; max |logit diff| {diff:.2e}"
    )
    times = interleaved(
        {"minillm fwd+bwd": step_ours, "HF Mixtral fwd+bwd": step_hf}, repeats=args.repeats
    )
    med = report(times, baseline="HF Mixtral fwd+bwd")
    print(
        f"RATIO minillm/HF = {med['minillm fwd+bwd'] / med['HF Mixtral fwd+bwd']:.3f} (goal <= 0.8)"
    )


if __name__ == "__main__":
    main()
