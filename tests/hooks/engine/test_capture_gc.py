"""The capture holds the cyclic GC's young-generation passes off from the start of
``Capture.start``: registering a forward pre- and post-hook on every module and a hook on every
parameter makes hundreds of small objects (each handle holds weak references), and the passes
they set off walked every young object (issue 37: 1.65 collections a captured step of minillm
``tiny``, a middle-generation one ~2.5 ms)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import hooks


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(20)])


def test_gc_passes_are_held_off_while_the_capture_attaches_its_hooks():
    m = _model()
    passes: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            passes.append(info["generation"])

    before = gc.get_threshold()
    gc.set_threshold(1, *before[1:])  # a pass on every new container object, unless held off
    gc.callbacks.append(count)
    try:
        cap = hooks.capture(m)
        passes.clear()
        cap.start()
        during_start = list(passes)
        m(torch.randn(2, 8)).sum().backward()
        cap.stop()
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*before)
    # a pass or two from the objects made before the threshold is raised; without the hold
    # (registration first), one pass per new object: over a thousand here
    assert len(during_start) <= 5, len(during_start)
    assert len(cap.trace.forward) == 61 and len(cap.trace.params) == 40  # 1 + 20 * 3 calls


def test_the_gc_threshold_is_given_back_when_start_raises():
    m = _model()
    m[0][0].weight = nn.Parameter(torch.empty(8, 8, device="meta"))  # no data: start raises
    before = gc.get_threshold()
    with pytest.raises(ValueError, match="no data"), hooks.capture(m):
        pass
    assert gc.get_threshold() == before
