"""Find the tensors inside a module's arguments or outputs.

Outputs of real models nest tensors in tuples, lists, dicts, dataclasses and HF ``ModelOutput``s
(an ``OrderedDict`` subclass whose ``items()`` hold only the fields that are set). The walk goes
a few levels deep (:data:`MAX_DEPTH`) and stops after a fixed number of tensors
(:data:`MAX_TENSORS`), so a module handed a list of hundreds of tensors does not turn one call
into hundreds of records. What a cap left out is counted (:class:`LeftOut`) and said on the call
(:meth:`LeftOut.notes`), or on the op when stepping in (``hooks.trace.ops``, whose cap is smaller),
never called a non-tensor part. Counting is linear in what the walk visits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

#: How deep :func:`find_tensors` descends into containers.
MAX_DEPTH = 4
#: Most tensors :func:`find_tensors` returns for one call side (inputs or outputs) when given a
#: :class:`LeftOut`. 256 holds the logits and (k, v) cache of a 126-layer model returned as
#: tuples; each tensor costs one statistics entry (about 0.6 kB of trace). Read at each call:
#: set ``hooks.tensors.walk.MAX_TENSORS`` higher before a capture to record more.
MAX_TENSORS = 256

_SCALARS = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


@dataclasses.dataclass
class LeftOut:
    """Tensors :func:`find_tensors` did not return because of a cap, for one call side.

    Attributes:
        over: tensors past :data:`MAX_TENSORS` (counted, not summarised).
        first_over: path of the first of them in walk order, or None.
        deep: tensors inside containers deeper than :data:`MAX_DEPTH`.
        first_deep: path of the first of them, or None.
    """

    over: int = 0
    first_over: str | None = None
    deep: int = 0
    first_deep: str | None = None
    # ids of the recorded tensors (and of what was counted); ``_src[:_upto]`` are in it
    _seen: set[int] | None = dataclasses.field(default=None, repr=False, compare=False)
    _src: list | None = dataclasses.field(default=None, repr=False, compare=False)
    _upto: int = dataclasses.field(default=0, repr=False, compare=False)

    @property
    def total(self) -> int:
        """How many tensors were left out, for either reason."""
        return self.over + self.deep

    def _add(self, obj: Any, path: str, tensors: list[tuple[str, torch.Tensor]],
             deep: bool) -> None:
        if self._seen is None:
            self._seen = set()
        # recorded ones are not left out; only those recorded since the last call are added
        # (the list only grows during a walk), so a walk with many left-out parts stays linear
        if tensors is not self._src or len(tensors) < self._upto:
            self._src, self._upto = tensors, 0
        self._seen.update(id(t) for _, t in tensors[self._upto:])
        self._upto = len(tensors)
        n, first = _count_tensors(obj, path, self._seen)
        if not n:
            return
        if deep:
            self.deep += n
            self.first_deep = self.first_deep or first
        else:
            self.over += n
            self.first_over = self.first_over or first

    def notes(self, side: str, recorded: int, *, who: str = "a call", limit: int | None = None,
              knob: str = "hooks.tensors.walk.MAX_TENSORS", when: str = "the capture") -> list[str]:
        """One line per cap that left tensors out of ``side`` (``"inputs"``/``"outputs"``)
        of a call that recorded ``recorded`` tensors; empty when nothing was left out.

        ``who`` (``"a call"``, ``"an op"``), ``limit`` (the cap the walk ran with; None:
        :data:`MAX_TENSORS`), ``knob`` (the setting that raises it) and ``when`` (before what
        to set it) word the first line."""
        out = []
        if self.over:
            cap = MAX_TENSORS if limit is None else limit
            out.append(
                f"{side}: {recorded} tensor(s) recorded, {self.over} not recorded (the first "
                f"left out: {self.first_over}): {who} records at most {cap} tensors per side "
                f"({knob}; set it higher before {when} to record more)")
        if self.deep:
            out.append(
                f"{side}: {self.deep} tensor(s) not recorded (the first left out: "
                f"{self.first_deep}): they are nested deeper than {MAX_DEPTH} containers "
                "(hooks.tensors.walk.MAX_DEPTH)")
        return out


def _count_tensors(obj: Any, path: str, seen: set[int]) -> tuple[int, str | None]:
    """How many tensors not in ``seen`` (ids; updated) ``obj`` holds at any depth, and the path
    of the first in :func:`find_tensors`' order. Containers seen twice (a cycle) count once."""
    n, first = 0, None
    stack = [(obj, path)]
    while stack:
        o, p = stack.pop()
        if isinstance(o, torch.Tensor):
            if not o.is_nested and id(o) not in seen:
                seen.add(id(o))
                n += 1
                first = first or p
            continue
        if isinstance(o, _SCALARS) or id(o) in seen:
            continue
        if isinstance(o, (tuple, list)):
            kids = [(v, f"{p}[{i}]") for i, v in enumerate(o)]
        elif isinstance(o, dict):
            kids = [(v, f"{p}.{k}") for k, v in o.items()]
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            kids = [(getattr(o, f.name), f"{p}.{f.name}") for f in dataclasses.fields(o)]
        else:
            continue
        seen.add(id(o))
        stack.extend(reversed(kids))
    return n, first


