"""Where a user's model raised: the module being called and the user's source line.

An exception from deep inside a forward (``RuntimeError: view size is not compatible ...``)
says what went wrong but not where in the model. :func:`locate_error` reads the traceback: the
innermost frame of an ``nn.Module.forward`` (or a hook) names the module being called, mapped to
its qualified name in the model; the innermost frame outside torch and outside mdb is the
user's ``file:line``. :func:`describe_error` makes the one line every mdb command prints.

Never imports textual, rich or tui.
"""

from __future__ import annotations

import linecache
import os
import traceback
from dataclasses import dataclass

import torch
from torch import nn

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_MDB_DIRS = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
    for d in ("hooks", "tui")
)


class ModelRaisedError(ValueError):
    """The user's model (its factory, forward, loss or backward) raised; the message is the one
    line of :func:`describe_error`. A ``ValueError``, so code that reports bad input on one line
    reports it too; ``mdb`` exits with 1 for it (the user's code failed, not the command line)."""


@dataclass(frozen=True)
class ErrorLocation:
    """Where an exception came from.

    Attributes:
        module: qualified name of the innermost module whose ``forward`` was running (``""``
            for the root), or None when the exception came from outside any forward.
        module_type: its class name, or ``""``.
        file: the innermost source file outside torch and mdb, or ``""``.
        line: its line number (0 when unknown).
        code: that line's text, stripped.
    """

    module: str | None
    module_type: str
    file: str
    line: int
    code: str

    @property
    def where(self) -> str:
        """``model.py:23``, or ``""``."""
        return f"{os.path.basename(self.file)}:{self.line}" if self.file else ""


def _outside(path: str) -> bool:
    return not path.startswith(_TORCH_DIR) and not path.startswith(_MDB_DIRS) \
        and not path.startswith("<frozen")


def locate_error(exc: BaseException, model: nn.Module | None = None) -> ErrorLocation:
    """The module being called and the user's source line when ``exc`` was raised.

    Args:
        exc: an exception with its traceback.
        model: the model whose modules are named (without it, or for a module not in it, the
            class name alone is given).
    """
    names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
    module = None
    module_type = ""
    file, line = "", 0
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        code = frame.f_code
        owner = frame.f_locals.get("self") if code.co_name == "forward" else None
        if isinstance(owner, nn.Module):
            module_type = type(owner).__name__
            module = names.get(id(owner), module if names else "")
            if names and id(owner) not in names:
                module = None
        if _outside(code.co_filename):
            file, line = code.co_filename, lineno
    text = linecache.getline(file, line).strip() if file else ""
    return ErrorLocation(module, module_type, file, line, text)


def describe_error(exc: BaseException, model: nn.Module | None = None,
                   doing: str = "") -> str:
    """One line: ``RuntimeError: view size is not compatible ... — in h.0.attn
    (CausalSelfAttention), at user_gpt.py:20: q = q.view(B, T, self.h, D // self.h)``.

    Args:
        exc: the exception.
        model: the user's model (to name the module).
        doing: what mdb was doing, e.g. ``"the forward pass"`` (prefixed as ``in the forward
            pass:``).
    """
    msg = " ".join(f"{type(exc).__name__}: {exc}".split())
    if len(msg) > 240:
        msg = msg[:237] + "..."
    loc = locate_error(exc, model)
    parts = [msg]
    if loc.module is not None:
        parts.append(f"in {loc.module or '<root>'} ({loc.module_type})")
    if loc.file:
        code = loc.code if len(loc.code) <= 80 else loc.code[:77] + "..."
        parts.append(f"at {loc.where}: {code}" if code else f"at {loc.where}")
    head = f"{doing}: " if doing else ""
    return head + " — ".join([parts[0], ", ".join(parts[1:])]) if len(parts) > 1 \
        else head + parts[0]
