"""MoE routing read from the ops a block runs in the captured step, for a block that no name
and no declaration marks (its router is ``switch``, its experts ``ffns``) and for a named or
declared one whose experts are a list the block calls one by one (nothing hands them the
routing in one call) and that no registered probe reads.

Dimension legend: N tokens, D hidden size, E experts, k experts per token.

Found from what the block computes, as :mod:`hooks.modelroles.traced` reads a router from a
trace, but on the step itself: no extra forward runs.

* **Candidates** (:func:`found_blocks`), by structure, before the step: a module with a
  projection child of E ≥ 2 outputs (the router candidates) and a child holding E experts (an
  ``nn.ModuleList`` of E entries, else a module with a 3-D weight of E rows). The walk is
  cached per model and done again when its modules change (one added, removed or replaced).
* **Routing** (:class:`TopKWatch`): while a candidate block runs (not while its experts run),
  a :class:`torch.overrides.TorchFunctionMode` follows the tensors computed from the output of
  one of its router candidates (same number of elements: softmax, sigmoid, casts, a bias, a
  group mask) to the first ``topk`` over their E columns. Its indices are the ids the experts
  got; the weights are the (N, k) tensors computed from its values (by ``div``, ``mul``,
  ``softmax``, casts) that a later op of the block (or an expert's call) read: the latest one
  whose rule :func:`hooks.probes.routing.infer_rule` verifies against the router's logits is
  recorded (source ``"topk"``). A candidate in which no such ``topk`` ran is not an MoE
  block: nothing is recorded and nothing is said.

What the step computes is not changed: the mode calls every function with the arguments the
model gave it and returns its result, takes no random numbers and writes no tensor; it keeps
references to the router's score tensors and the top-k values only until the block returns.
It is entered as the block starts and left as it returns (from the top of the stack only), so
every mode the block's forward enters and leaves lies above it. A block whose router is not
its child, or whose experts are not, is not a candidate: declare it
(``hooks.roles(model, router=..., experts=...)``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hooks.modelroles.graph import short_name
from hooks.modelroles.traced import is_projection, out_width

#: Ops through which the top-k values become the weights the experts get.
WEIGHT_OPS = frozenset((
    "div", "__truediv__", "div_", "__itruediv__", "mul", "__mul__", "__rmul__", "mul_",
    "__imul__", "softmax", "sigmoid", "to", "float", "half", "bfloat16", "type_as", "type",
    "clone", "contiguous", "detach", "reshape", "view",
))

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def num_experts(experts: nn.Module) -> int | None:
    """E of an experts module: an ``nn.ModuleList``'s length, else its ``num_experts``, else
    the rows of its own 3-D weight; None when none says."""
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    e = getattr(experts, "num_experts", None)
    if isinstance(e, int) and not isinstance(e, bool):
        return e
    for p in experts.parameters(recurse=False):
        if p.dim() == 3:
            return int(p.shape[0])
    return None


def router_children(block: nn.Module, experts: nn.Module, e: int | None) -> list[str]:
    """Names of ``block``'s projection children with E outputs (other than ``experts``)."""
    if not e or e < 2:
        return []
    return [n for n, c in block.named_children()
            if c is not experts and is_projection(c) and out_width(c) == e]


def _holds_experts(m: nn.Module, widths: set[int]) -> int | None:
    if isinstance(m, nn.ModuleList):
        return len(m) if len(m) in widths else None
    # Module._parameters (torch private): a module's own parameters, without a generator
    for p in m._parameters.values():
        if p is not None and p.dim() == 3 and int(p.shape[0]) in widths:
            return int(p.shape[0])
    return None


def _scan(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, str, int]]:
    out = []
    for name, m in modules:
        # Module._modules (torch private): the direct children, without a generator per call
        kids = [(n, c) for n, c in m._modules.items() if c is not None]
        widths = {out_width(c) for _, c in kids if not c._modules and is_projection(c)}
        widths = {w for w in widths if w is not None and w >= 2}
        if not widths:
            continue
        for cname, c in kids:
            e = _holds_experts(c, widths)
            if e is not None:
                out.append((name, f"{name}.{cname}" if name else cname, e))
                break
    return out


def found_blocks(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, str, int]]:
    """``(block, experts, E)`` names of every candidate MoE block of ``modules``
    (``hooks.tensors.walk.named_modules`` order, the root ``""`` first): see the module
    docstring. Cached per root module while the modules stay the same."""
    if not modules:
        return []
    root = modules[0][1]
    key = tuple((n, id(m)) for n, m in modules)
    try:
        hit = _CACHE.get(root)
    except TypeError:  # a module that cannot be weakly referenced
        return _scan(modules)
    if hit is not None and hit[0] == key:
        return hit[1]
    found = _scan(modules)
    _CACHE[root] = (key, found)
    return found


