"""Whose fault an exception is: the user's model or PyTorch (the check reports ``skip``), or
mdb's own code (``error``), decided by where it was raised.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
from torch import nn

_HOOKS_DIR = str(Path(__file__).resolve().parent.parent) + os.sep
_TORCH_DIR = str(Path(torch.__file__).resolve().parent) + os.sep
_MODULE_PY = os.path.join("torch", "nn", "modules", "module.py")
_AUTOGRAD = os.path.join("torch", "autograd") + os.sep
#: Frames of mdb's code that only forward the model's own torch calls (``TorchFunctionMode``).
_TRANSPARENT = frozenset({"__torch_function__", "__torch_dispatch__"})


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, at most ``limit`` characters."""
    msg = " ".join(f"{type(exc).__name__}: {exc}".split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _frames(exc: BaseException) -> list[tuple[FrameType, int]]:
    out = []
    tb = exc.__traceback__
    while tb is not None:
        out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


@dataclass(frozen=True)
class ModelFault:
    """Where the user's model or PyTorch raised.

    Attributes:
        module: qualified name of the innermost module whose forward was running, or None.
        module_type: its class name ("" without a module).
        file: base name of the file of the innermost frame that raised.
        line: its line number.
    """

    module: str | None
    module_type: str
    file: str
    line: int

    def describe(self) -> str:
        """``inside model.layers.0.lstm (LSTM) at rnn.py:1124``."""
        where = f"inside {self.module or '<root>'} ({self.module_type}) " if self.module_type \
            else ""
        return f"{where}at {self.file}:{self.line}"


def model_fault(exc: BaseException, check_file: str | None,
                names: dict[int, str]) -> ModelFault | None:
    """Where ``exc`` came from when the user's model or PyTorch raised it, else None (mdb's own
    fault).

    The frames after the last one in mdb's code (``hooks/`` or ``check_file``, the check's own
    source) decide: a module call (``torch/nn/modules/module.py``), the autograd engine, or
    code outside torch and mdb (the model's, transformers', a ``loss_fn``) means the model ran
    and raised. mdb's ``TorchFunctionMode`` frames only pass the model's calls through and do
    not count as mdb's.
    """
    frames = _frames(exc)

    def mdb(frame: FrameType) -> bool:
        if frame.f_code.co_name in _TRANSPARENT:
            return False  # mdb's torch-function modes only pass the model's own calls through
        f = os.path.abspath(frame.f_code.co_filename)
        return f.startswith(_HOOKS_DIR) or (check_file is not None and f == check_file)

    last = max((i for i, (f, _) in enumerate(frames) if mdb(f)), default=-1)
    after = frames[last + 1:]
    if not after:
        return None
    files = [os.path.abspath(f.f_code.co_filename) for f, _ in after]
    ran = any(f.endswith(_MODULE_PY) or _AUTOGRAD in f or not f.startswith(_TORCH_DIR)
              for f in files)
    if not ran:
        return None
    module, module_type = None, ""
    for frame, _ in reversed(after):
        obj = frame.f_locals.get("self")
        if isinstance(obj, nn.Module) and id(obj) in names:
            module, module_type = names[id(obj)], type(obj).__name__
            break
    frame, line = next(((f, n) for f, n in reversed(after)
                        if f.f_code.co_name not in _TRANSPARENT), after[-1])
    return ModelFault(module, module_type, os.path.basename(frame.f_code.co_filename), line)


def raised_by_model(exc: BaseException, check_file: str | None,
                    names: dict[int, str]) -> str | None:
    """:func:`model_fault` in words (``inside lstm (LSTM) at rnn.py:1124``), or None."""
    fault = model_fault(exc, check_file, names)
    return None if fault is None else fault.describe()
