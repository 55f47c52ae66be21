"""The module table of a trace: every module of a model in ``named_modules()`` order, with its
own and total parameter counts (:class:`hooks.trace.records.ModuleInfo`)."""

from __future__ import annotations

from torch import nn

from hooks.tensors.walk import named_modules, named_parameters
from hooks.trace.records import ModuleInfo


def module_infos(
    model: nn.Module, modules: list[tuple[str, nn.Module]] | None = None
) -> list[ModuleInfo]:
    """Every module of ``model.named_modules()`` order, with own and total parameter counts.

    A tied parameter (``lm_head.weight is embed_tokens.weight``) counts in ``own_params`` of each
    module that registers it, and once in ``total_params`` of any module holding it.
    ``modules`` is ``hooks.tensors.walk.named_modules(model)`` when the caller already has it.
    """
    if modules is None:
        modules = named_modules(model)
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    seen: dict[str, set[int]] = {}
    for qname, p in named_parameters(modules, remove_duplicate=False):
        owner, _, _ = qname.rpartition(".")
        own[owner] = own.get(owner, 0) + p.numel()
        prefix = owner
        while True:
            ids = seen.setdefault(prefix, set())
            if id(p) not in ids:
                ids.add(id(p))
                total[prefix] = total.get(prefix, 0) + p.numel()
            if not prefix:
                break
            prefix = prefix.rpartition(".")[0]
    return [
        ModuleInfo(
            name,
            type(m).__name__,
            0 if name == "" else name.count(".") + 1,
            own.get(name, 0),
            total.get(name, 0),
        )
        for name, m in modules
    ]
