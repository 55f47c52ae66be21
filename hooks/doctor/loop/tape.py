"""What the training loop does with the model's outputs, seen during a watched step's window:
the loss function it calls on them, and tensors that carry an earlier step's autograd graph.

:class:`LossTape` is a :class:`torch.overrides.TorchFunctionMode` that
:class:`hooks.doctor.loop.watch.LoopWatch` enters when a watched step's window opens and
leaves when it closes (unwatched steps run without it). It passes every call through
unchanged (``func(*args, **kwargs)``, the same call the loop made: the run is bit-identical
with and without it) and, outside the model's own forward, notes:

* the calls on a micro-batch's outputs up to the first loss function
  (:data:`LOSS_FUNCTIONS`: ``F.cross_entropy(model(x).view(-1, V), y.view(-1))``, an
  ``nn.CrossEntropyLoss``, ``F.mse_loss`` …), with their other arguments (the targets):
  :meth:`LossTape.replay` re-runs them on a replayed forward's outputs, so the accumulation
  check knows each micro-batch's loss when the model returns only logits;
* a call that joins this step's graph (a tensor made from the model's outputs) to a tensor
  whose graph was made before the window opened (``total = total + loss`` with ``total``
  from the steps before): the graph of every earlier step stays alive through it
  (:func:`foreign_graph_finding`).

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import linecache
import os
import sys
import weakref
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from hooks.doctor.loop import checks as lc

__all__ = ["LOSS_FUNCTIONS", "LossTape", "foreign_graph_finding", "graph_nodes", "user_site"]

#: The loss functions whose call on a micro-batch's outputs is that micro-batch's loss.
LOSS_FUNCTIONS = frozenset({
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
    F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.kl_div,
    F.poisson_nll_loss, F.gaussian_nll_loss, F.soft_margin_loss,
    F.multilabel_soft_margin_loss, F.cosine_embedding_loss, F.margin_ranking_loss,
    F.hinge_embedding_loss, F.multi_margin_loss, F.triplet_margin_loss, F.ctc_loss,
})
#: Autograd nodes counted at most when the size of an old graph is measured.
MAX_NODES = 100_000

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HOOKS_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def user_site() -> tuple[str, int, str]:
    """``(file, line, text)`` of the innermost frame of the caller's stack that is neither
    mdb's (``hooks/``) nor torch's: the line of the user's loop that issued the call."""
    f = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if not (path.startswith(_HOOKS_DIR) or path.startswith(_TORCH_DIR)):
            return path, f.f_lineno, linecache.getline(path, f.f_lineno).strip()
        f = f.f_back
    return "", 0, ""


def _from_mdb() -> bool:
    """Whether the innermost caller outside torch of the call :meth:`LossTape._see` sees is
    mdb's own code (``hooks/``); frames: this, ``_see``, ``__torch_function__``, then the
    caller's (through ``torch.overrides`` for a Python torch function)."""
    f = sys._getframe(3)
    while f is not None:
        path = f.f_code.co_filename
        if not path.startswith(_TORCH_DIR):
            return path.startswith(_HOOKS_DIR)
        f = f.f_back
    return False


def graph_nodes(t: torch.Tensor, limit: int = MAX_NODES) -> int:
    """The number of autograd nodes reachable from ``t.grad_fn`` (at most ``limit``)."""
    seen: set[int] = set()
    stack = [t.grad_fn]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(n for n, _ in node.next_functions)
    return len(seen)


