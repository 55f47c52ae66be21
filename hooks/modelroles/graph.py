"""One forward of a model as a graph of torch ops, for reading roles from the computation.

A :class:`torch.overrides.TorchFunctionMode` (as :class:`hooks.trace.ops.OpRecorder` uses)
sees every torch function and tensor method the forward calls; each call that returns tensors
becomes an :class:`OpNode` with the innermost module running
(:class:`hooks.tensors.walk.ModuleStack`), its tensor inputs and outputs (by identity) and the
few arguments the analysis reads (``dim``, split sizes, ``k``). Forward hooks tag each
module's output tensors with the module (innermost first) and remember each module's first
input. Every tensor seen is kept alive until the graph is dropped, so identities are never
reused: trace a small batch.

Dimension legend: B batch, T positions, D hidden size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, resolve_name

from hooks.tensors.walk import ModuleStack, named_modules

#: Ops that only move or relabel values (the walks pass through them freely).
SHAPE_OPS = frozenset((
    "view", "reshape", "transpose", "permute", "contiguous", "split", "chunk", "unbind",
    "__getitem__", "flatten", "unflatten", "squeeze", "unsqueeze", "expand", "repeat",
    "repeat_interleave", "to", "float", "half", "bfloat16", "type_as", "clone", "narrow", "t",
    "mT", "movedim", "view_as", "reshape_as", "expand_as", "tensor_split", "split_with_sizes",
    "dropout", "detach", "type", "select", "swapaxes", "swapdims",
))
#: Elementwise ops a score tensor goes through between the q·kᵀ matmul and the softmax.
SCORE_OPS = frozenset((
    "div", "__truediv__", "mul", "__mul__", "__rmul__", "masked_fill", "masked_fill_", "add",
    "__add__", "__radd__", "sub", "__sub__", "where", "tanh", "mul_", "div_", "add_", "__iadd__",
    "__imul__", "__itruediv__", "clamp", "softcap",
))
#: Matrix products (q·kᵀ, probabilities·v).
MATMUL_OPS = frozenset(("matmul", "__matmul__", "bmm", "einsum", "baddbmm", "__rmatmul__"))


def short_name(func: Any) -> str:
    """``softmax`` for ``torch.nn.functional.softmax``, ``Tensor.softmax`` and
    ``torch.softmax`` alike: the last part of the function's name."""
    try:
        name = resolve_name(func) or getattr(func, "__name__", repr(func))
    except Exception:  # some builtins have no resolvable name
        name = getattr(func, "__name__", repr(func))
    return name.rpartition(".")[2]


@dataclass
class OpNode:
    """One torch call of the traced forward.

    Attributes:
        index: position in execution order.
        op: the short name (``softmax``, ``linear``, ``__matmul__``, ``split``).
        module: the innermost module running (``""`` is the root), None outside every module.
        inputs: ids of the tensor arguments (positional first, then keyword, one level into
            lists and tuples).
        outputs: ids of the tensors returned, in order (``split`` returns several).
        args: the non-tensor arguments the analysis reads: ``dim``, ``sizes`` (split),
            ``chunks``, ``k`` (topk), ``index`` (``__getitem__`` with an int).
    """

    index: int
    op: str
    module: str | None
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, torch.Tensor):
                yield y


#: Op → (what its second argument is, its keyword name): ``split(x, sizes, dim)``,
#: ``chunk(x, chunks, dim)``, ``topk(x, k)``, ``softmax(x, dim)``.
_SECOND_ARG = {"split": ("sizes", "split_size_or_sections"), "tensor_split": ("sizes", "sections"),
               "chunk": ("chunks", "chunks"), "topk": ("k", "k"), "softmax": ("dim", "dim")}


def _read_args(op: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The non-tensor arguments of ``op`` the analysis reads (see :attr:`OpNode.args`)."""
    out: dict[str, Any] = {}
    if op in _SECOND_ARG:
        key, kw = _SECOND_ARG[op]
        v = args[1] if len(args) > 1 else kwargs.get(kw)
        if isinstance(v, (int, list, tuple)) and not isinstance(v, bool):
            out[key] = v
    if op in ("split", "chunk", "tensor_split"):
        out["dim"] = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if op == "__getitem__" and len(args) > 1:
        out["index"] = args[1]
    return out


class OpGraph(TorchFunctionMode):
    """Record the ops of the forwards run while it is entered (see the module docstring).

    Args:
        model: the modules to follow.

    Attributes:
        nodes: the ops, in order.
        producer: tensor id → (node index, position among its outputs).
        consumers: tensor id → indices of the nodes that take it.
        module_out: tensor id → the innermost module that returned it.
        module_in: module name → id of the first tensor of its first call's arguments.
        tensors: tensor id → the tensor (kept alive while the graph lives).
        called: module names in the order of their first call.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.nodes: list[OpNode] = []
        self.producer: dict[int, tuple[int, int]] = {}
        self.consumers: dict[int, list[int]] = {}
        self.module_out: dict[int, str] = {}
        self.module_in: dict[str, int] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        self.called: list[str] = []
        self._stack = ModuleStack(model)
        self._handles = []
        for name, m in named_modules(model):
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, args, n=name: self._pre(n, args)))
            self._handles.append(m.register_forward_hook(
                lambda mod, args, out, n=name: self._post(n, out)))

    def _keep(self, t: torch.Tensor) -> int:
        self.tensors.setdefault(id(t), t)
        return id(t)

    def _pre(self, name: str, args: tuple) -> None:
        if name not in self.module_in:
            self.called.append(name)
            first = next((t for a in args for t in _tensors(a)), None)
            if first is not None:
                self.module_in[name] = self._keep(first)

    def _post(self, name: str, out: Any) -> None:
        for t in _tensors(out):
            self.module_out.setdefault(self._keep(t), name)

    def remove(self) -> None:
        """Take the module hooks off."""
        self._stack.remove()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = list(_tensors(out))
        if not outs:
            return out
        op = short_name(func)
        node = OpNode(len(self.nodes), op, self._stack.current,
                      args=_read_args(op, tuple(args), kwargs))
        for a in (*args, *kwargs.values()):
            for t in _tensors(a):
                node.inputs.append(self._keep(t))
                self.consumers.setdefault(id(t), []).append(node.index)
        for i, t in enumerate(outs):
            node.outputs.append(self._keep(t))
            self.producer.setdefault(id(t), (node.index, i))
        self.nodes.append(node)
        return out

    # -- reading --------------------------------------------------------------------------------
    def made_by(self, tid: int) -> OpNode | None:
        """The node that returned tensor ``tid``, or None (a parameter, an input)."""
        p = self.producer.get(tid)
        return self.nodes[p[0]] if p is not None else None

    def shape(self, tid: int) -> tuple[int, ...]:
        """The shape of tensor ``tid``."""
        return tuple(self.tensors[tid].shape)
