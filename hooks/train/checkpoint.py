"""Training checkpoints: a model and its optimizer as safetensors + JSON, never pickle.

A checkpoint is a directory, written to ``<dir>.tmp`` and renamed into place, so a reader (or a
resume after ``kill -9``) sees either the previous checkpoint or the new one::

    model.safetensors      model state (tied tensors stored once: safetensors.torch.save_model)
    optimizer.safetensors  each tensor of optimizer.state_dict()["state"], key "<param idx>.<name>"
    checkpoint.json        step, seed, RNG state (hex), optimizer param_groups and non-tensor
                           state values, and any caller-supplied fields

For tests, ``$MDB_TEST_HOLD_CHECKPOINT`` names a FIFO: the first checkpoint a process saves
waits there, its files written and not yet renamed into place, until a byte arrives or the
FIFO's writer closes it (:func:`hold_point`). A test opens the FIFO to know that the process is
inside its checkpoint, then kills or signals it there, without guessing a time.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "CHECKPOINT_FORMAT",
    "checkpoint_mismatch",
    "load_checkpoint",
    "read_checkpoint_meta",
    "save_checkpoint",
]

#: ``checkpoint.json``'s ``format`` value.
CHECKPOINT_FORMAT = "mdb-checkpoint-1"
#: Environment variable naming the FIFO of :func:`hold_point` (tests only).
HOLD_ENV = "MDB_TEST_HOLD_CHECKPOINT"
_held = [False]


def hold_point() -> None:
    """Where a test holds a checkpoint being saved (``$MDB_TEST_HOLD_CHECKPOINT``, see the
    module docstring): once per process, open that FIFO for reading (which waits for a
    writer) and read one byte (which waits for it, or for the writer to close). Nothing
    happens when the variable is unset."""
    fifo = os.environ.get(HOLD_ENV)
    if not fifo or _held[0]:
        return
    _held[0] = True
    with open(fifo, "rb") as f:
        f.read(1)


def _encode_json(value: Any) -> Any:
    if isinstance(value, tuple):
        return {"__tuple__": [_encode_json(v) for v in value]}
    if isinstance(value, list):
        return [_encode_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode_json(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        raise TypeError("tensors belong in the safetensors file")
    return value


def _decode_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tuple__"} and isinstance(value["__tuple__"], list):
            return tuple(_decode_json(v) for v in value["__tuple__"])
        if set(value) == {"__float__"} and value["__float__"] in ("nan", "inf", "-inf"):
            return float(value["__float__"])
        return {k: _decode_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_json(v) for v in value]
    return value


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    step: int,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write a checkpoint directory atomically (see the module docstring for the layout).

    The files are written into ``<path>.tmp`` and the directory is then renamed into place, so
    a reader (or a resume after ``kill -9``) sees either the previous checkpoint or the new one.

    Args:
        path: Checkpoint directory.
        model: Its ``state_dict`` is saved with ``safetensors.torch.save_model`` (tied weights
            stored once).
        optimizer: Its state tensors go to ``optimizer.safetensors``, the rest to JSON.
        step: Step the checkpoint is taken after.
        extra: JSON-serialisable fields stored in ``checkpoint.json`` (e.g. the run config).

    Returns:
        The checkpoint directory.

    Raises:
        OSError, safetensors.SafetensorError: The files could not be written (disk full,
            read-only directory); ``<path>.tmp`` is removed and any previous checkpoint at
            ``path`` is untouched.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    _remove(tmp)
    tmp.mkdir(parents=True)
    try:
        _write_checkpoint_files(tmp, model, optimizer, step, extra)
        hold_point()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a disk-full write leaves nothing behind
        raise
    old = path.with_name(path.name + ".old")
    _remove(old)
    if path.is_symlink():  # a link planted in the run's folder: removed, never followed
        path.unlink()
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    _remove(old, ignore_errors=True)
    return path


def _remove(path: Path, ignore_errors: bool = False) -> None:
    """Remove the checkpoint folder (or a leftover) at ``path``: a symbolic link is unlinked,
    never followed (a link planted in the store must not make mdb delete what it points to)."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=ignore_errors)


