"""No private names between modules (#33): ``hooks``, ``tui`` and ``minillm`` import no
underscore name from one another, and read no ``obj._name`` of an object they do not own.

Read with :mod:`ast` (not a grep: comments, strings and ``self._x`` do not count). An
``obj._name`` is allowed when

* ``obj`` is ``self`` or ``cls``;
* the name is a dunder;
* the same module defines a class with that member (a method, a class attribute or a
  ``self._name = ...``): the module's own classes, e.g. a factory classmethod filling the
  instance it built, or a method merging another instance of its class;
* it starts with ``_mdb_``: mdb's own mark on a library object (a Textual widget or event, a
  torch module), prefixed so that it cannot collide with the library's names;
* it is in :data:`LIBRARY_PRIVATE` (a library's private attribute that mdb must read, each with
  its reason, pinned on the installed version by
  :func:`test_the_library_private_names_read_exist_on_the_installed_versions`) or in
  :data:`OWN_NAMESPACE`.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("hooks", "tui", "minillm")

#: A library's private attribute mdb reads, and why: there is no public reader.
LIBRARY_PRIVATE = {
    "_C": "torch._C: the autograd engine's graph task id and the ops' C bindings (no public API)",
    "_nn": "torch._C._nn: the functional ops the attention capture wraps (F.* call them)",
    "_VariableFunctions": "torch._C._VariableFunctions: torch.* ops the attention capture wraps",
    "_current_graph_task_id": "tells a backward pass running now (checkpoint recomputation)",
    "_execution_engine": "Variable._execution_engine.queue_callback: run at backward's end",
    "_foreach_norm": "torch._foreach_norm: one kernel for many norms (no public foreach API)",
    "_version": "Tensor._version: the in-place write counter (no public reader)",
    "_orig_mod": "OptimizedModule._orig_mod: the module a torch.compile wrapper runs",
    "_compiled_call_impl": "Module.compile() stores its compiled forward there",
    "_parameters": "Module._parameters: a module's own parameters, without a generator walk",
    "_buffers": "Module._buffers: a module's own buffers",
    "_modules": "Module._modules: a module's direct children, in order",
    "_forward_hooks": "Module._forward_hooks: whether a module already has forward hooks",
    "_forward_pre_hooks": "Module._forward_pre_hooks: the same, for pre-hooks",
    "_backward_hooks": "Tensor._backward_hooks: the gradient hooks a user registered on a "
                       "parameter (the doctor names them; no public reader)",
    "_qkv_same_embed_dim": "MultiheadAttention's own test for the fused fast path",
    "_privateuse1_backend_name": "the name of a PrivateUse1 device backend",
    "_DropoutNd": "nn.modules.dropout._DropoutNd: the base class of every dropout module",
    "_BatchNorm": "nn.modules.batchnorm._BatchNorm: the base class of BatchNorm1d/2d/3d",
    "_get_default_store": "the process group's TCPStore (rank heartbeats; no public getter)",
    "_getframe": "sys._getframe: documented CPython API, cheaper than inspect.stack",
    "_exit": "os._exit: documented; leave a child process without running atexit handlers",
    "_fields": "namedtuple._fields: documented namedtuple API (the underscore avoids clashes)",
    "_base": "Tensor._base: the tensor a view was taken of (a Parameter's view)",
    "_local_tensor": "DTensor._local_tensor: what to_local() returns, without a dispatch",
    "_is_in_optimized_module": "torch._dynamo.eval_frame: a torch.compile wrapper runs now",
    "_len_torch_function_stack": "the TorchFunctionMode stack's depth: the loop doctor leaves "
                                 "its mode only from the top (no public reader)",
    "_get_function_stack_at": "the mode at a depth of that stack: is the top the loop doctor's",
    "_schedule_phases": "OneCycleLR's phases: where its warm-up ends (no public reader)",
    "_milestones": "SequentialLR's milestones: where its first scheduler ends",
    "_vertical_scrollbar": "Textual Widget: flush_repaints hands pending repaints over",
    "_horizontal_scrollbar": "Textual Widget: the same, for the horizontal scroll bar",
    "_repaint_required": "Textual Widget: a repaint is pending",
    "_layout_required": "Textual Widget: a layout is pending",
    "_check_refresh": "Textual Widget: deliver the pending refresh now (one frame)",
    "_attn_implementation": "HF PretrainedConfig._attn_implementation: the attention "
                            "implementation in use, HF's own reader (set_attn_implementation "
                            "has no getter); the doctor's attn-impl check restores it",
}

#: Entries of mdb's own argparse namespace (``set_defaults(_run=...)`` and the argv), named
#: with an underscore so no command's option can take the same dest.
OWN_NAMESPACE = {("tui/cli.py", "_argv"), ("tui/cli.py", "_run"), ("tui/cli.py", "_torch"),
                 ("tui/commands/overfit_detach.py", "_argv")}


def _modules() -> list[Path]:
    return sorted(p for pkg in OURS for p in (ROOT / pkg).rglob("*.py"))


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _class_members(tree: ast.Module) -> set[str]:
    """Every member name of the classes this module defines."""
    out: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and (
                    isinstance(node.value, ast.Name) and node.value.id == "self"):
                out.add(node.attr)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def _by_name(node: ast.AST) -> bool:
    """``getattr(obj, "_name", ...)``, ``hasattr`` or ``setattr`` of a private name."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
            and _private(node.args[1].value))