class TopKWatch(TorchFunctionMode):
    """The routing one call of one block computes (see the module docstring).

    :meth:`begin` (the block's forward pre-hook) enters the mode, :meth:`start` (a router
    candidate's forward hook) marks the router's output to follow, :meth:`stop` (the block's
    forward hook) leaves the mode; :meth:`leave` and :meth:`back` take it off the stack while
    an expert runs. ``topk`` is ``(router, logits, ids)`` once the routing
    ``topk`` ran; ``weights`` the (N, k)-shaped tensors computed from its values, in order;
    ``used`` the ids of those that a later op of the block read (a weight nothing read was not
    applied).
    """

    def __init__(self, e: int) -> None:
        super().__init__()
        self.e = e
        self.on = False
        self.paused = False
        self.away = False
        self.scores: dict[int, tuple[torch.Tensor, str, torch.Tensor]] = {}
        self.topk: tuple[str, torch.Tensor, torch.Tensor] | None = None
        self.weights: list[torch.Tensor] = []
        self.used: set[int] = set()
        self._wids: dict[int, torch.Tensor] = {}

    def begin(self) -> None:
        """Enter the mode (the block starts)."""
        if not (self.paused or self.on):
            self.on = True
            self.__enter__()

    def start(self, router: str, output: Any) -> None:
        """Follow ``router``'s (…, E) float output from now on."""
        if not self.on or self.topk is not None:
            return
        parts = output if isinstance(output, (tuple, list)) else (output,)
        for t in parts:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2 \
                    and t.shape[-1] == self.e:
                self.scores.setdefault(id(t), (t, router, t))
                break

    def _on_top(self) -> bool:
        n = torch._C._len_torch_function_stack()
        return bool(n) and torch._C._get_function_stack_at(n - 1) is self

    def stop(self) -> bool:
        """Leave the mode (from the top of the stack only; a mode entered since and still
        there leaves this one passing everything through). Returns whether it was left."""
        if not self.on:
            return True
        self.on = False
        self.scores = {}
        self._wids = {}
        if self.away:  # an expert that raised: the mode is already off the stack
            self.away = False
            return True
        if self._on_top():
            self.__exit__(None, None, None)
            return True
        self.paused = True
        return False

    def leave(self, args: tuple) -> None:
        """An expert is called (its forward pre-hook): the weights among ``args`` are read;
        the mode steps off the stack while the expert runs (its ops are not the routing)."""
        if not self.on or self.away:
            return
        for a in args:
            if isinstance(a, torch.Tensor) and id(a) in self._wids:
                self.used.add(id(a))
        if self._on_top():
            self.__exit__(None, None, None)
            self.away = True

    def back(self) -> None:
        """The expert returned (its forward hook): the mode is entered again."""
        if self.away:
            self.away = False
            self.__enter__()

    def reset(self) -> None:
        """Forget what one call computed."""
        self.topk, self.weights, self.used = None, [], set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        if self.paused or not (self.scores or self._wids):
            return out
        ins = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)] if kwargs \
            else [a for a in args if isinstance(a, torch.Tensor)]
        src = next((self.scores[id(a)] for a in ins if id(a) in self.scores), None)
        if src is not None:
            self._follow(func, ins, src, out)
        else:
            hit = [a for a in ins if id(a) in self._wids]
            if hit:
                self.used.update(id(a) for a in hit)
                self._weight(func, out)
        return out

    def _follow(self, func, ins: list[torch.Tensor], src: tuple, out: Any) -> None:
        _, router, logits = src
        if short_name(func) == "topk" and isinstance(out, tuple) and len(out) == 2:
            values, ids = out
            if ins[0].shape[-1] == self.e and 0 < ids.shape[-1] < self.e \
                    and not ids.is_floating_point():
                self.topk = (router, logits, ids)
                self.scores = {}
                self._wids = {id(values): values}
                self.weights = [values]
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.is_floating_point() \
                    and t.numel() == logits.numel():
                self.scores.setdefault(id(t), (t, router, logits))

    def _weight(self, func, out: Any) -> None:
        ref = self.weights[0]
        if isinstance(out, torch.Tensor) and out.is_floating_point() \
                and out.shape == ref.shape and short_name(func) in WEIGHT_OPS:
            self._wids.setdefault(id(out), out)
            self.weights.append(out)


def watch_experts(tw: TopKWatch, experts: nn.Module) -> list[Any]:
    """Hooks that take ``tw``'s mode off the stack while each expert runs (an
    ``nn.ModuleList``'s entries, else the experts module), so that only the block's own ops
    are watched; return their handles."""
    mods = list(experts) if isinstance(experts, nn.ModuleList) else [experts]
    handles = []
    for m in mods:
        handles.append(m.register_forward_pre_hook(lambda mod, args: tw.leave(args),
                                                   prepend=True))
        handles.append(m.register_forward_hook(lambda mod, args, out: tw.back(),
                                               always_call=True))
    return handles