def _write_checkpoint_files(
    tmp: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    extra: Mapping[str, Any] | None,
) -> None:
    from safetensors.torch import save_file, save_model

    save_model(model, str(tmp / "model.safetensors"))
    meta: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "step": int(step),
        "saved": time.time(),
        "torch_rng_state": torch.get_rng_state().numpy().tobytes().hex(),
        "extra": _encode_json(dict(extra or {})),
    }
    if optimizer is not None:
        sd = optimizer.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        other: dict[str, dict[str, Any]] = {}
        for idx, st in sd["state"].items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{idx}.{key}"] = value.detach().contiguous().cpu()
                else:
                    other.setdefault(str(idx), {})[key] = _encode_json(value)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        meta["optimizer"] = {
            "class": type(optimizer).__name__,
            "param_groups": _encode_json(sd["param_groups"]),
            "state_other": other,
        }
    with open(tmp / "checkpoint.json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_checkpoint_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``checkpoint.json`` of a checkpoint directory, decoded.

    Raises:
        FileNotFoundError: No checkpoint there.
        ValueError: Not an mdb checkpoint.
    """
    path = Path(path)
    meta_path = path / "checkpoint.json"
    if not meta_path.exists():
        # an interrupted save leaves the previous checkpoint in <path>.old
        old = path.with_name(path.name + ".old")
        if (old / "checkpoint.json").exists():
            meta_path = old / "checkpoint.json"
        else:
            raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"unreadable checkpoint {meta_path}: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{meta_path} is not an mdb checkpoint")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{meta_path} is damaged: its step is {step!r}, not a step number")
    meta["extra"] = _decode_json(meta.get("extra", {}))
    if not isinstance(meta["extra"], dict):
        raise ValueError(f"{meta_path} is damaged: 'extra' is not a JSON object")
    meta["_dir"] = str(meta_path.parent)
    return meta


def _rng_state(meta: Mapping[str, Any], where: Path) -> torch.Tensor | None:
    """The checkpoint's torch CPU RNG state as a uint8 tensor (``None`` when it has none)."""
    text = meta.get("torch_rng_state")
    if not text:
        return None
    want = torch.get_rng_state().numel()
    try:
        raw = bytes.fromhex(text) if isinstance(text, str) else None
    except ValueError:
        raw = None
    if raw is None or len(raw) != want:
        shown = repr(text) if len(repr(text)) <= 20 else repr(text)[:19] + "…"
        raise ValueError(f"checkpoint {where} is damaged: its RNG state is {shown}, not the "
                         f"{want} bytes of torch's CPU generator in hex")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def _same_kind(stored: Any, current: Any) -> bool:
    """Whether an optimizer hyper-parameter read from a checkpoint can stand for the value the
    optimizer has now: a finite number for a number, a bool for a bool, a tuple of as many
    numbers for a tuple (AdamW's ``betas``); anything for ``None``."""
    if current is None:
        return stored is None or isinstance(stored, (bool, int, float, str))
    if isinstance(current, bool):
        return isinstance(stored, bool)
    if isinstance(current, (int, float)):
        return (isinstance(stored, (int, float)) and not isinstance(stored, bool)
                and (math.isfinite(stored) or not math.isfinite(current)))
    if isinstance(current, (tuple, list)):
        return (isinstance(stored, (tuple, list)) and len(stored) == len(current)
                and all(_same_kind(a, b) for a, b in zip(stored, current, strict=True)))
    if isinstance(current, str):
        return isinstance(stored, str)
    return True


def _check_groups(groups: Any, optimizer: torch.optim.Optimizer, where: Path) -> None:
    """Refuse param_groups that the optimizer would take but then fail on (``lr: "fast"``)."""
    current = optimizer.param_groups
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"checkpoint {where} is damaged: its param_groups are not a list of "
                         "objects")
    if len(groups) != len(current):
        raise ValueError(f"checkpoint {where} holds {len(groups)} parameter groups, the "
                         f"optimizer has {len(current)}")
    for i, (stored, now) in enumerate(zip(groups, current, strict=True)):
        params = stored.get("params")
        if not (isinstance(params, list) and all(
                isinstance(x, int) and not isinstance(x, bool) for x in params)):
            raise ValueError(f"checkpoint {where} is damaged: parameter group {i} lists no "
                             "parameter indices")
        for key, value in stored.items():
            if key != "params" and key in now and not _same_kind(value, now[key]):
                shown = repr(value) if len(repr(value)) <= 30 else repr(value)[:29] + "…"
                raise ValueError(f"checkpoint {where} is damaged: parameter group {i} has "
                                 f"{key} = {shown}, where the optimizer takes "
                                 f"{type(now[key]).__name__}")


