"""What kind of model the doctor examines: decoder-only, bidirectional encoder,
encoder-decoder, or not a sequence model, and how that was determined.

The kind decides which checks apply (a bidirectional encoder has no causal mask to test) and how
the logits line up with the tokens (next-token for a decoder, same position for a masked LM).
It comes from what the model and its batch declare, in this order, never from a silent guess:

1. the batch: no (B, T) integer token ids -> ``other`` (not a sequence model);
2. the config: ``is_encoder_decoder`` (or a forward taking ``decoder_input_ids``) ->
   ``encoder-decoder``; ``is_decoder = True`` -> ``decoder``;
3. the class: minillm's, or an HF causal-LM class (``transformers``'
   ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, e.g. ``LlamaForCausalLM``, ``GPT2LMHeadModel``) ->
   ``decoder``; a masked-LM class
   (``BertForMaskedLM``) -> ``encoder``;
4. the attention modules: all of them set ``is_causal = True`` -> ``decoder``; all ``False``
   -> ``encoder`` (HF sets it on every attention module);
5. the targets (:meth:`hooks.Batch.target_layout`): ``labels == input_ids`` or next-token
   ``targets`` -> ``decoder``; masked-LM labels -> ``encoder``;
6. otherwise ``unknown``: the causality check then measures it and says so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from torch import nn

from hooks.batch import Batch, is_encoder_decoder

KINDS = ("decoder", "encoder", "encoder-decoder", "other", "unknown")


@dataclass(frozen=True)
class ModelKind:
    """The kind of model and why.

    Attributes:
        kind: one of :data:`KINDS`.
        reason: what says so, e.g. ``HF LlamaForCausalLM is a causal LM``.
        source: ``batch``, ``config``, ``class``, ``attention``, ``targets`` or ``none``.
    """

    kind: str
    reason: str
    source: str

    @property
    def label(self) -> str:
        """``decoder-only`` / ``bidirectional encoder`` / ``encoder-decoder`` / ..."""
        return {"decoder": "decoder-only", "encoder": "bidirectional encoder",
                "encoder-decoder": "encoder-decoder", "other": "not a sequence model",
                "unknown": "sequence model of unknown kind"}[self.kind]

    def describe(self) -> str:
        """``decoder-only (HF LlamaForCausalLM is a causal LM)``."""
        return f"{self.label} ({self.reason})"

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "label": self.label, "reason": self.reason,
                "source": self.source}


def _hf_class_kind(model: nn.Module) -> tuple[str, str] | None:
    """(kind, class name) from transformers' auto mappings, only for transformers' classes and
    only when transformers is already imported (never imported here)."""
    if not type(model).__module__.startswith("transformers.") or "transformers" not in sys.modules:
        return None
    try:
        from transformers.models.auto import modeling_auto as auto
    except Exception:  # pragma: no cover - a transformers without the mappings
        return None

    def names(mapping: Any) -> set[str]:
        out: set[str] = set()
        for v in mapping.values():
            out.update(v if isinstance(v, (tuple, list)) else (v,))
        return out

    causal = names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    masked = names(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    for cls in type(model).__mro__:
        if cls.__name__ in causal:
            return "decoder", cls.__name__
        if cls.__name__ in masked and cls.__name__ not in causal:
            return "encoder", cls.__name__
    return None


def _attention_causal_flags(model: nn.Module) -> tuple[set[bool], str | None]:
    flags: set[bool] = set()
    first = None
    for _, m in model.named_modules():
        cls = type(m).__name__
        if ("Attention" in cls or "Attn" in cls) and isinstance(getattr(m, "is_causal", None),
                                                                 bool):
            flags.add(m.is_causal)
            first = first or cls
    return flags, first


def detect_kind(model: nn.Module, batch: Batch) -> ModelKind:
    """The :class:`ModelKind` of ``model`` run on ``batch`` (see the module docstring)."""
    ids = batch.ids(model)
    if ids is None:
        return ModelKind("other", f"the batch has no (B, T) integer token ids "
                         f"({batch.describe(model)})", "batch")
    cfg = getattr(model, "config", None)
    if is_encoder_decoder(model):
        why = ("config.is_encoder_decoder = True" if getattr(cfg, "is_encoder_decoder", None)
               else "its forward takes decoder_input_ids")
        return ModelKind("encoder-decoder", f"{type(model).__name__}: {why}", "config")
    if getattr(cfg, "is_decoder", None) is True:
        return ModelKind("decoder", f"{type(model).__name__}: config.is_decoder = True",
                         "config")
    if type(model).__module__.split(".")[0] == "minillm":
        return ModelKind("decoder", f"minillm's {type(model).__name__} is a causal LM", "class")
    hf = _hf_class_kind(model)
    if hf is not None:
        kind, cls = hf
        what = "a causal LM" if kind == "decoder" else "a masked LM"
        return ModelKind(kind, f"HF {cls} is {what}", "class")
    flags, cls = _attention_causal_flags(model)
    if len(flags) == 1:
        causal = flags.pop()
        return ModelKind("decoder" if causal else "encoder",
                         f"its attention modules ({cls}) set is_causal = {causal}", "attention")
    layout = batch.target_layout(model)
    if layout.kind in ("aligned", "shifted"):
        return ModelKind("decoder", layout.describe(), "targets")
    if layout.kind == "masked":
        return ModelKind("encoder", layout.describe(), "targets")
    what = "no targets" if layout.kind == "none" else layout.describe()
    return ModelKind("unknown", f"nothing declares it: no causal-LM class or config, {what}",
                     "none")
