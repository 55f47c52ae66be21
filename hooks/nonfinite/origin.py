"""Where a non-finite value started: a parameter, a forward call, or a gradient.

One answer for every path that meets a NaN or an Inf (:class:`hooks.train.trainer.Trainer`,
``mdb overfit``, :func:`hooks.run`'s ``watch``), looked for in this order:

1. **A parameter that holds NaN/Inf** (read while the weights are still the ones the forward
   used, i.e. before an optimizer applies a non-finite gradient): the module that owns it.
2. **The first non-finite forward output**, whether or not the loss is finite
   (:meth:`hooks.Trace.first_nonfinite`), unless it is masking (a module that returns a causal
   mask of ``-inf``: stepping into it finds only mask fills; then the first call that created
   NaN from inputs without NaN): a kernel can return finite values for non-finite
   inputs (on some CPUs the fused ``F.scaled_dot_product_attention`` returns 0 for a query row
   of NaN), leaving the loss finite and the gradients NaN; the origin is still the forward
   call, and :attr:`Origin.note` names the enclosing call that returned finite values.
3. **The first non-finite gradient** in the order autograd produced them.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hooks.engine.capture import capture
from hooks.sharded.stats import is_dtensor, local_piece
from hooks.trace.ops import Replay
from hooks.trace.records import NonFinite

__all__ = [
    "Origin",
    "NonFiniteSentinel",
    "first_nonfinite_tensor",
    "gradient_origin",
    "nonfinite_counts",
    "nonfinite_weight_notes",
    "parameter_origin",
    "replay_origin",
    "trace_origin",
]


@dataclass(frozen=True)
class Origin:
    """Where a non-finite value started.

    Attributes:
        module: Qualified name of the module (``""`` for the root module).
        direction: ``"parameter"`` (the module's own weight held NaN/Inf), ``"forward"`` (its
            output was non-finite while its inputs were finite), ``"backward"`` (the gradient
            of its output was the first non-finite gradient) or ``"gradient"`` (only the
            parameters' gradients were seen: ``module`` owns the first non-finite one).
        detail: What was non-finite, without the module's name, e.g. ``its weight holds 1 NaN
            of 4096 values``.
        note: When the loss stayed finite although a forward output was not: which enclosing
            call returned finite values from it; else ``None``.
        rank: For a sharded (FSDP2, tensor-parallel) parameter: the one rank whose own shard
            holds the NaN/Inf, when a capture's ``nonfinite_shard`` note names it; else
            ``None``.
    """

    module: str
    direction: str
    detail: str
    note: str | None = None
    rank: int | None = None

    def sentence(self) -> str:
        """``first in blocks.1.mlp.0 (parameter): its weight holds 1 NaN of 4096 values``, with
        the note after a semicolon."""
        text = f"first in {self.module or 'the root module'} ({self.direction}): {self.detail}"
        return f"{text}; {self.note}" if self.note else text

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-serialisable dict."""
        return dataclasses.asdict(self)


def _output(path: str) -> str:
    """``output`` for a call's only output (``out``), ``output out[1]`` for one of several."""
    return "output" if path == "out" else f"output {path}"


def _stats_phrase(stats: Any) -> str:
    return _phrase(stats.nan_count, stats.inf_count, stats.numel)


def _phrase(nan: int, inf: int, numel: int) -> str:
    parts = [f"{nan} NaN"] if nan else []
    parts += [f"{inf} Inf"] if inf else []
    return f"{' and '.join(parts) or 'no NaN/Inf'} of {numel} values"


def nonfinite_counts(t: torch.Tensor) -> str:
    """``1 NaN of 4096 values``, ``2 NaN and 1 Inf of 64 values``."""
    t = local_piece(t)
    return _phrase(int(torch.isnan(t).sum()), int(torch.isinf(t).sum()), t.numel())


def _all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN/Inf: its sum is finite (one pass, no allocation: NaN and Inf
    reach the sum), else the exact check (finite values can overflow a sum)."""
    t = t.detach()
    if t.numel() == 0 or math.isfinite(float(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def first_nonfinite_tensor(obj: Any) -> torch.Tensor | None:
    """The first floating-point tensor in ``obj`` (a tensor, or nested tuples, lists, mappings
    and dataclasses of them) that holds NaN or ±Inf; ``None`` when all are finite."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and not _all_finite(obj):
            return obj
        return None
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, (list, tuple)):
        for item in obj:
            t = first_nonfinite_tensor(item)
            if t is not None:
                return t
    return None


