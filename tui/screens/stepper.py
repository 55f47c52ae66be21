"""``Stepper``: where the step view is in a trace, and every way of moving (no Textual here).

The position is a pass (``"forward"`` over ``Trace.forward`` in execution order, or
``"backward"`` over ``Trace.backward`` in the order autograd produced the gradients) and an index
into it. Each move returns whether it moved, so the view can say why it did not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hooks.text import printable

if TYPE_CHECKING:  # hooks imports torch: keep it out of the app's import time
    from hooks.trace.records import CallRecord, GradRecord

FORWARD = "forward"
BACKWARD = "backward"


@dataclass
class Stepper:
    """The current record of a trace and the moves between records.

    Attributes:
        trace: the :class:`hooks.Trace` being walked.
        direction: ``"forward"`` or ``"backward"``.
        index: position in ``trace.forward`` or ``trace.backward``.
    """

    trace: object
    direction: str = FORWARD
    index: int = 0
    _layers: dict[str, list[int | None]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        from hooks.trace.records import layer_of

        self._layers = {
            FORWARD: [layer_of(r.module) for r in self.trace.forward],
            BACKWARD: [layer_of(g.module) for g in self.trace.backward],
        }
        if not self.trace.forward and self.trace.backward:
            self.direction = BACKWARD

    # -- what is current ----------------------------------------------------------------------
    @property
    def records(self) -> list:
        """The records of the current pass."""
        return self.trace.forward if self.direction == FORWARD else self.trace.backward

    @property
    def current(self) -> CallRecord | GradRecord | None:
        """The current record (None for an empty trace)."""
        recs = self.records
        return recs[self.index] if 0 <= self.index < len(recs) else None

    @property
    def call(self) -> CallRecord | None:
        """The forward call the current record belongs to (itself in the forward pass)."""
        cur = self.current
        if cur is None:
            return None
        if self.direction == FORWARD:
            return cur
        return self.trace.forward[cur.forward_index]

    @property
    def module(self) -> str | None:
        """Qualified name of the current record's module."""
        cur = self.current
        return None if cur is None else cur.module

    def layer(self) -> int | None:
        """Decoder layer index of the current record, or None outside the layers."""
        layers = self._layers[self.direction]
        return layers[self.index] if 0 <= self.index < len(layers) else None

    def status(self) -> str:
        """``forward · call 37/344 · model.layers.1.mlp.gate`` (``backward · grad 3/189 · ...``)."""
        cur = self.current
        if cur is None:
            return "empty trace: nothing was recorded"
        total = len(self.records)
        name = printable(cur.module or "<root>")
        if self.direction == FORWARD:
            return f"forward · call {self.index + 1}/{total} · {name}"
        return f"backward · grad {self.index + 1}/{total} · {name} · {printable(cur.output)}"

    # -- moves ----------------------------------------------------------------------------------
    def go(self, direction: str, index: int) -> bool:
        """Go to ``index`` of pass ``direction``; False if out of range."""
        recs = self.trace.forward if direction == FORWARD else self.trace.backward
        if not 0 <= index < len(recs):
            return False
        self.direction, self.index = direction, index
        return True

    def step(self, delta: int) -> bool:
        """Move ``delta`` records within the current pass; False at either end."""
        return self.go(self.direction, self.index + delta)

    def next_layer(self) -> bool:
        """Go to the first record of the next decoder layer met in this pass."""
        layers = self._layers[self.direction]
        here = self.layer()
        for i in range(self.index + 1, len(layers)):
            if layers[i] is not None and layers[i] != here:
                return self.go(self.direction, i)
        return False

    def prev_layer(self) -> bool:
        """Go to the start of the current layer's run, or of the previous layer's run."""
        layers = self._layers[self.direction]
        starts = [
            i for i, lay in enumerate(layers)
            if lay is not None and (i == 0 or layers[i - 1] != lay)
        ]  # fmt: skip
        before = [s for s in starts if s < self.index]
        return self.go(self.direction, before[-1]) if before else False

    def toggle_pass(self) -> bool:
        """Forward → start of backward; backward → the forward call of the current gradient."""
        if self.direction == FORWARD:
            return self.go(BACKWARD, 0)
        cur = self.current
        return self.go(FORWARD, cur.forward_index if cur is not None else 0)

    def first_nonfinite(self):
        """Go to where NaN/Inf first appeared (forward first, else backward).

        Returns:
            hooks.NonFinite | None: the location, or None when every value is finite.
        """
        for direction in (FORWARD, BACKWARD):
            hit = self.trace.first_nonfinite(direction)
            if hit is not None:
                self.go(direction, hit.index)
                return hit
        return None

    def jump_module(self, module: str, call_index: int = 0) -> bool:
        """Go to ``module``'s ``call_index``-th forward call (in backward: its first gradient)."""
        if self.direction == BACKWARD:
            for g in self.trace.backward:
                if g.module == module:
                    return self.go(BACKWARD, g.index)
        for r in self.trace.forward:
            if r.module == module and r.call_index == call_index:
                return self.go(FORWARD, r.index)
        for r in self.trace.forward:
            if r.module == module:
                return self.go(FORWARD, r.index)
        return False

    # -- related records ------------------------------------------------------------------------
    def grads_of(self, call: CallRecord) -> list[GradRecord]:
        """Gradient records of ``call``'s outputs, in autograd order (indexed once per
        stepper: a trace does not change once captured)."""
        by_call = self.__dict__.get("_grads_by_call")
        if by_call is None:
            by_call = self.__dict__["_grads_by_call"] = {}
            for g in self.trace.backward:
                by_call.setdefault(g.forward_index, []).append(g)
        return list(by_call.get(call.index, ()))

    def params_of(self, module: str) -> list:
        """ParamGradRecords registered directly on ``module`` (not on its children)."""
        by_module = self.__dict__.get("_params_by_module")
        if by_module is None:
            by_module = self.__dict__["_params_by_module"] = {}
            for name, p in self.trace.params.items():
                by_module.setdefault(name.rsplit(".", 1)[0] if "." in name else "",
                                     []).append(p)
        return list(by_module.get(module or "", ()))

    def rows_by_module(self) -> tuple[dict[str, int], int | None]:
        """:func:`hooks.doctor.verdicts.rows_by_module` of the trace, computed once per stepper."""
        rows = self.__dict__.get("_rows_by_module")
        if rows is None:
            from hooks.doctor.verdicts import rows_by_module

            rows = self.__dict__["_rows_by_module"] = rows_by_module(self.trace)
        return rows
