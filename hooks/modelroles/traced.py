"""Roles read from the ops of one traced forward (:class:`hooks.modelroles.graph.OpGraph`),
not from names.

* **Attention**: a ``softmax`` over the last dimension of a score tensor of 3 or more
  dimensions whose input came (through scaling, masking and reshapes) from a matmul of two
  tensors that each came from a projection's output (q·kᵀ), and whose output is multiplied by
  a third (v); or a call of ``F.scaled_dot_product_attention``. H and Dh are read from q's
  shape (B, H, T, Dh) (a (B·H, T, Dh) q: H = the q projection's width / Dh), Hkv from the k
  projection's width / Dh. The o projection is the first projection the heads' output
  (B, T, H·Dh) flows into; the attention module is the smallest module holding the softmax,
  the q/k/v projections and the o projection.
* **Fused q|k|v**: when q, k and v come from one projection, a ``split``/``chunk`` over its
  last dimension gives each one's columns; without one, the q|k|v order of widths
  (H·Dh, Hkv·Dh, Hkv·Dh) is assumed and the detail says so.
* **RoPE**: a position table (cos/sin, or complex) that multiplies the queries or keys on
  their way from the projection to the scores, their channels paired back by a ``cat``,
  ``stack`` or ``view_as_complex`` (:mod:`hooks.modelroles.rotary`); the attention role's
  ``rotary`` is the module that makes the table.
* **LM head**: the projection whose output, through reshapes (and a soft-cap), is the logits
  the model returned; **final norm**: the module whose output the head read, when it
  normalises (its class says Norm or it runs ``layer_norm``, ``rms_norm`` or ``rsqrt``).
* **q/k norms**: a norm module whose output lies on the path from the q (or k) projection to
  the scores (Qwen3's per-head, OLMoE's joint ``k_norm``).
* **Norms**: every module without children and without weights of more than one dimension
  whose own forward ran ``layer_norm``, ``rms_norm`` or ``rsqrt`` (an ``nn.LayerNorm``, HF's
  ``LlamaRMSNorm``, one's own ``x * torch.rsqrt(x.pow(2).mean(-1) + eps) * scale``).
* **Router and experts**: a ``topk`` over scores that came (through softmax, sigmoid, a
  bias) from a projection of E outputs is the router; the block is its parent, the experts
  the block's ``nn.ModuleList`` (or a module with (E, ...) weights) of E entries.

A projection is a module with a 2-D weight that is not an embedding (``nn.Linear``, HF's
``Conv1D``). Dimension legend: B batch, T positions, D hidden size, H query heads, Hkv
key/value heads, Dh head dim, E experts, k experts per token.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from hooks.modelroles.found import AttentionRole, Columns, Found, MoERole, Roles, Rotary
from hooks.modelroles.graph import MATMUL_OPS, SCORE_OPS, SHAPE_OPS, OpGraph, OpNode
from hooks.modelroles.rotary import rope_of

_SCORE_ROUTER_OPS = frozenset(("softmax", "sigmoid", "log_softmax", "float", "to", "add",
                               "__add__", "type_as"))
_CAP_OPS = frozenset(("tanh", "mul", "__mul__", "div", "__truediv__"))
_NORM_OPS = frozenset(("layer_norm", "rms_norm", "rsqrt", "group_norm"))
#: The ops that make a module a norm over the last dimension (:func:`norm_roles`).
LAST_DIM_NORM_OPS = frozenset(("layer_norm", "rms_norm", "rsqrt"))


def is_projection(m: nn.Module | None) -> bool:
    """Whether ``m`` is a projection: a module without children with a 2-D ``weight`` that is
    not an ``nn.Embedding`` (``nn.Linear``, HF's ``Conv1D``, a user's own linear)."""
    if m is None or isinstance(m, nn.Embedding) or next(m.children(), None) is not None:
        return False
    w = getattr(m, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 2


def in_width(m: nn.Module) -> int | None:
    """A projection's input width: ``in_features``, else its weight's columns (a Conv1D's
    weight is (in, out): its rows)."""
    v = getattr(m, "in_features", None)
    if isinstance(v, int):
        return v
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    return int(w.shape[0]) if type(m).__name__ == "Conv1D" else int(w.shape[1])


def out_width(m: nn.Module) -> int | None:
    """A projection's output width: ``out_features``, else its weight's rows (a transformers
    ``Conv1D``'s weight is (in, out): its columns)."""
    v = getattr(m, "out_features", None)
    if isinstance(v, int):
        return v
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    return int(w.shape[1]) if type(m).__name__ == "Conv1D" else int(w.shape[0])


def common_parent(names: list[str]) -> str:
    """The deepest module name that is ``names``' common ancestor (or one of them)."""
    parts = [n.split(".") if n else [] for n in names]
    out = []
    for level in zip(*parts, strict=False):
        if any(p != level[0] for p in level):
            break
        out.append(level[0])
    return ".".join(out)


class _Reader:
    """The walks over one graph (see the module docstring)."""

    def __init__(self, g: OpGraph, modules: dict[str, nn.Module]) -> None:
        self.g = g
        self.modules = modules

    def proj_of(self, tid: int) -> str | None:
        name = self.g.module_out.get(tid)
        return name if name is not None and is_projection(self.modules.get(name)) else None

    def back_to_projection(self, tid: int, through: frozenset[str] | None
                           ) -> tuple[str, int, tuple[int, int] | None] | None:
        """Nearest projection output upstream of ``tid``: (module, its output id, the columns a
        split over its last dimension took, or None). ``through``: the ops walked (None: any)."""
        seen, todo = set(), deque([(tid, None, 0)])
        while todo:
            t, cols, depth = todo.popleft()
            if t in seen or depth > 60:
                continue
            seen.add(t)
            name = self.proj_of(t)
            if name is not None:
                return name, t, cols
            node = self.g.made_by(t)
            if node is None or (through is not None and node.op not in through):
                continue
            cols = self._split_cols(node, t) or cols
            ins = node.inputs[:1] if node.op in SHAPE_OPS else node.inputs
            todo.extend((i, cols, depth + 1) for i in ins)
        return None

    def _split_cols(self, node: OpNode, out_tid: int) -> tuple[int, int] | None:
        """Columns of ``node``'s input that its output ``out_tid`` holds, for a split or chunk
        over the last dimension."""
        if node.op not in ("split", "chunk", "tensor_split") or not node.inputs:
            return None
        shape = self.g.shape(node.inputs[0])
        d = node.args.get("dim", 0)
        if not isinstance(d, int) or d % len(shape) != len(shape) - 1:
            return None
        widths = [self.g.shape(o)[-1] for o in node.outputs]
        i = node.outputs.index(out_tid)
        return sum(widths[:i]), sum(widths[:i + 1])

    def back_through(self, tid: int, ops: frozenset[str], stop) -> OpNode | None:
        """First node upstream of ``tid`` (through ``ops``) for which ``stop(node)`` holds."""
        seen, todo = set(), deque([tid])
        while todo:
            t = todo.popleft()
            node = self.g.made_by(t)
            if node is None or node.index in seen:
                continue
            seen.add(node.index)
            if stop(node):
                return node
            if node.op in ops:
                todo.extend(node.inputs[:1] if node.op in SHAPE_OPS else node.inputs)
        return None

    def forward_to(self, tid: int, ops: frozenset[str], stop) -> tuple[OpNode, int] | None:
        """First node downstream of ``tid`` (through ``ops``) for which ``stop(node)`` holds,
        with the tensor it took."""
        seen, todo = set(), deque([tid])
        while todo:
            t = todo.popleft()
            for i in self.g.consumers.get(t, []):
                node = self.g.nodes[i]
                if i in seen:
                    continue
                seen.add(i)
                if stop(node):
                    return node, t
                if node.op in ops:
                    todo.extend(node.outputs)
        return None

    def source(self, tid: int) -> tuple[str, int, tuple[int, int] | None] | None:
        return (self.back_to_projection(tid, SHAPE_OPS)
                or self.back_to_projection(tid, None))

    def norms(self) -> set[str]:
        """The modules that normalise (see the module docstring: **Norms**)."""
        ran = {n.module for n in self.g.nodes if n.op in LAST_DIM_NORM_OPS and n.module}
        return {name for name in ran if (m := self.modules.get(name)) is not None
                and next(m.children(), None) is None
                and all(p.dim() <= 1 for p in m.parameters(recurse=False))}

    def norm_between(self, tid: int, stop: int, norms: set[str]) -> str | None:
        """The nearest norm (of ``norms``) whose output lies upstream of ``tid`` and
        downstream of tensor ``stop`` (a projection's output), or None."""
        seen, todo = set(), deque([(tid, 0)])
        while todo:
            t, depth = todo.popleft()
            if t in seen or t == stop or depth > 60:
                continue
            seen.add(t)
            name = self.g.module_out.get(t)
            if name in norms:
                return name
            node = self.g.made_by(t)
            if node is not None:
                todo.extend((i, depth + 1) for i in node.inputs)
        return None


def _calls(r: _Reader) -> list[tuple[OpNode, int, int, int, int, str]]:
    """(node, q, k, v, heads' output) tensor ids of every attention call, with its kernel."""
    out = []
    for node in r.g.nodes:
        if node.op == "scaled_dot_product_attention" and len(node.inputs) >= 3:
            q, k, v = node.inputs[:3]
            out.append((node, q, k, v, node.outputs[0], "sdpa"))
            continue
        if node.op != "softmax" or not node.inputs:
            continue
        shape = r.g.shape(node.inputs[0])
        d = node.args.get("dim")
        if len(shape) < 3 or not isinstance(d, int) or d % len(shape) != len(shape) - 1:
            continue
        mm = r.back_through(node.inputs[0], SCORE_OPS | SHAPE_OPS,
                            lambda n: n.op in MATMUL_OPS and len(n.inputs) >= 2)
        pv = r.forward_to(node.outputs[0], SHAPE_OPS | SCORE_OPS,
                          lambda n: n.op in MATMUL_OPS and len(n.inputs) >= 2)
        if mm is None or pv is None:
            continue
        node_pv, probs = pv
        v = next((i for i in node_pv.inputs if i != probs), None)
        if v is not None:
            out.append((node, mm.inputs[0], mm.inputs[1], v, node_pv.outputs[0], "softmax"))
    return out


def _columns(r: _Reader, srcs, h: int, hkv: int | None, dh: int) -> tuple[list, str]:
    """q, k, v :class:`Columns` from their sources; a fused projection without a split gets
    the q|k|v order of widths (said in the returned note)."""
    names = [s[0] if s else None for s in srcs]
    fused = names[0] is not None and names[0] == names[1] == names[2]
    note = ""
    cols = []
    for i, s in enumerate(srcs):
        if s is None:
            cols.append(None)
            continue
        name, tid, c = s
        width = r.g.shape(tid)[-1]
        if c is None and fused and hkv:
            bounds = [0, h * dh, (h + hkv) * dh, (h + 2 * hkv) * dh]
            c = (bounds[i], bounds[i + 1])
            note = f"; {name} is fused without a split: q|k|v order assumed"
        cols.append(Columns(name, *(c if c is not None else (0, width))))
    return cols, note


def _heads(r: _Reader, q: int, k: int, srcs) -> tuple[int, int | None, int]:
    """(H, Hkv, Dh) of one call from the shapes of q and k and the k projection's columns."""
    qs, ks = r.g.shape(q), r.g.shape(k)
    dh = qs[-1]
    if len(qs) >= 4:
        h = qs[-3]
    else:  # (B·H, T, Dh): the heads are folded into the batch
        h = (srcs[0][2][1] - srcs[0][2][0] if srcs[0][2] else r.g.shape(srcs[0][1])[-1]) // dh
    kcols = srcs[1][2] if srcs[1][2] else None
    if kcols is not None:
        hkv = (kcols[1] - kcols[0]) // dh
    elif srcs[1][0] != srcs[0][0]:
        hkv = r.g.shape(srcs[1][1])[-1] // dh
    elif r.g.shape(srcs[0][1])[-1] == 3 * h * dh:
        hkv = h
    else:
        hkv = ks[-3] if len(ks) >= 4 and ks[-3] != dh else None
    if not hkv or h % hkv:  # keys of another width than Dh (MLA): not a head grouping
        hkv = None
    return h, hkv, dh


def attention_roles(r: _Reader) -> tuple[list[AttentionRole], list[Rotary]]:
    """Every attention module of the traced forward and the RoPE tables that rotate their
    queries or keys (see the module docstring and :mod:`hooks.modelroles.rotary`)."""
    out: dict[str, AttentionRole] = {}
    tables: dict[str, Rotary] = {}
    norms = r.norms()
    for node, q, k, v, y, kernel in _calls(r):
        srcs = [r.source(t) for t in (q, k, v)]
        if node.module is None or srcs[0] is None or srcs[1] is None:
            continue
        h, hkv, dh = _heads(r, q, k, srcs)
        cols, note = _columns(r, srcs, h, hkv, dh)
        hit = r.forward_to(y, SHAPE_OPS, lambda n: is_projection(r.modules.get(n.module or "")))
        o = hit[0].module if hit is not None else None
        if o is not None and in_width(r.modules[o]) != h * dh:
            note += f"; {o} reads {in_width(r.modules[o])} columns, not H·Dh = {h * dh}"
            o = None
        name = common_parent([node.module, *(c.module for c in cols if c), *([o] if o else [])])
        if name in out:
            continue
        what = "F.scaled_dot_product_attention" if kernel == "sdpa" else \
            f"a softmax over q·kᵀ scores ({node.module or '<root>'})"
        rope = rope_of(r.g, r.modules, node.index, q, k, srcs[0][1], srcs[1][1])
        if rope is not None:
            rot = tables.setdefault(rope[0], Rotary(rope[0], "traced", [], rope[1], rope[2]))
            rot.attention.append(name)
        out[name] = AttentionRole(
            name, "traced", h, hkv, dh, *cols, o=o, kernel=kernel,
            detail=f"{what}: q {tuple(r.g.shape(q))}, H={h}, Hkv={hkv}, Dh={dh}{note}",
            q_norm=r.norm_between(q, srcs[0][1], norms),
            k_norm=r.norm_between(k, srcs[1][1], norms),
            rotary=rope[0] if rope is not None else None)
    return list(out.values()), [tables[n] for n in r.modules if n in tables]


def moe_roles(r: _Reader) -> list[MoERole]:
    """Every router (a ``topk`` over a projection's scores) and its block's experts."""
    out: dict[str, MoERole] = {}
    for node in r.g.nodes:
        if node.op != "topk" or not node.inputs:
            continue
        src = r.back_to_projection(node.inputs[0], _SCORE_ROUTER_OPS | SHAPE_OPS)
        if src is None:
            continue
        router, tid, _ = src
        e = r.g.shape(tid)[-1]
        block = router.rpartition(".")[0]
        if block in out:
            continue
        experts = _experts_in(r.modules, block, e)
        k = node.args.get("k")
        out[block] = MoERole(block, "traced", router, experts, e,
                             k if isinstance(k, int) else None,
                             detail=f"topk (k={k}) over scores of {router} ({e} outputs)"
                             + ("" if experts else f"; no list of {e} experts in "
                                f"{block or '<root>'}"))
    return list(out.values())


def _experts_in(modules: dict[str, nn.Module], block: str, e: int) -> str | None:
    """The block's experts: a ModuleList of E entries (a child first), else a module with a
    3-D weight of E rows."""
    prefix = f"{block}." if block else ""
    kids = [(n, m) for n, m in modules.items() if n.startswith(prefix) and n != block]
    kids.sort(key=lambda nm: nm[0].count("."))
    for n, m in kids:
        if isinstance(m, nn.ModuleList) and len(m) == e:
            return n
    for n, m in kids:
        if any(p.dim() == 3 and p.shape[0] == e for p in m.parameters(recurse=False)):
            return n
    return None


def head_and_norm(r: _Reader, logits: int | None) -> tuple[Found | None, Found | None, str]:
    """The LM head and the final norm from the logits' tensor id; a note when not found."""
    if logits is None:
        return None, None, "the model's output holds no (B, T, V) logits: no LM head traced"
    src = r.back_to_projection(logits, SHAPE_OPS | _CAP_OPS)
    if src is None:
        return None, None, ("the logits come from no projection module (an F.linear on an "
                            "embedding's weight?): no LM head traced")
    head = Found(src[0], "traced", "its output is the logits the model returned")
    x = r.g.module_in.get(head.module)
    seen = 0
    while x is not None and seen < 20 and x not in r.g.module_out:
        node = r.g.made_by(x)
        x = node.inputs[0] if node is not None and node.op in SHAPE_OPS and node.inputs else None
        seen += 1
    name = r.g.module_out.get(x) if x is not None else None
    m = r.modules.get(name) if name is not None else None
    if m is None or not (
            "norm" in type(m).__name__.lower()
            or any(n.module == name and n.op in _NORM_OPS for n in r.g.nodes)):
        return head, None, f"{head.module} reads no norm's output: no final norm traced"
    return head, Found(name, "traced", f"{head.module} reads its output"), ""


def read_roles(g: OpGraph, model: nn.Module, logits: int | None) -> Roles:
    """Every role of the traced forward ``g`` of ``model`` (see the module docstring)."""
    r = _Reader(g, dict(model.named_modules()))
    head, norm, note = head_and_norm(r, logits)
    ran = r.norms()
    norms = [Found(n, "traced", "its forward normalises (layer_norm, rms_norm or rsqrt)")
             for n in r.modules if n in ran]
    attention, rotary = attention_roles(r)
    roles = Roles(attention, head, norm, moe_roles(r), traced=True, norms=norms, rotary=rotary)
    if note:
        roles.notes.append(note)
    return roles
