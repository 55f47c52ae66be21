"""Step into a module call: every torch operation inside it, with the source line that issued it.

The finest grain of a :class:`hooks.Trace` is a module call. :class:`OpRecorder` goes one level
down: a :class:`torch.overrides.TorchFunctionMode` sees every call of a torch function or tensor
method (``F.linear``, ``Tensor.masked_fill``, ``torch.softmax``, ``@``...) while it is active,
and records, per operation that returns a tensor:

* the function's qualified name (``torch.nn.functional.softmax``);
* the innermost module running (module forward pre/post hooks keep a stack);
* the frame that issued it: the innermost frame outside torch's own machinery and outside
  ``hooks`` — the user's ``file:line`` and that line's text (the ``forward`` of a torch
  module with children, in ``torch/nn/modules``, counts as source; the op of a module without
  children, ``F.linear`` of an ``nn.Linear``, is placed where the model called that module);
* input and output shapes, dtypes and the same statistics as module outputs
  (:class:`hooks.tensors.stats.TensorStats`), for at most :data:`MAX_OP_TENSORS` tensors per side;
  what a cap left out is counted and said in the op's notes, as a module call's are.

Metadata queries (``Tensor.shape``, ``size``, ``dim``, ``is_floating_point``...) return no
tensor and are not recorded: :func:`recorded` is the rule.

Where the ops come from (see :meth:`hooks.Trace.ops`): a capture remembers the root call's
arguments and the RNG state at its start (:class:`Replay`); stepping into a call re-runs that
forward under ``torch.no_grad`` with the RNG state restored and the recorder active only inside
the chosen call. Before the ops are shown, the replayed call's output statistics are compared
with the recorded ones; when they differ the replay *diverged* (the weights or inputs changed,
a non-deterministic op) and :class:`OpTrace` says so instead of showing ops of another
computation. ``hooks.capture(model, ops=[...])`` records the ops of matching modules during
the captured forward itself, so a saved trace carries them.

For the backward pass, :func:`locate_backward_origin` re-runs forward and backward under
``torch.autograd.detect_anomaly`` and names the forward op whose backward produced the first
non-finite gradient, with its source line (autograd's anomaly mode keeps each node's forward
stack).

Dimension names follow the rest of ``hooks``; nothing here imports textual, rich or tui.
"""

from __future__ import annotations

import linecache
import math
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils.weak import WeakIdKeyDictionary

