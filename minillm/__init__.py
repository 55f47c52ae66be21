"""minillm: a small Llama/Mixtral-style decoder (RMSNorm, RoPE, GQA, SwiGLU, top-k MoE).

Pure PyTorch; module and config names follow Hugging Face's Llama/Mixtral so that
``model.layers[0].self_attn.q_proj.weight`` means the same thing here. Checked against HF
transformers in ``tests/``.
"""

from minillm.config import MiniLLMConfig, default_intermediate_size
from minillm.model import MiniLLM, MiniLLMOutput, PastKeyValues
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
