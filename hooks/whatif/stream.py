"""Where a decoder-only model's residual stream is: its blocks, each block's attention and output
projection, the final norm and the LM head.

Every what-if experiment that reads or writes the residual stream (the patching sweep,
attribution patching, direct logit attribution, the lens at mid-block) finds these parts through
:func:`stream_parts` alone: by names first, else by the roles recognised from the computation
(:mod:`hooks.modelroles`, which also reads a declaration). The logit lens
(:mod:`hooks.whatif.lens`) reads the same parts.

Dimension legend: L decoder blocks, H query heads, Dh head dim, D hidden size.

Never imports textual, rich or tui.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# the final norm's names beside that list are the roles' name fast path's (one definition)
from hooks.modelroles.named import FINAL_NORM_NAMES

#: Names a decoder-only model gives the list of its blocks (Llama ``layers``, GPT-2 ``h``).
LAYER_LIST_NAMES = ("layers", "h", "blocks", "layer", "decoder_layers")


@dataclass(frozen=True, slots=True)
class LensParts:
    """Where the lens reads a model: its decoder layers, final norm and head (qualified names),
    and what the model does to the head's output (``post``, None when nothing)."""

    layers: list[str]
    norm: str
    head: str
    post: Callable[[torch.Tensor], torch.Tensor] | None
    post_text: str


def _config_value(model: nn.Module, name: str) -> Any:
    return getattr(getattr(model, "config", None), name, None)


