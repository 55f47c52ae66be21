"""torch.compile as :mod:`hooks.engine.capture` sees it: which modules are compiled, whether a
compiled wrapper is running, and the ``force_eager`` stance under which a captured step runs eagerly
so that every module hook fires (used by :class:`hooks.engine.capture.Capture`)."""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
from torch import nn

# -- torch.compile ------------------------------------------------------------------------------
# Nothing can be compiled before torch._dynamo was imported, and importing it costs seconds: the
# helpers below only look it up in sys.modules.


def _dynamo_eval_frame() -> Any:
    return sys.modules.get("torch._dynamo.eval_frame")


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module that ``torch.compile(module)`` wrapped (``OptimizedModule._orig_mod``, also
    through several wrappers); ``model`` itself when it is not such a wrapper."""
    ef = _dynamo_eval_frame()
    wrapper = getattr(ef, "OptimizedModule", None) if ef is not None else None
    while wrapper is not None and isinstance(model, wrapper):
        model = model._orig_mod  # torch private, the only way to the wrapped module
    return model


def compiled_parts(modules: list[tuple[str, nn.Module]]) -> list[str]:
    """Names of the modules that are compiled: ``torch.compile(m)`` wrappers and modules
    compiled in place with ``m.compile()``."""
    ef = _dynamo_eval_frame()
    if ef is None:
        return []
    wrapper = getattr(ef, "OptimizedModule", ())
    return [
        name or "<root>"
        for name, m in modules
        if isinstance(m, wrapper) or getattr(m, "_compiled_call_impl", None) is not None
    ]


def in_compiled_wrapper() -> bool:
    """True while a ``torch.compile(module)`` wrapper (``OptimizedModule``) runs its module."""
    ef = _dynamo_eval_frame()
    check = getattr(ef, "_is_in_optimized_module", None) if ef is not None else None
    return bool(check is not None and check())


def force_eager() -> Any:
    """Enter ``torch.compiler.set_stance("force_eager")`` when dynamo is loaded: compiled code
    (``torch.compile``'d modules and functions) runs its original Python eagerly until the
    returned context is exited, so module hooks fire and dynamo traces none of them. Returns
    None when dynamo is not loaded (nothing can be compiled) or torch has no ``set_stance``
    (torch < 2.6)."""
    if "torch._dynamo" not in sys.modules:
        return None
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return None
    with _EAGER_LOCK:  # captures overlap and stop in any order: the last one out restores
        if _EAGER[0] == 0:
            try:  # takes effect now; its __exit__ restores the stance before it
                _EAGER[1] = set_stance("force_eager")
            except Exception:  # e.g. called inside a compiled region
                return None
        _EAGER[0] += 1
    return _EagerHold()




_EAGER_LOCK = threading.Lock()
_EAGER: list = [0, None]  # captures holding the force_eager stance, its context


class _EagerHold:
    """One capture's hold on the shared ``force_eager`` stance (``__exit__`` once)."""

    def __init__(self) -> None:
        self._held = True

    def __exit__(self, *exc: Any) -> None:
        with _EAGER_LOCK:
            if not self._held:
                return
            self._held = False
            _EAGER[0] -= 1
            ctx = _EAGER[1] if _EAGER[0] == 0 else None
            if ctx is not None:
                _EAGER[1] = None
        if ctx is not None:
            ctx.__exit__(None, None, None)