def parameter_origin(model: nn.Module) -> Origin | None:
    """The module whose own parameter holds NaN/Inf, first in ``named_parameters`` order.

    Only meaningful while the weights are the ones the failing forward used (before an
    optimizer applied a non-finite gradient, which spreads NaN into every weight).

    Args:
        model: The model.

    Returns:
        The origin (``direction="parameter"``), the other bad parameters counted in ``detail``;
        ``None`` when every parameter is finite.
    """
    bad = [(name, p) for name, p in model.named_parameters()
           if p.is_floating_point() and not bool(torch.isfinite(local_piece(p)).all())]
    if not bad:
        return None
    name, p = bad[0]
    module, _, leaf = name.rpartition(".")
    more = f" (and {len(bad) - 1} more parameters)" if len(bad) > 1 else ""
    return Origin(module, "parameter", f"its {leaf} holds {nonfinite_counts(p)}{_shard(p)}{more}")


def _shard(p: torch.Tensor) -> str:
    """`` in rank 1's shard`` for a DTensor (only this rank's shard is looked at: no
    collective), else nothing."""
    if not is_dtensor(p):
        return ""
    import torch.distributed as dist

    return f" in rank {dist.get_rank()}'s shard (of the full {list(p.shape)})"


def _sharded(model: nn.Module) -> bool:
    """Whether ``model`` has DTensor parameters (FSDP2, tensor parallel)."""
    return any(is_dtensor(p) for p in model.parameters())


def _swallow_note(trace: Any, module: str, stayed: str) -> str:
    """Why ``stayed`` (``"the loss"``) is finite although ``module``'s output was not: the
    innermost recorded call enclosing ``module`` whose outputs are all finite."""
    ancestors = [r for r in trace.forward if module.startswith(r.module + ".") or (
        r.module == "" and module)]
    finite = [r for r in ancestors
              if all(t.stats is None or t.stats.finite for t in r.outputs)]
    if finite:
        inner = max(finite, key=lambda r: len(r.module))
        where = f"{inner.module or 'the root module'} ({inner.module_type})"
        return (f"{stayed} stayed finite: {where} returned finite values from it (a kernel "
                f"such as fused attention can drop NaN)")
    return f"{stayed} stayed finite: a later operation returned finite values from it"


def trace_origin(trace: Any, *, stayed_finite: str | None = None) -> Origin | None:
    """The origin a capture shows: its first non-finite forward output, else its first
    non-finite gradient (:meth:`hooks.Trace.first_nonfinite`). A forward output that turned
    non-finite from finite inputs in a module whose own parameter the capture saw non-finite
    (a ``nonfinite_shard`` note of a sharded parameter, naming the rank whose shard holds it)
    is blamed on that parameter (``direction="parameter"``, :attr:`Origin.rank`), as
    :func:`parameter_origin` would.

    Args:
        trace: A :class:`hooks.Trace` of the failing step.
        stayed_finite: What stayed finite although a forward output was not (``"the loss"``):
            a forward origin then gets the note that names the call that returned finite
            values from it.

    Returns:
        The origin, or ``None`` when the trace holds nothing non-finite.
    """
    hit = trace.first_nonfinite("forward")
    masked = hit is not None and _masking_call(trace, hit)
    if masked:
        hit = _first_nan_creator(trace)  # a mask module's -inf is masking, not the origin
    if hit is not None:
        rec = trace.forward[hit.index]
        fed = None if masked else next(
            (t for t in rec.inputs if t.stats is not None and not t.stats.finite), None)
        detail = (f"its {_output(hit.tensor)} ({hit.module_type}, call {hit.call_index}) holds "
                  f"{_stats_phrase(hit.stats)}")
        own = _own_nonfinite_param(trace, hit.module) if fed is None else None
        if own is not None:  # the module's own weight made it: blame the weight, as uncaptured
            leaf, what, rank = own
            return Origin(hit.module, "parameter", f"its {leaf} holds {what}; then {detail}",
                          rank=rank)
        if fed is not None:  # no recorded call made it: it came in with the inputs
            detail += (f", and its input {fed.path} already held {_stats_phrase(fed.stats)} "
                       "(non-finite values in the data given to the model?)")
        elif masked:
            detail += " while its inputs held no NaN (the -inf of a mask, which is masking)"
        elif rec.inputs:
            detail += " while its inputs were finite"
        note = _swallow_note(trace, hit.module, stayed_finite) if stayed_finite else None
        return Origin(hit.module, "forward", detail, note)
    hit = trace.first_nonfinite("backward")
    if hit is not None:
        detail = (f"the gradient of its {_output(hit.tensor)} ({hit.module_type}, call "
                  f"{hit.call_index}) holds {_stats_phrase(hit.stats)}")
        return Origin(hit.module, "backward", detail)
    return None


