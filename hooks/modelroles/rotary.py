"""RoPE read from the ops of one traced forward (:class:`hooks.modelroles.graph.OpGraph`), not
from names: whether the queries (or keys) of an attention call are rotated by a position table
on their way from their projection to the scores, and which module makes that table.

The path is every op whose output both comes from the projection's output and flows into the
scores' q (or k) input. RoPE is found on it when

* an elementwise product multiplies a tensor of the path by a **position table**: a float or
  complex tensor of 2 or more dimensions, not computed from the projection, with an axis of
  the T query positions (T > 1) along which its values change and a last axis of channels
  (HF's ``cos``/``sin`` of (B, T, Dh), Meta's complex ``freqs_cis`` of (T, Dh/2)); and
* the path pairs channels: a ``cat``/``stack`` (rotate-half ``cat((-x2, x1))``, an
  interleaved ``stack``, ``x1·cos - x2·sin`` put back together) or a ``view_as_complex``.

A position-dependent scale alone (no pairing) or a KV cache's ``cat`` alone (no table) is not
RoPE. The table's module is the nearest upstream of the table that returned it, holds it as a
buffer or computed its ``cos``/``sin``/``polar`` in its own forward (the attention module
itself when RoPE is a function called there). Channels rotated per head are 2 × the distinct
frequencies of the table: its columns (last axis) that change along the positions, each kept
once (a rotate-half table holds each frequency twice).

Dimension legend: B batch, H heads, T positions, Dh head dim.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from hooks.modelroles.graph import OpGraph, OpNode

#: Elementwise products (a tensor of the path times a table).
MUL_OPS = frozenset(("mul", "__mul__", "__rmul__", "mul_", "__imul__"))
#: Ops that pair channels back together after the products.
PAIR_OPS = frozenset(("cat", "concat", "concatenate", "stack", "view_as_complex"))
#: Ops that make a table of angles.
TABLE_OPS = frozenset(("cos", "sin", "polar"))
_NEG_OPS = frozenset(("neg", "__neg__", "negative"))


@dataclass(frozen=True)
class Rotation:
    """RoPE on one path (see the module docstring).

    Attributes:
        style: ``rotate-half`` (a negation and a ``cat``), ``complex`` (a complex product) or
            ``pairwise`` (``x1·cos - x2·sin`` put back together).
        table: the table's tensor id in the graph.
        axis: the table's axis of positions.
        module: the node's module where the product ran (the module applying RoPE).
        channels: channels rotated per head (:func:`rotated_channels`), the most any table of
            the path gives (a cos of a frequency too low for fp32 is 1 at every position;
            its sin is not).
    """

    style: str
    table: int
    axis: int
    module: str | None
    channels: int | None = None


def _downstream(g: OpGraph, start: int, before: int) -> set[int]:
    """Tensor ids computed from tensor ``start`` by the ops before node ``before``."""
    seen, todo = {start}, deque([start])
    while todo:
        t = todo.popleft()
        for i in g.consumers.get(t, []):
            if i >= before:
                continue
            for o in g.nodes[i].outputs:
                if o not in seen:
                    seen.add(o)
                    todo.append(o)
    return seen


def path_nodes(g: OpGraph, start: int, end: int, before: int) -> tuple[list[OpNode], set[int]]:
    """The ops on the way from tensor ``start`` (a projection's output) to tensor ``end`` (the
    scores' input), in order, and every tensor computed from ``start`` before node
    ``before``; ([], ...) when ``end`` does not come from ``start``."""
    down = _downstream(g, start, before)
    if end not in down:
        return [], down
    found: set[int] = set()
    seen, todo = {end}, [end]
    while todo:
        t = todo.pop()
        node = g.made_by(t)
        if node is None or t == start:
            continue
        found.add(node.index)
        for i in node.inputs:
            if i in down and i not in seen:
                seen.add(i)
                todo.append(i)
    return [g.nodes[i] for i in sorted(found)], down


def position_axis(table: torch.Tensor, out_shape: tuple[int, ...], positions: int) -> int | None:
    """The axis of ``table`` (right-aligned with the product's ``out_shape``) that holds the
    ``positions`` query positions and along which its values change, or None when it is no
    position table (see the module docstring)."""
    if positions < 2 or table.dim() < 2 or table.dim() > len(out_shape) or table.shape[-1] < 2:
        return None
    if not (table.is_floating_point() or table.is_complex()):
        return None
    pad = len(out_shape) - table.dim()
    for a in range(table.dim() - 1):  # the last axis holds channels
        if table.shape[a] == positions and out_shape[a + pad] == positions:
            if bool(((table - table.narrow(a, 0, 1)).abs() > 0).any()):
                return a
    return None


def rotation(g: OpGraph, start: int, end: int, before: int, positions: int) -> Rotation | None:
    """RoPE on the path from ``start`` to ``end`` (see the module docstring), or None."""
    nodes, down = path_nodes(g, start, end, before)
    ops = {n.op for n in nodes}
    if not ops & PAIR_OPS:
        return None
    tables = [(n, tid, axis) for n in nodes if n.op in MUL_OPS and any(i in down for i in n.inputs)
              for tid in n.inputs if tid not in down
              and (axis := position_axis(g.tensors[tid], g.shape(n.outputs[0]), positions))
              is not None]
    if not tables:
        return None
    n, tid, axis = tables[0]
    style = ("complex" if "view_as_complex" in ops or g.tensors[tid].is_complex() else
             "rotate-half" if ops & _NEG_OPS else "pairwise")
    counts = [c for _, t, a in tables if (c := rotated_channels(g.tensors[t], a)) is not None]
    return Rotation(style, tid, axis, n.module, max(counts) if counts else None)


def rotated_channels(table: torch.Tensor, axis: int) -> int | None:
    """2 × the distinct frequencies of a position table: its columns (last axis) that change
    along ``axis``, each counted once; None when none change."""
    x = table.detach().movedim(axis, 0)
    x = x.reshape(x.shape[0], -1, x.shape[-1])[:, 0, :]  # (T, C): the first of other axes
    cols = (torch.view_as_real(x).permute(1, 0, 2).reshape(x.shape[1], -1) if x.is_complex()
            else x.transpose(0, 1)).double()  # (C, T) or (C, 2·T)
    cols = cols[(cols - cols[:, :1]).abs().amax(dim=1) > 0]
    return 2 * int(torch.unique(cols, dim=0).shape[0]) if cols.shape[0] else None


def _buffers(modules: dict[str, nn.Module]) -> dict[int, tuple[str, str]]:
    """id(buffer or parameter) -> (owner module, its name there)."""
    out: dict[int, tuple[str, str]] = {}
    for name, m in modules.items():
        for b, t in (*m.named_buffers(recurse=False), *m.named_parameters(recurse=False)):
            out.setdefault(id(t), (name, b))
    return out


def table_module(g: OpGraph, modules: dict[str, nn.Module], r: Rotation) -> tuple[str, str]:
    """(the module that makes the table of ``r``, how it does, in words): the nearest upstream
    of the table that returned it, holds it or computed its cos/sin; else the module applying
    RoPE."""
    owners = _buffers(modules)
    seen, todo = set(), deque([(r.table, 0)])
    while todo:
        t, depth = todo.popleft()
        if t in seen or depth > 40:
            continue
        seen.add(t)
        if t in g.module_out:
            return g.module_out[t], "returns the table"
        if t in owners:
            owner, name = owners[t]
            return owner, f"holds the table as {name}"
        node = g.made_by(t)
        if node is None:
            continue
        if node.op in TABLE_OPS:
            return node.module or "", f"computes the table's {node.op} in its forward"
        todo.extend((i, depth + 1) for i in node.inputs)
    return r.module or "", "applies it (the table's source was not seen)"


def rope_of(g: OpGraph, modules: dict[str, nn.Module], before: int, q: int, k: int,
            q_src: int, k_src: int) -> tuple[str, int | None, str] | None:
    """RoPE on one attention call (the scores' node ``before``; ``q``, ``k`` its inputs,
    ``q_src``, ``k_src`` their projections' outputs): (the table's module, channels rotated
    per head or None, the evidence in words), or None when neither q nor k is rotated."""
    shape = g.shape(q)
    positions = shape[-2] if len(shape) >= 2 else 0
    got = {p: rotation(g, src, t, before, positions)
           for p, t, src in (("q", q, q_src), ("k", k, k_src))}
    which = [p for p, r in got.items() if r is not None]
    if not which:
        return None
    r = got[which[0]]
    owner, how = table_module(g, modules, r)
    return owner, r.channels, (f"{r.style} rotation of {' and '.join(which)} by a position "
                               f"table ({owner or '<root>'} {how})")
