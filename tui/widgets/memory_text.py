"""The text the memory view (``m``) and ``mdb memory`` share: column headers and the lines
under the table (totals, the peak, what is alive at it), from the numbers of
:mod:`hooks.trace.memory_view`."""

from __future__ import annotations

from typing import Any

from hooks.trace.memory_view import PeakReport
from hooks.whatif.memory_fit import human_bytes

#: Column headers of the module table, by kind.
HEADERS = {"param": "params", "grad": "grads", "optimizer": "optimizer", "saved": "saved"}


def total_lines(trace: Any, peak: PeakReport) -> list[str]:
    """The totals, the peak and what autograd held at it, one line each."""
    mem = trace.memory
    opt = f" ({mem.optimizer}{', estimated' if any(p.estimated for p in mem.params) else ''})" \
        if mem.optimizer else " (no optimizer given)"
    lines = [
        f"step total {human_bytes(mem.total_bytes)}: parameters {human_bytes(mem.param_bytes)}"
        f" + buffers {human_bytes(mem.buffer_bytes)} + gradients {human_bytes(mem.grad_bytes)}"
        f" + optimizer state {human_bytes(mem.optimizer_bytes)}{opt} + saved activations "
        f"{human_bytes(mem.saved_bytes)}",
        f"peak {human_bytes(peak.bytes)} {peak.where}: "
        + ", ".join(f"{k} {human_bytes(v)}" for k, v in peak.parts.items()),
    ]
    if peak.holders:
        shown = ", ".join(f"{m or '<root>'}#{c} {human_bytes(b)}" for m, c, b in peak.holders[:5])
        more = f" and {len(peak.holders) - 5} more calls" if len(peak.holders) > 5 else ""
        lines.append(f"saved activations alive at the peak: {shown}{more}")
    if mem.unattributed_bytes:
        lines.append(f"saved outside any recorded call: {human_bytes(mem.unattributed_bytes)}")
    return lines
