"""Where an edit by role lands (:mod:`hooks.engine.edits`): a head of the o projection's input,
a head's columns of the q, k or v projection's output, the attention pattern of a head; and the
steering vector of ``add … vector=FILE.safetensors``.

The roles are :mod:`hooks.modelroles`' (declared, named, traced), so these edits work on any
model whose attention mdb finds. Dimension legend: B batch, T positions, D hidden size,
H query heads, Hkv key/value heads, Dh head dim.

* ``head=H`` alone: columns ``[H·Dh, (H+1)·Dh)`` of the o projection's input (TransformerLens's
  ``hook_z`` of head H).
* ``q``/``k``/``v`` ``head=H``: columns ``[start + H·Dh, start + (H+1)·Dh)`` of the projection's
  output (``start`` is the part's first column in a fused q|k|v projection), heads laid out
  one after the other as every ``view(B, T, H, Dh)`` reads them. With grouped KV heads (GQA) a
  ``k``/``v`` head is a KV head, ``0 … Hkv-1``; without ``head=`` every column of the part.
* ``pattern``: the attention module's probabilities (:mod:`hooks.engine.edit_pattern`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hooks.modelroles import attention_role, find_roles
from hooks.modelroles.found import AttentionRole
from hooks.modelroles.lookup import attention_hint
from hooks.modelroles.traced import out_width

#: The parts of an attention module an edit can name after MODULE.
PARTS = ("q", "k", "v", "pattern")


@dataclass(frozen=True)
class Binding:
    """Where one edit by role is applied.

    Attributes:
        kind: ``head`` (a pre-hook on the o projection), ``columns`` (a forward hook on a
            q/k/v projection) or ``pattern`` (the attention module's call).
        hooked: the qualified name of the module the hook goes on.
        start: first column edited (``head``, ``columns``).
        stop: one past the last.
        width: the hooked tensor's last dimension (H·Dh for ``head``; the projection's out
            width for ``columns``); H for ``pattern``.
        head: the head of a ``pattern`` edit (None: every head).
    """

    kind: str
    hooked: str
    start: int = 0
    stop: int = 0
    width: int = 0
    head: int | None = None


def _role(model: nn.Module, name: str, spec: str, part: str | None) -> AttentionRole:
    got = attention_role(model, name)
    if isinstance(got, str):
        what = f"{part} " if part else ""
        raise ValueError(f"edit {spec!r}: {what}head= needs an attention module: {got}")
    if part in ("q", "k", "v") and getattr(got, part) is None:
        full = find_roles(model).attention_of(name)  # the trace reads the projections
        if full is not None and getattr(full, part) is not None:
            return full
        raise ValueError(f"edit {spec!r}: the {part} projection of {name} was not found (looked "
                         f"for the projection whose output feeds the softmax over q·kᵀ or "
                         f"F.scaled_dot_product_attention, in one traced forward); its attention "
                         f"is declared with {attention_hint(name, got.num_heads)}, and its q/k/v "
                         f"are read from the trace")
    return got


def _check_head(spec: str, name: str, head: int, n: int, what: str, why: str = "") -> None:
    if head >= n:
        raise ValueError(f"edit {spec!r}: {name} has {n} {what} (0…{n - 1}); head={head} is "
                         f"out of range{why}")


def bind(model: nn.Module, name: str, spec: str, part: str | None, head: int | None
         ) -> Binding:
    """Where the edit ``spec`` on attention module ``name`` is applied (see the module
    docstring).

    Raises:
        ValueError: one line: ``name`` is not attention mdb found (what was looked for and the
            line that declares it), the part's projection was not found, ``head`` out of range
            (a ``k``/``v`` head counts KV heads with GQA).
    """
    role = _role(model, name, spec, part)
    h, dh = role.num_heads, role.head_dim
    assert h and dh and role.o
    if part is None:
        assert head is not None
        _check_head(spec, name, head, h, "heads")
        return Binding("head", role.o, head * dh, (head + 1) * dh, h * dh)
    if part == "pattern":
        if head is not None:
            _check_head(spec, name, head, h, "heads")
        return Binding("pattern", name, width=h, head=head)
    cols = getattr(role, part)
    n = h if part == "q" else (role.num_kv_heads or h)
    if cols.width != n * dh:
        raise ValueError(f"edit {spec!r}: {cols.describe()} is {cols.width} columns, not "
                         f"{n} heads × Dh={dh}: its heads cannot be told apart")
    out = out_width(dict(model.named_modules())[cols.module]) or cols.stop
    if head is None:
        return Binding("columns", cols.module, cols.start, cols.stop, out)
    gqa = part != "q" and n != h
    _check_head(spec, name, head, n, "KV heads" if gqa else "heads",
                f" (grouped-query attention: a {part} head is one of the {n} KV heads that "
                f"the {h} query heads share)" if gqa else "")
    return Binding("columns", cols.module, cols.start + head * dh, cols.start + (head + 1) * dh,
                   out)


def load_vector(spec: str, path: str, tensor: str | None) -> torch.Tensor:
    """The steering vector of ``add … vector=PATH [tensor=NAME]``: one tensor of a
    safetensors file (read with ``safetensors`` only, never unpickled).

    Returns:
        torch.Tensor: (D,) or (T, D), floating point, finite.

    Raises:
        ValueError: one line: no such file, not a safetensors file, several tensors and no
            ``tensor=``, no tensor of that name, not 1-D or 2-D, not floating point, not finite.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"edit {spec!r}: vector={path}: no such file")
    try:
        tensors = load_file(str(p))
    except (SafetensorError, OSError, ValueError) as exc:
        first = " ".join(str(exc).split())[:200]
        raise ValueError(f"edit {spec!r}: vector={path} is not a safetensors file ({first})") \
            from None
    if tensor is None and len(tensors) != 1:
        names = ", ".join(sorted(tensors)[:8]) or "none"
        raise ValueError(f"edit {spec!r}: vector={path} holds {len(tensors)} tensors ({names}): "
                         f"name one with tensor=NAME")
    key = tensor if tensor is not None else next(iter(tensors))
    if key not in tensors:
        raise ValueError(f"edit {spec!r}: vector={path} has no tensor {key!r} (it has "
                         f"{', '.join(sorted(tensors)[:8])})")
    vec = tensors[key]
    if vec.dim() not in (1, 2) or not vec.is_floating_point():
        raise ValueError(f"edit {spec!r}: the vector {key!r} is {tuple(vec.shape)} "
                         f"{vec.dtype}: give a floating-point (D,) or (T, D) tensor")
    if not bool(torch.isfinite(vec).all()):
        raise ValueError(f"edit {spec!r}: the vector {key!r} holds non-finite values")
    return vec


def check_vector_width(spec: str, vec: torch.Tensor, x: torch.Tensor, hooked: str) -> None:
    """That ``vec`` (D,) or (T, D) adds to the output ``x`` (..., T, D) of ``hooked``.

    Raises:
        ValueError: one line naming both shapes.
    """
    ok = vec.shape[-1] == x.shape[-1] and (vec.dim() == 1 or (x.dim() >= 2
                                                              and vec.shape[0] == x.shape[-2]))
    if not ok:
        raise ValueError(f"edit {spec!r}: the vector is {tuple(vec.shape)}, {hooked}'s output "
                         f"{tuple(x.shape)}: give (D,) or (T, D) with D={x.shape[-1]}"
                         + (f", T={x.shape[-2]}" if x.dim() >= 2 else ""))


def finite(spec: str, key: str, text: str) -> float:
    """``float(text)`` for ``key=`` of ``spec``; ValueError (one line) when not a finite
    number."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"edit {spec!r}: {key}={text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"edit {spec!r}: {key} must be a finite number, got {text}")
    return value


__all__ = ["PARTS", "Binding", "bind", "check_vector_width", "finite", "load_vector"]
