"""The floor of a capture built on hooks and torch's eager kernels, shared by the capture
benchmarks: the hooks ``hooks.capture`` installs, running nothing, or only the three
reductions that every statistic needs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (no collective), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _passes(t: torch.Tensor) -> None:
    x = _local(t.detach()).reshape(-1)
    if x.numel() and x.is_floating_point():
        torch.aminmax(x), x.sum(), torch.dot(x, x)


@contextmanager
def floor_hooks(model: torch.nn.Module, reduce: bool) -> Iterator[None]:
    """Install, for the block, forward pre- and post-hooks on every module, a tensor hook on
    every output that requires grad and a post-accumulate-grad hook on every parameter, as
    ``hooks.capture`` does. With ``reduce`` they run ``aminmax``, ``sum`` and ``dot(x, x)`` of
    every input, output and gradient (a DTensor's local piece: no collective), and ``aminmax``
    and ``dot`` of each parameter's gradient and ``dot`` of its weight; nothing is read back,
    binned or kept. Without it the hooks do nothing."""

    def grad_hook(g: torch.Tensor) -> None:
        if reduce:
            _passes(g)

    def pre(module, args, kwargs) -> None:
        if reduce:
            for t in args:
                if isinstance(t, torch.Tensor):
                    _passes(t)

    def post(module, args, kwargs, out) -> None:
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                if reduce:
                    _passes(t)
                if t.requires_grad:
                    t.register_hook(grad_hook)

    def on_param(p: torch.Tensor) -> None:
        if reduce and p.grad is not None:
            g, w = _local(p.grad.detach()).reshape(-1), _local(p.detach()).reshape(-1)
            if g.numel():
                torch.aminmax(g), torch.dot(g, g), torch.dot(w, w)

    handles = []
    try:
        for m in model.modules():
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
        handles += [p.register_post_accumulate_grad_hook(on_param) for p in model.parameters()
                    if p.requires_grad]
        yield
    finally:
        for h in handles:
            h.remove()
