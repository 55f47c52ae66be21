"""A trace read from a file or a run database is untrusted data: :func:`check_trace` checks
every field of the rebuilt :class:`hooks.Trace` against its declared type before any view
uses it, so a trace changed outside mdb (a name that is a number, a depth of 10**30, a shape
of text, ``NaN`` where a capture never writes one, a routing tensor of the wrong shape) is one
:class:`hooks.trace.trace.TraceFormatError` line, never an exception deep inside a table or a
screen.

Never imports textual, rich or tui.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any

#: Largest integer a trace field holds (int64, what safetensors and torch index with).
MAX_INT = 2**63 - 1
#: Deepest module nesting a trace may record (a view indents by the depth).
MAX_DEPTH = 4096
#: Fields a capture always writes as finite numbers (a statistic, a loss, may be NaN or Inf).
_FINITE = frozenset({"time_ms", "dropout", "scale"})
#: Fields that count or index, never negative (``-1``: ``end_order`` not set yet).
_NON_NEGATIVE = frozenset({"index", "call_index", "depth", "own_params", "total_params",
                           "num_experts", "top_k", "forward_index", "numel", "nan_count",
                           "inf_count", "hist_count", "recomputed", "kept_bytes",
                           # hooks.trace.memory: bytes and the indices of the step's memory
                           "call", "bytes", "saved_bytes", "square_bytes", "param_saved_bytes",
                           "output_bytes", "retained_bytes", "grad_bytes", "optimizer_bytes",
                           "live_bytes",
                           "seq", "peak_bytes", "peak_point", "param_bytes", "buffer_bytes",
                           "master_bytes", "unattributed_bytes"})


class TraceFormatError(ValueError):
    """A file that is not a trace, a trace of an unsupported schema version, or a trace whose
    fields are not what a capture writes (re-exported as ``hooks.trace.trace.TraceFormatError``)."""


def _error(where: str, what: str) -> ValueError:
    return TraceFormatError(f"malformed trace: {where} {what}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a hint naming a type only imported for type checkers: not checked
        return {}


@functools.cache
def _checker(hint: Any) -> typing.Callable[[Any], bool]:
    """A function telling whether a value is of the declared type ``hint`` (the element types
    of a list or a dict too; an ``int`` is a ``float``, a ``bool`` is neither), built once per
    hint: a trace holds tens of thousands of values."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or isinstance(hint, typing.TypeVar):
        return lambda v: True
    if origin in (typing.Union, types.UnionType):
        if len(args) == 2 and type(None) in args:  # X | None
            other = _checker(next(a for a in args if a is not type(None)))
            return lambda v: v is None or other(v)
        parts = [_checker(a) for a in args]
        return lambda v: any(p(v) for p in parts)
    if hint is type(None) or hint is None:
        return lambda v: v is None
    if hint is bool:
        return lambda v: type(v) is bool
    if hint is int:
        return lambda v: type(v) is int
    if hint is float:
        return lambda v: type(v) is float or type(v) is int
    if origin is list:
        each = _checker(args[0]) if args else _checker(Any)
        return lambda v: type(v) is list and all(map(each, v))
    if origin is dict:
        key, val = (_checker(args[0]), _checker(args[1])) if args else (_checker(Any),) * 2
        return lambda v: type(v) is dict and all(key(k) and val(x) for k, x in v.items())
    kind = origin or hint
    if isinstance(kind, type):
        return lambda v: isinstance(v, kind)
    return lambda v: True


def digits(value: int) -> int:
    """How many decimal digits ``abs(value)`` has, without ``str`` (refused past 4,300 digits)
    or ``float`` (which overflows past 308)."""
    n = max(int(abs(value).bit_length() * 0.30102999566398120), 1)  # log10(2): n or n - 1
    return n + 1 if abs(value) >= 10**n else n


@functools.cache
def dtype_names() -> frozenset[str]:
    """The names a capture writes for a tensor's dtype: ``str(dtype)`` less ``torch.``
    (``float32``, ``bfloat16``, ``int64``, ``bool``), for every dtype this torch has."""
    import torch

    return frozenset(str(d).removeprefix("torch.") for d in vars(torch).values()
                     if isinstance(d, torch.dtype))