from hooks.tensors import walk
from hooks.tensors.stats import NUM_BINS, StatsBatch, TensorStats
from hooks.tensors.walk import LeftOut, ModuleStack, dtype_name, find_tensors
from hooks.trace.records import TensorInfo

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_MODULES_DIR = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep
_HOOKS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: Most tensors of one op side (inputs or outputs) that get statistics (or
#: ``hooks.tensors.walk.MAX_TENSORS`` when that is smaller). Read at each op; what the cap or
#: ``hooks.tensors.walk.MAX_DEPTH`` left out is said in :attr:`OpRecord.notes`.
MAX_OP_TENSORS = 8


def recorded(output: Any) -> bool:
    """Whether an op with this output is recorded: it returned a tensor (or a tuple/list of
    tensors, e.g. ``split``). Metadata queries (``shape``, ``size()``, ``dim()``) return none."""
    if isinstance(output, torch.Tensor):
        return True
    return isinstance(output, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in output)


def _leaf_module_frame(f) -> bool:
    """Whether frame ``f`` runs a method of a torch module without children (``nn.Linear``,
    ``nn.LayerNorm``, ``nn.Embedding``...): its one functional call says nothing the op's name
    does not, the line that called the module does."""
    owner = f.f_locals.get("self")
    return isinstance(owner, nn.Module) and next(owner.children(), None) is None


def _user_frame(start) -> tuple[str, int, str]:
    """``(file, line, text)`` of the innermost frame that issued the op: not in ``hooks`` and
    not in torch, except the methods of torch modules with children in ``torch/nn/modules``
    (``nn.TransformerEncoderLayer``, ``nn.Sequential``; not ``module.py``). An op of a torch
    module without children (``F.linear`` of an ``nn.Linear``) is placed at the line that
    called that module: ``q, k, v = self.qkv(x).split(...)`` in the model, not ``linear.py``."""
    f = start
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(_HOOKS_DIR):
            f = f.f_back
            continue
        if path.startswith(_TORCH_DIR) and not (
            path.startswith(_MODULES_DIR) and not path.endswith("module.py")
            and not _leaf_module_frame(f)
        ):
            f = f.f_back
            continue
        text = linecache.getline(path, f.f_lineno).strip()
        return path, f.f_lineno, text
    return "", 0, ""


@dataclass(slots=True)
class OpRecord:
    """One torch operation inside a stepped-into module call.

    Attributes:
        index: position among the call's recorded ops (execution order).
        op: qualified name (``torch.nn.functional.softmax``, ``torch.Tensor.masked_fill``).
        module: qualified name of the innermost module running (the call itself or a child).
        file: source file of the frame that issued the op (absolute path).
        line: its line number.
        code: the text of that line, stripped.
        inputs: tensor arguments (``args[0]``, ``kwargs.attn_mask``...), statistics before the op.
        outputs: tensor results (``out``, ``out[1]``...).
        kept: full copies (on CPU) of the inputs and outputs of the first op that created NaN
            and of the first that created ±Inf (see :meth:`OpTrace.first_nonfinite`), by the
            tensors' paths, so a view can show the offending row; empty for other ops.
        notes: what was not recorded, one sentence each: tensors past :data:`MAX_OP_TENSORS`
            of a side (how many, the first left out) or deeper than ``hooks.tensors.walk.MAX_DEPTH``
            (:meth:`hooks.tensors.walk.LeftOut.notes`).
        sources: indices of the recorded ops whose outputs this op took as inputs (by tensor
            identity), or ``None`` for an op read from a trace saved before they were kept.
        mask_fill: whether this op wrote a mask value: an argument was ``-inf`` or
            ``torch.finfo(dtype).min`` (a scalar, or a tensor holding it) and the only
            non-finite values of its output are ``-inf`` (``masked_fill(mask, -inf)``,
            ``where(mask, s, -inf)``, ``torch.full(..., -inf)``, ``s + mask`` overflowing to
            ``-inf`` in half precision). See :meth:`OpTrace.masking`.
    """

    index: int
    op: str
    module: str
    file: str
    line: int
    code: str
    inputs: list[TensorInfo] = field(default_factory=list)
    outputs: list[TensorInfo] = field(default_factory=list)
    kept: dict[str, torch.Tensor] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sources: list[int] | None = None
    mask_fill: bool = False

    @property
    def location(self) -> str:
        """``model.py:23`` (the file's base name and line)."""
        return f"{os.path.basename(self.file)}:{self.line}" if self.file else "?"

    @property
    def short_op(self) -> str:
        """``softmax``, ``Tensor.masked_fill``, ``linear`` — the name without its package."""
        name = self.op
        for prefix in ("torch.nn.functional.", "torch._C._nn.", "torch._C._VariableFunctions.",
                       "torch."):
            if name.startswith(prefix):
                return name[len(prefix):]
        return name

    def created(self, kind: str) -> bool:
        """Whether this op created ``kind`` (``"nan"`` or ``"inf"``) values: its output holds
        them and none of its inputs did (for ``"inf"``: every input was finite)."""
        def count(t: TensorInfo) -> int:
            s = t.stats
            return 0 if s is None else (s.nan_count if kind == "nan" else s.inf_count)

        if not any(count(t) for t in self.outputs):
            return False
        if kind == "nan":
            return not any(count(t) for t in self.inputs)
        return all(t.stats is None or t.stats.finite for t in self.inputs)

    def offending_row(self) -> str | None:
        """For a kept op: where its first NaN (else ±Inf) output element is, and what the
        matching row (last dimension) of each same-shaped input holds, e.g. ``out[0, 0, 0, :]
        first NaN at [0, 0, 0, 0]; args[0][0, 0, 0, :] is all -inf (32 of 32)``."""
        out = self.kept.get("out")
        if out is None or not out.is_floating_point() or out.dim() == 0:
            return None
        bad = torch.isnan(out)
        if not bool(bad.any()):
            bad = torch.isinf(out)
        if not bool(bad.any()):
            return None
        where = [int(i) for i in bad.nonzero()[0]]
        row = tuple(where[:-1])
        idx = ", ".join(map(str, row))
        parts = [f"first {'NaN' if bool(torch.isnan(out).any()) else 'Inf'} of out at "
                 f"[{', '.join(map(str, where))}]"]
        for path, t in self.kept.items():
            if path == "out" or not isinstance(t, torch.Tensor) or t.shape != out.shape:
                continue
            r = t[row].float()
            n = r.numel()
            neg, pos, nan = int((r == -math.inf).sum()), int((r == math.inf).sum()), \
                int(torch.isnan(r).sum())
            if neg == n:
                what = f"all -inf ({n} of {n})"
            elif pos == n:
                what = f"all +inf ({n} of {n})"
            elif nan == n:
                what = f"all NaN ({n} of {n})"
            else:
                what = f"{neg} -inf, {pos} +inf, {nan} NaN, {n - neg - pos - nan} finite of {n}"
            parts.append(f"{path}[{idx}, :] is {what}")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "index": self.index, "op": self.op, "module": self.module, "file": self.file,
            "line": self.line, "code": self.code,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
        }
        if self.notes:  # absent when empty, as in traces saved before ops had notes
            d["notes"] = list(self.notes)
        if self.sources is not None:
            d["sources"] = list(self.sources)
        if self.mask_fill:
            d["mask_fill"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OpRecord:
        return cls(
            index=int(d["index"]), op=d["op"], module=d["module"], file=d.get("file", ""),
            line=int(d.get("line", 0)), code=d.get("code", ""),
            inputs=[TensorInfo.from_dict(t) for t in d.get("inputs", [])],
            outputs=[TensorInfo.from_dict(t) for t in d.get("outputs", [])],
            notes=[str(n) for n in d.get("notes", [])],
            sources=[int(i) for i in d["sources"]] if "sources" in d else None,
            mask_fill=bool(d.get("mask_fill", False)),
        )


@dataclass
class OpTrace:
    """The ops of one module call.

    Attributes:
        module: qualified name of the stepped-into module.
        call_index: its call index.
        ops: the recorded operations, in execution order.
        source: ``"capture"`` (recorded during the captured forward) or ``"replay"``.
        diverged: a sentence when the replayed call did not reproduce the recorded output
            statistics (then ``ops`` describe another computation and views must not show them
            as this call's), else ``""``.
        note: what else the reader should know (e.g. the call was not reached), or ``""``.
    """

    module: str
    call_index: int
    ops: list[OpRecord] = field(default_factory=list)
    source: str = "replay"
    diverged: str = ""
    note: str = ""

    def first_nonfinite(self) -> OpRecord | None:
        """Where non-finite values were created: the first op whose output holds NaN while no
        input did (a softmax over a row of only -inf, 0 * inf, sqrt of a negative); if no op
        created NaN, the first op whose output holds ±Inf while its inputs were finite (a
        division by zero, an overflow) and is not masking (:meth:`masking`: the causal
        ``masked_fill(mask, -inf)`` whose scores a softmax consumes); None if neither."""
        for op in self.ops:
            if op.created("nan"):
                return op
        masks = self.masking()
        for op in self.ops:
            if op.created("inf") and op.index not in masks:
                return op
        return None

    def nonfinite_sentence(self) -> str:
        """What :meth:`first_nonfinite` found, as a step-into header says it: ``first op
        creating non-finite values: #16 softmax at model.py:29``; when only masking made
        non-finite values, ``no op created non-finite values; masking: #13 Tensor.masked_fill
        at model.py:23 wrote -inf that a softmax takes``; else ``every op's output is
        finite``."""
        first = self.first_nonfinite()
        if first is not None:
            return (f"first op creating non-finite values: #{first.index} {first.short_op} at "
                    f"{first.location}")
        masks = sorted(self.masking())
        if masks:
            op = next(o for o in self.ops if o.index == masks[0])
            more = f" (and {len(masks) - 1} more)" if len(masks) > 1 else ""
            return (f"no op created non-finite values; masking: #{op.index} {op.short_op} at "
                    f"{op.location} wrote -inf that a softmax takes{more}")
        return "every op's output is finite"

    def masking(self) -> set[int]:
        """Indices of the ops that are masking, not a non-finite origin: a :attr:`OpRecord.
        mask_fill` whose ``-inf`` reaches a softmax (``softmax``, ``log_softmax``, ``exp`` of
        a hand-written one, ``logsumexp``, or ``scaled_dot_product_attention``'s
        ``attn_mask``) through ops whose outputs still hold Inf and no NaN (``triu``, ``+``,
        views). A fully masked row's NaN is the softmax's own and still found there. For ops of
        a trace saved before :attr:`OpRecord.sources` was kept, a mask fill followed by any
        softmax counts."""
        out: set[int] = set()
        consumers: dict[int, list[OpRecord]] = {}
        for op in self.ops:
            for i in op.sources or ():
                consumers.setdefault(i, []).append(op)
        for op in self.ops:
            if not op.mask_fill:
                continue
            if op.sources is None:
                if any(_softmax_like(o) for o in self.ops if o.index > op.index):
                    out.add(op.index)
                continue
            todo, seen = [op.index], set()
            while todo:
                i = todo.pop()
                if i in seen:
                    continue
                seen.add(i)
                for c in consumers.get(i, ()):
                    if _softmax_like(c):
                        out.add(op.index)
                        todo.clear()
                        break
                    if _holds_inf_only(c):
                        todo.append(c.index)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "call_index": self.call_index, "source": self.source,
                "diverged": self.diverged, "note": self.note,
                "ops": [o.to_dict() for o in self.ops]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OpTrace:
        return cls(module=d["module"], call_index=int(d["call_index"]),
                   ops=[OpRecord.from_dict(o) for o in d.get("ops", [])],
                   source=d.get("source", "replay"), diverged=d.get("diverged", ""),
                   note=d.get("note", ""))


#: Ops that take scores holding a mask's ``-inf`` and give its positions weight 0 (the last part
#: of the qualified name): a softmax, the ``exp`` of a hand-written one, ``logsumexp``, SDPA.
_SOFTMAX_OPS = frozenset({"softmax", "log_softmax", "_softmax", "_log_softmax", "exp", "exp_",
                          "logsumexp", "scaled_dot_product_attention"})
#: Ops that can write a mask value into scores (the last part of the qualified name).
_MASK_WRITERS = frozenset({
    "masked_fill", "masked_fill_", "where", "full", "full_like", "new_full", "fill_", "fill",
    "add", "add_", "__add__", "__iadd__", "__radd__", "sub", "__sub__", "masked_scatter",
    "masked_scatter_", "triu", "tril", "triu_", "tril_", "clamp", "clamp_min", "to", "float",
    "type_as",
})


def _softmax_like(op: OpRecord) -> bool:
    return op.op.rsplit(".", 1)[-1] in _SOFTMAX_OPS


def _holds_inf_only(op: OpRecord) -> bool:
    """Whether ``op``'s outputs hold Inf and no NaN (a mask passed on: ``triu``, ``+``)."""
    stats = [t.stats for t in op.outputs if t.stats is not None]
    return any(s.inf_count for s in stats) and not any(s.nan_count for s in stats)


def _is_mask_value(v: Any, floor: float) -> bool:
    """Whether ``v`` (a scalar or tensor argument) is ``-inf`` or at most ``floor`` (the
    output dtype's ``finfo.min``), or a floating-point tensor holding such a value."""
    if isinstance(v, torch.Tensor):
        return v.is_floating_point() and v.numel() > 0 and bool((v.detach() <= floor).any())
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v <= floor


def _writes_mask(name: str, args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether this op wrote a mask value (:attr:`OpRecord.mask_fill`): a cheap name check
    first, then one pass over the output (its non-finite values are all ``-inf``), then the
    arguments (one holds ``-inf`` or ``finfo.min``)."""
    if name.rsplit(".", 1)[-1] not in _MASK_WRITERS:
        return False
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() == 0:
        return False
    o = out.detach()
    if not bool(torch.isneginf(o).any()) or bool(torch.isnan(o).any()) \
            or bool(torch.isposinf(o).any()):
        return False
    floor = torch.finfo(o.dtype).min
    flat = list(args) + list(kwargs.values())
    flat += [x for v in flat if isinstance(v, (tuple, list)) for x in v]
    return any(_is_mask_value(v, floor) for v in flat)


def _tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an op's arguments, and inside tuples and lists of them (one level)."""
    flat = list(args) + list(kwargs.values())
    flat += [x for v in flat if isinstance(v, (tuple, list)) for x in v]
    return [v for v in flat if isinstance(v, torch.Tensor)]


class OpRecorder(TorchFunctionMode):
    """Record every torch operation while :attr:`armed` is true.

    The mode is entered for the whole forward (entering it is cheap); a caller arms it for the
    calls it wants (:func:`record_ops` arms it inside one module call). Statistics are computed
    in one :class:`~hooks.tensors.stats.StatsBatch` and filled in by :meth:`finish`.

    Args:
        model: the modules whose calls maintain the "innermost module" stack (forward pre/post
            hooks, removed by :meth:`remove`).
        bins: histogram bins per tensor.
    """

    def __init__(self, model: nn.Module | None = None, bins: int = NUM_BINS) -> None:
        super().__init__()
        self.armed = False
        self.ops: list[OpRecord] = []
        self._batch = StatsBatch(bins=bins)
        self._pending: list[tuple[TensorInfo, int]] = []
        self._kept: set[str] = set()  # "nan"/"inf": the first creator of each was kept
        self._modules = ModuleStack(model) if model is not None else None
        # which recorded op last returned each live tensor (OpRecord.sources)
        self._producers: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def remove(self) -> None:
        """Remove the module hooks."""
        if self._modules is not None:
            self._modules.remove()

    def _infos(self, parts: list[tuple[Any, str]], side: str,
               notes: list[str]) -> list[TensorInfo]:
        """Infos (statistics queued) of the tensors in ``parts`` (``(object, path)``, one op
        side); what the caps left out goes to ``notes``."""
        tensors: list[tuple[str, torch.Tensor]] = []
        cut = LeftOut()
        limit = min(MAX_OP_TENSORS, walk.MAX_TENSORS)
        for obj, path in parts:
            find_tensors(obj, path, tensors, [], left_out=cut, limit=limit)
        if cut.total:
            knob = ("hooks.trace.ops.MAX_OP_TENSORS" if MAX_OP_TENSORS <= walk.MAX_TENSORS
                    else "hooks.tensors.walk.MAX_TENSORS")
            notes.extend(cut.notes(side, len(tensors), who="an op", limit=limit, knob=knob,
                                   when="stepping in or capturing"))
        out = []
        for p, t in tensors:
            info = TensorInfo(p, list(t.shape), dtype_name(t.dtype), t.requires_grad)
            if not t.is_meta and (t.is_floating_point() or t.dtype == torch.bool
                                  or not t.is_complex()):
                slot = self._batch.add(t)
                if slot is not None:
                    self._pending.append((info, slot))
            out.append(info)
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.armed:
            return func(*args, **kwargs)
        # inputs are summarised before the op runs: an in-place op would overwrite them
        copies = None if len(self._kept) == 2 else _copies(args, kwargs)
        notes: list[str] = []
        ins = self._infos([(args, "args"), (kwargs, "kwargs")] if kwargs else [(args, "args")],
                          "inputs", notes)
        sources = sorted({self._producers[t] for t in _tensors_in(args, kwargs)
                          if t in self._producers})
        out = func(*args, **kwargs)
        if recorded(out):
            name = resolve_name(func) or getattr(func, "__qualname__", None) or str(func)
            path, line, code = _user_frame(sys._getframe(1))
            where = self._modules.current if self._modules is not None else None
            op = OpRecord(len(self.ops), name, where or "", path, line, code, ins,
                          self._infos([(out, "out")], "outputs", notes), notes=notes,
                          sources=sources, mask_fill=_writes_mask(name, args, kwargs, out))
            for t in _tensors_in((out,), {}):
                self._producers[t] = op.index
            if copies is not None and not op.mask_fill:  # a mask is rarely the origin
                kind = _created(copies, out, self._kept)
                if kind is not None:
                    self._kept.add(kind)
                    outs: list[tuple[str, torch.Tensor]] = []
                    find_tensors(out, "out", outs, [])
                    op.kept = {**copies,
                               **{p: t.detach().to("cpu", copy=True) for p, t in outs}}
            self.ops.append(op)
        return out

    def finish(self) -> list[OpRecord]:
        """Fill in every statistic and return the ops."""
        results = self._batch.finalize()
        for info, slot in self._pending:
            info.stats = results[slot]
        self._pending.clear()
        return self.ops


#: Largest tensor (bytes) copied for the first non-finite op.
KEEP_LIMIT = 64 << 20


def _copies(args: tuple, kwargs: dict) -> dict[str, torch.Tensor] | None:
    """CPU copies of an op's tensor inputs (taken before it runs), or None if they are too big
    or hold nothing but finite values (an op with finite inputs is the one worth showing)."""
    tensors: list[tuple[str, torch.Tensor]] = []
    find_tensors(args, "args", tensors, [])
    if kwargs:
        find_tensors(kwargs, "kwargs", tensors, [])
    if sum(t.numel() * t.element_size() for _, t in tensors) > KEEP_LIMIT:
        return None
    return {p: t.detach().to("cpu", copy=True) for p, t in tensors}


def _created(inputs: dict[str, torch.Tensor], out: Any, done: set[str]) -> str | None:
    """``"nan"`` if ``out`` holds NaN and no input did, else ``"inf"`` if it holds ±Inf and
    every input was finite, else None; kinds in ``done`` are not looked for again."""
    tensors: list[tuple[str, torch.Tensor]] = []
    find_tensors(out, "out", tensors, [])
    floats = [t for _, t in tensors if t.is_floating_point()]
    ins = [t for t in inputs.values() if t.is_floating_point()]
    if "nan" not in done and any(bool(torch.isnan(t).any()) for t in floats) \
            and not any(bool(torch.isnan(t).any()) for t in ins):
        return "nan"
    if "inf" not in done and any(bool(torch.isinf(t).any()) for t in floats) \
            and all(bool(torch.isfinite(t).all()) for t in ins):
        return "inf"
    return None


def _stats_agree(a: TensorStats | None, b: TensorStats | None, rtol: float = 1e-4) -> bool:
    if a is None or b is None:
        return a is b
    if (a.numel, a.nan_count, a.inf_count) != (b.numel, b.nan_count, b.inf_count):
        return False
    for x, y in ((a.mean, b.mean), (a.std, b.std), (a.min, b.min), (a.max, b.max)):
        if x is None or y is None:
            if x is not y:
                return False
            continue
        scale = max(abs(a.abs_max or 0.0), abs(b.abs_max or 0.0), 1e-30)
        if abs(x - y) > rtol * scale + 1e-12:
            return False
    return True


def compare_outputs(recorded_out: list[TensorInfo], replayed: list[TensorInfo]) -> str:
    """``""`` when the replayed call's outputs have the recorded statistics (relative 1e-4 of
    the largest magnitude), else one sentence saying what differs."""
    rec = {t.path: t for t in recorded_out}
    rep = {t.path: t for t in replayed}
    if set(rec) != set(rep):
        return (f"the replayed call returned {sorted(rep)} where the capture recorded "
                f"{sorted(rec)}")
    for path, t in rec.items():
        r = rep[path]
        if t.shape != r.shape:
            return f"{path}: shape {tuple(r.shape)} on replay, {tuple(t.shape)} in the capture"
        if not _stats_agree(t.stats, r.stats):
            def brief(s):
                if s is None:
                    return "no statistics"
                return (f"mean {s.mean:.6g}, std {s.std:.6g}, {s.nan_count} NaN"
                        if s.mean is not None else f"{s.nan_count} NaN, {s.inf_count} Inf")
            return (f"{path}: {brief(r.stats)} on replay vs {brief(t.stats)} in the capture "
                    "(weights, inputs or RNG changed since, or a non-deterministic op)")
    return ""


@dataclass
class Replay:
    """What a capture remembers to re-run its forward: the model, the root call's arguments
    and the RNG state at its start (CPU, and CUDA when initialised). Not saved with a trace.

    Attributes:
        model: the captured model (the root module).
        args: positional arguments of its first call.
        kwargs: keyword arguments of its first call.
        rng_cpu: ``torch.get_rng_state()`` before that call.
        rng_cuda: ``torch.cuda.get_rng_state_all()`` or None.
        training: the model's train flag at that call.
        batch: the :class:`hooks.Batch` the step ran on, when the caller says
            (``capture_step``), for a loss function that reads it (``batch.targets``).
        loss_fn: the step's ``loss_fn(output, batch)``, when it had one; with ``batch``, what
            re-runs the whole step (:func:`hooks.whatif.rerun.rerun_edited`).
    """

    model: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    rng_cpu: torch.Tensor
    rng_cuda: list[torch.Tensor] | None
    training: bool
    batch: Any = None
    loss_fn: Any = None

    @classmethod
    def at(cls, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Replay:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return cls(model, tuple(args), dict(kwargs), torch.get_rng_state(), cuda,
                   model.training)

    def run(self, recorder: OpRecorder | None = None, *,
            arm: Callable[[str, int], bool] | None = None,
            grad: bool = False) -> dict[tuple[str, int], list[TensorInfo]]:
        """Re-run the forward with the saved RNG state (restored afterwards, so the caller's
        random stream is untouched).

        Args:
            recorder: armed inside the calls for which ``arm(module, call_index)`` is true.
            arm: which calls to record.
            grad: run with autograd on (default off: nothing is trained).

        Returns:
            The outputs (with statistics) of the calls that were armed, by ``(module,
            call_index)``.
        """
        model = self.model
        outs: dict[tuple[str, int], list[TensorInfo]] = {}
        handles = []
        batch = StatsBatch()
        pending: list[tuple[TensorInfo, int]] = []
        if recorder is not None and arm is not None:
            handles = _arm_hooks(model, recorder, arm, outs, batch, pending)
        flags = [(m, m.training) for m in model.modules()]
        model.train(self.training)
        try:
            self._forward(recorder, grad)
        finally:
            for h in handles:
                h.remove()
            for m, f in flags:
                m.training = f
            if recorder is not None:
                recorder.armed = False
        results = batch.finalize()
        for info, slot in pending:
            info.stats = results[slot]
        return outs

    def _forward(self, recorder: OpRecorder | None, grad: bool) -> None:
        """Call the model on the saved arguments with the saved RNG state (CPU, and CUDA when
        saved), inside a forked RNG so the caller's stream is untouched; ``recorder`` entered
        around the call when given."""
        model = self.model
        devices = []
        if self.rng_cuda is not None:
            devices = list(range(len(self.rng_cuda)))
        with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(grad):
            torch.set_rng_state(self.rng_cpu)
            if self.rng_cuda is not None:
                torch.cuda.set_rng_state_all(self.rng_cuda)
            if recorder is not None:
                with recorder:
                    model(*self.args, **self.kwargs)
            else:
                model(*self.args, **self.kwargs)


def _arm_hooks(model: nn.Module, recorder: OpRecorder, arm: Callable[[str, int], bool],
               outs: dict[tuple[str, int], list[TensorInfo]], batch: StatsBatch,
               pending: list[tuple[TensorInfo, int]]) -> list:
    """Hooks on every module of ``model`` for :meth:`Replay.run`: each call is counted; in
    the calls ``arm(module, call_index)`` chooses, ``recorder`` is armed, and the call's
    output tensors go to ``outs`` by ``(module, call_index)``, their statistics queued on
    ``batch`` (``pending``). Returns the hook handles."""
    handles = []
    counts: dict[str, int] = {}

    def pre(name, mod, args):
        ci = counts.get(name, 0)
        counts[name] = ci + 1
        if arm(name, ci):
            recorder.armed = True
            mod._mdb_replay_ci = ci  # type: ignore[attr-defined]
        return None

    def post(name, mod, args, output):
        ci = getattr(mod, "_mdb_replay_ci", None)
        if ci is None:
            return None
        del mod._mdb_replay_ci
        recorder.armed = False
        tensors: list[tuple[str, torch.Tensor]] = []
        if isinstance(output, torch.Tensor):
            tensors = [("out", output)]
        else:  # capped as the capture's walk was, so the paths compare
            find_tensors(output, "out", tensors, [], left_out=LeftOut())
        infos = []
        for p, t in tensors:
            info = TensorInfo(p, list(t.shape), dtype_name(t.dtype), t.requires_grad)
            slot = batch.add(t)
            if slot is not None:
                pending.append((info, slot))
            infos.append(info)
        outs[(name, ci)] = infos
        return None

    for name, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(
            lambda mod, args, n=name: pre(n, mod, args)))
        handles.append(m.register_forward_hook(
            lambda mod, args, out, n=name: post(n, mod, args, out)))
    return handles


def record_ops(replay: Replay, module: str, call_index: int = 0,
               expected: list[TensorInfo] | None = None) -> OpTrace:
    """Step into ``module``'s ``call_index``-th call by replaying the forward.

    Args:
        replay: the capture's :class:`Replay`.
        module: qualified module name (``""`` for the root).
        call_index: which call of it.
        expected: the call's recorded outputs; when given, a replay that does not reproduce
            their statistics is marked :attr:`OpTrace.diverged`.

    Returns:
        OpTrace: the ops (``source="replay"``).
    """
    rec = OpRecorder(replay.model)
    try:
        outs = replay.run(rec, arm=lambda n, ci: n == module and ci == call_index)
    finally:
        rec.remove()
    ops = rec.finish()
    trace = OpTrace(module, call_index, ops, "replay")
    got = outs.get((module, call_index))
    if got is None:
        trace.note = (f"the replayed forward did not call {module or '<root>'} a "
                      f"{call_index + 1}{'st' if call_index == 0 else 'th'} time")
        trace.ops = []
        trace.diverged = trace.note
    elif expected is not None:
        trace.diverged = compare_outputs(expected, got)
    return trace


@dataclass
class BackwardOrigin:
    """The forward op whose backward produced the first non-finite gradient.

    Attributes:
        node: the autograd node, e.g. ``SqrtBackward0``.
        op: the forward op it belongs to, e.g. ``sqrt`` (the node's name without ``Backward``).
        file: the user's source file of the forward op.
        line: its line.
        code: the line's text.
        module: the innermost module running when the forward op ran (``""`` is the root), or
            None when unknown.
        message: what was found, in words.
    """

    node: str
    op: str
    file: str
    line: int
    code: str
    module: str | None = None
    message: str = ""

    @property
    def location(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}" if self.file else "?"

    def describe(self) -> str:
        """``SqrtBackward0 (forward sqrt at model.py:23: y = x.sqrt())``."""
        where = f" at {self.location}: {self.code}" if self.file else ""
        return f"{self.node} (forward {self.op}{where})"

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "op": self.op, "file": self.file, "line": self.line,
                "code": self.code, "module": self.module, "message": self.message}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BackwardOrigin:
        return cls(d["node"], d["op"], d.get("file", ""), int(d.get("line", 0)),
                   d.get("code", ""), d.get("module"), d.get("message", ""))


def _frame_from_stack(frames: list[str]) -> tuple[str, int, str]:
    """The innermost user frame of a forward stack as anomaly mode stores it (formatted
    ``File "x.py", line 3, in f`` entries, outermost first)."""
    import re

    for entry in reversed(frames):
        m = re.search(r'File "([^"]+)", line (\d+)', entry)
        if m is None:
            continue
        path, line = m.group(1), int(m.group(2))
        if path.startswith(_HOOKS_DIR):
            continue
        if path.startswith(_TORCH_DIR) and not (
            path.startswith(_MODULES_DIR) and not path.endswith("module.py")
        ):
            continue
        return path, line, linecache.getline(path, line).strip()
    return "", 0, ""


class _GradFnOwners(TorchFunctionMode):
    """Map each autograd node created by a torch function to the innermost module running."""

    def __init__(self, model: nn.Module | None) -> None:
        super().__init__()
        self.owner: dict[int, str] = {}
        self._modules = ModuleStack(model) if model is not None else None
        # which recorded op last returned each live tensor (OpRecord.sources)
        self._producers: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def remove(self) -> None:
        if self._modules is not None:
            self._modules.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        where = self._modules.current if self._modules is not None else None
        if where is not None:
            tensors: list[tuple[str, torch.Tensor]] = []
            find_tensors(out, "out", tensors, [])
            for _, t in tensors:
                if t.grad_fn is not None:
                    self.owner.setdefault(id(t.grad_fn), where)
        return out


def _all_finite(grads) -> bool:
    return all(g is None or not g.is_floating_point() or bool(torch.isfinite(g).all())
               for g in grads)


def locate_backward_origin(run_loss: Callable[[], torch.Tensor],
                           model: nn.Module | None = None) -> BackwardOrigin | None:
    """Name the forward op whose backward produced the first non-finite gradient.

    Runs the forward under ``torch.autograd.set_detect_anomaly(True)``, which stores each
    autograd node's forward stack, hooks every node of the loss's graph
    (``Node.register_hook``), runs the backward, and returns the first node (in the order
    autograd ran them) that turned finite incoming gradients into NaN/Inf ones. Parameter
    ``.grad`` fields receive this backward's gradients: save and restore them around the call.

    Args:
        run_loss: runs the forward and returns the 0-dim loss (called once).
        model: when given, the innermost module running at the forward op is named too.

    Returns:
        BackwardOrigin | None: None when every gradient was finite, or when the loss itself
        was already non-finite (then the forward is where to look).
    """
    owners = _GradFnOwners(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled"
            with torch.autograd.set_detect_anomaly(True, check_nan=False), owners:
                loss = run_loss()
    finally:
        owners.remove()
    if loss.grad_fn is None or not bool(torch.isfinite(loss.detach()).all()):
        return None
    nodes, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        n = todo.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        nodes.append(n)
        todo.extend(nxt for nxt, _ in n.next_functions)
    found: list[Any] = []

    def make(node):
        def hook(grad_inputs, grad_outputs):
            if not found and not _all_finite(grad_inputs) and _all_finite(grad_outputs):
                found.append(node)
        return hook

    handles = [n.register_hook(make(n)) for n in nodes if type(n).__name__ != "AccumulateGrad"]
    try:
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    if not found:
        return None
    import re

    node = found[0]
    name = type(node).__name__
    frames = node.metadata.get("traceback_", []) if hasattr(node, "metadata") else []
    path, line, code = _frame_from_stack(list(frames))
    op = re.sub(r"Backward\d*$", "", name)
    op = re.sub(r"(?<!^)(?=[A-Z])", "_", op).lower() if op else "?"
    return BackwardOrigin(name, op, path, line, code, owners.owner.get(id(node)),
                          f"{name} turned finite gradients into NaN/Inf")


def backward_origin(replay: Replay,
                    loss_of_output: Callable[[Any], torch.Tensor]) -> BackwardOrigin | None:
    """:func:`locate_backward_origin` on a capture's forward: re-run it from the replay's
    arguments and RNG state, take ``loss_of_output(output)`` and run its backward. The
    parameters' ``.grad``, the train/eval flags and the global RNG state are restored.

    Args:
        replay: the capture's :class:`Replay`.
        loss_of_output: the captured loss convention, e.g. ``lambda out:
            hooks.select_loss(out, loss_fn, batch).loss``.
    """
    model = replay.model
    saved = [(p, p.grad) for p in model.parameters()]
    flags = [(m, m.training) for m in model.modules()]
    devices = list(range(len(replay.rng_cuda))) if replay.rng_cuda is not None else []
    for p, _ in saved:
        p.grad = None

    def run_loss() -> torch.Tensor:
        torch.set_rng_state(replay.rng_cpu)
        if replay.rng_cuda is not None:
            torch.cuda.set_rng_state_all(replay.rng_cuda)
        return loss_of_output(model(*replay.args, **replay.kwargs))

    model.train(replay.training)
    try:
        with torch.random.fork_rng(devices=devices):
            return locate_backward_origin(run_loss, model)
    finally:
        for p, g in saved:
            p.grad = g
        for m, f in flags:
            m.training = f
