"""PyTorch fast paths that forward hooks turn off: ``nn.TransformerEncoderLayer`` runs one fused
inference kernel only while it has no forward hooks; these helpers find those layers and say
whether a call would have taken that path (used by :class:`hooks.engine.capture.Capture` to note
it)."""

from __future__ import annotations

import torch
from torch import nn


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule has forward or forward pre-hooks (PyTorch's
    ``_forward_hooks`` / ``_forward_pre_hooks``: nn.Module has no public reader of them)."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def fast_path_layers(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module, bool]]:
    """``(name, layer, had forward hooks before the capture)`` of every
    ``nn.TransformerEncoderLayer``."""
    return [
        (name, m, has_forward_hooks(m))
        for name, m in modules
        if isinstance(m, nn.TransformerEncoderLayer)
    ]


def encoder_layer_fast_path_blocker(layer: nn.Module, args: tuple, kwargs: dict) -> str:
    """Why ``nn.TransformerEncoderLayer.forward`` would *not* take its fast path
    (``torch._transformer_encoder_layer_fwd``) for this call if the module had no forward
    hooks; ``""`` when it would. The conditions are PyTorch's own (``TransformerEncoderLayer
    .forward``, torch 2.x), checked in its order, leaving out only "forward pre-/hooks are
    attached to the module"; a test holds them to what PyTorch actually runs."""
    names = ("src", "src_mask", "src_key_padding_mask", "is_causal")
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    src = bound.get("src")
    if not isinstance(src, torch.Tensor):
        return "no tensor src"
    attn = getattr(layer, "self_attn", None)
    norm1, norm2 = getattr(layer, "norm1", None), getattr(layer, "norm2", None)
    if attn is None or norm1 is None or norm2 is None:
        return "not a standard TransformerEncoderLayer"
    masks = bound.get("src_mask") is not None or bound.get("src_key_padding_mask") is not None
    if not torch.backends.mha.get_fastpath_enabled():
        return "torch.backends.mha.get_fastpath_enabled() was not True"
    if src.dim() != 3:
        return "input not batched"
    if layer.training:
        return "training is enabled"
    if not attn.batch_first:
        return "self_attn.batch_first was not True"
    if attn.in_proj_bias is None:
        return "self_attn was passed bias=False"
    # the checks of torch's TransformerEncoderLayer.forward, on the same private names
    if not attn._qkv_same_embed_dim:
        return "self_attn._qkv_same_embed_dim was not True"
    if not getattr(layer, "activation_relu_or_gelu", False):
        return "activation_relu_or_gelu was not True"
    if norm1.eps != norm2.eps:
        return "norm1.eps is not equal to norm2.eps"
    if src.is_nested and masks:
        return "masks are not supported with NestedTensor input"
    if attn.num_heads % 2 == 1:
        return "num_head is odd"
    if torch.is_autocast_enabled():
        return "autocast is enabled"
    tensor_args = (src, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight,
                   attn.out_proj.bias, norm1.weight, norm1.bias, norm2.weight, norm2.bias,
                   layer.linear1.weight, layer.linear1.bias, layer.linear2.weight,
                   layer.linear2.bias)  # fmt: skip
    if torch.overrides.has_torch_function(tensor_args):
        return "some Tensor argument has_torch_function"
    supported = ("cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name)
    if not all(x.device.type in supported for x in tensor_args):
        return "some Tensor argument's device is not supported"
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensor_args):
        return "grad is enabled and a weight or the input requires grad"
    return ""
