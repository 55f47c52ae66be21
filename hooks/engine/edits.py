"""Edits: one module call changed while the step runs ("what if this head, expert or layer were
off; what if this activation came from another input").

One grammar serves the API (``hooks.capture(model, edits=[...])``), the CLI (``mdb capture
--edit``, ``mdb diff --edit``) and the step view's ``e``::

    zero MODULE                  the module's output is replaced by zeros
    zero MODULE head=H           attention head H's output is zeroed before the output
                                 projection (its slice of o_proj's / c_proj's input; with GQA
                                 H is a query head); the attention module, its heads and its
                                 o projection are hooks.modelroles' (declared, named, traced)
    zero MODULE expert=E         expert E's contribution is zeroed: the router still picks it,
                                 the other weights are not renormalised
    drop MODULE expert=E         the router never picks E: its logit is -inf before top-k
    scale MODULE by=F            the output times F
    mean MODULE                  the output replaced by its mean over batch and positions
                                 (every dimension but the last)
    patch MODULE from=SOURCE     the output taken from the same model run on the batch SOURCE
          [pos=P]                (activation patching); only at positions P (``3``, ``0,5``,
                                 ``2:6``, ``-1``) of dimension 1 when given
    patch MODULE head=H from=S   head H's slice of the o projection's input taken from the run
                                 on S (TransformerLens's ``hook_z`` of head H); ``scale …
                                 head=H by=F`` scales it
    zero|scale|patch MODULE q|k|v [head=H] …
                                 head H's columns of the q, k or v projection's output (a
                                 fused q|k|v projection's slice); with grouped KV heads (GQA) a
                                 k/v head is a KV head, 0…Hkv-1; no head=: every head
    zero|scale|patch MODULE pattern [head=H] …
                                 head H's attention probabilities (B, H, T, S) after the
                                 softmax, before they weigh v: an eager softmax or
                                 F.scaled_dot_product_attention (recomputed explicitly), see
                                 :mod:`hooks.engine.edit_pattern`
    add MODULE vector=FILE.safetensors [tensor=NAME] [scale=F]
                                 the output plus F times a (D,) or (T, D) steering vector read
                                 with safetensors (tensor= names one of several)
    add MODULE from=SOURCE [scale=F]
                                 the output plus F times the output of the run on SOURCE
    clamp MODULE min=A max=B     the output clamped to [A, B] (either bound may be left out)

``scale`` takes ``by=F`` or ``factor=F`` (echoed as typed).

MODULE is a qualified module name (``model.layers.1.self_attn``) or an ``fnmatch`` pattern
(``model.layers.*.mlp``: every match is edited). A module returning a tuple or a dict has its
first floating-point tensor edited (a decoder layer's hidden states). The heads, the q/k/v
projections and the o projection of an attention module are :mod:`hooks.modelroles`' (declared,
named, traced), so these edits work on home-grown models as on HF's. Dimension legend: B
batch, T positions, D hidden size, H query heads, Dh head dim, N tokens (B·T), E experts, k
experts per token.

:func:`resolve_edits` checks every edit against the model before anything runs (one-line
``ValueError``: no module matches, a head or expert out of range, a module whose output cannot
be edited); :class:`hooks.engine.edit_apply.Editor` applies them with forward hooks and forward
pre-hooks and records what was applied (:class:`AppliedEdit`), with a note for an edit that
changed nothing. References: activation patching as in Meng et al. 2022 (ROME, "causal
tracing") and Heimersheim & Nanda 2024 ("How to use and interpret activation patching"); head
ablation as in Michel et al. 2019 ("Are sixteen heads really better than one?").
"""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hooks.engine.edit_roles import PARTS, bind, finite, load_vector
from hooks.modelroles import attention_role, moe_role
from hooks.modelroles.named import (  # noqa: F401 (edits' public names, as before)
    HEAD_ATTRS,
    OUT_PROJ_NAMES,
    ROUTER_NAMES,
    looks_like_attention,
    named_attention,
)
from hooks.trace.applied_edit import AppliedEdit

#: The edit operations, in the order the form offers them.
OPS = ("zero", "drop", "scale", "mean", "patch", "add", "clamp")
_KEYS = {"zero": {"head", "expert"}, "drop": {"expert"}, "scale": {"by", "factor", "head"},
         "mean": set(), "patch": {"from", "pos", "head"},
         "add": {"vector", "tensor", "from", "scale"}, "clamp": {"min", "max"}}
