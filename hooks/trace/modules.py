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
    params = named_parameters(modules, remove_duplicate=False)
    own: dict[str, int] = {}
    for qname, p in params:
        owner = qname.rpartition(".")[0]
        own[owner] = own.get(owner, 0) + p.numel()
    total = _totals(modules, own)
    registered: dict[int, list[str]] = {}
    for qname, p in params:
        registered.setdefault(id(p), []).append(qname)
    for qname, p in params:  # a tied parameter: once in each module holding it
        names = registered[id(p)]
        if len(names) > 1 and names[0] == qname:
            for prefix, n in _holders(names).items():
                if n > 1 and prefix in total:
                    total[prefix] -= (n - 1) * p.numel()
    for name, m in _holding_aliases(modules):  # a submodule listed under another name first
        total[name] = sum(p.numel() for p in m.parameters())
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


def _totals(modules: list[tuple[str, nn.Module]], own: dict[str, int]) -> dict[str, int]:
    """Each module's own count added to its ancestors', children before parents
    (``named_modules`` lists a parent before its children); a tied parameter counts once per
    name here."""
    total = dict.fromkeys((name for name, _ in modules), 0)
    for name, _ in reversed(modules):
        total[name] += own.get(name, 0)
        if name:
            parent = name.rpartition(".")[0]
            if parent in total:
                total[parent] += total[name]
    return total


def _holding_aliases(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The modules whose subtree holds a module that ``named_modules`` lists under another
    name (one module in two places: its parameters are not under this name in the list)."""
    first = {id(m): name for name, m in modules}
    marked: set[str] = set()
    for name, m in modules:
        for key, child in m._modules.items():  # torch's own children table (no copy)
            if child is not None and first.get(id(child)) != (f"{name}.{key}" if name else key):
                prefix = name
                while prefix not in marked:
                    marked.add(prefix)
                    if not prefix:
                        break
                    prefix = prefix.rpartition(".")[0]
    return [(name, m) for name, m in modules if name in marked]


def _holders(qnames: list[str]) -> dict[str, int]:
    """Per module prefix, how many of ``qnames`` (one parameter's names) it holds."""
    held: dict[str, int] = {}
    for qname in qnames:
        prefix = qname.rpartition(".")[0]
        while True:
            held[prefix] = held.get(prefix, 0) + 1
            if not prefix:
                break
            prefix = prefix.rpartition(".")[0]
    return held
