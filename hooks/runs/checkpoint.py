"""Training checkpoints: a model and its optimizer as safetensors + JSON, never pickle.

A checkpoint is a directory, written to ``<dir>.tmp`` and renamed into place, so a reader (or a
resume after ``kill -9``) sees either the previous checkpoint or the new one::

    model.safetensors      model state (tied tensors stored once: safetensors.torch.save_model)
    optimizer.safetensors  each tensor of optimizer.state_dict()["state"], key "<param idx>.<name>"
    checkpoint.json        step, seed, RNG state (hex), optimizer param_groups and non-tensor
                           state values, and any caller-supplied fields

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
        if set(value) == {"__tuple__"}:
            return tuple(_decode_json(v) for v in value["__tuple__"])
        if set(value) == {"__float__"}:
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
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _write_checkpoint_files(tmp, model, optimizer, step, extra)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a disk-full write leaves nothing behind
        raise
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    return path


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
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable checkpoint {meta_path}: {exc}") from exc
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{meta_path} is not an mdb checkpoint")
    meta["extra"] = _decode_json(meta.get("extra", {}))
    meta["_dir"] = str(meta_path.parent)
    return meta


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

    Raises:
        FileNotFoundError: No checkpoint at ``path``.
        ValueError: Not an mdb checkpoint, or it does not fit the model/optimizer.
    """
    from safetensors.torch import load_file, load_model

    meta = read_checkpoint_meta(path)
    d = Path(meta["_dir"])
    mismatch = checkpoint_mismatch(d, model)
    if mismatch is not None:
        raise ValueError(f"checkpoint {d} does not fit the model: {mismatch}")
    try:
        missing, unexpected = load_model(model, str(d / "model.safetensors"), strict=True)
    except Exception as exc:  # RuntimeError, OSError, safetensors' SafetensorError (truncated)
        raise ValueError(f"checkpoint {d} does not fit the model or is unreadable: {exc}") from exc
    if optimizer is not None:
        info = meta.get("optimizer")
        if info is None:
            raise ValueError(f"checkpoint {d} has no optimizer state")
        if info["class"] != type(optimizer).__name__:
            raise ValueError(
                f"checkpoint {d} holds {info['class']} state, not {type(optimizer).__name__}"
            )
        try:
            tensors = load_file(str(d / "optimizer.safetensors"))
        except Exception as exc:
            raise ValueError(f"checkpoint {d} has an unreadable optimizer state: {exc}") from exc
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            idx, name = key.split(".", 1)
            state.setdefault(int(idx), {})[name] = value
        for idx, values in info.get("state_other", {}).items():
            for name, value in values.items():
                state.setdefault(int(idx), {})[name] = _decode_json(value)
        groups = _decode_json(info["param_groups"])
        try:
            optimizer.load_state_dict({"state": state, "param_groups": groups})
        except (ValueError, KeyError, RuntimeError) as exc:
            raise ValueError(f"checkpoint {d} does not fit the optimizer: {exc}") from exc
    if restore_rng and meta.get("torch_rng_state"):
        rng = torch.frombuffer(bytearray(bytes.fromhex(meta["torch_rng_state"])), dtype=torch.uint8)
        torch.set_rng_state(rng.clone())
    return meta
