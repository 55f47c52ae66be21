"""Probes: what a plain module output does not show (MoE routing, attention probabilities).

Most of it needs no probe: :mod:`hooks.probes.routing` reads the routing of every MoE block from the
call of its experts module (or from the ``topk`` the block runs,
:mod:`hooks.probes.routing_ops`), :mod:`hooks.probes.attention` the probabilities from the
model's own ``scaled_dot_product_attention`` and softmax calls. A probe is registered per
module type (a class, or a class name so that HF or minillm need not be imported) for what
those cannot see, and is attached by :func:`hooks.capture` to every module of that type. Built-in:

* :class:`BlockRoutingProbe` on ``MiniLLMSparseMoeBlock`` (and HF v4 ``MixtralSparseMoeBlock``),
  whose experts are an ``nn.ModuleList`` and whose output is ``(y (B, T, D), router_logits
  (N, E))``: routing recomputed from the logits with the block's own rule (softmax in fp32,
  top-k, renormalise).
* :class:`EagerAttentionProbe` on ``MiniLLMAttention``, only when attention was requested: the
  weights an eager module returns (``(attn_output, attn_weights (B, H, T, S), present)``), when
  the intercepted softmax did not already record that call.

:class:`TopKRouterProbe` (a router returning ``(logits, top_k_weights, top_k_index)``) is kept
for user code; HF v5 routers need no probe.

A user probe subclasses :class:`Probe`, overrides :meth:`Probe.on_forward` (or
:meth:`Probe.attach`) and calls ``ctx.add_extra(...)``; then ``hooks.register_probe(MyType,
MyProbe())``. A probe that raises never breaks the forward: the error becomes a note. Probes do
not run for calls re-run by activation checkpointing during backward.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from hooks.probes.routing import Rule, routing_record
from hooks.trace.records import AttentionRecord, Note, ProbeRecord, RoutingRecord, layer_of
from hooks.trace.trace import Trace


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread (checkpoint recomputation)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class ProbeHost(Protocol):
    """What a :class:`ProbeContext` needs of the capture that runs it (a
    :class:`hooks.engine.capture.Capture`); a protocol, so that probes do not import the capture."""

    active: bool
    trace: Trace

    def wants_attention(self, name: str) -> bool: ...


class ProbeContext:
    """What a probe may do with the running capture (one per capture)."""

    def __init__(self, capture: ProbeHost) -> None:
        self._capture = capture
        #: the capture's :class:`hooks.probes.attention.AttentionCapture`, when attention was
        # requested
        self.attention: Any = None

    @property
    def active(self) -> bool:
        """True while the capture is recording (probes do nothing otherwise)."""
        return self._capture.active

    @property
    def recording(self) -> bool:
        """Active and not inside a backward pass (where activation checkpointing re-runs
        forward calls that were already recorded)."""
        return self._capture.active and not in_backward()

    def wants_attention(self, name: str) -> bool:
        """Whether attention probabilities were requested for module ``name``."""
        return self._capture.wants_attention(name)

    def add_routing(self, rec: RoutingRecord) -> None:
        self._capture.trace.routing.append(rec)

    def has_routing(self, module: str, call_index: int) -> bool:
        """Whether a routing record exists for that call of MoE block ``module``."""
        return any(r.module == module and r.call_index == call_index
                   for r in self._capture.trace.routing)

    def add_note(self, note: Note) -> None:
        """Append ``note`` to the trace unless an equal one is there."""
        notes = self._capture.trace.notes
        if not any(n.kind == note.kind and n.module == note.module and n.message == note.message
                   for n in notes):
            notes.append(note)

    def add_attention(self, rec: AttentionRecord) -> None:
        self._capture.trace.attention.append(rec)

    def add_extra(self, rec: ProbeRecord) -> None:
        self._capture.trace.extras.append(rec)

    def note(self, kind: str, message: str, module: str | None = None, call_index=None) -> None:
        """Say what the probe could not record (deduplicated by kind, module and message)."""
        self.add_note(Note(kind, message, module, call_index))

    def error(self, probe: Probe, module: str, exc: BaseException) -> None:
        self.note("probe", f"probe {probe.name} failed: {type(exc).__name__}: {exc}", module)


class Probe:
    """Base class: attaches one forward hook per matching module and calls :meth:`on_forward`.

    Attributes:
        name: shown in notes and stored in :class:`~hooks.trace.records.ProbeRecord`.
    """

    name = "probe"

    def attach(self, name: str, module: nn.Module, ctx: ProbeContext) -> list[Any]:
        """Register hooks on ``module`` (qualified name ``name``); return removable handles.

        The default forward hook counts calls and runs :meth:`on_forward` under ``no_grad``
        (not for calls re-run during backward by activation checkpointing).
        """
        counter = [0]

        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not ctx.recording:
                return None
            ci = counter[0]
            counter[0] += 1
            try:
                with torch.no_grad():
                    self.on_forward(ctx, name, ci, mod, args, kwargs, output)
            except Exception as exc:
                ctx.error(self, name, exc)
            return None

        return [module.register_forward_hook(hook, with_kwargs=True)]

    def on_forward(
        self,
        ctx: ProbeContext,
        name: str,
        call_index: int,
        module: nn.Module,
        args: tuple,
        kwargs: dict,
        output: Any,
    ) -> None:
        """Inspect one call; record with ``ctx.add_extra`` / ``add_routing`` / ``add_attention``."""


# -- routing ------------------------------------------------------------------------------------
_MIXTRAL_RULE = Rule("softmax", normalized=True)


def _top_k_of(module: nn.Module) -> int | None:
    k = getattr(module, "top_k", None) or getattr(module, "num_experts_per_tok", None)
    return int(k) if isinstance(k, int) else None


class BlockRoutingProbe(Probe):
    """Routing of an MoE block whose output is ``(y, router_logits (N, E))`` and which has
    ``top_k`` (or ``num_experts_per_tok``) and a ``gate`` router, routing with Mixtral's rule
    (``minillm.moe.route``: softmax over E in fp32, top-k, renormalise the k weights). The ids
    and weights are recomputed from the logits with that rule (source ``"recomputed"``);
    ignored when the experts call of the same block call was already recorded."""

    name = "routing"

    def on_forward(self, ctx, name, call_index, module, args, kwargs, output) -> None:
        if not (isinstance(output, tuple) and len(output) >= 2):
            return
        logits = output[1]
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 \
                or not logits.is_floating_point():
            return
        if ctx.has_routing(name, call_index):
            return
        top_k = _top_k_of(module)
        if top_k is None:
            ctx.note("probe", "MoE block has no top_k attribute: routing not recorded", name)
            return
        probs = torch.softmax(logits.detach().float(), dim=-1)
        w, ids = torch.topk(probs, top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        router = f"{name}.gate" if name else "gate"
        ctx.add_routing(routing_record(name, router, call_index, ids, w, logits_NE=logits,
                                       rule=_MIXTRAL_RULE, scores_NE=probs, source="recomputed"))


class TopKRouterProbe(Probe):
    """Routing of a router module returning ``(router_logits (N, E), top_k_weights (N, k),
    top_k_index (N, k))``; the MoE block is the router's parent module. The rule is verified
    with :func:`hooks.probes.routing.infer_rule`. Not registered by default: HF v5 blocks are read
    from their experts call (:mod:`hooks.probes.routing`); register it for a block whose experts are
    called one by one."""

    name = "routing"

    def on_forward(self, ctx, name, call_index, module, args, kwargs, output) -> None:
        if not (isinstance(output, tuple) and len(output) == 3):
            return
        logits, weights, ids = output
        block = name.rpartition(".")[0]
        ctx.add_routing(routing_record(block, name, call_index, ids, weights, logits_NE=logits,
                                       router_module=module, source="router"))


# -- attention ----------------------------------------------------------------------------------
class EagerAttentionProbe(Probe):
    """Attention probabilities an eager module returns (``MiniLLMAttention`` with
    ``attn_implementation="eager"``: output ``(attn_output, attn_weights (B, H, T, S),
    present)``). Attached only for requested modules; the module's path is not changed (its
    SDPA path is read by :mod:`hooks.probes.attention`), and a call the intercepted softmax already
    recorded is left alone."""

    name = "attention"

    def attach(self, name, module, ctx):
        if not ctx.wants_attention(name):
            return []
        return super().attach(name, module, ctx)

    def on_forward(self, ctx, name, call_index, module, args, kwargs, output) -> None:
        w = output[1] if isinstance(output, tuple) and len(output) >= 2 else None
        if not isinstance(w, torch.Tensor) or w.dim() != 4:
            return
        att = ctx.attention
        if att is not None and att.recorded(name, call_index):
            return
        ctx.add_attention(AttentionRecord(name, call_index, layer_of(name), "eager",
                                          w.detach().to("cpu", torch.float32, copy=True),
                                          num_heads=int(w.shape[1])))


# -- registry -----------------------------------------------------------------------------------
_REGISTRY: list[tuple[type | str, Probe]] = []
_CACHE: dict[type, list[Probe]] = {}  # module class -> matching probes (cleared on (un)register)


def register_probe(module_type: type | str, probe: Probe) -> Probe:
    """Attach ``probe`` to every module of ``module_type`` in future captures.

    Args:
        module_type: a class (matched with ``isinstance``) or a class name / ``module.Class``
            qualified name (matched against the module's MRO, no import needed).
        probe: the probe instance.

    Returns:
        Probe: ``probe``, so the call can be used as an expression.
    """
    _REGISTRY.append((module_type, probe))
    _CACHE.clear()
    return probe


def unregister_probe(probe: Probe) -> None:
    """Remove every registration of ``probe``."""
    _REGISTRY[:] = [(k, p) for k, p in _REGISTRY if p is not probe]
    _CACHE.clear()


def _type_matches(module: nn.Module, key: type | str) -> bool:
    if isinstance(key, type):
        return isinstance(module, key)
    for cls in type(module).__mro__:
        if key == cls.__name__ or key == f"{cls.__module__}.{cls.__qualname__}":
            return True
    return False


def probes_for(module: nn.Module) -> list[Probe]:
    """Registered probes matching ``module``, each once, in registration order."""
    cls = type(module)
    hit = _CACHE.get(cls)
    if hit is not None:
        return hit
    out: list[Probe] = []
    for key, probe in _REGISTRY:
        if probe not in out and _type_matches(module, key):
            out.append(probe)
    _CACHE[cls] = out
    return out


_block_routing = BlockRoutingProbe()
register_probe("MiniLLMSparseMoeBlock", _block_routing)
register_probe("MixtralSparseMoeBlock", _block_routing)  # HF v4: returns (y, router_logits)
register_probe("MiniLLMAttention", EagerAttentionProbe())