_REQUIRED = {"drop": ("expert",), "patch": ("from",)}
#: One of these keys is needed (``scale``: by= or factor=; ``add``: vector= or from=).
_ONE_OF = {"scale": ("by", "factor"), "add": ("vector", "from"), "clamp": ("min", "max")}
#: The operations that take a part of an attention module (q, k, v, pattern) after MODULE.
PART_OPS = ("zero", "scale", "patch")
# OUT_PROJ_NAMES, HEAD_ATTRS and ROUTER_NAMES (the names tried by the fast path) are
# hooks.modelroles.named's: edits read the roles every view reads (hooks.modelroles).


def _same_number(text: str, value: object) -> bool:
    try:
        return float(text) == float(str(value))
    except ValueError:
        return False


def _num(x: float) -> str:
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


@dataclass(frozen=True)
class Edit:
    """One parsed edit spec (see the module docstring for the grammar).

    Attributes:
        op: one of :data:`OPS`.
        module: the module name or ``fnmatch`` pattern.
        part: ``q``, ``k``, ``v`` or ``pattern`` of an attention module, or None.
        head: query head H (a KV head for ``k``/``v`` with grouped KV heads).
        expert: expert E (``zero``/``drop ... expert=E``).
        by: the factor F of ``scale``.
        by_key: the key it was given with, ``by`` or ``factor``.
        source: the name of the batch a ``patch`` / ``add`` takes its values from.
        pos: positions of a ``patch`` (the text after ``pos=``), None for all.
        vector: the safetensors file of ``add … vector=``.
        tensor: the tensor's name in that file (``tensor=``), None when it holds one.
        scale: the factor of ``add`` (None: 1).
        min: ``clamp``'s lower bound, or None.
        max: ``clamp``'s upper bound, or None.
        order: ``(key, text)`` as typed, in order (the echo keeps both; not compared).
    """

    op: str
    module: str
    head: int | None = None
    expert: int | None = None
    by: float | None = None
    source: str | None = None
    pos: str | None = None
    part: str | None = None
    by_key: str = "by"
    vector: str | None = None
    tensor: str | None = None
    scale: float | None = None
    min: float | None = None
    max: float | None = None
    order: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @classmethod
    def parse(cls, spec: str) -> Edit:
        """The :class:`Edit` that ``spec`` writes; see :func:`parse_edit`."""
        return parse_edit(spec)

    @property
    def spec(self) -> str:
        """The spec text as typed: the keys in the order they were typed and the numbers as
        written (:attr:`order`); for an edit built by hand the grammar's order and ``:g``
        (``parse_edit(e.spec) == e``)."""
        values = {"head": self.head, "expert": self.expert,
                  self.by_key: None if self.by is None else _num(self.by),
                  "vector": self.vector, "tensor": self.tensor, "from": self.source,
                  "scale": None if self.scale is None else _num(self.scale),
                  "min": None if self.min is None else _num(self.min),
                  "max": None if self.max is None else _num(self.max), "pos": self.pos}
        typed = dict(self.order)
        for k, text in typed.items():  # a number as it was typed (1e-3, 0.50) when it is it
            if k in ("head", "expert", self.by_key, "scale", "min", "max") and \
                    values.get(k) is not None and _same_number(text, values[k]):
                values[k] = text
        keys = [k for k in typed if values.get(k) is not None]
        keys += [k for k in values if k not in keys and values[k] is not None]
        head = [self.op, self.module] + ([self.part] if self.part is not None else [])
        return " ".join(head + [f"{k}={values[k]}" for k in keys])

    @property
    def needs_source(self) -> bool:
        """Whether it reads a source batch (``patch``, ``add … from=``)."""
        return self.source is not None

    def __str__(self) -> str:
        return self.spec