def _masking_call(trace: Any, hit: Any) -> bool:
    """Whether the call ``hit`` names made only masking (a module that returns a causal mask
    of ``-inf``, or fills scores with it): its output holds Inf and no NaN, and stepping into it
    (:meth:`hooks.Trace.ops`, a replay of the captured forward) finds no op creating NaN and
    only mask fills (:attr:`hooks.trace.ops.OpRecord.mask_fill`) creating Inf; the softmax that
    takes a mask module's output runs in another call, whose NaN, if a row is fully masked, is
    found there. False when the ops cannot be had (a trace from disk, a replay that
    diverged)."""
    if hit.stats is None or hit.stats.nan_count or not hit.stats.inf_count:
        return False
    try:
        ot = trace.ops(hit.module, hit.call_index)
    except (LookupError, KeyError, RuntimeError):
        return False
    if ot.diverged or any(op.created("nan") for op in ot.ops):
        return False
    made = [op for op in ot.ops if op.created("inf")]
    return bool(made) and all(op.mask_fill for op in made)


def _first_nan_creator(trace: Any) -> Any:
    """The first call (in the order calls finished) whose output holds NaN while none of its
    inputs did (Inf in an input, a mask, is allowed): :meth:`hooks.Trace.first_nonfinite`'s
    record for it, or None."""
    for rec in sorted(trace.forward, key=lambda r: (r.end_order < 0, r.end_order)):
        bad = next((t for t in rec.outputs if t.stats and t.stats.nan_count), None)
        if bad is None or any(t.stats and t.stats.nan_count for t in rec.inputs):
            continue
        return NonFinite("forward", rec.index, rec.module, rec.module_type, rec.call_index,
                         bad.path, bad.stats)
    return None


#: A capture's ``nonfinite_shard`` note about a weight: ``l2.weight: its weight holds 1 NaN of
#: 528 values, in rank 1's shard`` (:mod:`hooks.sharded.stats`).
_SHARD_NOTE = re.compile(r"^(?P<name>\S+): its weight holds (?P<what>.+)$")
_ONE_RANK = re.compile(r"in rank (\d+)'s shard")


def nonfinite_weight_notes(trace: Any, module: str | None = None) -> list[str]:
    """The messages of a capture's ``nonfinite_shard`` notes about a non-finite weight (not a
    gradient), e.g. ``l2.weight: its weight holds 1 NaN of 528 values, in rank 1's shard``;
    with ``module``, only those about parameters registered directly on it. Empty for a
    trace of an unsharded model (its notes have no such kind)."""
    out = []
    for n in getattr(trace, "notes", ()):
        m = _SHARD_NOTE.match(n.message) if n.kind == "nonfinite_shard" else None
        if m is not None and (module is None or m["name"].rpartition(".")[0] == module):
            out.append(n.message)
    return out


def _own_nonfinite_param(trace: Any, module: str) -> tuple[str, str, int | None] | None:
    """``(leaf, what, rank)`` for the first parameter registered directly on ``module`` whose
    weight a capture's ``nonfinite_shard`` note says is non-finite (the weight as read when its
    gradient arrived, before an update): its counts over the full tensor, and the one rank
    whose shard holds it, else ``None``. A parameter record's counts are its gradient's, and a
    weight read after the update holds the NaN the update spread: neither tells."""
    for text in nonfinite_weight_notes(trace, module)[:1]:
        m = _SHARD_NOTE.match(text)
        one = _ONE_RANK.search(m["what"])
        shape = getattr(trace.params.get(m["name"]), "shape", None)
        what = m["what"] + (f" (of the full {list(shape)})" if shape else "")
        return m["name"].rpartition(".")[2], what, int(one.group(1)) if one else None
    return None


def gradient_origin(model: nn.Module) -> Origin | None:
    """The module owning the first parameter (``named_parameters`` order) whose ``.grad``
    holds NaN/Inf, when nothing else could be located; ``None`` if every gradient is finite."""
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and not bool(torch.isfinite(local_piece(g)).all()):
            module, _, leaf = name.rpartition(".")
            detail = f"the gradient of its {leaf} holds {nonfinite_counts(g)}{_shard(g)}"
            return Origin(module, "gradient", detail)
    return None


