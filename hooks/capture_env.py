"""What a capture reads of its process before it starts: free cores for the statistics
worker, a ``torch.distributed`` job, parameters left on the meta device."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

__all__ = ["check_data", "core_left", "distributed"]


def core_left() -> bool:
    """Whether this process may use more cores than torch's intra-op threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return torch.get_num_threads() < (cores or 1)


def distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialised (without importing it)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def check_data(modules: list[tuple[str, nn.Module]]) -> None:
    """Raise ``ValueError`` (one line naming it) when a parameter or buffer of ``modules``
    (``(qualified name, module)`` pairs) is on the meta device: it holds no values to read."""
    no_data = next((f"{prefix}.{n}" if prefix else n for prefix, m in modules
                    for d in (m._parameters, m._buffers) for n, t in d.items()
                    if t is not None and t.is_meta), None)
    if no_data is not None:
        raise ValueError(f"the model has no data: {no_data} is on the meta device; "
                         "materialise it first: model.to_empty(device='cpu'), then "
                         "initialise or load its weights")
