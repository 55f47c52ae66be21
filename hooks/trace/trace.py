"""``Trace``: everything one capture recorded, plus saving, loading and NaN/Inf localisation.

On disk a trace is a directory (conventionally ``*.mdbtrace``) with two files:

* ``trace.json`` — metadata, records and statistics, with ``"schema"`` :data:`SCHEMA_VERSION`;
  strict JSON (NaN/Inf are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``).
* ``tensors.safetensors`` — kept tensors, routing and attention tensors (only when there are
  any).

Neither format can execute code on load (no pickle anywhere), so a trace from someone else is
safe to open.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hooks.trace.applied_edit import AppliedEdit
from hooks.trace.check import TraceFormatError, check_trace
from hooks.trace.diff import TraceDiff, diff_traces
from hooks.trace.memory import StepMemory
from hooks.trace.ops import BackwardOrigin, OpTrace, Replay, backward_origin, record_ops
from hooks.trace.records import (
    AttentionRecord,
    CallRecord,
    GradRecord,
    ModuleInfo,
    NonFinite,
    Note,
    ParamGradRecord,
    ProbeRecord,
    RoutingRecord,
)

#: Version of the on-disk format; bumped on incompatible changes.
SCHEMA_VERSION = 1
JSON_NAME = "trace.json"
TENSORS_NAME = "tensors.safetensors"
#: Largest trace.json :meth:`Trace.load` reads (bytes): a captured step of a 4-layer model
#: writes about 0.4 MB; a few hundred MB would take gigabytes of memory to parse.
MAX_JSON_BYTES = 512 << 20


@dataclass
class Trace:
    """What one :func:`hooks.capture` recorded.

    Attributes:
        forward: one :class:`~hooks.trace.records.CallRecord` per module call, in execution order.
        backward: one :class:`~hooks.trace.records.GradRecord` per gradient of a recorded output, in
            the order autograd produced them.
        params: :class:`~hooks.trace.records.ParamGradRecord` by qualified parameter name (empty
            when no backward ran).
        routing: one :class:`~hooks.trace.records.RoutingRecord` per MoE layer call.
        attention: :class:`~hooks.trace.records.AttentionRecord` per requested attention call.
        extras: :class:`~hooks.trace.records.ProbeRecord` from user probes.
        modules: every module in ``named_modules()`` order (draws the tree without the model).
        notes: what could not be captured, in words.
        tensors: kept full tensors by key (``fwd/<index>/<path>``, ``bwd/<index>``), on CPU.
        meta: JSON-serialisable values the caller attached (config, token texts, losses).
        step: the training step, when given to ``capture``.
        model_type: class name of the captured model.
        captured: False when every-N sampling skipped this step (the trace is then empty).
        kept_bytes: bytes held in ``tensors``.
        op_traces: the torch operations of stepped-into calls (:meth:`ops`), by
            ``(module, call_index)``; saved with the trace.
        backward_origin: the forward op whose backward produced the first non-finite
            gradient, when it was located (:func:`hooks.trace.ops.locate_backward_origin`).
        replay: what re-runs the captured forward (the model and the root call's arguments);
            None for a trace loaded from disk. Not saved.
        edits: what each edit of ``capture(model, edits=[...])`` did
            (:class:`hooks.engine.edits.AppliedEdit`); empty for an unedited step.
        memory: where the step's bytes go (:class:`hooks.trace.memory.StepMemory`: saved
            activations per call, parameters, gradients, optimizer state, the timeline and its
            peak); None when the capture did not account memory (``memory=False``, a compiled
            or sharded model, a trace written before mdb recorded it).
    """

    forward: list[CallRecord] = field(default_factory=list)
    backward: list[GradRecord] = field(default_factory=list)
    params: dict[str, ParamGradRecord] = field(default_factory=dict)
    routing: list[RoutingRecord] = field(default_factory=list)
    attention: list[AttentionRecord] = field(default_factory=list)
    extras: list[ProbeRecord] = field(default_factory=list)
    modules: list[ModuleInfo] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    model_type: str = ""
    captured: bool = True
    kept_bytes: int = 0
    op_traces: dict[tuple[str, int], OpTrace] = field(default_factory=dict)
    backward_origin: BackwardOrigin | None = None
    replay: Replay | None = field(default=None, repr=False, compare=False)
    edits: list[AppliedEdit] = field(default_factory=list)
    memory: StepMemory | None = None

    # -- lookup ---------------------------------------------------------------------------------
    def calls(self, module: str) -> list[CallRecord]:
        """All forward records of module ``module`` (qualified name), in call order."""
        return [r for r in self.forward if r.module == module]

    def call(self, module: str, call_index: int = 0) -> CallRecord:
        """The forward record of ``module``'s ``call_index``-th call.

        Raises:
            KeyError: no such call was recorded.
        """
        for r in self.forward:
            if r.module == module and r.call_index == call_index:
                return r
        raise KeyError(f"no recorded call {call_index} of module {module!r}")

    def grads(self, module: str) -> list[GradRecord]:
        """Gradient records of module ``module``'s outputs, in autograd order."""
        return [g for g in self.backward if g.module == module]

    # -- NaN/Inf origin -------------------------------------------------------------------------
    def first_nonfinite(self, direction: str = "forward") -> NonFinite | None:
        """Where NaN/Inf first appeared.

        Forward: among calls in the order they *finished* (so a leaf is examined before the
        block containing it), the first whose output has NaN/Inf while all its recorded inputs
        were finite: the innermost recorded module where non-finite values were created. If
        every non-finite call also had a non-finite input (NaN fed in from outside), the first
        non-finite call is returned.

        Backward: the first gradient record, in the order autograd produced them, that has
        NaN/Inf (all gradients produced before it were finite).

        Args:
            direction: ``"forward"`` or ``"backward"``.

        Returns:
            NonFinite | None: the location and the offending statistics; None if all finite.

        Raises:
            ValueError: unknown ``direction``.
        """
        if direction == "forward":
            fallback = None
            for rec in sorted(self.forward, key=lambda r: (r.end_order < 0, r.end_order)):
                bad = next((t for t in rec.outputs if t.stats and not t.stats.finite), None)
                if bad is None:
                    continue
                hit = NonFinite(
                    "forward", rec.index, rec.module, rec.module_type, rec.call_index,
                    bad.path, bad.stats,
                )  # fmt: skip
                if all(t.stats is None or t.stats.finite for t in rec.inputs):
                    return hit
                fallback = fallback or hit
            return fallback
        if direction == "backward":
            for g in self.backward:
                if g.stats is not None and not g.stats.finite:
                    return NonFinite(
                        "backward", g.index, g.module, g.module_type, g.call_index,
                        g.output, g.stats,
                    )  # fmt: skip
            return None
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")

    # -- stepping into a call ------------------------------------------------------------------
    def ops(self, module: str, call_index: int = 0, *, refresh: bool = False) -> OpTrace:
        """The torch operations inside one module call, with their source lines and statistics.

        Recorded ops are returned as they are; otherwise the captured forward is replayed
        (:func:`hooks.trace.ops.record_ops`: same arguments, same RNG state, the recorder active
        only inside that call) and the result is kept in :attr:`op_traces`. A replay whose call does
        not reproduce the recorded output statistics is returned with
        :attr:`OpTrace.diverged` set.

        Args:
            module: qualified module name (``""`` for the root).
            call_index: which call of it.
            refresh: replay even when ops were recorded before.

        Raises:
            KeyError: no such call was recorded.
            LookupError: the ops were not recorded and the trace cannot replay (it was loaded
                from disk, or the capture saw no call of its root module).
        """
        rec = self.call(module, call_index)
        key = (module, call_index)
        if key in self.op_traces and not refresh:
            return self.op_traces[key]
        if self.replay is None:
            raise LookupError(
                f"the ops of {module or '<root>'} call {call_index} were not recorded, and this "
                "trace cannot replay its forward (it was loaded from disk); step in from a live "
                "`mdb step`, or record them with `mdb capture --ops MODULE`")
        self._no_edits("the ops of this step")
        ot = record_ops(self.replay, module, call_index, expected=rec.outputs)
        self.op_traces[key] = ot
        return ot

    def _no_edits(self, what: str) -> None:
        """Refuse an op replay of an edited step (``LookupError``): the replay re-runs the
        model without the edits, so it would show numbers the edited step did not compute."""
        if self.edits:
            raise LookupError(f"{what} cannot be replayed: the step was edited "
                              f"({'; '.join(e.spec for e in self.edits)}) and the replay "
                              "runs the model as it is; step in on the unedited step")

    def locate_backward_origin(self, loss_of_output) -> BackwardOrigin | None:
        """Find the forward op whose backward produced the first non-finite gradient
        (:func:`hooks.trace.ops.backward_origin`) and keep it in :attr:`backward_origin`.

        Args:
            loss_of_output: ``output -> 0-dim loss``, the loss the captured step
                differentiated (e.g. ``lambda out: hooks.select_loss(out, loss_fn, batch).loss``).

        Raises:
            LookupError: the trace cannot replay its forward (loaded from disk).
        """
        if self.replay is None:
            raise LookupError("this trace cannot replay its forward (it was loaded from disk)")
        self._no_edits("the origin of its non-finite gradient")
        self.backward_origin = backward_origin(self.replay, loss_of_output)
        return self.backward_origin

    # -- comparison -----------------------------------------------------------------------------
    def diff(self, other: Trace) -> TraceDiff:
        """Per module call, the change of each statistic from ``self`` to ``other``.

        See :class:`hooks.trace.diff.TraceDiff`.
        """
        return diff_traces(self, other)

    # -- persistence ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON part of the trace (tensors are referenced by key, not included)."""
        return {
            "schema": SCHEMA_VERSION,
            "kind": "mdb-trace",
            "model_type": self.model_type,
            "step": self.step,
            "captured": self.captured,
            "kept_bytes": self.kept_bytes,
            "meta": self.meta,
            "modules": [m.to_dict() for m in self.modules],
            "forward": [r.to_dict() for r in self.forward],
            "backward": [g.to_dict() for g in self.backward],
            "params": [p.to_dict() for p in self.params.values()],
            "routing": [r.to_dict() for r in self.routing],
            "attention": [a.to_dict() for a in self.attention],
            "extras": [e.to_dict() for e in self.extras],
            "notes": [n.to_dict() for n in self.notes],
            "tensor_keys": sorted(self.tensors),
            "op_traces": [o.to_dict() for o in self.op_traces.values()],
            "backward_origin": (None if self.backward_origin is None
                                else self.backward_origin.to_dict()),
            "edits": [e.to_dict() for e in self.edits],
            "memory": None if self.memory is None else self.memory.to_dict(),
        }

    def all_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the trace holds (kept, routing, attention, probe), by safetensors key."""
        out = dict(self.tensors)
        for i, r in enumerate(self.routing):
            out.update(r.tensor_items(f"routing/{i}"))
        for i, a in enumerate(self.attention):
            out.update(a.tensor_items(f"attention/{i}"))
        for i, e in enumerate(self.extras):
            out.update(e.tensor_items(f"extras/{i}"))
        for i, ot in enumerate(self.op_traces.values()):
            for op in ot.ops:
                for path, t in op.kept.items():
                    out[f"ops/{i}/{op.index}/{path}"] = t
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write the trace to directory ``path`` (created if needed).

        Returns:
            Path: the directory.

        Raises:
            OSError: the directory cannot be written.
            TypeError: ``meta`` holds something JSON cannot represent.
        """
        from safetensors.torch import save_file

        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        tensors = {
            k: v.detach().to("cpu").contiguous().clone() for k, v in self.all_tensors().items()
        }
        tpath = d / TENSORS_NAME
        if tensors:
            save_file(tensors, str(tpath), metadata={"schema": str(SCHEMA_VERSION)})
        elif tpath.exists():
            tpath.unlink()
        text = json.dumps(self.to_dict(), allow_nan=False, separators=(",", ":"))
        tmp = d / (JSON_NAME + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(d / JSON_NAME)
        return d

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        """Read a trace written by :meth:`save` (``path`` is the directory or its trace.json).

        Raises:
            FileNotFoundError: nothing at ``path``.
            TraceFormatError: not a trace, or a schema version this code cannot read; a
                trace.json or tensors file that is not a regular file (a FIFO, a device such
                as ``/dev/zero``), or a trace.json larger than :data:`MAX_JSON_BYTES`; a
                missing tensors file that the trace.json names tensors of.
            OSError: a file cannot be read.
        """
        from safetensors.torch import load_file

        p = Path(path)
        named = p.name == JSON_NAME and p.exists() and not p.is_dir()  # a FIFO trace.json too
        d = p.parent if p.is_file() or named else p
        jpath = d / JSON_NAME
        if not jpath.exists():
            raise FileNotFoundError(f"no {JSON_NAME} in {d}")
        raw = _read_capped(jpath, MAX_JSON_BYTES)  # not a regular file, too large: its own line
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:  # also an integer of 5,000 digits
            raise TraceFormatError(f"{jpath} is not valid JSON: {exc}") from None
        except RecursionError:
            raise TraceFormatError(f"{jpath} nests too deeply to be a trace") from None
        if not isinstance(data, dict) or data.get("kind") != "mdb-trace":
            raise TraceFormatError(f"{jpath} is not an mdb trace")
        tpath = d / TENSORS_NAME
        if tpath.exists():
            _read_capped(tpath, 0)  # a regular file, not a FIFO that would block the read
        elif any(data.get(k) for k in ("tensor_keys", "routing", "attention")):
            raise TraceFormatError(f"{tpath} is missing: {jpath} names tensors it holds (kept "
                                   "tensors, routing or attention); copy the trace's whole "
                                   "folder")
        try:
            tensors = load_file(str(tpath)) if tpath.exists() else {}
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise TraceFormatError(f"{tpath} is not a valid safetensors file: {exc}") from None
        try:
            return cls.from_dict(data, tensors)
        except TraceFormatError as exc:
            raise TraceFormatError(f"{jpath}: {exc}") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Trace:
        """Inverse of :meth:`to_dict` + :meth:`all_tensors`. ``data`` and ``tensors`` are
        untrusted (a file or a run database from elsewhere): the trace rebuilt is checked
        field by field (:func:`hooks.trace.check.check_trace`).

        Raises:
            TraceFormatError: another schema version, or missing/mistyped fields or tensors
                (one line naming the first).
        """
        trace = cls._from_dict(data, tensors)
        check_trace(trace)
        return trace

    @classmethod
    def _from_dict(cls, data: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Trace:
        schema = data.get("schema", SCHEMA_VERSION) if isinstance(data, dict) else None
        if schema != SCHEMA_VERSION:
            raise TraceFormatError(
                f"trace schema {schema!r}; this mdb reads schema {SCHEMA_VERSION}"
            )
        try:
            kept = {k: tensors[k] for k in data.get("tensor_keys", [])}
            return cls(
                forward=[CallRecord.from_dict(r) for r in data["forward"]],
                backward=[GradRecord.from_dict(g) for g in data["backward"]],
                params={p["name"]: ParamGradRecord.from_dict(p) for p in data.get("params", [])},
                routing=[
                    RoutingRecord.from_dict(r, tensors, f"routing/{i}")
                    for i, r in enumerate(data.get("routing", []))
                ],
                attention=[
                    AttentionRecord.from_dict(a, tensors, f"attention/{i}")
                    for i, a in enumerate(data.get("attention", []))
                ],
                extras=[
                    ProbeRecord.from_dict(e, tensors, f"extras/{i}")
                    for i, e in enumerate(data.get("extras", []))
                ],
                modules=[ModuleInfo.from_dict(m) for m in data.get("modules", [])],
                notes=[Note.from_dict(n) for n in data.get("notes", [])],
                tensors=kept,
                meta=dict(data.get("meta", {})),
                step=data.get("step"),
                model_type=data.get("model_type", ""),
                captured=bool(data.get("captured", True)),
                kept_bytes=int(data.get("kept_bytes", 0)),
                op_traces=_op_traces(data.get("op_traces", []), tensors),
                backward_origin=(None if data.get("backward_origin") is None
                                 else BackwardOrigin.from_dict(data["backward_origin"])),
                edits=[AppliedEdit.from_dict(e) for e in data.get("edits", [])],
                memory=(None if data.get("memory") is None
                        else StepMemory.from_dict(data["memory"])),
            )
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError,
                RuntimeError, RecursionError) as exc:  # RuntimeError: a tensor torch refuses
            if isinstance(exc, TraceFormatError):
                raise
            raise TraceFormatError(f"malformed trace: {type(exc).__name__}: "
                                   f"{str(exc)[:200]}") from None


def _read_capped(path: Path, limit: int) -> bytes:
    """The bytes of ``path``, which must be a regular file of at most ``limit`` bytes
    (``limit`` 0: only check that it is a regular file and return nothing). The file is opened
    without blocking, so a FIFO is refused instead of waiting for a writer.

    Raises:
        TraceFormatError: not a regular file, or larger than ``limit``.
        OSError: it cannot be opened or read.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TraceFormatError(f"{path} is not a regular file (a FIFO, socket or device); "
                                   "a trace is a directory of files written by mdb capture")
        if not limit:
            return b""
        if st.st_size > limit:
            raise TraceFormatError(f"{path} has {st.st_size:,} bytes, more than a trace "
                                   f"holds (at most {limit:,})")
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while being read
        raise TraceFormatError(f"{path} has more than {limit:,} bytes, more than a trace holds")
    return data


def _op_traces(items: list[dict[str, Any]],
               tensors: dict[str, torch.Tensor]) -> dict[tuple[str, int], OpTrace]:
    out = {}
    for i, d in enumerate(items):
        ot = OpTrace.from_dict(d)
        prefix = f"ops/{i}/"
        for op in ot.ops:
            head = f"{prefix}{op.index}/"
            op.kept = {k[len(head):]: v for k, v in tensors.items() if k.startswith(head)}
        out[(ot.module, ot.call_index)] = ot
    return out
