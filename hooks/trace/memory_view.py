"""What the memory views show, computed once from a trace's :class:`~hooks.trace.memory.StepMemory`:
the module tree with bytes per kind (:func:`module_bytes`), and the peak with what autograd
held there (:func:`peak_report`). Never imports textual, rich or tui.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The kinds of bytes a module row holds, in the order they are shown.
KINDS = ("param", "grad", "optimizer", "saved")


class NoMemoryError(ValueError):
    """The trace holds no memory record (written before mdb recorded it, or captured with
    ``memory=False``, or of a compiled or sharded model)."""


def step_memory(trace: Any):
    """``trace.memory``, checked to be there.

    Raises:
        NoMemoryError: one line saying why it is missing.
    """
    if trace.memory is None:
        said = [n.message for n in trace.notes if n.kind == "memory"]
        raise NoMemoryError(said[0] if said else
                            "the trace has no memory fields (captured by an older mdb, or with "
                            "memory=False): capture the step again")
    return trace.memory


@dataclass
class ModuleBytes:
    """One module's bytes by kind, its descendants' included.

    Attributes:
        name: qualified module name (``""``: the root).
        module_type: class name.
        depth: nesting depth (root 0).
        bytes: by kind (:data:`KINDS`): its parameters (tied ones once, under their first
            name), their gradients, their optimizer state, and the activations autograd saved
            during its calls.
        retained: bytes its calls left alive when they returned (summed over its calls).
        children: its child modules, largest total first.
    """

    name: str
    module_type: str
    depth: int
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    retained: int = 0
    children: list[ModuleBytes] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Sum over the kinds."""
        return sum(self.bytes.values())

    @property
    def dominant(self) -> str:
        """The kind holding the most bytes (``param`` on a tie or none)."""
        return max(KINDS, key=lambda k: (self.bytes[k], -KINDS.index(k)))


def _owners(name: str) -> list[str]:
    parts = name.split(".")
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts))]


def module_bytes(trace: Any) -> ModuleBytes:
    """The module tree of ``trace`` with :class:`ModuleBytes` per module, siblings sorted by
    their total (largest first).

    Raises:
        NoMemoryError: the trace has no memory record.
    """
    mem = step_memory(trace)
    rows = {m.name: ModuleBytes(m.name, m.module_type, m.depth) for m in trace.modules}
    if "" not in rows:
        rows[""] = ModuleBytes("", trace.model_type, 0)
    for p in mem.params:
        for owner in _owners(p.name):
            row = rows.get(owner)
            if row is not None:
                row.bytes["param"] += p.bytes
                row.bytes["grad"] += p.grad_bytes
                row.bytes["optimizer"] += p.optimizer_bytes
    calls = mem.call_bytes()
    for rec in trace.forward:
        cm = calls.get(rec.index)
        if cm is None:
            continue
        if rec.module in rows:
            rows[rec.module].retained += cm.retained_bytes
        if cm.saved_bytes:
            for owner in {*_owners(rec.module), rec.module}:
                if owner in rows:
                    rows[owner].bytes["saved"] += cm.saved_bytes
    for name, row in rows.items():
        if name:
            parent = name.rpartition(".")[0]
            rows.get(parent, rows[""]).children.append(row)
    for row in rows.values():
        row.children.sort(key=lambda r: -r.total)
    return rows[""]


def walk(root: ModuleBytes, depth: int | None = None) -> list[ModuleBytes]:
    """``root`` and its descendants depth first (children largest first), at most ``depth``
    levels deep."""
    out, todo = [], [root]
    while todo:
        row = todo.pop()
        if depth is not None and row.depth > depth:
            continue
        out.append(row)
        todo.extend(reversed(row.children))
    return out


@dataclass
class PeakReport:
    """The peak of the step's timeline and what was alive there.

    Attributes:
        bytes: the peak's live bytes.
        where: in words: after which call or gradient it was reached.
        parts: kind -> bytes at the peak (param, buffer, optimizer, grad, saved).
        holders: ``(module, call_index, bytes)`` of the calls whose saved activations were
            alive at the peak, largest first.
    """

    bytes: int
    where: str
    parts: dict[str, int]
    holders: list[tuple[str, int, int]]


def peak_report(trace: Any) -> PeakReport:
    """:class:`PeakReport` of ``trace``.

    Raises:
        NoMemoryError: the trace has no memory record.
    """
    mem = step_memory(trace)
    point = mem.timeline[mem.peak_point] if mem.timeline else None
    if point is None:
        return PeakReport(0, "no timeline", {}, [])
    if point.call is not None and point.call < len(trace.forward):
        rec = trace.forward[point.call]
        what = f"{rec.module or '<root>'} call {rec.call_index}"
        where = (f"after the forward of {what}" if point.phase == "forward"
                 else f"in backward, at the gradient of {what}'s output")
    elif point.param is not None:
        where = f"in backward, after the gradient of {point.param} was accumulated"
    else:
        where = {"start": "when the capture started", "end": "when the capture ended"}.get(
            point.phase, point.phase)
    parts = {"param": mem.param_bytes, "buffer": mem.buffer_bytes,
             "optimizer": mem.optimizer_bytes, "grad": point.grad_bytes,
             "saved": point.saved_bytes}
    holders = []
    for a in mem.at_peak:
        if a.call < len(trace.forward):
            rec = trace.forward[a.call]
            holders.append((rec.module, rec.call_index, a.bytes))
    return PeakReport(point.live_bytes, where, parts, holders)