def replay_origin(replay: Replay, *, stayed_finite: str | None = None) -> Origin | None:
    """Find the origin of a forward that is over: a non-finite parameter, else the first
    non-finite output of a re-run of that forward under :func:`hooks.capture` (same arguments,
    same RNG state, no autograd; the caller's random stream is left as it was).

    Args:
        replay: The forward's root call (:class:`hooks.trace.ops.Replay`).
        stayed_finite: Passed to :func:`trace_origin`.

    Returns:
        The origin, or ``None`` when the parameters and the re-run forward are all finite.
    """
    found = parameter_origin(replay.model)
    if found is not None:
        return found
    with capture(replay.model, grads=False, params=False, probes=False) as trace:
        replay.run()
    return trace_origin(trace, stayed_finite=stayed_finite)


class NonFiniteSentinel:
    """Finds where a NaN/Inf started in a training loop that is not ours (``hooks.run``'s
    ``watch``), at the moment the weights are still the ones the failing forward used.

    * A forward pre-hook on the root module keeps the call's arguments and RNG state
      (references, and a copy of the CPU RNG state: a few microseconds a step).
    * A forward hook checks the root's output (the sum of each floating-point tensor, the
      exact check only when a sum is not finite); when one is non-finite it locates the
      origin at once: :func:`replay_origin`, or only :func:`parameter_origin` while
      ``busy()`` says a capture records this forward (its trace answers for the rest).
    * With ``optimizer``, a step pre-hook (``Optimizer.register_step_pre_hook``) checks the
      gradients (one sum of their norms, the exact check only when it is not finite) before
      they are applied, and locates the origin the same way, else :func:`gradient_origin`
      (not on a captured step: the trace answers); this catches a kernel that dropped the
      NaN from the output.

    :meth:`take` hands the finding to the caller (``hooks.run``'s ``log()``).

    Args:
        model: The root module.
        busy: Returns True while the forward is being captured anyway.
        optimizer: The loop's ``torch.optim.Optimizer``, or ``None``.
    """

    def __init__(self, model: nn.Module, busy: Callable[[], bool] = lambda: False,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self._busy = busy
        self._replay: Replay | None = None
        self._inside = False
        self._found: tuple[str, Origin | None] | None = None
        # a sharded model is never replayed: its forward runs collectives, which one rank
        # alone would wait for forever; only this rank's shards are looked at
        self._sharded = _sharded(model)
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, with_kwargs=True),
        ]
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._before_update))

    @property
    def replaying(self) -> bool:
        """True while the sentinel re-runs the model's forward to locate a non-finite value's
        origin (:func:`replay_origin`): a forward seen now is mdb's, not the user's (the loop
        doctor skips it)."""
        return self._inside

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._inside and self._found is None:
            self._replay = Replay.at(module, args, kwargs)

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._inside or self._found is not None:
            return
        try:
            if first_nonfinite_tensor(output) is not None:
                self._found = ("model output", self._locate(None))
        except Exception:  # never break the user's forward
            self._found = None

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._found is not None:
            return
        try:
            grads = [local_piece(p.grad) for group in optimizer.param_groups
                     for p in group["params"] if p.grad is not None and p.grad.is_floating_point()]
            if not grads or not _any_nonfinite(grads):
                return
            origin = self._locate("the model's output")
            if origin is None and not self._busy():  # a capture's trace answers better
                origin = gradient_origin(self.model)
            self._found = ("gradient", origin)
        except Exception:  # never break the user's step
            self._found = None

    def _locate(self, stayed_finite: str | None) -> Origin | None:
        if self._busy() or self._replay is None or self._sharded:
            return parameter_origin(self.model)
        self._inside = True
        try:
            return replay_origin(self._replay, stayed_finite=stayed_finite)
        finally:
            self._inside = False
            self._replay = None

    def take(self) -> tuple[str, Origin | None] | None:
        """``(symptom, origin)`` found since the last call, and forget it: the symptom is
        ``"model output"`` or ``"gradient"``; the origin is ``None`` when it could not be
        located here (on a captured step, beyond a weight: the capture's trace answers), or
        located. ``None`` when nothing non-finite was seen."""
        found, self._found = self._found, None
        return found

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self._handles:
            with contextlib.suppress(Exception):
                h.remove()
        self._handles = []


def _any_nonfinite(tensors: list[torch.Tensor]) -> bool:
    """Whether any tensor holds NaN/Inf: one norm per tensor and one sum of them (about a
    microsecond a tensor on a CPU), and the exact check only when that sum is not finite
    (finite values can overflow a norm)."""
    if len({t.device for t in tensors}) > 1:
        return any(not bool(torch.isfinite(t).all()) for t in tensors)
    norms = torch._foreach_norm([t.detach() for t in tensors])
    if math.isfinite(float(torch.stack(norms).float().sum())):
        return False
    return any(not bool(torch.isfinite(t).all()) for t in tensors)