def _int(spec: str, key: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"edit {spec!r}: {key}={text!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"edit {spec!r}: {key} must be >= 0, got {value}")
    return value


def parse_positions(text: str) -> list[int] | slice:
    """Positions of ``pos=``: ``3``, ``0,5,7``, ``-1`` (a list) or ``2:6`` (a slice).

    Raises:
        ValueError: anything else (the caller adds the spec).
    """
    if ":" in text:
        a, _, b = text.partition(":")
        try:
            return slice(int(a) if a else None, int(b) if b else None)
        except ValueError:
            raise ValueError(f"pos={text!r} is not START:STOP") from None
    try:
        out = [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"pos={text!r}: give positions like 3, 0,5 or 2:6") from None
    return out


def _words(spec: str) -> tuple[str, str, str | None, list[str]]:
    """``(op, module, part, key=value words)`` of ``spec``, the op and module checked."""
    words = spec.split()
    if not words:
        raise ValueError("empty edit spec: write OP MODULE [key=value], e.g. 'zero "
                         "model.layers.1.mlp'")
    op = words[0].lower()
    if op not in OPS:
        raise ValueError(f"edit {spec!r}: unknown operation {words[0]!r}; one of "
                         f"{', '.join(OPS)}")
    if len(words) < 2 or "=" in words[1]:
        raise ValueError(f"edit {spec!r}: name the module after {op!r}, e.g. '{op} "
                         "model.layers.1.mlp'")
    part = None
    if len(words) > 2 and "=" not in words[2]:
        part = words[2]
        if part not in PARTS:
            raise ValueError(f"edit {spec!r}: {part!r} is not a part of attention (one of "
                             f"{', '.join(PARTS)}) nor key=value")
        if op not in PART_OPS:
            raise ValueError(f"edit {spec!r}: {op} takes no part {part!r} (only "
                             f"{', '.join(PART_OPS)} do)")
    return op, words[1], part, words[3 if part else 2:]


def _key_values(spec: str, op: str, words: list[str]) -> dict[str, str]:
    kv: dict[str, str] = {}
    for w in words:
        key, eq, value = w.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"edit {spec!r}: {w!r} is not key=value")
        if key not in _KEYS[op]:
            allowed = ", ".join(sorted(_KEYS[op])) or "none"
            raise ValueError(f"edit {spec!r}: {op} takes no {key}= (its keys: {allowed})")
        if key in kv:
            raise ValueError(f"edit {spec!r}: {key}= given twice")
        kv[key] = value
    for key in _REQUIRED.get(op, ()):
        if key not in kv:
            raise ValueError(f"edit {spec!r}: {op} needs {key}=")
    one = _ONE_OF.get(op)
    if one is not None:
        given = [k for k in one if k in kv]
        if not given or (len(given) > 1 and op != "clamp"):
            raise ValueError(f"edit {spec!r}: {op} needs {' or '.join(f'{k}=' for k in one)}"
                             + ("" if not given else ", not both"))
    if "head" in kv and "expert" in kv:
        raise ValueError(f"edit {spec!r}: give head= or expert=, not both")
    if "tensor" in kv and "vector" not in kv:
        raise ValueError(f"edit {spec!r}: tensor= names a tensor of vector=FILE")
    return kv


def parse_edit(spec: str | Edit) -> Edit:
    """Parse one edit spec (an :class:`Edit` is checked as its spec string is).

    Args:
        spec: ``"OP MODULE [PART] [key=value ...]"``, e.g.
            ``"zero model.layers.1.self_attn head=3"``, ``"zero blocks.0.attn q head=1"``.

    Returns:
        Edit: the parsed edit (not yet checked against a model: :func:`resolve_edits`).

    Raises:
        ValueError: one line naming the spec and what is wrong (unknown op or part, missing
            module, unknown or repeated key, a value that is not a number, ``head`` with
            ``expert``, ``min`` above ``max``).
    """
    if isinstance(spec, Edit):  # checked like a spec string (an Edit can be built by hand)
        return parse_edit(spec.spec)
    if not isinstance(spec, str):
        raise ValueError(f"an edit is a spec string or a hooks.engine.edits.Edit, got "
                         f"{type(spec).__name__}")
    op, module, part, words = _words(spec)
    kv = _key_values(spec, op, words)
    by_key = "factor" if "factor" in kv else "by"
    nums = {k: finite(spec, k, kv[k]) for k in ("by", "factor", "scale", "min", "max")
            if k in kv}
    if "min" in nums and "max" in nums and nums["min"] > nums["max"]:
        raise ValueError(f"edit {spec!r}: min={kv['min']} is above max={kv['max']}")
    if "pos" in kv:
        try:
            parse_positions(kv["pos"])
        except ValueError as exc:
            raise ValueError(f"edit {spec!r}: {exc}") from None
    return Edit(op, module,
                head=_int(spec, "head", kv["head"]) if "head" in kv else None,
                expert=_int(spec, "expert", kv["expert"]) if "expert" in kv else None,
                by=nums.get(by_key), source=kv.get("from"), pos=kv.get("pos"), part=part,
                by_key=by_key, vector=kv.get("vector"), tensor=kv.get("tensor"),
                scale=nums.get("scale"), min=nums.get("min"), max=nums.get("max"),
                order=tuple(kv.items()))