class _Ref:
    """A tensor of the tape, by its index (the outputs first, then each call's results)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Tape:
    """One micro-batch's calls on its outputs, up to its loss function."""

    __slots__ = ("size", "calls", "loss", "site")

    def __init__(self, size: int) -> None:
        self.size = size  # tensors known: the outputs, then each call's results
        self.calls: list[tuple[Any, Any, Any, list[int]]] = []
        self.loss: int | None = None
        self.site: tuple[str, int, str] | None = None


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of an output, in a fixed order (tuples, lists, dicts, HF ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    elif hasattr(obj, "to_tuple"):
        obj = list(obj.to_tuple())
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


class LossTape(TorchFunctionMode):
    """The loop's calls on the model's outputs during one window (see the module docstring).

    Attributes:
        depth: Root forwards running now (their inner calls are the model's, passed through).
        paused: Set while mdb replays (its calls are not the loop's).
        foreign: The first call that joined this window's graph to an older one, or ``None``:
            ``{"shape", "site", "nodes"}`` of the older tensor.
        losses: Weak references to each loss function's result (a tensor the loop may keep).
    """

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.paused = False
        self.foreign: dict[str, Any] | None = None
        self.losses: list[tuple[Any, tuple[int, ...], tuple[str, int, str]]] = []
        self._tapes: list[_Tape] = []
        # id(tensor) -> (weak ref, micro-batch, index in its tape or None)
        self._derived: dict[int, tuple[Any, int, int | None]] = {}
        self._made: dict[int, Any] = {}  # tensors with a graph made in the window, not derived

    def outputs(self, output: Any) -> int:
        """A root forward returned ``output``: its tensors start a micro-batch's tape."""
        ts = _tensors(output)
        mb = len(self._tapes)
        self._tapes.append(_Tape(len(ts)))
        for i, t in enumerate(ts):
            self._mark(t, mb, i)
        return mb

    def _mark(self, t: torch.Tensor, mb: int, index: int | None) -> None:
        try:
            self._derived[id(t)] = (weakref.ref(t), mb, index)
        except TypeError:
            pass

    def _lookup(self, t: torch.Tensor) -> tuple[int, int | None] | None:
        hit = self._derived.get(id(t))
        if hit is None or hit[0]() is not t:
            return None
        return hit[1], hit[2]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth or self.paused or not torch.is_grad_enabled():
            return out
        try:
            self._see(func, args, kwargs, out)
        except Exception:
            pass
        return out

    def _see(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        ins = [t for x in (*args, *kwargs.values())
               for t in (x if isinstance(x, (list, tuple)) else (x,))
               if isinstance(t, torch.Tensor)]
        hits = [(t, self._lookup(t)) for t in ins]
        derived = [h for _, h in hits if h is not None]
        outs = _tensors(out)
        if not derived:
            for t in outs:
                if t.grad_fn is not None:
                    self._made[id(t)] = weakref.ref(t)
            return
        if _from_mdb():
            return  # the capture's statistics of the outputs, not the loop's calls
        if self.foreign is None:
            self._foreign(hits)
        mb = derived[0][0]
        tape = self._tapes[mb]
        if tape.loss is not None or any(h[0] != mb or h[1] is None for h in derived):
            for t in outs:  # past the loss (loss / k, total + loss): followed, not taped
                self._mark(t, mb, None)
            return
        refs = {id(t): h[1] for t, h in hits if h is not None}
        first = tape.size
        tape.calls.append((func, _template(args, refs), _template(kwargs, refs),
                           list(range(first, first + len(outs)))))
        tape.size += len(outs)
        for i, t in enumerate(outs):
            self._mark(t, mb, first + i)
        if func in LOSS_FUNCTIONS and len(outs) == 1 and outs[0].numel() == 1:
            tape.loss, tape.site = first, user_site()
            self.losses.append((weakref.ref(outs[0]), tuple(outs[0].shape), tape.site))

    def _foreign(self, hits: list[tuple[torch.Tensor, Any]]) -> None:
        for t, h in hits:
            if h is None and t.grad_fn is not None and t.requires_grad:
                made = self._made.get(id(t))
                if made is not None and made() is t:
                    continue
                self.foreign = {"shape": tuple(t.shape), "site": user_site(),
                                "nodes": graph_nodes(t)}
                return

    def replay(self, mb: int, output: Any) -> torch.Tensor | None:
        """Micro-batch ``mb``'s loss, recomputed from ``output`` (a replay of its forward) by
        the calls the loop made (with the targets it passed); ``None`` when none was seen."""
        tape = self._tapes[mb] if 0 <= mb < len(self._tapes) else None
        if tape is None or tape.loss is None:
            return None
        values: dict[int, torch.Tensor] = dict(enumerate(_tensors(output)))
        needed = {tape.loss}
        calls = []
        for call in reversed(tape.calls):  # only the calls the loss depends on, and the
            refs = _refs((call[1], call[2]))  # in-place writes into them (no result)
            if needed.intersection(call[3]) or (not call[3] and needed.intersection(refs)):
                calls.append(call)
                needed.update(refs)
        self.paused = True
        try:
            for func, args, kwargs, results in reversed(calls):
                out = func(*_fill(args, values), **_fill(kwargs, values))
                values.update(zip(results, _tensors(out), strict=False))
                if tape.loss in values:
                    return values[tape.loss]
        finally:
            self.paused = False
        return None

    def reset(self) -> None:
        """Forget the window (its tapes and the tensors followed)."""
        self._tapes, self._derived, self._made = [], {}, {}
        self.losses, self.foreign = [], None


def _template(obj: Any, refs: dict[int, int]) -> Any:
    if isinstance(obj, torch.Tensor):
        return _Ref(refs[id(obj)]) if id(obj) in refs else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_template(x, refs) for x in obj)
    if isinstance(obj, dict):
        return {k: _template(v, refs) for k, v in obj.items()}
    return obj


def _refs(obj: Any) -> list[int]:
    if isinstance(obj, _Ref):
        return [obj.index]
    if isinstance(obj, (list, tuple)):
        return [i for x in obj for i in _refs(x)]
    if isinstance(obj, dict):
        return [i for x in obj.values() for i in _refs(x)]
    return []


def _fill(obj: Any, values: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, _Ref):
        return values[obj.index]
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(x, values) for x in obj)
    if isinstance(obj, dict):
        return {k: _fill(v, values) for k, v in obj.items()}
    return obj


