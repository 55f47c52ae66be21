"""minillm: a small Llama/Mixtral-style decoder (RMSNorm, RoPE, GQA, SwiGLU, top-k MoE).

Pure PyTorch; module and config names follow Hugging Face's Llama/Mixtral so that
``model.layers[0].self_attn.q_proj.weight`` means the same thing here. Checked against HF
transformers in ``tests/``.

The model (:mod:`minillm.model`, which imports torch) loads on first use of ``MiniLLM``,
``MiniLLMOutput`` or ``PastKeyValues``: reading a config (``mdb compare`` of stored runs) does
not import torch.
"""

from minillm.config import MiniLLMConfig, default_intermediate_size
from minillm.presets import PRESETS, list_presets, load_preset
from minillm.tokenizer import ByteTokenizer, CharTokenizer

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "CharTokenizer",
    "MiniLLM",
    "MiniLLMConfig",
    "MiniLLMOutput",
    "PastKeyValues",
    "default_intermediate_size",
    "list_presets",
    "load_preset",
]


def __getattr__(name: str):
    """``MiniLLM``, ``MiniLLMOutput``, ``PastKeyValues``: loaded from :mod:`minillm.model` (and
    torch) on first use."""
    if name in ("MiniLLM", "MiniLLMOutput", "PastKeyValues"):
        import minillm.model as model

        value = getattr(model, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")
