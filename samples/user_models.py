"""Examples for ``--model FILE:FUNCTION``: each function returns ``(model, batch)``.

    mdb step    --model samples/user_models.py:hf_mixtral
    mdb summary --model samples/user_models.py:small_cnn
    mdb doctor  --model samples/user_models.py:hf_llama

``batch`` is a tensor (passed as the first argument), a tuple of positional arguments or a dict
of keyword arguments. The loss is ``output.loss`` when the model returns one; otherwise mdb
differentiates the mean of the output.
"""

from __future__ import annotations

import torch
from torch import nn


def _ids(vocab: int, batch: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def hf_mixtral():
    """A small HF ``MixtralForCausalLM`` built from a config (no download; needs transformers)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128, output_router_logits=True)
    ids = _ids(256)
    return MixtralForCausalLM(config), {"input_ids": ids, "labels": ids}


def hf_llama():
    """A small HF ``LlamaForCausalLM`` built from a config (needs transformers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    ids = _ids(256)
    return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def small_cnn():
    """Not a language model at all: a CNN on random 28×28 images (no loss: mdb uses the mean)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(16, 10),
    )
    return model, torch.randn(4, 1, 28, 28)
