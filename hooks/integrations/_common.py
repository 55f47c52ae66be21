"""What the two trainer callbacks share: checked options, the run they make, the numbers
they log (this module imports neither trainer library)."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["CallbackOptions", "lazy_callback", "numeric", "plain_config"]


class CallbackOptions:
    """The options of an ``MdbCallback``, checked when it is made (one-line errors).

    Args:
        name: The run's name (``None``: ``run-YYYYMMDD-HHMMSS``).
        db: The run database (``None``: ``$MDB_DB``, else ``./runs/mdb.sqlite``).
        every: Capture every ``every``-th optimizer step (``run.watch``); ``0``: no watch (no
            captures, no loop doctor): metrics only.
        config: Extra configuration stored with the run (merged over the trainer's
            arguments).
        capture_options: Passed to ``run.watch`` (``include``, ``exclude``, ``attention``…).

    Raises:
        TypeError: ``every`` not an integer, ``config`` not a mapping, or a capture option
            that ``run.watch`` does not take.
        ValueError: ``every < 0``.
    """

    def __init__(self, name: str | None, db: str | os.PathLike[str] | None, every: int,
                 config: Mapping[str, Any] | None, capture_options: dict[str, Any]) -> None:
        import operator

        from hooks.doctor.loop.watch import check_watch_arguments

        every = operator.index(every)
        if every < 0:
            raise ValueError(f"MdbCallback(every={every}): 0 (metrics only) or more")
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"MdbCallback(config=...) expects a mapping, got "
                            f"{type(config).__name__}")
        check_watch_arguments(None, None, capture_options)
        self.name, self.db, self.every = name, db, every
        self.config = dict(config or {})
        self.capture_options = capture_options

    def start(self, model: Any, optimizer: Any, scheduler: Any, *,
              trainer_config: Mapping[str, Any], total_steps: int | None) -> Any:
        """Start the run (and watch ``model`` with the optimizer and scheduler); return it."""
        from hooks.recorder.run import Run

        run = Run(self.name, db=self.db, config={**plain_config(trainer_config), **self.config},
                  total_steps=total_steps if total_steps and total_steps > 0 else None)
        if self.every and model is not None:
            run.watch(model, every=self.every, optimizer=optimizer, scheduler=scheduler,
                      **self.capture_options)
        return run


def plain_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-plain entries of ``config`` (numbers, strings, booleans, ``None``)."""
    return {str(k): v for k, v in config.items()
            if v is None or isinstance(v, (bool, int, float, str))}


def numeric(values: Mapping[str, Any]) -> dict[str, float]:
    """The entries of a trainer's log dict that are numbers (or one-element tensors), as
    floats; strings, lists and ``epoch`` counters of other types are left out."""
    out = {}
    for k, v in values.items():
        if hasattr(v, "numel") and callable(v.numel) and v.numel() == 1:
            v = v.detach().float().item() if hasattr(v, "detach") else v.item()
        if isinstance(v, numbers.Real) and not isinstance(v, bool):
            out[str(k)] = float(v) if math.isfinite(float(v)) else float(v)
    return out


def lazy_callback(module: dict[str, Any], make) -> Any:
    """The module ``__getattr__`` of an integration: ``MdbCallback`` is built by ``make()``
    (which imports the library it subclasses) on first use and cached in the module's
    globals ``module``, so importing the integration imports neither library.

    Raises (from the returned function):
        AttributeError: any other name.
    """

    def __getattr__(name: str) -> Any:
        if name == "MdbCallback":
            cls = make()
            cls.__module__ = module["__name__"]
            module["MdbCallback"] = cls
            return cls
        raise AttributeError(f"module {module['__name__']!r} has no attribute {name!r}")

    return __getattr__