# -- what the model has -----------------------------------------------------------------------
def _is_container(m: nn.Module) -> bool:
    return type(m).forward is nn.Module.forward


def in_features(proj: nn.Module) -> int | None:
    """Input width of a projection: ``nn.Linear.in_features``, or a transformers ``Conv1D``'s
    weight rows (its weight is (in, out)); None for anything else."""
    if isinstance(proj, nn.Linear):
        return proj.in_features
    w = getattr(proj, "weight", None)
    if type(proj).__name__ == "Conv1D" and w is not None and w.dim() == 2:
        return int(w.shape[0])
    return None


def num_heads(m: nn.Module) -> int | None:
    """H, the query heads of attention module ``m`` (its attribute or its config's)."""
    for owner in (m, getattr(m, "config", None)):
        for attr in HEAD_ATTRS:
            v = getattr(owner, attr, None)
            if isinstance(v, int) and v > 0:
                return v
    return None


def out_projection(m: nn.Module) -> tuple[str, nn.Module, int, int] | str:
    """``(child name, projection, H, Dh)`` of attention module ``m``'s output projection, whose
    input is the heads' outputs concatenated, (..., H·Dh), by names alone
    (:func:`hooks.modelroles.named.named_attention`); else why not (one phrase). Edits read
    :func:`hooks.modelroles.attention_role`, which also traces and reads the declaration."""
    got = named_attention("", m)
    if isinstance(got, str):
        return got
    assert got.o is not None and got.num_heads and got.head_dim
    return got.o, getattr(m, got.o), got.num_heads, got.head_dim


def num_experts(block: nn.Module, experts: nn.Module) -> int | None:
    """E of an MoE block: its experts list's length, ``num_experts``, or a fused weight's first
    dimension."""
    if isinstance(experts, (nn.ModuleList, nn.Sequential)):
        return len(experts)
    for owner in (experts, block, getattr(block, "gate", None), getattr(block, "config", None)):
        for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
            v = getattr(owner, attr, None)
            if isinstance(v, int) and v > 0:
                return v
    for p in experts.parameters(recurse=False):
        if p.dim() == 3:
            return int(p.shape[0])
    return None


def moe_of(name: str, m: nn.Module, by_name: dict[str, nn.Module]
           ) -> tuple[str, nn.Module, nn.Module] | None:
    """``(block name, block, experts)`` when ``m`` is an MoE block (a module with an
    ``experts`` child, as :mod:`hooks.probes.routing` finds them) or that block's experts."""
    experts = getattr(m, "experts", None)
    if isinstance(experts, nn.Module) and experts in m.children():
        return name, m, experts
    parent_name = name.rpartition(".")[0]
    parent = by_name.get(parent_name)
    if parent is not None and getattr(parent, "experts", None) is m:
        return parent_name, parent, m
    return None


def router_of(block: nn.Module, experts: nn.Module, e: int) -> tuple[str, nn.Module] | None:
    """The block's router: a child other than the experts named like one
    (:data:`ROUTER_NAMES`) or whose weight has E rows (``nn.Linear(D, E)``, HF's TopKRouter)."""
    kids = [(n, c) for n, c in block.named_children() if c is not experts]
    kids.sort(key=lambda nc: (nc[0] not in ROUTER_NAMES,))
    for n, c in kids:
        w = getattr(c, "weight", None)
        if getattr(w, "dim", None) and w.dim() == 2 and int(w.shape[0]) == e:
            return n, c
    return None


