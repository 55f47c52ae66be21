"""The list of checks, their ids and options, and ``--only`` parsing."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hooks.doctor.model.result import Outcome
from hooks.doctor.model.target import Target


@dataclass
class DoctorOptions:
    """Knobs of the checks (defaults keep the default run to a few seconds).

    Attributes:
        overfit_steps: N, the most optimizer steps of the overfit check.
        overfit_lr: AdamW learning rate of the overfit check.
        overfit_drop: fraction by which the cross-entropy must fall (0.9 = by 90%).
        routing_batches: batches the routing check pools (the given one plus random ones).
        seed: seed of every random input the checks draw (private generators).
    """

    overfit_steps: int = 300
    overfit_lr: float = 3e-3
    overfit_drop: float = 0.9
    routing_batches: int = 4
    seed: int = 0


CheckFn = Callable[[Target, DoctorOptions], Outcome]


@dataclass(frozen=True)
class Check:
    """One registered check.

    Attributes:
        id: its number (1-10: the first battery; 11-14: magnitudes and gradient paths;
            21-25: invariances).
        key: short name accepted by ``--only``.
        name: title shown in tables.
        func: ``func(target, options) -> Outcome``.
        slow: only run when asked (``--overfit``).
    """

    id: int
    key: str
    name: str
    func: CheckFn
    slow: bool = False


CHECKS: list[Check] = []


def check(id: int, key: str, name: str, *, slow: bool = False) -> Callable[[CheckFn], CheckFn]:
    """Decorator registering a check function under ``id``/``key``."""

    def deco(func: CheckFn) -> CheckFn:
        CHECKS.append(Check(id, key, name, func, slow))
        CHECKS.sort(key=lambda c: c.id)
        return func

    return deco


def resolve_only(only: Iterable[str | int] | str | None) -> set[int] | None:
    """Check ids selected by ``only``: numbers or keys, or a comma-separated string of them.

    Returns:
        The set of ids, or None for "all".

    Raises:
        ValueError: an unknown id or key (the message lists the valid ones).
    """
    if only is None:
        return None
    if isinstance(only, (str, int)):
        only = [only]
    items: list[str] = []
    for x in only:
        items.extend(p.strip() for p in str(x).split(","))
    by_key = {c.key: c.id for c in CHECKS}
    ids = {c.id for c in CHECKS}
    out: set[int] = set()
    for item in items:
        if not item:
            continue
        if item.isdigit() and int(item) in ids:
            out.add(int(item))
        elif item.lower() in by_key:
            out.add(by_key[item.lower()])
        else:
            valid = ", ".join(f"{c.id}={c.key}" for c in CHECKS)
            raise ValueError(f"unknown check {item!r}; choose from {valid}")
    if not out:
        raise ValueError("no check selected")
    return out
