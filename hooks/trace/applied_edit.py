"""``AppliedEdit``: what one edit (:mod:`hooks.engine.edits`) did during a capture, as saved with
the trace (``trace.edits``). Kept apart from the edits' machinery so that :mod:`hooks.trace.trace`
reads and writes it without importing the model-facing code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class AppliedEdit:
    """What one edit did during a capture (``trace.edits``; saved with the trace).

    Attributes:
        spec: the edit's canonical spec.
        module: the module it was bound to (a pattern gives one record per match).
        hooked: the module whose call was changed (the output projection for ``head=``,
            expert E or the router for ``expert=``).
        calls: how many calls of ``hooked`` the edit ran on.
        changed: of those, how many it changed (values other than the model's own).
        reached_loss: whether a gradient came back to the edited tensor during backward (None
            when no backward ran, or the edited tensor does not require grad).
        note: why the edit changed nothing, or what else to know; None when it simply worked.
    """

    spec: str
    module: str
    hooked: str
    calls: int = 0
    changed: int = 0
    reached_loss: bool | None = None
    note: str | None = None

    @property
    def applied(self) -> bool:
        """True when the edit changed at least one call's values."""
        return self.changed > 0

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "module": self.module, "hooked": self.hooked,
                "calls": self.calls, "changed": self.changed,
                "reached_loss": self.reached_loss, "note": self.note}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AppliedEdit:
        return cls(str(d["spec"]), str(d["module"]), str(d.get("hooked", d["module"])),
                   int(d.get("calls", 0)), int(d.get("changed", 0)), d.get("reached_loss"),
                   d.get("note"))

    def describe(self) -> str:
        """``zero model.layers.1.mlp: 1 call changed`` (or why nothing changed)."""
        if self.note:
            return f"{self.spec}: {self.note}"
        return f"{self.spec}: {self.changed} of {self.calls} call(s) changed"


__all__ = ["AppliedEdit"]