def checkpoint_mismatch(path: str | os.PathLike[str], model: nn.Module) -> str | None:
    """Whether ``model`` can load the checkpoint's weights, read from the safetensors header
    only (no tensor is loaded).

    A name of ``model.state_dict()`` that the file lacks is fine when it shares its storage
    with a name the file holds (tied weights are stored once by
    ``safetensors.torch.save_model``).

    Args:
        path: A checkpoint directory (see :func:`save_checkpoint`).
        model: The model to compare.

    Returns:
        ``None`` when every tensor matches in name, shape and dtype; else one line naming the
        first difference and how many tensors differ, e.g. ``transformer.h.0.mlp.0.weight is
        (256, 64) in the model, (128, 64) in the checkpoint (4 tensors differ)``.

    Raises:
        FileNotFoundError, ValueError: No readable checkpoint at ``path``.
    """
    from safetensors import safe_open

    meta = read_checkpoint_meta(path)
    file = Path(meta["_dir"]) / "model.safetensors"
    try:
        with safe_open(str(file), framework="pt") as f:
            stored = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                      for k in f.keys()}
    except Exception as exc:  # SafetensorError, OSError: a truncated or missing file
        raise ValueError(f"checkpoint {file.parent} is unreadable: {exc}") from exc
    state = model.state_dict()
    storages: dict[int, list[str]] = {}
    for name, t in state.items():
        if t.numel():
            storages.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    problems: list[str] = []
    for name, t in state.items():
        want = (tuple(t.shape), _ST_DTYPES.get(t.dtype, str(t.dtype)))
        got = stored.get(name)
        if got is None:
            twins = storages.get(t.untyped_storage().data_ptr(), []) if t.numel() else []
            if not any(n in stored for n in twins if n != name):
                problems.append(f"the model has {name} {want[0]}, the checkpoint does not")
        elif got[0] != want[0]:
            problems.append(f"{name} is {want[0]} in the model, {got[0]} in the checkpoint")
        elif got[1] != want[1]:
            problems.append(f"{name} is {want[1]} in the model, {got[1]} in the checkpoint")
    for name in stored:
        if name not in state:
            problems.append(f"the checkpoint has {name}, the model does not")
    if not problems:
        return None
    more = f" ({len(problems)} tensors differ)" if len(problems) > 1 else ""
    return problems[0] + more


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``).

    Args:
        path: Checkpoint directory.
        model: A model of the same architecture; loaded strictly.
        optimizer: An optimizer of the same class over the same parameters, or ``None``.
        restore_rng: Restore torch's global CPU RNG state too.

    Returns:
        The decoded ``checkpoint.json`` (``step``, ``extra`` ...).

    Everything read from ``checkpoint.json`` is checked before the model is touched: its
    RNG state, and that each optimizer hyper-parameter is of the kind the optimizer holds now
    (``lr: "fast"`` is refused here, not when the first update fails).

    Raises:
        FileNotFoundError: No checkpoint at ``path``.
        ValueError: Not an mdb checkpoint, damaged (one line naming the field), or it does not
            fit the model/optimizer.
    """
    from safetensors.torch import load_file, load_model

    meta = read_checkpoint_meta(path)
    d = Path(meta["_dir"])
    rng = _rng_state(meta, d) if restore_rng else None
    info = meta.get("optimizer")
    if optimizer is not None:
        if not isinstance(info, dict):
            raise ValueError(f"checkpoint {d} has no optimizer state")
        if info.get("class") != type(optimizer).__name__:
            raise ValueError(
                f"checkpoint {d} holds {info.get('class')} state, not {type(optimizer).__name__}"
            )
        groups = _decode_json(info.get("param_groups"))
        _check_groups(groups, optimizer, d)
        other = info.get("state_other", {})
        if not isinstance(other, dict) or not all(
                isinstance(k, str) and k.isdigit() and isinstance(v, dict)
                for k, v in other.items()):
            raise ValueError(f"checkpoint {d} is damaged: its optimizer state_other is not an "
                             "object of per-parameter objects")
    mismatch = checkpoint_mismatch(d, model)
    if mismatch is not None:
        raise ValueError(f"checkpoint {d} does not fit the model: {mismatch}")
    try:
        missing, unexpected = load_model(model, str(d / "model.safetensors"), strict=True)
    except Exception as exc:  # RuntimeError, OSError, safetensors' SafetensorError (truncated)
        raise ValueError(f"checkpoint {d} does not fit the model or is unreadable: {exc}") from exc
    if optimizer is not None:
        try:
            tensors = load_file(str(d / "optimizer.safetensors"))
        except Exception as exc:
            raise ValueError(f"checkpoint {d} has an unreadable optimizer state: {exc}") from exc
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            idx, _, name = key.partition(".")
            if not idx.isdigit() or not name:
                raise ValueError(f"checkpoint {d} is damaged: optimizer tensor {key!r} names no "
                                 "parameter index")
            state.setdefault(int(idx), {})[name] = value
        for idx, values in info.get("state_other", {}).items():
            for name, value in values.items():
                state.setdefault(int(idx), {})[name] = _decode_json(value)
        try:
            optimizer.load_state_dict({"state": state, "param_groups": groups})
        except (ValueError, KeyError, RuntimeError, TypeError, IndexError) as exc:
            raise ValueError(f"checkpoint {d} does not fit the optimizer: {exc}") from exc
    if rng is not None:
        torch.set_rng_state(rng)
    return meta


def checkpoint_shapes(path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of a checkpoint's model tensors, read from the safetensors header only
    (no tensor is loaded).

    Raises:
        FileNotFoundError, ValueError: No readable checkpoint at ``path``.
    """
    from safetensors import safe_open

    meta = read_checkpoint_meta(path)
    file = Path(meta["_dir"]) / "model.safetensors"
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # SafetensorError, OSError: a truncated or missing file
        raise ValueError(f"checkpoint {file.parent} is unreadable: {exc}") from exc


def shapes_mismatch(stored: Mapping[str, tuple[int, ...]], model: nn.Module) -> str | None:
    """The first name or shape in which ``model`` (which may be on the ``meta`` device: only
    names and shapes are read) differs from a checkpoint's ``stored`` shapes
    (:func:`checkpoint_shapes`), with how many differ; ``None`` when none does. A name the file
    lacks is fine when it is a tied weight stored under another of its names."""
    state = model.state_dict(keep_vars=True)  # a tied weight: one object, several names
    names: dict[int, list[str]] = {}
    for n, t in state.items():
        names.setdefault(id(t), []).append(n)
    problems = [f"the model has {n} {tuple(t.shape)}, the checkpoint does not"
                for n, t in state.items()
                if not any(twin in stored for twin in names[id(t)])]
    problems += [f"{n} is {tuple(t.shape)} in the model, {stored[n]} in the checkpoint"
                 for n, t in state.items() if n in stored and tuple(t.shape) != stored[n]]
    problems += [f"the checkpoint has {n}, the model does not" for n in stored
                 if n not in state]
    if not problems:
        return None
    more = f" ({len(problems)} tensors differ)" if len(problems) > 1 else ""
    return problems[0] + more
