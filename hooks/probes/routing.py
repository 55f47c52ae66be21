"""MoE routing as the model used it: the ids and weights a block hands its experts.

Dimension legend: N tokens, D hidden size, E experts, k experts per token, G expert groups.

In transformers 5 almost every sparse MoE block (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3,
GPT-OSS, Granite-MoE, JetMoE, DBRX, ERNIE-4.5, GLM-4-MoE, MiniMax, ...) ends in one call
``self.experts(hidden (N, D), top_k_index (N, k), top_k_weights (N, k))``. A forward *pre*-hook on
that experts module reads the two tensors the experts are about to apply: those are the routing,
whatever rule produced them. Blocks are found by structure (a module with an ``experts`` child),
by declaration, or from what they compute (:mod:`hooks.probes.routing_ops`: a router child's
scores through a ``topk`` beside E experts; also how a block whose experts are a list called
one by one is read), never by class name.

The router's logits are taken from the block's other children: the one that returned, during
the same block call, an (N, E) float tensor (alone or in a tuple) before the experts ran. The
scoring rule is then *verified* against the ids and weights the experts received
(:func:`infer_rule`): softmax over E, softmax over the k chosen logits, or sigmoid, each with an
optional bias on the choice (``e_score_correction_bias``), group-limited top-k
(``n_group``/``topk_group``), renormalisation and a constant scale. Only a rule that reproduces
the model's own ids and weights is reported; otherwise the record says ``"unknown"`` and shows
no probabilities and no aux loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from hooks.modelroles.declare import declared_roles
from hooks.probes.routing_ops import (
    TopKWatch,
    found_blocks,
    num_experts,
    router_children,
    watch_experts,
)
from hooks.trace.records import Note, RoutingRecord, layer_of

#: Attribute names under which routers keep a bias added to the scores for the choice only.
BIAS_ATTRS = ("e_score_correction_bias", "expert_bias", "score_correction_bias")
#: Attribute names of the number of expert groups and of the groups kept (group-limited top-k).
GROUP_ATTRS = (("n_group", "num_group", "num_expert_group"), ("topk_group",))


class RoutingHost(Protocol):
    """What routing needs of the running capture (a :class:`hooks.probes.base.ProbeContext`)."""

    @property
    def recording(self) -> bool: ...

    def add_routing(self, rec: RoutingRecord) -> None: ...

    def has_routing(self, module: str, call_index: int) -> bool: ...

    def add_note(self, note: Note) -> None: ...


@dataclass(frozen=True, slots=True)
class Rule:
    """How a router turned logits into the ids and weights the experts got.

    Attributes:
        scoring: ``"softmax"`` (over all E), ``"sigmoid"`` or ``"unknown"``.
        normalized: the k weights were divided by their sum (None when unknown).
        scale: constant factor on the weights (e.g. ``routed_scaling_factor``), None for 1.
        bias: the choice ranked ``scores + bias`` (the weights use the scores without it).
        groups: ``(G, kept)`` for group-limited top-k, else None.
        group_score: how a group was scored (``"top2_sum"``, ``"max"``), with ``groups``.
    """

    scoring: str = "unknown"
    normalized: bool | None = None
    scale: float | None = None
    bias: bool = False
    groups: tuple[int, int] | None = None
    group_score: str | None = None


UNKNOWN = Rule()


def _tol(dtype: torch.dtype) -> float:
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 1e-7
    return max(1e-5, 8 * eps)


def first_attr(obj: Any, names: tuple[str, ...]) -> Any:
    """The first attribute of ``obj`` among ``names`` that is not ``None``, else ``None``."""
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    return None


def _scaled_match(w: torch.Tensor, base: torch.Tensor, tol: float) -> float | None:
    """The constant c with ``w ≈ c · base`` (all entries), or None."""
    den = float((base * base).sum())
    if den == 0.0 or not torch.isfinite(base).all():
        return None
    c = float((w * base).sum()) / den
    if abs(c - 1.0) <= tol:
        c = 1.0
    if torch.allclose(w, c * base, rtol=tol, atol=tol * 1e-2):
        return c
    return None


def _weights_rule(w: torch.Tensor, picked: torch.Tensor, tol: float) -> tuple[bool, float] | None:
    """(normalized, scale) such that ``w ≈ scale · picked [/ sum]``, trying raw first."""
    c = _scaled_match(w, picked, tol)
    if c is not None:
        return False, c
    s = picked.sum(dim=-1, keepdim=True)
    c = _scaled_match(w, picked / torch.where(s == 0, torch.ones_like(s), s), tol)
    if c is not None:
        return True, c
    return None


def _is_top_k(choice: torch.Tensor, ids: torch.Tensor, allowed: torch.Tensor | None,
              tol: float) -> bool:
    """Whether ``ids`` (N, k) are k largest entries of ``choice`` (N, E) among ``allowed``."""
    chosen = torch.zeros_like(choice, dtype=torch.bool).scatter_(1, ids, True)
    if allowed is not None:
        if bool((chosen & ~allowed).any()):
            return False
        rest = chosen | ~allowed
    else:
        rest = chosen
    lo = choice.masked_fill(~chosen, float("inf")).amin(dim=-1)
    hi = choice.masked_fill(rest, float("-inf")).amax(dim=-1)
    scale = choice.abs().amax(dim=-1).clamp_min(1.0)
    return bool((lo >= hi - tol * scale).all())


def _group_mask(choice: torch.Tensor, groups: int, kept: int, how: str) -> torch.Tensor:
    n, e = choice.shape
    per = choice.view(n, groups, e // groups)
    if how == "top2_sum":
        score = per.topk(min(2, e // groups), dim=-1)[0].sum(dim=-1)
    else:
        score = per.amax(dim=-1)
    idx = score.topk(kept, dim=-1)[1]
    mask = torch.zeros(n, groups, dtype=torch.bool, device=choice.device).scatter_(1, idx, True)
    return mask[:, :, None].expand(n, groups, e // groups).reshape(n, e)


def infer_rule(
    logits_NE: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor,
    router: nn.Module | None = None,
) -> tuple[Rule, torch.Tensor | None]:
    """The routing rule that reproduces ``ids_NK`` and ``weights_NK`` from ``logits_NE``.

    Tried in order: softmax over all E in fp32 (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2; also
    GPT-OSS and Granite-MoE, whose softmax over the k chosen logits is the renormalised softmax
    over E, identical in ids and weights), sigmoid (DeepSeek-V3, GLM-4-MoE),
    each with the router's choice bias (:data:`BIAS_ATTRS`) and group-limited top-k
    (:data:`GROUP_ATTRS`: group score = sum of the top 2, DeepSeek-V3; or the max, DeepSeek-V2)
    when the router has them. A rule is accepted only when the ids are a top-k of its choice
    scores and ``weights ≈ scale · picked`` (optionally renormalised) for one constant scale,
    within a tolerance set by the weights' dtype.

    Args:
        logits_NE: the router's logits, (N, E).
        ids_NK: the expert ids the experts received, (N, k) integer.
        weights_NK: the weights the experts received, (N, k) float.
        router: the router module (for its bias and group attributes), or None.

    Returns:
        (rule, scores_NE): the rule (:data:`UNKNOWN` when none reproduces them) and the
        per-expert scores it computed, (N, E) fp32 (softmax probabilities or sigmoid scores;
        None for an unknown rule).
    """
    logits = logits_NE.detach().float()
    ids = ids_NK.detach().long()
    w = weights_NK.detach().double()
    tol = _tol(weights_NK.dtype)
    n, e = logits.shape
    if ids.shape[0] != n or ids.numel() == 0 or int(ids.max()) >= e or int(ids.min()) < 0:
        return UNKNOWN, None
    bias = first_attr(router, BIAS_ATTRS) if router is not None else None
    if not (isinstance(bias, torch.Tensor) and bias.shape == (e,)):
        bias = None
    groups = None
    if router is not None and getattr(router, "topk_method", None) in (None, "group_limited_greedy",
                                                                         "noaux_tc"):
        g, kept = first_attr(router, GROUP_ATTRS[0]), first_attr(router, GROUP_ATTRS[1])
        if isinstance(g, int) and isinstance(kept, int) and 1 < g and kept < g and e % g == 0:
            groups = (g, kept)

    def choose(choice: torch.Tensor) -> tuple[bool, tuple[int, int] | None, str | None]:
        ctol = _tol(torch.float32)
        if groups is not None:
            for how in ("top2_sum", "max"):
                allowed = _group_mask(choice, groups[0], groups[1], how)
                if _is_top_k(choice, ids, allowed, ctol):
                    return True, groups, how
        return _is_top_k(choice, ids, None, ctol), None, None

    probs = torch.softmax(logits, dim=-1)
    for scores, scoring in ((probs, "softmax"), (torch.sigmoid(logits), "sigmoid")):
        for b in ((bias, None) if bias is not None else (None,)):
            choice = scores if b is None else scores + b.detach().float().to(scores.device)
            ok, grp, how = choose(choice)
            if not ok:
                continue
            wr = _weights_rule(w, scores.gather(1, ids).double(), tol)
            if wr is not None:
                normalized, c = wr
                return Rule(scoring, normalized, None if c == 1.0 else c, b is not None, grp,
                            how), scores
    return UNKNOWN, None


def switch_aux_loss(probs_NE: torch.Tensor, ids_NK: torch.Tensor) -> float:
    """Switch-Transformer load-balancing loss of one layer, without coefficient:
    ``E · Σ_e f_e · P_e`` with ``f_e`` the share of the N·k assignments that went to expert e and
    ``P_e`` the mean softmax probability of e (``minillm.moe.load_balancing_loss``); 1.0 when
    perfectly balanced. Defined only for a softmax over all E."""
    n, e = probs_NE.shape
    k = ids_NK.shape[1]
    counts = torch.bincount(ids_NK.reshape(-1), minlength=e)
    return float(e * torch.sum(counts.float() / (n * k) * probs_NE.float().mean(dim=0)))


def routing_record(
    block: str,
    router: str | None,
    call_index: int,
    ids_NK: torch.Tensor,
    weights_NK: torch.Tensor,
    *,
    logits_NE: torch.Tensor | None = None,
    num_experts: int | None = None,
    rule: Rule | None = None,
    scores_NE: torch.Tensor | None = None,
    router_module: nn.Module | None = None,
    source: str = "experts",
) -> RoutingRecord:
    """A :class:`~hooks.trace.records.RoutingRecord` from the ids and weights one block used.

    Args:
        block: qualified name of the MoE block.
        router: qualified name of the router whose logits are given (None if not seen).
        call_index: the block's call index.
        ids_NK: (N, k) expert ids as applied.
        weights_NK: (N, k) weights as applied.
        logits_NE: the router's (N, E) logits, when seen.
        num_experts: E when no logits are given (else ``logits_NE.shape[-1]``).
        rule, scores_NE: a rule already known (e.g. the block's own recomputation); else it is
            inferred with :func:`infer_rule` from the logits.
        router_module: the router (bias and group attributes) for :func:`infer_rule`.
        source: ``"experts"`` (read from the experts call), ``"topk"`` (the block's own
            ``topk``, :func:`topk_record`), ``"router"`` or ``"recomputed"``.
    """
    ids = ids_NK.detach().reshape(-1, ids_NK.shape[-1]).long()
    weights = weights_NK.detach().reshape(ids.shape)
    logits = None if logits_NE is None else logits_NE.detach().reshape(-1, logits_NE.shape[-1])
    if logits is not None and logits.shape[0] != ids.shape[0]:
        logits = None
    if rule is None:
        rule, scores_NE = (infer_rule(logits, ids, weights, router_module) if logits is not None
                           else (UNKNOWN, None))
    e = int(logits.shape[-1]) if logits is not None else int(num_experts or int(ids.max()) + 1)
    probs = scores_NE if rule.scoring == "softmax" else None
    sig = scores_NE if rule.scoring == "sigmoid" else None
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    aux = switch_aux_loss(probs, ids) if probs is not None else None
    return RoutingRecord(
        module=block,
        router=router or "",
        call_index=call_index,
        layer=layer_of(block),
        num_experts=e,
        top_k=int(ids.shape[1]),
        top_k_ids=ids.cpu().clone(),
        top_k_weights=weights.float().cpu().clone(),
        router_probs=None if probs is None else probs.float().cpu().clone(),
        tokens_per_expert=counts.cpu().clone(),
        aux_loss=aux,
        source=source,
        scoring=rule.scoring,
        normalized=rule.normalized,
        scale=rule.scale,
        score_bias=rule.bias,
        groups=None if rule.groups is None else list(rule.groups),
        group_score=rule.group_score,
        router_logits=None if logits is None else logits.float().cpu().clone(),
        router_scores=None if sig is None else sig.float().cpu().clone(),
    )


# -- finding blocks -----------------------------------------------------------------------------
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def moe_blocks(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module, nn.Module]]:
    """``(name, block, experts)`` for every module with an ``experts`` child module, and every
    MoE block the model (``modules``' root, ``""``) declares with experts under another name
    (``hooks.roles(model, router=..., experts=...)``, :mod:`hooks.modelroles`)."""
    return _named_and_declared(modules)[0]


def _named_and_declared(modules: list[tuple[str, nn.Module]]
                        ) -> tuple[list[tuple[str, nn.Module, nn.Module]], dict[str, str]]:
    """:func:`moe_blocks`, and the declared router of each declared block that has one."""
    out = []
    for name, m in modules:
        experts = getattr(m, "experts", None)
        if isinstance(experts, nn.Module) and experts in m.children():
            out.append((name, m, experts))
    by_name = dict(modules)
    root = by_name.get("")
    if root is None:
        return out, {}
    try:
        declared = declared_roles(root).moe
    except ValueError:  # a declaration that does not fit is said where roles are read
        declared = []
    known = {n for n, _, _ in out}
    for b in declared:
        if b.name not in known and b.experts in by_name and b.name in by_name:
            out.append((b.name, by_name[b.name], by_name[b.experts]))
    return out, {b.name: b.router for b in declared if b.router in by_name}


def _join(prefix: str, child: str) -> str:
    return f"{prefix}.{child}" if prefix else child


def routing_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor,
                                                       torch.Tensor] | str:
    """``(hidden (N, D), ids (N, k), weights (N, k))`` from an experts call, else why not."""
    vals = list(args[:3])
    for key in ("hidden_states", "top_k_index", "top_k_weights"):
        if len(vals) < 3 and key in kwargs:
            vals.append(kwargs[key])
    if len(vals) < 3 or not all(isinstance(v, torch.Tensor) for v in vals):
        kinds = ", ".join(type(v).__name__ if not isinstance(v, torch.Tensor) else
                          f"{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
                          for v in list(args) + list(kwargs.values()))
        return f"its experts were called with ({kinds}), not (hidden, top-k ids, top-k weights)"
    x, ids, w = vals
    shapes = f"{tuple(x.shape)}, {tuple(ids.shape)}, {tuple(w.shape)}"
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        return f"its experts' second argument is {ids.dtype}, not integer expert ids ({shapes})"
    if not w.is_floating_point() or ids.dim() != 2 or w.shape != ids.shape \
            or x.dim() < 2 or x.reshape(-1, x.shape[-1]).shape[0] != ids.shape[0]:
        return f"its experts were called with shapes ({shapes}), not (N, D), (N, k), (N, k)"
    if ids.shape[1] > 1:
        srt = ids.sort(dim=-1).values
        if bool((srt[:, 1:] == srt[:, :-1]).any()):  # a one-hot mask, not k distinct ids
            return f"its experts' second argument repeats ids within a token ({shapes})"
    return x, ids, w


def topk_record(block: str, call_index: int, watch: TopKWatch,
                router_module: nn.Module | None) -> RoutingRecord | str:
    """The record of one block call from the ``topk`` that ``watch`` saw
    (:mod:`hooks.probes.routing_ops`): its ids, and the latest weights computed from its
    values that the block read and whose rule :func:`infer_rule` verifies against the router's
    logits (source ``"topk"``); else one line saying what ran and what did not match."""
    if watch.topk is None:
        return "no topk over its router's scores ran in the block"
    router, logits, ids = watch.topk
    k = ids.shape[-1]
    ids_nk = ids.detach().reshape(-1, k)
    logits_ne = logits.detach().reshape(-1, logits.shape[-1])
    used = [w for w in watch.weights if id(w) in watch.used]
    if not used:
        return (f"a topk (k={k}) over {router}'s scores ran, but the block read none of the "
                "weights computed from its values: the experts got weights of another origin; "
                "register a probe that reads them with hooks.register_probe")
    for w in reversed(used):
        w_nk = w.detach().reshape(-1, k)
        rule, scores = infer_rule(logits_ne, ids_nk, w_nk, router_module)
        if rule.scoring != "unknown":
            return routing_record(block, router, call_index, ids_nk, w_nk, logits_NE=logits_ne,
                                  rule=rule, scores_NE=scores, source="topk")
    return (f"a topk (k={k}) over {router}'s scores ran, but no known rule (softmax over E or "
            "over the top-k, sigmoid; with bias, groups, renormalisation, a scale) reproduces "
            "the weights computed from its values; register a probe that reads them with "
            "hooks.register_probe")


def _called(experts: nn.Module) -> bool:
    """Whether the block calls ``experts`` itself (a container's forward is never called)."""
    return type(experts).forward is not nn.Module.forward


class ExpertsRouting:
    """Records routing from the experts call of every MoE block of a model, or from the
    ``topk`` the block runs (:mod:`hooks.probes.routing_ops`).

    Blocks: those with an ``experts`` child and those declared (:func:`moe_blocks`), then
    those found from what they compute (:func:`hooks.probes.routing_ops.found_blocks`: a router
    child of E outputs beside E experts, an MoE block only if a ``topk`` over the router's
    scores runs in the step). The ``topk`` is watched in a found block, and in a named or
    declared block whose experts are a container and that no registered probe reads.

    One instance per capture: :meth:`attach` hooks the blocks, :meth:`finish` adds a
    :class:`~hooks.trace.records.Note` naming each block that ran but left no routing record, and
    why.
    """

    def __init__(self, host: RoutingHost) -> None:
        self.host = host
        self._why: dict[str, str] = {}
        self._ran: dict[str, int] = {}
        self._blocks: list[tuple[str, nn.Module, nn.Module]] = []
        self._found: set[str] = set()  # blocks found from the computation, not by name
        self._saw: set[str] = set()  # found blocks in which a routing topk ran

    def attach(self, modules: list[tuple[str, nn.Module]],
               probed: Callable[[nn.Module], Any] | None = None) -> list[Any]:
        """Hook every block of ``modules`` (``hooks.tensors.walk.named_modules`` order); return
        handles. ``probed(block)``: whether a registered probe reads that block (no ``topk`` is
        watched in a named block that one reads)."""
        handles: list[Any] = []
        self._blocks, declared = _named_and_declared(modules)
        known = {n for n, _, _ in self._blocks}
        found = [(b, x) for b, x, _ in found_blocks(modules) if b not in known]
        if found:
            by_name = dict(modules)
            self._blocks += [(b, by_name[b], by_name[x]) for b, x in found]
            self._found = {b for b, _ in found}
        for name, block, experts in self._blocks:
            watch = name in self._found or not (_called(experts) or (probed and probed(block)))
            handles.extend(self._attach_block(name, block, experts, watch, declared.get(name)))
        return handles

    def _attach_block(self, name: str, block: nn.Module, experts: nn.Module,
                      watch: bool, router: str | None = None) -> list[Any]:
        """Hook one block: its calls, its children's outputs (the router's logits), its
        experts' call, and (``watch``) the ``topk`` over the scores of its router children
        (the declared ``router``, and every projection child of E outputs)."""
        host = self.host
        state: dict[str, Any] = {"call": -1, "seen": []}
        children = [(c, m) for c, m in block.named_children() if m is not experts]
        e = num_experts(experts)
        routers = set()
        if watch and e:
            routers = {_join(name, c) for c in router_children(block, experts, e)}
            routers |= {router} if router is not None else set()
        tw = TopKWatch(e) if routers else None

        def pre(mod, args):
            if host.recording:
                self._ran[name] = self._ran.get(name, 0) + 1
                state["call"] += 1
                state["seen"] = []
                state["open"] = True
            return None

        def post(mod, args, output):
            state["open"] = False
            state["seen"] = []
            return None

        called = _called(experts)  # else no experts call reads what the children returned

        def child_hook(cname: str, cmod: nn.Module):
            def hook(mod, args, output):
                if state.get("open"):
                    if called:
                        state["seen"].append((cname, cmod, output))
                    if tw is not None and cname in routers:
                        tw.start(cname, output)
                return None

            return hook

        def experts_pre(mod, args, kwargs):
            if not (state.get("open") and host.recording):
                return None
            try:
                got = routing_args(args, kwargs)
                if isinstance(got, str):
                    self._why.setdefault(name, got)
                    return None
                _, ids, w = got
                n = getattr(experts, "num_experts", None)
                with torch.no_grad():
                    rec = self._record(name, state["call"], state["seen"], ids, w,
                                       n if isinstance(n, int) else None)
                host.add_routing(rec)
            except Exception as exc:  # never break the forward
                self._why.setdefault(name, f"routing probe failed: {type(exc).__name__}: {exc}")
            return None

        handles = [block.register_forward_pre_hook(pre),
                   block.register_forward_hook(post, always_call=True)]
        if called:  # containers are never called
            handles.append(experts.register_forward_pre_hook(experts_pre, with_kwargs=True))
        else:
            ran = ", no topk over its router's scores ran in it," if tw is not None else ","
            self._why[name] = (f"its experts are an {type(experts).__name__} that the block "
                               f"calls one by one{ran} and no probe reads its router; register "
                               "one with hooks.register_probe")
        for cname, cmod in children:
            handles.append(cmod.register_forward_hook(child_hook(_join(name, cname), cmod)))
        if tw is not None:
            handles.extend(self._watch_hooks(name, block, experts, tw, state, dict(children)))
        return handles

    def _watch_hooks(self, name: str, block: nn.Module, experts: nn.Module, tw: TopKWatch,
                     state: dict[str, Any], children: dict[str, nn.Module]) -> list[Any]:
        """The hooks of ``tw``: its mode entered as the block starts (after the block's other
        pre-hooks, so that every mode the block's forward enters lies above it) and left as it
        returns (before its other forward hooks, which may leave modes of their own), off the
        stack while each expert runs."""

        def begin(mod, args):
            if state.get("open"):
                tw.reset()
                tw.begin()
            return None

        def end(mod, args, output):
            if not tw.stop():
                self._why.setdefault(name, "a TorchFunctionMode entered in the block was still "
                                     "on when it returned: its topk is no longer watched")
            return None

        def record(mod, args, output):  # after the probes' hooks, which may record it first
            if tw.topk is not None:
                self._end_watch(name, state["call"], tw, children)
            return None

        return [block.register_forward_pre_hook(begin),
                block.register_forward_hook(end, prepend=True, always_call=True),
                block.register_forward_hook(record, always_call=True),
                *watch_experts(tw, experts)]

    def _end_watch(self, name: str, call: int, tw: TopKWatch,
                   children: dict[str, nn.Module]) -> None:
        """After a block call: record what the ``topk`` ``tw`` saw gave, unless that call
        already has a record (its experts call, a probe)."""
        try:
            if self.host.has_routing(name, call):
                return
            self._saw.add(name)
            cname = tw.topk[0].rpartition(".")[2]
            with torch.no_grad():
                got = topk_record(name, call, tw, children.get(cname))
            if isinstance(got, str):
                self._why[name] = got
            else:
                self.host.add_routing(got)
        except Exception as exc:  # never break the forward
            self._why.setdefault(name, f"routing probe failed: {type(exc).__name__}: {exc}")
        finally:
            tw.reset()

    @staticmethod
    def _record(block: str, call: int, seen: list, ids: torch.Tensor, w: torch.Tensor,
                num_experts: int | None) -> RoutingRecord:
        """The record of one experts call, with the router logits of the child that returned
        them: candidates are (N, E) float tensors the block's children returned before the
        experts ran, a child whose output also holds ``ids`` itself first, then those with E
        matching the experts' ``num_experts``. The first whose rule verifies wins; a child that
        returned ``ids`` is the router even when no rule verifies."""
        n, top = ids.shape[0], int(ids.max())
        cands = []
        for order, (cname, cmod, out) in enumerate(seen):
            parts = out if isinstance(out, (tuple, list)) else (out,)
            tensors = [p for p in parts if isinstance(p, torch.Tensor)]
            owns = any(t is ids for t in tensors)
            for t in tensors:
                if t.is_floating_point() and t.dim() == 2 and t.shape[0] == n \
                        and t.shape[1] > top:
                    rank = (0 if owns else 1, 0 if t.shape[1] == num_experts else 1, order)
                    cands.append((rank, t, cname, cmod, owns))
                    break
        cands.sort(key=lambda c: c[0])
        for _, logits, cname, cmod, _ in cands:
            rule, scores = infer_rule(logits, ids, w, cmod)
            if rule.scoring != "unknown":
                return routing_record(block, cname, call, ids, w, logits_NE=logits, rule=rule,
                                      scores_NE=scores)
        owner = next((c for c in cands if c[4]), None)
        if owner is not None:
            rec = routing_record(block, owner[2], call, ids, w, logits_NE=owner[1], rule=UNKNOWN)
            rec.note = (f"{owner[2]} returned logits, but no known rule (softmax over E or "
                        "over the top-k, sigmoid; with bias, groups, renormalisation, a scale) "
                        "reproduces the ids and weights the experts received")
            return rec
        rec = routing_record(block, None, call, ids, w, num_experts=num_experts, rule=UNKNOWN)
        rec.note = ("router logits not identified: no child of the block returned (N, E) "
                    "logits that reproduce the ids and weights the experts received")
        return rec

    def finish(self) -> None:
        """Add a note for each MoE block that ran but has no routing record."""
        try:
            self._finish()
        except Exception as exc:  # a note must never stop the capture from finishing
            self.host.add_note(Note("routing", f"routing notes failed: {exc!r}"))

    def _finish(self) -> None:
        for name, block, _ in self._blocks:
            if name in self._found and name not in self._saw:
                continue  # no topk over its router's scores ran: not an MoE block
            calls = self._ran.get(name, 0)
            if calls == 0 or any(self.host.has_routing(name, c) for c in range(calls)):
                continue
            why = self._why.get(name, "its experts module was not called during the block")
            self.host.add_note(Note(
                "routing", f"MoE block ({type(block).__name__}) ran {calls}×, routing not "
                f"recorded: {why}", module=name))