def _check_number(name: str, value: Any, where: str) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, str):
        if name == "dtype" and value not in dtype_names():
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:39] + "…"
            raise _error(where, f"is {shown}, not the name of a torch dtype (float32, int64…)")
        return
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise _error(where, f"is an integer of {digits(value)} digits, larger than a "
                                "trace holds")
        if name in _NON_NEGATIVE and value < 0:
            raise _error(where, f"is {value}, where a count or an index is never negative")
        if name == "depth" and value > MAX_DEPTH:
            raise _error(where, f"is {value}, deeper than {MAX_DEPTH} modules")
    elif isinstance(value, float) and name in _FINITE and not math.isfinite(value):
        raise _error(where, f"is {value}, where a capture writes a finite number")


def _check_value(name: str, value: Any, where: str, depth: int) -> None:
    if depth > 64:
        raise _error(where, "nests too deeply")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        _check_record(value, where, depth + 1)
    elif isinstance(value, (list, tuple)):
        if name == "shape" and any(isinstance(d, int) and d < 0 for d in value):
            raise _error(where, f"is {list(value)[:8]}, a shape with a negative size")
        if all(type(v) is int or type(v) is float for v in value):  # a histogram, a shape
            ints = [v for v in value if type(v) is int]
            if ints and max(map(abs, ints)) > MAX_INT:
                raise _error(where, "holds an integer larger than a trace holds")
            if ints and name in _NON_NEGATIVE | {"hist"} and min(ints) < 0:
                raise _error(where, "holds a negative count")
            return
        for i, v in enumerate(value):
            _check_value(name, v, f"{where}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_value(name, v, f"{where}[{k!r}]", depth + 1)
    else:
        _check_number(name, value, where)


def _check_record(record: Any, where: str, depth: int = 0) -> None:
    hints = _hints(type(record))
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        at = f"{where}.{f.name}"
        hint = hints.get(f.name, Any)
        if not _checker(hint)(value):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:39] + "…"
            raise _error(at, f"is {shown}, not of the type {_words(hint)}")
        _check_value(f.name, value, at, depth)


def _words(hint: Any) -> str:
    text = str(hint).replace("typing.", "").replace("torch.", "")
    return text.removeprefix("<class '").removesuffix("'>")


def _check_routing(i: int, r: Any) -> None:
    n_k = tuple(r.top_k_ids.shape)
    where = f"routing[{i}] ({r.module})"
    if r.top_k_ids.dim() != 2 or tuple(r.top_k_weights.shape) != n_k:
        raise _error(where, f"has top-k ids of shape {list(n_k)} and weights of shape "
                            f"{list(r.top_k_weights.shape)}, not two equal (tokens, k)")
    if r.tokens_per_expert.dim() != 1 or r.tokens_per_expert.numel() != r.num_experts:
        raise _error(where, f"counts tokens for {list(r.tokens_per_expert.shape)} experts, "
                            f"not its {r.num_experts}")
    if n_k[1] != r.top_k or r.top_k > r.num_experts:
        raise _error(where, f"chooses {n_k[1]} experts per token, top_k is {r.top_k} of "
                            f"{r.num_experts}")
    if r.top_k_ids.numel() and (int(r.top_k_ids.min()) < 0
                                or int(r.top_k_ids.max()) >= r.num_experts):
        raise _error(where, f"names an expert outside 0..{r.num_experts - 1}")
    for name in ("router_probs", "router_logits", "router_scores"):
        t = getattr(r, name)
        if t is not None and tuple(t.shape) != (n_k[0], r.num_experts):
            raise _error(where, f"has {name} of shape {list(t.shape)}, not (tokens "
                                f"{n_k[0]}, experts {r.num_experts})")


def _check_attention(i: int, a: Any) -> None:
    p = a.probs
    where = f"attention[{i}] ({a.module})"
    if p.dim() < 2 or p.shape[-1] != p.shape[-2]:
        raise _error(where, f"has attention probabilities of shape {list(p.shape)}, not "
                            "(..., queries, keys) with as many keys as queries")
    if a.mask is not None and tuple(a.mask.shape[-2:]) != tuple(p.shape[-2:]):
        raise _error(where, f"has a mask of shape {list(a.mask.shape)} for probabilities of "
                            f"shape {list(p.shape)}")


