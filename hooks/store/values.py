"""The values ``hooks.run`` takes, checked on the caller's thread before anything is stored:
logged scalars (:func:`to_float`), the per-expert load table (:func:`expert_load_table`), the
run's ``total_steps``/``gather_every`` and its ``config``, ``run.log``'s ``step``
(:func:`checked_step`) and ``run.watch``'s ``every`` and byte budgets (:func:`checked_every`,
:func:`checked_bytes`). Every error names the argument.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping
from typing import Any

__all__ = ["checked_bytes", "checked_counts", "checked_every", "checked_metric_name",
           "checked_step", "config_checked", "expert_load_table", "to_float"]

#: Steps are SQLite INTEGERs: the largest step (and ``every``) the store can hold.
MAX_STEP = 2**63 - 1


def checked_metric_name(name: str) -> str:
    """A metric name ``run.log`` may store: any text that UTF-8 can encode.

    An empty name is kept (it reads back everywhere, shown as an empty header); a control
    character is kept (every view shows it escaped, ``\\x1b``); a lone surrogate
    (``"bad\\ud800"``) cannot be written to the database, and the background writer would
    fail on it after the call returned, losing the steps not yet written: it is refused here.

    Raises:
        ValueError: A name holding a lone surrogate; the message shows it escaped.
    """
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"run.log({name!r}=...): the metric name holds a lone surrogate "
                         f"({name[exc.start]!r} at {exc.start}), which UTF-8 cannot encode"
                         ) from None
    return name


def to_float(name: str, value: Any) -> float:
    """A logged value as a Python float: a number, or a one-element tensor / numpy value.

    Raises:
        TypeError: Text, a complex number (a complex tensor), or another object that is not a
            number; the message names the metric.
        ValueError: A tensor of more than one element or on the meta device, an integer beyond
            float64's range.
    """
    if type(value) is float:
        return value
    is_complex = getattr(value, "is_complex", None)  # a torch tensor
    if isinstance(value, complex) or callable(is_complex) and is_complex() is True:
        raise TypeError(f"run.log({name}=...): expected a real number, got a complex "
                        f"{type(value).__name__} (log its .real, .imag or abs() as metrics "
                        "of their own)")
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # an int beyond float64's range
            raise ValueError(f"run.log({name}=...): an integer of {int(value).bit_length()} bits "
                             "does not fit a float64") from None
    if isinstance(value, (str, bytes)):
        raise TypeError(f"run.log({name}=...): expected a number or a one-element tensor, "
                        f"got {type(value).__name__}")
    if getattr(value, "is_meta", False) is True:  # a torch tensor on the meta device
        raise ValueError(f"run.log({name}=...): the tensor is on the meta device, which holds "
                         "shapes but no values: log a tensor computed on a real device")
    item = getattr(value, "item", None)
    if callable(item):
        try:
            x = item()
        except (RuntimeError, ValueError) as exc:
            shape = tuple(getattr(value, "shape", ()))
            raise ValueError(
                f"run.log({name}=...): expected a scalar, got a tensor of shape {shape}"
            ) from exc
        if isinstance(x, complex):  # a numpy complex scalar
            raise TypeError(f"run.log({name}=...): expected a real number, got a complex "
                            f"{type(value).__name__} (log its .real, .imag or abs() as "
                            "metrics of their own)")
        if isinstance(x, (int, float)):
            return float(x)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"run.log({name}=...): expected a number or a one-element tensor, "
                        f"got {type(value).__name__}") from None


_LOAD_WANTED = ("run.log(expert_load=...): expected per MoE layer, per expert, the share of "
                "routed slots (a 2-D tensor or nested lists of numbers)")


def _load_row(row: Any) -> list[float]:
    if isinstance(row, (str, bytes)):
        raise TypeError(f"{_LOAD_WANTED}, got a row that is {type(row).__name__}")
    try:
        items = list(row)
    except TypeError:
        raise TypeError(f"{_LOAD_WANTED}, got a row that is {type(row).__name__}") from None
    for x in items:
        if isinstance(x, (str, bytes)) or not isinstance(x, (int, float)) and not hasattr(
                x, "__float__"):
            raise TypeError(f"{_LOAD_WANTED}, got a share that is {type(x).__name__}")
    return [float(x) for x in items]


def expert_load_table(value: Any) -> list[list[float]] | None:
    """``run.log(expert_load=...)`` as nested lists (L, E), or ``None`` for a scalar (logged
    as a scalar named ``expert_load``, as before the argument existed).

    Raises:
        TypeError: Text, or a table whose rows or shares are not numbers (one line naming
            the argument).
        ValueError: No layer, a layer without experts, or layers with different numbers of
            experts (a ragged table).
    """
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{_LOAD_WANTED}, got {type(value).__name__}")
    tolist = getattr(value, "tolist", None)
    rows = tolist() if callable(tolist) else value
    if isinstance(rows, (int, float)) or getattr(value, "ndim", None) == 0:
        return None
    try:
        rows = list(rows)
    except TypeError:
        raise TypeError(f"{_LOAD_WANTED}, got {type(value).__name__}") from None
    out = [_load_row(row) for row in rows]
    if not out:
        raise ValueError("run.log(expert_load=...): no MoE layer in it; leave it out for a "
                         "model without experts")
    widths = [len(row) for row in out]
    if min(widths) == 0 or len(set(widths)) > 1:
        raise ValueError(f"run.log(expert_load=...): its layers have {widths[:8]} experts"
                         f"{' …' if len(widths) > 8 else ''}: every MoE layer needs one share "
                         "per expert, the same number in each (an (L, E) table)")
    return out


def checked_counts(total_steps: Any, gather_every: Any) -> tuple[int | None, int]:
    """``hooks.run``'s ``total_steps`` and ``gather_every`` as integers, checked."""
    if total_steps is not None:
        total_steps = operator.index(total_steps)
        if not 0 < total_steps < 2**63:
            raise ValueError(f"total_steps must be a positive integer below 2**63, got "
                             f"{total_steps}")
    gather_every = operator.index(gather_every)
    if gather_every < 1:
        raise ValueError(f"gather_every={gather_every}: must be 1 or more")
    return total_steps, gather_every