def _post_of(model: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, str]:
    """What the model applies to its head's output, read from what it declares (Gemma's
    ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``)."""
    cap = _config_value(model, "final_logit_softcapping")
    if isinstance(cap, (int, float)) and cap:
        return (lambda x: torch.tanh(x / cap) * cap), f"soft-cap {cap:g} · tanh(x / {cap:g})"
    scale = getattr(model, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return (lambda x: x * scale), f"× logit_scale {scale:g}"
    div = _config_value(model, "logits_scaling")
    if isinstance(div, (int, float)) and div and div != 1:
        return (lambda x: x / div), f"÷ logits_scaling {div:g}"
    return None, "none"


def _head_of(model: nn.Module) -> str:
    """The LM head's name: :func:`hooks.modelroles.lm_head_role` (declared, named, traced)."""
    from hooks.modelroles import lm_head_role

    got = lm_head_role(model)
    if isinstance(got, str):
        raise ValueError(f"the logit lens needs an LM head: {got}")
    return got.module


def _blocks(module: nn.Module) -> bool:
    kids = list(module.children())
    return isinstance(module, nn.ModuleList) and bool(kids) and all(
        type(c) is type(kids[0]) for c in kids)


def find_parts(model: nn.Module) -> LensParts:
    """Find a decoder-only model's decoder layers, final norm and LM head.

    The roles are every view's (:mod:`hooks.modelroles`): a declared head and final norm win;
    then the layers are the first ``nn.ModuleList`` of blocks of one class named like
    :data:`LAYER_LIST_NAMES` (``model.layers``, ``transformer.h``, ``model.model.layers``)
    whose parent also holds a final norm named like :data:`FINAL_NORM_NAMES`; the head is
    ``get_output_embeddings()``, else ``lm_head``. Where names fail, the roles traced from one
    forward: the projection whose output is the logits, the norm it reads, and the list of
    blocks (of one class) that holds the final norm's input.

    Raises:
        ValueError: one line saying why not: an encoder-decoder, no list of blocks, no final
            norm, no LM head (with the line that declares the one missing).
    """
    from hooks.batch import is_encoder_decoder
    from hooks.modelroles import declared_roles

    kind = type(model).__name__
    if is_encoder_decoder(model):
        raise ValueError(f"{kind} is an encoder-decoder model: the logit lens reads the "
                         "residual stream of a decoder-only model")
    modules = dict(model.named_modules())
    head = _head_of(model)
    declared = declared_roles(model).final_norm
    lists = [n for n, m in modules.items()
             if n.rpartition(".")[2] in LAYER_LIST_NAMES and _blocks(m)]
    if declared is None:
        for name in lists:
            parent = name.rpartition(".")[0]
            prefix = f"{parent}." if parent else ""
            for norm in FINAL_NORM_NAMES:
                if prefix + norm in modules:
                    return _parts(model, modules, name, prefix + norm, head)
    return _parts_by_role(model, modules, lists, head)


def _parts(model: nn.Module, modules: dict[str, nn.Module], layers: str, norm: str,
           head: str) -> LensParts:
    post, text = _post_of(model)
    return LensParts([f"{layers}.{c}" for c, _ in modules[layers].named_children()], norm, head,
                     post, text)


def _parts_by_role(model: nn.Module, modules: dict[str, nn.Module], lists: list[str],
                   head: str) -> LensParts:
    """The lens's parts when names give no final norm beside the blocks: the declared or
    traced final norm (:func:`hooks.modelroles.final_norm_role`) and the list of blocks beside
    it (any name), else the first list named like one."""
    from hooks.modelroles import final_norm_role

    kind = type(model).__name__
    got = final_norm_role(model)
    if isinstance(got, str):
        raise ValueError(f"the logit lens would read the residual stream without the norm the "
                         f"head expects: {got}")
    parent = got.module.rpartition(".")[0]
    beside = [n for n, m in modules.items() if n.rpartition(".")[0] == parent and _blocks(m)]
    found = beside[:1] or (lists[:1] if got.how == "declared" else [])
    if found:
        return _parts(model, modules, found[0], got.module, head)
    if lists:  # a norm elsewhere (BERT's head transform) is not the blocks' final norm
        raise ValueError(f"{kind} has no final norm beside {lists[0]} (looked for "
                         f"{', '.join(FINAL_NORM_NAMES)}, and the head reads {got.module}, "
                         "which is not beside the blocks): the logit lens would read the "
                         "residual stream without the norm the head expects; if one is, "
                         f"declare it: hooks.roles(model, final_norm='NAME')")
    raise ValueError(f"{kind} has no list of decoder blocks (an nn.ModuleList of blocks of "
                     f"one class beside {got.module}, or named {', '.join(LAYER_LIST_NAMES)}): "
                     "the logit lens has no layers to read")


def output_logits(output: Any) -> torch.Tensor | None:
    """The model's (B, T, V) logits: ``output.logits``, ``output["logits"]``, the first 3-D
    float tensor of a tuple, or the output itself."""
    cand = getattr(output, "logits", None)
    if cand is None and isinstance(output, dict):
        cand = output.get("logits")
    if cand is None and isinstance(output, (tuple, list)):
        cand = next((x for x in output if isinstance(x, torch.Tensor) and x.dim() == 3), None)
    if cand is None and isinstance(output, torch.Tensor):
        cand = output
    if isinstance(cand, torch.Tensor) and cand.dim() == 3 and cand.is_floating_point():
        return cand
    return None





@dataclass(frozen=True)
class BlockParts:
    """One decoder block's attention, as the head-level experiments need it.

    Attributes:
        name: the block's qualified name.
        attention: the attention module's qualified name, None when none is recognised.
        out_proj: its output projection's qualified name (input: the heads' outputs concatenated,
            (…, H·Dh)), None when none.
        heads: H, None when not known.
        head_dim: Dh, None when not known.
        why: why ``attention`` or ``out_proj`` is None (one phrase), else ``""``.
    """

    name: str
    attention: str | None
    out_proj: str | None
    heads: int | None
    head_dim: int | None
    why: str = ""


@dataclass(frozen=True)
class StreamParts:
    """The residual stream's parts of a model (qualified names; see :func:`stream_parts`).

    Attributes:
        blocks: one :class:`BlockParts` per decoder block, in order (L of them).
        norm: the final norm's name.
        head: the LM head's name.
        post: what the model applies after the head (a callable on the logits), or None.
        post_text: that in words (``"none"`` when nothing).
    """

    blocks: list[BlockParts]
    norm: str
    head: str
    post: object
    post_text: str

    @property
    def layers(self) -> list[str]:
        """The blocks' names."""
        return [b.name for b in self.blocks]


def block_parts(model: nn.Module, name: str, block: nn.Module) -> BlockParts:
    """The attention parts of block ``block`` named ``name`` of ``model``: its first child that
    plays the attention role (:func:`hooks.modelroles.attention_role`: declared, named, or
    traced from one forward), with its output projection, H and Dh."""
    from hooks.modelroles import attention_role

    why = "no attention module recognised among its children"
    for child, _m in block.named_children():
        got = attention_role(model, f"{name}.{child}")
        if isinstance(got, str):
            continue
        if got.o is None or not got.num_heads or not got.head_dim:
            why = f"{name}.{child}: its output projection or head count is unknown"
            continue
        o = got.o if got.o.startswith(f"{name}.{child}.") else f"{name}.{child}.{got.o}"
        return BlockParts(name, f"{name}.{child}", o, got.num_heads, got.head_dim)
    return BlockParts(name, None, None, None, None, why)


def stream_parts(model: nn.Module) -> StreamParts:
    """Find a decoder-only model's blocks, final norm and LM head (by
    :func:`find_parts`), and each block's attention module and output projection
    (:func:`block_parts`: the roles every view reads, :mod:`hooks.modelroles`).

    Raises:
        ValueError: one line, from :func:`find_parts` (no blocks, no final norm, no head, an
            encoder-decoder).
    """
    parts = find_parts(model)
    modules = dict(model.named_modules())
    blocks = [block_parts(model, n, modules[n]) for n in parts.layers]
    return StreamParts(blocks, parts.norm, parts.head, parts.post, parts.post_text)


__all__ = ["FINAL_NORM_NAMES", "LAYER_LIST_NAMES", "BlockParts", "LensParts", "StreamParts",
           "block_parts", "find_parts", "output_logits", "stream_parts"]