def _check_memory(mem: Any, n: int) -> None:
    """Every call a memory record names is one of the ``n`` recorded calls; the peak is a
    point of the timeline and its largest value; a phase is one the tracker writes."""
    named = [(f"memory.calls[{i}].call", c.call) for i, c in enumerate(mem.calls)]
    named += [(f"memory.at_peak[{i}].call", a.call) for i, a in enumerate(mem.at_peak)]
    named += [(f"memory.timeline[{i}].call", p.call) for i, p in enumerate(mem.timeline)
              if p.call is not None]
    for where, call in named:
        if call >= n:
            raise _error(where, f"is {call}, not one of the {n} calls")
    for i, p in enumerate(mem.timeline):
        if p.phase not in ("start", "forward", "backward", "end"):
            raise _error(f"memory.timeline[{i}].phase", f"is {p.phase[:40]!r}, not start, "
                                                        "forward, backward or end")
    if mem.timeline:
        if mem.peak_point >= len(mem.timeline):
            raise _error("memory.peak_point", f"is {mem.peak_point}, not one of the "
                                              f"{len(mem.timeline)} points of the timeline")
        if mem.peak_bytes != max(p.live_bytes for p in mem.timeline):
            raise _error("memory.peak_bytes", f"is {mem.peak_bytes}, not the timeline's "
                                              "largest live bytes")


#: The ``meta`` fields whose type the views rely on, and the type a capture (``mdb capture``,
#: ``hooks.run``, a what-if rerun) writes each as. The others (a loss, the values logged, a
#: caller's own keys) may hold any JSON: the views show what is not a number as text.
META_TYPES: dict[str, Any] = {
    "description": str | None,
    "tokens": list[str] | None,
    "input_shape": list[int] | None,
    "config": dict[str, Any] | None,
}
#: The ``meta["config"]`` fields the views read (HF config names), and their types.
META_CONFIG_TYPES: dict[str, Any] = {
    "router_aux_loss_coef": float | None,
    "num_experts_per_tok": int | None,
    "num_local_experts": int | None,
}


def _check_meta(meta: dict[str, Any]) -> None:
    """Each field of :data:`META_TYPES` that ``meta`` holds of its type, and the config's
    fields of :data:`META_CONFIG_TYPES` (other fields: any JSON)."""
    fields = [(f"trace.meta[{k!r}]", meta[k], hint) for k, hint in META_TYPES.items()
              if k in meta]
    config = meta.get("config") or {}
    fields += [(f"trace.meta['config'][{k!r}]", config[k], hint)
               for k, hint in META_CONFIG_TYPES.items() if k in config]
    for where, value, hint in fields:
        if not _checker(hint)(value):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:39] + "…"
            raise _error(where, f"is {shown}, not of the type {_words(hint)}")


def check_trace(trace: Any) -> None:
    """Check a :class:`hooks.Trace` rebuilt from untrusted data: every field of every record
    of its declared type (a module name is text, a shape a list of sizes, a statistic a
    number), integers within int64, counts and indices not negative, a module depth of at
    most :data:`MAX_DEPTH`, timings finite, routing and attention tensors of consistent
    shapes, each parent or forward index naming a recorded call, and the ``meta`` fields the
    views read of the types a capture writes (:data:`META_TYPES`: a description is text,
    tokens a list of text, the config an object whose ``router_aux_loss_coef`` is a number).

    Raises:
        hooks.trace.trace.TraceFormatError: one line naming the first field that is wrong.
    """
    _check_record(trace, "trace")
    n = len(trace.forward)
    for i, c in enumerate(trace.forward):
        if c.parent is not None and not 0 <= c.parent < n:
            raise _error(f"forward[{i}].parent", f"is {c.parent}, not one of the {n} calls")
    for i, g in enumerate(trace.backward):
        if not 0 <= g.forward_index < max(n, 1):
            raise _error(f"backward[{i}].forward_index",
                         f"is {g.forward_index}, not one of the {n} calls")
    for i, r in enumerate(trace.routing):
        _check_routing(i, r)
    for i, a in enumerate(trace.attention):
        _check_attention(i, a)
    if trace.memory is not None:
        _check_memory(trace.memory, n)
    if not isinstance(trace.meta, dict):
        raise _error("trace.meta", "is not an object")
    _check_meta(trace.meta)