def foreign_graph_finding(step: int, foreign: dict[str, Any]) -> dict[str, Any]:
    """The finding of a tensor that holds the autograd graph of earlier steps (a loss summed
    across steps without ``.item()``/``.detach()``): memory grows every step."""
    path, line, text = foreign["site"]
    where = f"{os.path.basename(path)}:{line}" if path else "?"
    shape = tuple(foreign["shape"])
    return lc.finding(
        "memory_growth", step, f"graph kept at {where}",
        f"a tensor of shape {shape} made at {where} ({text}) holds the autograd graph of "
        f"earlier steps ({foreign['nodes']} nodes reachable) and this step's is joined to it, "
        f"so memory grows every step: accumulate loss.item() or loss.detach(), not loss",
        f"at step {step} a call outside the model joined a tensor made from the model's "
        f"outputs to a tensor (shape {shape}) whose graph was made before the step began; "
        f"{foreign['nodes']} autograd nodes reachable from it", shape=list(shape),
        site=f"{path}:{line}", nodes=foreign["nodes"])


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class KeptOutputs:
    """Weak references to the tensors the loop got from the model (and from its loss
    function) in the last watched windows: a tensor of an earlier window still alive when a
    later one ends is held by the loop (a list of logits, of losses) — with its graph, as
    it required grad. Costs nothing between windows (weak references only)."""

    #: Earlier windows remembered; tensors of this many of them alive at once is growth.
    WINDOWS = 2

    def __init__(self) -> None:
        self._windows: list[tuple[int, list[tuple[Any, tuple[int, ...], tuple]]]] = []

    def end_window(self, step: int, refs: list[tuple[Any, tuple[int, ...], tuple]]
                   ) -> dict[str, Any] | None:
        """Close watched step ``step``'s window, whose tensors are ``refs`` (weak reference,
        shape, the user's line that made it); the finding when tensors of each of the
        :data:`WINDOWS` windows before it are still alive, else ``None``."""
        alive = [(s, [(shape, site, _nbytes(ref())) for ref, shape, site in rs
                      if ref() is not None]) for s, rs in self._windows]
        self._windows = (self._windows + [(step, refs)])[-self.WINDOWS:]
        if len(alive) < self.WINDOWS or not all(kept for _, kept in alive):
            return None
        steps = [s for s, _ in alive]
        shape, (path, line, text), _ = alive[0][1][0]
        count = sum(len(kept) for _, kept in alive)
        held = sum(n for _, kept in alive for _, _, n in kept)
        where = f"{os.path.basename(path)}:{line}" if path else "?"
        return lc.finding(
            "memory_growth", step, f"outputs kept from {where}",
            f"tensors the model returned at earlier steps ({count} from steps "
            f"{', '.join(map(str, steps))}; the first of shape {tuple(shape)}, made at {where}: "
            f"{text}) are still alive at step {step}, each with its autograd graph, so memory "
            "grows every step: keep .detach() (or .item()) of what you store across steps",
            f"weak references to the outputs (and losses) of the watched steps "
            f"{', '.join(map(str, steps))} still resolve when step {step} ends; "
            f"{count} tensor(s) kept, {held} bytes of their own (their graphs' saved tensors "
            "besides)", shape=list(shape), site=f"{path}:{line}", steps=steps, kept=count,
            bytes=held)
