"""Activation checkpointing as :mod:`hooks.engine.capture` sees it: telling a re-run of a forward
call during backward (checkpoint recomputation) from a new call, matching it to the call it repeats,
and comparing the re-run's values with the original's (used by
:class:`hooks.engine.capture.Capture`)."""

from __future__ import annotations

import torch

from hooks.tensors.stats import TensorStats
from hooks.trace.records import CallRecord

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread (checkpoint recomputation)."""
    return _graph_task_id is not None and _graph_task_id() != -1


class Recomputed:
    """An open re-run (by activation checkpointing) of the forward call ``original``."""

    __slots__ = ("module", "original", "children")

    def __init__(self, module: str, original: CallRecord) -> None:
        self.module = module
        self.original = original
        self.children: dict[str, int] = {}  # module -> re-run children of that name so far


def storage_signature(tensors: list[tuple[str, torch.Tensor]]) -> tuple:
    """Where a call's input tensors live (their storage), to tell calls of one module apart."""
    try:
        return tuple([t.data_ptr() for _, t in tensors])
    except Exception:  # tensors without storage (sparse, some subclasses)
        return tuple(id(t) for _, t in tensors)


def same_values(a: TensorStats, b: TensorStats, rtol: float = 1e-5) -> bool:
    """Whether two summaries describe the same values up to float rounding."""
    if (a.numel, a.nan_count, a.inf_count) != (b.numel, b.nan_count, b.inf_count):
        return False
    scale = max(abs(a.abs_max or 0.0), abs(b.abs_max or 0.0))
    for x, y in ((a.mean, b.mean), (a.std, b.std), (a.min, b.min), (a.max, b.max)):
        if x is None or y is None:
            if x is not y:
                return False
        elif abs(x - y) > rtol * scale:
            return False
    return True
