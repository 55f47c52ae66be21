"""The rows of ``mdb diff``: each changed tensor of a :class:`hooks.trace.diff.TraceDiff` as the
strings the printed table and the diff screen show."""

from __future__ import annotations

import math

from hooks.text import printable
from tui.widgets.fmt import sci, shape


def _num(x: float | None) -> str:
    return sci(x)


def _rel(x: float) -> str:
    return "inf" if math.isinf(x) else f"{100 * x:.3g}%"


def rows(diff, ranked=None) -> list[dict]:
    """The changed tensors as table rows, largest change first (see
    :meth:`hooks.trace.diff.TraceDiff.ranked`), or in the order ``ranked`` gives (an edit's:
    :meth:`hooks.trace.diff.TraceDiff.ranked_for_edit`); the call and tensor names
    :func:`hooks.text.printable`."""
    out = []
    for d in diff.ranked() if ranked is None else ranked:
        rel = d.relative()
        if d.shape_changed:
            what = f"{shape(d.shape_self)} → {shape(d.shape_other)}"
        else:
            what = shape(d.shape_self)
        nan = d.delta.get("nan_count") or 0
        out.append({
            "diff": d, "pass": "fwd" if d.direction == "forward" else "bwd",
            "call": printable(f"{d.module or '<root>'}#{d.call_index}"),
            "tensor": printable(d.tensor),
            "shape": what, "mean": _num(d.delta.get("mean")), "std": _num(d.delta.get("std")),
            "change": ("layout" if d.layout_changed else f"{nan:+.0f} NaN" if nan
                       else _rel(rel) + (" rows" if d.shape_changed else "")),
        })
    return out


def summary_line(diff, a: str, b: str) -> str:
    """``12 tensors changed · 2 only in A · 0 only in B`` or ``no differences``."""
    if diff.is_zero():
        return printable(f"no differences between {a} and {b}")
    n = len(diff.ranked())
    return (f"{n} tensor(s) changed · {len(diff.only_in_self)} only in A · "
            f"{len(diff.only_in_other)} only in B")