def config_checked(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``config`` as a dict that the store can write as JSON (as ``create_run`` writes it),
    checked before any database is opened.

    Raises:
        TypeError: Not a mapping, or keys JSON cannot store.
        ValueError: A value that contains itself (``Circular reference detected``) or nests
            too deep.
    """
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping (a dict), got {type(config).__name__}")
    config = dict(config or {})
    try:
        json.dumps(config, sort_keys=True, default=str)
    except TypeError as exc:
        raise TypeError(f"hooks.run(config=...) cannot be stored as JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:
        why = " (a value in it contains itself)" if "ircular" in str(exc) else ""
        raise ValueError(f"hooks.run(config=...) cannot be stored as JSON: {exc}{why}") from None
    return config


def _integer(call: str, value: Any) -> int:
    """``value`` as an int (an int, a numpy or 0-dim tensor integer), never a bool or a
    float; else ``TypeError`` naming ``call`` (``"run.watch(every=...)"``)."""
    if isinstance(value, bool):
        raise TypeError(f"{call}: expected an integer, got a bool ({value})")
    try:
        return operator.index(value)
    except TypeError:
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:39] + "…"
        raise TypeError(f"{call}: expected an integer, got {type(value).__name__} "
                        f"{shown}") from None


def _shown_int(n: int) -> str:
    return str(n) if n.bit_length() <= 64 else f"<an integer of {n.bit_length()} bits>"


def checked_step(step: Any) -> int:
    """``run.log(step=...)`` as an int in 0 … :data:`MAX_STEP`.

    Raises:
        TypeError: Not an integer (a float, a bool: ``step=True`` is not step 1).
        ValueError: Negative, or above :data:`MAX_STEP` (the store could not hold it).
    """
    step = _integer("run.log(step=...)", step)
    if step < 0:
        raise ValueError(f"run.log(step={step}): steps are counted from 0")
    if step > MAX_STEP:  # SQLite's INTEGER: the writer thread could not store it
        raise ValueError(f"run.log(step={_shown_int(step)}): steps go up to 2**63 - 1")
    return step


def checked_every(every: Any) -> int:
    """``run.watch(every=...)`` as an int in 1 … :data:`MAX_STEP`: an ``every`` beyond the
    largest step the store holds would capture no step at all, silently.

    Raises:
        TypeError: Not an integer (``1.5``, ``nan``, a bool).
        ValueError: Below 1 or above :data:`MAX_STEP`.
    """
    every = _integer("run.watch(every=...)", every)
    if every < 1:
        raise ValueError(f"watch(every={every}): must be 1 or more")
    if every > MAX_STEP:
        raise ValueError(f"watch(every={_shown_int(every)}): steps go up to 2**63 - 1, so no step "
                         "would ever be captured; every must be at most 2**63 - 1")
    return every


def checked_bytes(options: Mapping[str, Any], call: str = "run.watch") -> None:
    """The byte budgets among ``options`` (``hooks.capture``'s ``attention_bytes`` and
    ``keep_bytes``), checked when ``run.watch`` is called rather than at the first capture.

    Raises:
        TypeError: A budget that is not an integer (a float, a bool).
        ValueError: A negative budget.
    """
    for key in ("attention_bytes", "keep_bytes"):
        if key in options:
            n = _integer(f"{call}({key}=...)", options[key])
            if n < 0:
                raise ValueError(f"{call}({key}={n}): a budget in bytes, 0 or more")
