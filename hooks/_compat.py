"""Old import paths that keep working with a :class:`DeprecationWarning`.

``hooks.runstore``, ``hooks.training``, ``hooks.overfit`` and ``hooks.checkpoint`` moved into
:mod:`hooks.runs`; each old module is a stub whose module-level ``__getattr__`` (PEP 562) comes
from :func:`forward`.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def forward(old: str, new: str, extra: Mapping[str, str] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` that finds ``name`` in module ``new`` (or in the module that
    ``extra`` names for it) and warns that ``old`` moved.

    Raises:
        AttributeError: neither module has ``name``.
    """
    extra = dict(extra or {})

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        target = extra.get(name, new)
        module = importlib.import_module(target)
        try:
            value = getattr(module, name)
        except AttributeError:
            raise AttributeError(f"module {old!r} has no attribute {name!r}") from None
        warnings.warn(f"{old}.{name} moved to {target}.{name}", DeprecationWarning, stacklevel=2)
        return value

    return __getattr__
