"""The record every check returns, and the statuses it may carry."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: The statuses a check can report, from best to worst.
#:
#: ``pass``: measured, nothing wrong. ``n/a``: the check does not apply to this kind of model
#: (causality on a bidirectional encoder, RoPE without rotary embeddings, routing on a dense
#: model); ``evidence`` says why. ``skip``: it applies but could not be measured (the model or
#: PyTorch raised, e.g. an op CPU autocast does not support, or the batch lacks what it needs);
#: ``evidence`` says why and what would let it run. ``warn``: a finding worth a look. ``fail``:
#: a measured mistake. ``error``: mdb's own fault, the check crashed in mdb's code (the
#: exception is in ``evidence``); it counts as a failure for the exit code.
STATUSES = ("pass", "n/a", "skip", "warn", "fail", "error")

#: Statuses that make ``mdb doctor`` exit with code 1.
FAILING = frozenset({"fail", "error"})


def _jsonable(value: Any) -> Any:
    """``value`` with non-finite floats as strings and tuples as lists (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


@dataclass
class CheckResult:
    """The outcome of one doctor check.

    Attributes:
        id: the check's number (:attr:`hooks.doctor.model.registry.Check.id`).
        key: the check's short name (``init-loss``, ``causality``, ...); ``--only`` takes it.
        name: human-readable title.
        status: one of :data:`STATUSES`.
        evidence: what was measured, with the numbers (one or a few short sentences).
        hint: one line on the likely cause and where to look; empty when nothing is wrong.
        module: qualified name (``model.named_modules()``) of the module the finding is about,
            or None; the TUI jumps there.
        data: the measurements as JSON-serialisable values (numbers, lists, strings).
        seconds: wall time the check took.
    """

    id: int
    key: str
    name: str
    status: str
    evidence: str
    hint: str = ""
    module: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    @property
    def failed(self) -> bool:
        """True for ``fail`` and ``error``."""
        return self.status in FAILING

    def to_dict(self) -> dict[str, Any]:
        """A strict-JSON dict (NaN/Inf written as strings)."""
        return {
            "id": self.id,
            "key": self.key,
            "name": self.name,
            "status": self.status,
            "evidence": self.evidence,
            "hint": self.hint,
            "module": self.module,
            "data": _jsonable(self.data),
            "seconds": round(self.seconds, 4),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckResult:
        """Inverse of :meth:`to_dict` (non-finite floats stay strings in ``data``)."""
        return cls(
            id=int(data["id"]),
            key=str(data["key"]),
            name=str(data["name"]),
            status=str(data["status"]),
            evidence=str(data.get("evidence", "")),
            hint=str(data.get("hint", "")),
            module=data.get("module"),
            data=dict(data.get("data", {})),
            seconds=float(data.get("seconds", 0.0)),
        )


class Outcome:
    """What a check function returns; the runner adds id, key, name and timing.

    A small builder so check code reads ``return Outcome.fail(evidence, hint, module, **data)``.
    """

    __slots__ = ("status", "evidence", "hint", "module", "data")

    def __init__(self, status: str, evidence: str, hint: str = "", module: str | None = None,
                 **data: Any) -> None:
        self.status, self.evidence, self.hint, self.module = status, evidence, hint, module
        self.data = data

    @classmethod
    def ok(cls, evidence: str, module: str | None = None, **data: Any) -> Outcome:
        return cls("pass", evidence, "", module, **data)

    @classmethod
    def warn(cls, evidence: str, hint: str = "", module: str | None = None, **data: Any) -> Outcome:
        return cls("warn", evidence, hint, module, **data)

    @classmethod
    def fail(cls, evidence: str, hint: str = "", module: str | None = None, **data: Any) -> Outcome:
        return cls("fail", evidence, hint, module, **data)

    @classmethod
    def skip(cls, reason: str, **data: Any) -> Outcome:
        return cls("skip", reason, "", None, **data)