def _imported_from_ours(tree: ast.Module) -> set[str]:
    """The names this module binds by importing from our packages (modules, classes,
    functions): their private members are another module's."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in OURS:
            out.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.asname for a in node.names
                       if a.asname and a.name.split(".")[0] in OURS)
    return out


def private_uses(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """``(imports, attributes)``: the private names imported between our modules, and the
    ``obj._name`` reads none of the rules above allow, as ``path:line: ...``."""
    imports, attrs = [], []
    for path in (sorted(p for pkg in OURS for p in (root / pkg).rglob("*.py"))):
        rel = path.relative_to(root).as_posix()
        tree = _parsed(path)
        own = _class_members(tree)
        imported = _imported_from_ours(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] in OURS:
                imports += [f"{rel}:{node.lineno}: from {node.module} import {a.name}"
                            for a in node.names if _private(a.name)]
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                imports += [f"{rel}:{node.lineno}: from {'.' * node.level}{node.module or ''} "
                            f"import {a.name}" for a in node.names if _private(a.name)]
            elif (isinstance(node, ast.Attribute) and _private(node.attr)) or _by_name(node):
                v, name = (node.value, node.attr) if isinstance(node, ast.Attribute) \
                    else (node.args[0], node.args[1].value)
                if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                    continue
                if isinstance(v, ast.Name) and v.id in imported:  # a module or class of ours
                    attrs.append(f"{rel}:{node.lineno}: {v.id}.{name}")
                    continue
                if name in own or name.startswith("_mdb_") or name in LIBRARY_PRIVATE \
                        or (rel, name) in OWN_NAMESPACE:
                    continue
                attrs.append(f"{rel}:{node.lineno}: {ast.unparse(v)}.{name}")
    return imports, attrs


def test_no_private_name_is_imported_between_our_modules() -> None:
    imports, _ = private_uses()
    assert imports == []


def test_no_private_attribute_of_another_object_is_read() -> None:
    _, attrs = private_uses()
    assert attrs == []


def test_the_scan_finds_what_it_must(tmp_path) -> None:
    """The scan itself: each kind of use it must report, and each it must let pass."""
    pkg = tmp_path / "hooks"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "from hooks.b import _helper, public\n"
        "from hooks import checks as hc\n"
        "from hooks.b import __version__\n"
        "class Own:\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def merge(self, other):\n"
        "        return other._mine + self._theirs\n"
        "def f(store, widget, x):\n"
        "    store._transaction()\n"
        "    widget._mdb_text = 'x'\n"
        "    hc._names(x)\n"
        "    getattr(x, '_inside', False), getattr(self_, '_mdb_x', 0)\n"
        "    return x._version, x.__class__, _\n",
        encoding="utf-8")
    for pkg_name in ("tui", "minillm"):
        (tmp_path / pkg_name).mkdir()
    imports, attrs = private_uses(tmp_path)
    assert imports == ["hooks/a.py:1: from hooks.b import _helper"]
    assert attrs == ["hooks/a.py:10: store._transaction", "hooks/a.py:12: hc._names",
                     "hooks/a.py:13: x._inside"]


def test_the_library_private_names_read_exist_on_the_installed_versions() -> None:
    """Each entry of LIBRARY_PRIVATE, on the installed torch: an upgrade that renames one
    fails here, by name, not somewhere in a capture."""
    import collections
    import os
    import sys

    import textual
    import torch
    import torch._dynamo.eval_frame as eval_frame
    import torch.distributed.distributed_c10d as c10d
    import torch.utils.backend_registration as backend_registration
    from textual.widget import Widget
    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.optim.lr_scheduler import LinearLR, OneCycleLR, SequentialLR

    m = nn.Linear(2, 2)
    Point = collections.namedtuple("Point", "x y")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    one_cycle = OneCycleLR(opt, max_lr=1.0, total_steps=10)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sequential = SequentialLR(opt, [LinearLR(opt), LinearLR(opt)], milestones=[3])
    widget = Widget()
    present = {
        "_C": hasattr(torch, "_C"),
        "_nn": hasattr(torch._C, "_nn"),
        "_VariableFunctions": hasattr(torch._C, "_VariableFunctions"),
        "_current_graph_task_id": callable(getattr(torch._C, "_current_graph_task_id", None)),
        "_execution_engine": callable(getattr(getattr(torch.autograd.Variable,
                                                      "_execution_engine", None),
                                              "queue_callback", None)),
        "_foreach_norm": callable(getattr(torch, "_foreach_norm", None)),
        "_version": isinstance(getattr(torch.zeros(1), "_version", None), int),
        "_orig_mod": getattr(torch.compile(m), "_orig_mod", None) is m,
        "_compiled_call_impl": hasattr(m, "_compiled_call_impl"),
        "_parameters": set(getattr(m, "_parameters", {})) == {"weight", "bias"},
        "_buffers": isinstance(getattr(nn.BatchNorm1d(2), "_buffers", None), dict),
        "_modules": list(getattr(nn.Sequential(m), "_modules", {})) == ["0"],
        "_forward_hooks": isinstance(getattr(m, "_forward_hooks", None), dict),
        "_forward_pre_hooks": isinstance(getattr(m, "_forward_pre_hooks", None), dict),
        "_backward_hooks": _hook_dict_holds_a_registered_hook(),
        "_qkv_same_embed_dim": getattr(nn.MultiheadAttention(4, 1), "_qkv_same_embed_dim",
                                       None) is True,
        "_privateuse1_backend_name": isinstance(
            getattr(backend_registration, "_privateuse1_backend_name", None), str),
        "_DropoutNd": issubclass(nn.Dropout, getattr(nn.modules.dropout, "_DropoutNd", ())),
        "_BatchNorm": issubclass(nn.BatchNorm2d, getattr(nn.modules.batchnorm, "_BatchNorm",
                                                          ())),
        "_get_default_store": callable(getattr(c10d, "_get_default_store", None)),
        "_getframe": callable(getattr(sys, "_getframe", None)),
        "_exit": callable(getattr(os, "_exit", None)),
        "_fields": Point._fields == ("x", "y"),
        "_base": torch.zeros(4)[:2]._base is not None,
        "_local_tensor": "_local_tensor" in getattr(DTensor, "__slots__", ()),
        "_is_in_optimized_module": callable(getattr(eval_frame, "_is_in_optimized_module",
                                                    None)),
        "_len_torch_function_stack": callable(getattr(torch._C, "_len_torch_function_stack",
                                                      None)),
        "_get_function_stack_at": callable(getattr(torch._C, "_get_function_stack_at", None)),
        "_schedule_phases": bool(getattr(one_cycle, "_schedule_phases", None)),
        "_milestones": getattr(sequential, "_milestones", None) == [3],
        **{a: hasattr(widget, a) for a in ("_vertical_scrollbar", "_horizontal_scrollbar",
                                          "_repaint_required", "_layout_required")},
        "_check_refresh": callable(getattr(widget, "_check_refresh", None)),
        "_attn_implementation": _hf_attn_implementation(),
    }
    assert set(present) == set(LIBRARY_PRIVATE)
    missing = sorted(k for k, ok in present.items() if not ok)
    assert missing == [], f"torch {torch.__version__}, textual {textual.__version__}: {missing}"


def _hf_attn_implementation() -> bool:
    """HF configs have ``_attn_implementation`` (True without transformers, a test extra)."""
    try:
        import transformers.configuration_utils as cu
    except ImportError:
        return True
    return isinstance(getattr(cu.PretrainedConfig, "_attn_implementation", None), property)


@pytest.mark.parametrize("pattern", ["_active", "_inside", "_transaction", "_parent"])
def test_the_named_reaches_of_issue_33_are_gone(pattern) -> None:
    """Capture._active, NonFiniteSentinel._inside, RunStore._transaction, Textual's _parent:
    read through their public APIs now."""
    hits = []
    for path in _modules():
        tree = _parsed(path)
        for n in ast.walk(tree):
            obj, name = ((n.value, n.attr) if isinstance(n, ast.Attribute) else
                         (n.args[0], n.args[1].value) if _by_name(n) else (None, None))
            if name == pattern and not (isinstance(obj, ast.Name)
                                        and obj.id in ("self", "cls")):
                hits.append(f"{path.relative_to(ROOT)}:{n.lineno}")
    assert hits == []


def _hook_dict_holds_a_registered_hook() -> bool:
    """``Tensor._backward_hooks`` holds what ``register_hook`` registered (the doctor's user
    hooks check reads it)."""
    import torch

    p = torch.nn.Parameter(torch.zeros(2))

    def fn(g):
        return g

    p.register_hook(fn)
    return list(getattr(p, "_backward_hooks", {}).values()) == [fn]