def find_tensors(
    obj: Any,
    path: str,
    tensors: list[tuple[str, torch.Tensor]],
    others: list[tuple[str, str]],
    depth: int = 0,
    left_out: LeftOut | None = None,
    limit: int | None = None,
) -> None:
    """Append ``(path, tensor)`` for each tensor inside ``obj`` to ``tensors``.

    Args:
        obj: a tensor or a container of tensors.
        path: the path of ``obj`` itself (``out``, ``args``...); children get ``[i]``/``.key``.
        tensors: receives ``(path, tensor)`` pairs in traversal order (a tensor object seen
            twice is listed once).
        others: receives ``(path, type name)`` for leaves that are neither tensors, containers
            nor plain scalars (e.g. an HF ``DynamicCache``), and for nested tensors (no single
            shape to record: ``nn.TransformerEncoder``'s padding fast path makes them), so the
            caller can say what it could not record.
        depth: current depth (callers pass nothing).
        left_out: with one, ``tensors`` never grows past ``limit`` and every tensor a cap
            left out is counted there (containers holding them are not put in ``others``).
            Without one the caps only stop the walk from entering further containers, and
            what they held is not said.
        limit: the cap on ``len(tensors)``; None reads :data:`MAX_TENSORS` (``hooks.trace.ops``
            passes its own, smaller one).
    """
    if limit is None:
        limit = MAX_TENSORS
    if isinstance(obj, torch.Tensor):
        if obj.is_nested:
            others.append((path, "nested tensor"))
            return
        if left_out is not None and len(tensors) >= limit:
            left_out._add(obj, path, tensors, deep=False)  # skips a tensor already recorded
            return
        for _, t in tensors:
            if t is obj:
                return
        tensors.append((path, obj))
        return
    if isinstance(obj, _SCALARS):
        return
    full = len(tensors) >= limit
    if depth >= MAX_DEPTH or full:
        if left_out is not None:
            before = left_out.total
            left_out._add(obj, path, tensors, deep=not full)
            if left_out.total > before:
                return
        others.append((path, type(obj).__name__))
        return
    if isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            find_tensors(v, f"{path}[{i}]", tensors, others, depth + 1, left_out, limit)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            find_tensors(v, f"{path}.{k}", tensors, others, depth + 1, left_out, limit)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            find_tensors(getattr(obj, f.name), f"{path}.{f.name}", tensors, others, depth + 1,
                         left_out, limit)
    else:
        others.append((path, type(obj).__name__))


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32``."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def named_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``list(model.named_modules())`` (same names, same order, each module once), computed by
    plain recursion: several times cheaper than torch's nested generators, which matters because
    every capture walks the tree."""
    out: list[tuple[str, torch.nn.Module]] = []
    memo: set[int] = set()

    def visit(m: torch.nn.Module, prefix: str) -> None:
        if id(m) in memo:
            return
        memo.add(id(m))
        out.append((prefix, m))
        # Module._modules (torch private): the direct children, without a generator per call
        for name, child in m._modules.items():
            if child is not None:
                visit(child, f"{prefix}.{name}" if prefix else name)

    visit(model, "")
    return out


def named_parameters(
    modules: list[tuple[str, torch.nn.Module]], remove_duplicate: bool = True
) -> list[tuple[str, torch.nn.Parameter]]:
    """``model.named_parameters()`` from a :func:`named_modules` list (same names and order)."""
    out = []
    seen: set[int] = set()
    for prefix, m in modules:
        for name, p in m._parameters.items():
            if p is None:
                continue
            if remove_duplicate:
                if id(p) in seen:
                    continue
                seen.add(id(p))
            out.append((f"{prefix}.{name}" if prefix else name, p))
    return out


class ModuleStack:
    """Which module is running right now: forward pre/post hooks on every module of ``model``
    push and pop its qualified name, so code called from inside a forward (a
    ``TorchFunctionMode``, a swapped torch function) can attribute what it sees to the
    innermost module.

    Args:
        model: the modules to follow (``named_modules()`` names; ``""`` is the root).

    Call :meth:`remove` to take the hooks off.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.names: list[str] = []
        self._handles = []
        for name, m in named_modules(model):
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, args, n=name: self.names.append(n)))
            self._handles.append(m.register_forward_hook(
                lambda mod, args, out, n=name: self._pop(n)))

    def _pop(self, name: str) -> None:
        if self.names and self.names[-1] == name:
            self.names.pop()

    @property
    def current(self) -> str | None:
        """The innermost running module's name, or None outside every forward."""
        return self.names[-1] if self.names else None

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
