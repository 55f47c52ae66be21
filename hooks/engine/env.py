"""What a capture reads of its process before it starts: free cores for the statistics
worker, a ``torch.distributed`` job, parameters left on the meta device."""

from __future__ import annotations

import gc
import os
import sys
import threading

import torch
from torch import nn

__all__ = ["check_data", "core_left", "distributed", "fewer_gc_passes", "gc_passes_back"]

#: The young-generation threshold of Python's cyclic GC while a capture records (700 by
#: default): a capture allocates ~10,000 small objects, each 700 of which would run a collection.
GC_YOUNG = 20_000
_gc_lock = threading.Lock()
_gc_state: list = [0, None]  # captures recording, the threshold before the first of them


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
    # Module._parameters/_buffers (torch private): a module's own, no recursive walk
    no_data = next((f"{prefix}.{n}" if prefix else n for prefix, m in modules
                    for d in (m._parameters, m._buffers) for n, t in d.items()
                    if t is not None and t.is_meta), None)
    if no_data is not None:
        raise ValueError(f"the model has no data: {no_data} is on the meta device; "
                         "materialise it first: model.to_empty(device='cpu'), then "
                         "initialise or load its weights")


def fewer_gc_passes() -> None:
    """Raise the cyclic GC's young-generation threshold to :data:`GC_YOUNG` while a capture
    records; captures nest and may stop in any order: the first one in saves the threshold,
    the last one out (:func:`gc_passes_back`) restores it."""
    with _gc_lock:
        if _gc_state[0] == 0:
            _gc_state[1] = gc.get_threshold()
            young, *older = _gc_state[1]
            gc.set_threshold(max(young, GC_YOUNG), *older)
        _gc_state[0] += 1


def gc_passes_back() -> None:
    """Undo one :func:`fewer_gc_passes`."""
    with _gc_lock:
        if _gc_state[0] == 0:
            return
        _gc_state[0] -= 1
        if _gc_state[0] == 0 and _gc_state[1] is not None:
            gc.set_threshold(*_gc_state[1])
