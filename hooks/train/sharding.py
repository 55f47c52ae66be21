"""How ``mdb overfit --nproc N --fsdp`` / ``--tp`` shards minillm, and the global gradient norm
of a sharded model. Used by :mod:`hooks.train.ddp_overfit`.

* :func:`shard_fsdp`: FSDP2 as torchtitan applies it: ``fully_shard`` on every decoder layer,
  then on the root (one all-gather per layer in forward and backward, one reduce-scatter per
  layer in backward; the gradients are averaged over the ranks, as DDP's). An expert that
  receives no token on a rank gets a zero gradient there, as with DDP.
* :func:`shard_tp`: Megatron-style tensor parallelism with ``parallelize_module``: in each
  layer the query projection and the MLPs' ``gate_proj``/``up_proj`` (every expert's) are
  ``ColwiseParallel``, ``o_proj`` and ``down_proj`` ``RowwiseParallel``; the key/value
  projections too when the KV heads divide among the ranks (else they stay replicated, as
  with a single KV head, and the gradient of their outputs is summed over the ranks); the
  attention then has ``heads / N`` local query heads.
  Embeddings, norms, the router and the LM head stay replicated plain tensors.
* :func:`global_grad_norm`: the L2 norm of all gradients of the job: DTensor pieces' sums of
  squares counted once per element (a ``Replicate`` mesh dimension on coordinate 0 only),
  summed across the mesh in one ``all_reduce``; plain gradients (replicated) added once.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hooks.sharded.stats import is_dtensor

__all__ = ["ExpertUse", "global_grad_norm", "shard_fsdp", "shard_tp"]


def _layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("the model has no model.layers (a minillm MiniLLM is expected)")
    return list(layers)


def shard_fsdp(model: nn.Module, mesh: Any) -> nn.Module:
    """``fully_shard`` every decoder layer of ``model`` (a minillm ``MiniLLM``) and the root
    on the 1-D ``mesh``; return ``model`` (sharded in place: its parameters become DTensors
    ``Shard(0)``, names unchanged)."""
    from torch.distributed.fsdp import fully_shard

    for layer in _layers(model):
        for m in layer.modules():
            if isinstance(getattr(m, "experts", None), nn.ModuleList):
                m.register_forward_hook(_every_expert_in_graph)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class ExpertUse:
    """Which experts of ``model`` ran during a step, on any rank: after backward,
    :meth:`drop_unused` leaves the gradient of an expert that no rank's tokens reached as
    ``None`` (what DDP with ``find_unused_parameters`` does, so that AdamW skips it), where
    :func:`shard_fsdp`'s zero gradient would let the optimizer move it (momentum, weight
    decay)."""

    def __init__(self, model: nn.Module, mesh: Any) -> None:
        self.mesh = mesh
        self.experts = [e for m in model.modules()
                        if isinstance(getattr(m, "experts", None), nn.ModuleList)
                        for e in m.experts]
        self.used = torch.zeros(len(self.experts))
        for i, e in enumerate(self.experts):
            e.register_forward_pre_hook(lambda *_, i=i: self.used.__setitem__(i, 1.0))

    def drop_unused(self) -> None:
        """Set to ``None`` the gradients of the experts no rank used since the last call
        (one ``all_reduce`` over the mesh: every rank must call it)."""
        import torch.distributed as dist

        if not self.experts:
            return
        used = self.used.clone()
        self.used.zero_()
        for d in range(self.mesh.ndim):
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.mesh.get_group(d))
        for e, u in zip(self.experts, used.tolist(), strict=True):
            if not u:
                for p in e.parameters():
                    p.grad = None


def _every_expert_in_graph(block: nn.Module, args: Any, output: Any) -> Any:
    """An MoE block's output plus an exact 0 that depends on every expert's parameters (the
    sum of an empty slice of each): an expert that no token of this rank reached gets a zero
    gradient instead of none, so that every rank reduce-scatters the same gradients (DDP's
    ``find_unused_parameters`` does the same for DDP)."""
    zero = sum(p.reshape(-1)[:0].sum() for p in block.experts.parameters())
    if isinstance(output, tuple):
        return (output[0] + zero, *output[1:])
    return output + zero


def shard_tp(model: nn.Module, mesh: Any) -> nn.Module:
    """Tensor-parallel ``model`` (a minillm ``MiniLLM``) over the 1-D ``mesh`` (see the module
    docstring); return it.

    Raises:
        ValueError: the query heads, or an MLP's intermediate size, do not divide by the
            mesh's size.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = mesh.size()
    for layer in _layers(model):
        attn = layer.self_attn
        if attn.num_heads % tp:
            raise ValueError(f"{attn.num_heads} attention heads do not divide among {tp} ranks")
        plan: dict[str, Any] = {"self_attn.q_proj": ColwiseParallel(),
                                "self_attn.o_proj": RowwiseParallel()}
        kv_split = attn.num_key_value_heads % tp == 0
        if kv_split:
            plan["self_attn.k_proj"] = ColwiseParallel()
            plan["self_attn.v_proj"] = ColwiseParallel()
        for name, m in layer.named_modules():
            if hasattr(m, "gate_proj") and hasattr(m, "down_proj"):
                if m.down_proj.in_features % tp:
                    raise ValueError(f"{name}: intermediate size {m.down_proj.in_features} "
                                     f"does not divide among {tp} ranks")
                plan[f"{name}.gate_proj"] = ColwiseParallel()
                plan[f"{name}.up_proj"] = ColwiseParallel()
                plan[f"{name}.down_proj"] = RowwiseParallel()
        parallelize_module(layer, mesh, plan)
        attn.num_heads //= tp
        if kv_split:
            attn.num_key_value_heads //= tp
        else:  # replicated K/V feed this rank's query heads only: sum their gradients
            group = mesh.get_group(0)
            for proj in (attn.k_proj, attn.v_proj):
                proj.register_forward_hook(
                    lambda m, a, out, group=group: _SumGradient.apply(out, group))
        attn.num_key_value_groups = attn.num_heads // attn.num_key_value_heads
    return model


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (Megatron's ``f``): a
    replicated tensor read by every rank's own query heads gets the gradient of all heads."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def global_grad_norm(grads: Sequence[torch.Tensor]) -> float:
    """The L2 norm of the job's gradients (see the module docstring): the same number on every
    rank; NaN when a gradient holds NaN. Every rank of the gradients' mesh must call it."""
    import torch.distributed as dist

    plain = [g.detach() for g in grads if not is_dtensor(g)]
    sharded = [g for g in grads if is_dtensor(g)]
    total = sum(float(torch.dot(g.reshape(-1).float(), g.reshape(-1).float())) for g in plain)
    if sharded:
        mesh = sharded[0].device_mesh
        coord = mesh.get_coordinate() or [0] * mesh.ndim
        parts = []
        for g in sharded:
            keep = all(not p.is_replicate() or coord[d] == 0 for d, p in enumerate(g.placements))
            x = g.to_local().detach().reshape(-1).double()
            parts.append(torch.dot(x, x) if keep else x.new_zeros(()))
        sq = torch.stack(parts).sum().reshape(1)
        for d in range(mesh.ndim):
            dist.all_reduce(sq, group=mesh.get_group(d))
        total += float(sq)
    return math.sqrt(total) if total >= 0 else math.nan
