"""``hooks.trace``: what a capture records, and what a trace file holds.

* :mod:`hooks.trace.trace` — :class:`Trace` (save, load, ``diff``, ``ops``), the format's
  version :data:`SCHEMA_VERSION`;
* :mod:`hooks.trace.records` — one record per module call, gradient, parameter, probe;
* :mod:`hooks.trace.check` — a loaded file checked field by field (:class:`TraceFormatError`);
* :mod:`hooks.trace.diff` — two traces compared (:class:`TraceDiff`);
* :mod:`hooks.trace.ops` — step into a module call: its torch operations (:class:`OpTrace`);
* :mod:`hooks.trace.applied_edit` — what an edit did, as saved with the trace.

Built on :mod:`hooks.tensors`; never imports textual, rich or tui.
"""

from hooks.trace.trace import SCHEMA_VERSION, Trace, TraceFormatError

__all__ = ["SCHEMA_VERSION", "Trace", "TraceFormatError"]