# -- resolving edits against a model ----------------------------------------------------------
@dataclass
class Target:
    """One edit bound to one module of the model (a pattern gives one per match).

    Attributes:
        edit: the edit.
        name: the qualified name of the module the edit names.
        kind: how it is applied: ``output`` (the module's output), ``head`` (a pre-hook on
            the output projection: columns ``[start, stop)`` of its input), ``columns`` (a
            forward hook on a q/k/v projection: columns ``[start, stop)`` of its output),
            ``pattern`` (the attention module's probabilities), ``expert_list`` (a forward
            hook on expert E of an ``nn.ModuleList``), ``expert_fused`` (a pre-hook on fused
            experts called with (hidden, ids, weights)), ``router`` (a forward hook on the
            router).
        module: the module the hook goes on.
        hooked: its qualified name.
        size: H (``head``, ``pattern``) or E (experts), where it applies.
        head_dim: Dh for ``head``.
        router_owner: the MoE block, for ``router``.
        start: first column of ``head``/``columns``.
        stop: one past its last column.
        width: the hooked tensor's last dimension for ``head``/``columns``.
        vector: the steering vector of ``add … vector=``, (D,) or (T, D).
    """

    edit: Edit
    name: str
    kind: str
    module: nn.Module
    hooked: str
    size: int | None = None
    head_dim: int | None = None
    router_owner: nn.Module | None = None
    start: int = 0
    stop: int = 0
    width: int = 0
    vector: Any = None


