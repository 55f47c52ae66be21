"""Find the tensors inside a module's arguments or outputs.

Outputs of real models nest tensors in tuples, lists, dicts, dataclasses and HF ``ModelOutput``s
(an ``OrderedDict`` subclass whose ``items()`` hold only the fields that are set). The walk goes
a few levels deep and stops after a fixed number of tensors, so a KV cache of many layers does
not turn one call into hundreds of records.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

#: How deep :func:`find_tensors` descends into containers.
MAX_DEPTH = 4
#: Most tensors :func:`find_tensors` returns for one call side (inputs or outputs).
MAX_TENSORS = 32

_SCALARS = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def find_tensors(
    obj: Any,
    path: str,
    tensors: list[tuple[str, torch.Tensor]],
    others: list[tuple[str, str]],
    depth: int = 0,
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
    """
    if isinstance(obj, torch.Tensor):
        if obj.is_nested:
            others.append((path, "nested tensor"))
            return
        for _, t in tensors:
            if t is obj:
                return
        tensors.append((path, obj))
        return
    if isinstance(obj, _SCALARS):
        return
    if depth >= MAX_DEPTH or len(tensors) >= MAX_TENSORS:
        others.append((path, type(obj).__name__))
        return
    if isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            find_tensors(v, f"{path}[{i}]", tensors, others, depth + 1)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            find_tensors(v, f"{path}.{k}", tensors, others, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            find_tensors(getattr(obj, f.name), f"{path}.{f.name}", tensors, others, depth + 1)
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