def _match(edit: Edit, modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    pat = edit.module
    exact = [(n, m) for n, m in modules if n == pat]
    if exact:
        return exact
    if any(c in pat for c in "*?["):
        found = [(n, m) for n, m in modules if n and fnmatch.fnmatchcase(n, pat)]
        if found:
            return found
    names = [n for n, _ in modules if n]
    close = difflib.get_close_matches(pat, names, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"edit {edit.spec!r}: no module matches {pat!r}{hint}")


def _target(edit: Edit, name: str, m: nn.Module, by_name: dict[str, nn.Module],
            model: nn.Module) -> Target:
    where = f"edit {edit.spec!r}: {name}"
    if name == "":
        raise ValueError(f"edit {edit.spec!r}: the model itself cannot be edited (its output is "
                         "what the loss reads); name a submodule")
    if edit.expert is not None:  # an MoE block, or its experts (a list of modules too)
        return _expert_target(edit, name, m, by_name, where, model)
    if _is_container(m):
        raise ValueError(f"{where} is a {type(m).__name__}, a container that is never called; "
                         "name one of its modules")
    if edit.head is not None or edit.part is not None:
        b = bind(model, name, edit.spec, edit.part, edit.head)
        dh = b.stop - b.start if b.kind == "head" else None
        size = b.width // dh if dh else (b.width if b.kind == "pattern" else None)
        return Target(edit, name, b.kind, by_name[b.hooked], b.hooked, size=size, head_dim=dh,
                      start=b.start, stop=b.stop, width=b.width)
    vector = load_vector(edit.spec, edit.vector, edit.tensor) if edit.vector else None
    return Target(edit, name, "output", m, name, vector=vector)


def _moe_parts(name: str, m: nn.Module, by_name: dict[str, nn.Module], model: nn.Module,
               where: str) -> tuple[str, nn.Module, nn.Module, str | None]:
    """``(block name, block, experts, router name or None)``: by the block's ``experts``
    child, else from :func:`hooks.modelroles.moe_role` (declared or traced)."""
    moe = moe_of(name, m, by_name)
    if moe is not None:
        return (*moe, None)
    role = moe_role(model, name)
    if isinstance(role, str) or role.experts is None:
        why = role if isinstance(role, str) else f"{role.name} has no experts found"
        raise ValueError(f"{where}: expert= needs an MoE block or its experts: {why}")
    return role.name, by_name[role.name], by_name[role.experts], role.router


def _expert_target(edit: Edit, name: str, m: nn.Module, by_name: dict[str, nn.Module],
                   where: str, model: nn.Module) -> Target:
    bname, block, experts, router = _moe_parts(name, m, by_name, model, where)
    e = num_experts(block, experts)
    if e is None:
        raise ValueError(f"{where}: the number of experts of {bname} is not known")
    if edit.expert >= e:
        raise ValueError(f"{where} has {e} experts (0…{e - 1}); expert={edit.expert} is out of "
                         "range")
    ename = next(n for n, x in by_name.items() if x is experts)
    if edit.op == "drop":
        r = (router.rpartition(".")[2], by_name[router]) if router else \
            router_of(block, experts, e)
        if r is None:
            raise ValueError(f"{where}: no router found in {bname} (a child named gate/router "
                             f"with a weight of {e} rows)")
        return Target(edit, name, "router", r[1], f"{bname}.{r[0]}" if bname else r[0], size=e,
                      router_owner=block)
    if isinstance(experts, (nn.ModuleList, nn.Sequential)):
        exp = experts[edit.expert]
        return Target(edit, name, "expert_list", exp, f"{ename}.{edit.expert}", size=e)
    if _is_container(experts):
        raise ValueError(f"{where}: its experts are a {type(experts).__name__} that is never "
                         "called, with no expert list to edit")
    return Target(edit, name, "expert_fused", experts, ename, size=e)


def resolve_edits(model: nn.Module, edits: list[str | Edit],
                  sources: dict[str, Any] | None = None) -> list[Target]:
    """Parse ``edits`` and bind each to the modules of ``model`` it names, checking everything
    that can be checked before the model runs.

    Args:
        model: the model (a torch.compile wrapper is looked through).
        edits: spec strings or :class:`Edit` objects.
        sources: batches by name for ``patch ... from=NAME``.

    Returns:
        list[Target]: one per (edit, matched module), in the order given.

    Raises:
        ValueError: one line: a bad spec, no module matches, the model itself or a container
            named, ``head=`` on a module that is not a recognised attention module or out of
            range (a ``k``/``v`` head counts KV heads with grouped KV heads), a part whose
            projection was not found, ``expert=`` on a module without experts or out of range,
            ``drop`` where no router is found, ``patch``/``add`` from a source that was not
            given, ``add … vector=`` of a file that is missing, not safetensors, holds several
            tensors and no ``tensor=``, or a tensor that is not a finite (D,) or (T, D).
    """
    from hooks.engine.compile import unwrap_compiled
    from hooks.tensors.walk import named_modules

    parsed = [parse_edit(e) for e in edits]
    root = unwrap_compiled(model)
    modules = named_modules(root)
    by_name = dict(modules)
    out: list[Target] = []
    for edit in parsed:
        if edit.needs_source and edit.source not in (sources or {}):
            given = ", ".join(sorted(sources or {})) or "none"
            raise ValueError(f"edit {edit.spec!r}: no source batch named {edit.source!r} "
                             f"(sources given: {given})")
        for name, m in _match(edit, modules):
            out.append(_target(edit, name, m, by_name, root))
    return out


def edit_options(model: nn.Module, module: str) -> list[str]:
    """The edit specs that fit ``module`` of ``model`` (templates for the step view's form):
    ``zero``; on an attention module a head's ``zero``/``patch``, its pattern's and its q, k, v
    edits; ``zero``/``drop … expert=0`` on an MoE block or its experts; ``scale … by=0.5``,
    ``mean``, ``patch … from=rolled`` (the batch's rows rolled by one), ``add … from=rolled
    scale=0.5`` (steering by the rolled batch's output), ``clamp … min=-1 max=1``.

    Returns:
        list[str]: specs, empty when the module cannot be edited (the model itself, a
        container, a name not in the model).
    """
    from hooks.engine.compile import unwrap_compiled
    from hooks.tensors.walk import named_modules

    root = unwrap_compiled(model)
    modules = named_modules(root)
    by_name = dict(modules)
    m = by_name.get(module)
    if not module or m is None:
        return []
    moe = [f"zero {module} expert=0", f"drop {module} expert=0"] \
        if moe_of(module, m, by_name) is not None or not isinstance(
            moe_role(root, module), str) else []
    if _is_container(m):  # never called: only an MoE block's expert list has edits
        return moe
    out = [f"zero {module}"]
    if not isinstance(attention_role(root, module), str):
        out += [f"zero {module} head=0", f"patch {module} head=0 from=rolled",
                f"zero {module} pattern head=0", f"patch {module} pattern head=0 from=rolled",
                f"zero {module} q head=0", f"scale {module} k head=0 by=0.5",
                f"patch {module} v head=0 from=rolled"]
    out += moe + [f"scale {module} by=0.5", f"mean {module}", f"patch {module} from=rolled",
                  f"add {module} from=rolled scale=0.5", f"clamp {module} min=-1 max=1"]
    return out


__all__ = ["OPS", "PARTS", "AppliedEdit", "Edit", "Target", "edit_options", "parse_edit",
           "parse_positions", "resolve_edits"]
