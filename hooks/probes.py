"""Probes: what a plain module output does not show (MoE routing, attention probabilities).

A probe is registered per module type (a class, or a class name so that HF or minillm need not
be imported) and is attached by :func:`hooks.capture` to every module of that type. Built-in:

* :class:`BlockRoutingProbe` on ``MiniLLMSparseMoeBlock`` (and HF v4 ``MixtralSparseMoeBlock``),
  whose output is ``(y (B, T, D), router_logits (N, E))``: routing recomputed from the logits with
  the model's own rule (softmax in fp32, top-k, renormalise).
* :class:`TopKRouterProbe` on HF v5 ``MixtralTopKRouter``, whose output is ``(router_logits,
  top_k_weights, top_k_index)``: the ids/weights the block actually used.
* :class:`EagerAttentionProbe` on ``MiniLLMAttention``, only when attention was requested: sets
  the module's ``return_attn_weights`` for the capture and reads the probabilities it returns.
* :class:`QKAttentionProbe` on HF ``LlamaAttention`` / ``MixtralAttention``, only when requested:
  recomputes ``softmax(rope(q) rope(k)^T * scaling + mask)`` from the captured ``q_proj`` /
  ``k_proj`` outputs and the ``position_embeddings`` / ``attention_mask`` kwargs, without
  changing the attention path the model runs.

A user probe subclasses :class:`Probe`, overrides :meth:`Probe.on_forward` (or
:meth:`Probe.attach`) and calls ``ctx.add_extra(...)``; then ``hooks.register_probe(MyType,
MyProbe())``. A probe that raises never breaks the forward: the error becomes a note.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from hooks.records import AttentionRecord, Note, ProbeRecord, RoutingRecord, layer_of
from hooks.trace import Trace


class ProbeHost(Protocol):
    """What a :class:`ProbeContext` needs of the capture that runs it (a
    :class:`hooks.capture.Capture`); a protocol, so that probes do not import the capture."""

    active: bool
    trace: Trace

    def wants_attention(self, name: str) -> bool: ...


class ProbeContext:
    """What a probe may do with the running capture (one per capture)."""

    def __init__(self, capture: ProbeHost) -> None:
        self._capture = capture

    @property
    def active(self) -> bool:
        """True while the capture is recording (probes do nothing otherwise)."""
        return self._capture.active

    def wants_attention(self, name: str) -> bool:
        """Whether attention probabilities were requested for module ``name``."""
        return self._capture.wants_attention(name)

    def add_routing(self, rec: RoutingRecord) -> None:
        self._capture.trace.routing.append(rec)

    def add_attention(self, rec: AttentionRecord) -> None:
        self._capture.trace.attention.append(rec)

    def add_extra(self, rec: ProbeRecord) -> None:
        self._capture.trace.extras.append(rec)

    def note(self, kind: str, message: str, module: str | None = None, call_index=None) -> None:
        """Say what the probe could not record (deduplicated by kind, module and message)."""
        notes = self._capture.trace.notes
        if not any(n.kind == kind and n.module == module and n.message == message for n in notes):
            notes.append(Note(kind, message, module, call_index))

    def error(self, probe: Probe, module: str, exc: BaseException) -> None:
        self.note("probe", f"probe {probe.name} failed: {type(exc).__name__}: {exc}", module)


class _Restore:
    """A handle whose ``remove()`` restores an attribute (probes that flip a module flag)."""

    def __init__(self, obj: Any, attr: str, value: Any) -> None:
        self.obj, self.attr, self.value = obj, attr, value

    def remove(self) -> None:
        setattr(self.obj, self.attr, self.value)


class Probe:
    """Base class: attaches one forward hook per matching module and calls :meth:`on_forward`.

    Attributes:
        name: shown in notes and stored in :class:`~hooks.records.ProbeRecord`.
    """

    name = "probe"

    def attach(self, name: str, module: nn.Module, ctx: ProbeContext) -> list[Any]:
        """Register hooks on ``module`` (qualified name ``name``); return removable handles.

        The default forward hook counts calls and runs :meth:`on_forward` under ``no_grad``.
        """
        counter = [0]

        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not ctx.active:
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
def _routing_record(
    block: str,
    router: str,
    call_index: int,
    logits_NE: torch.Tensor,
    top_k: int,
    weights_NK: torch.Tensor | None = None,
    ids_NK: torch.Tensor | None = None,
) -> RoutingRecord:
    """Routing of one layer from its router logits (N, E); ids/weights recomputed if not given.

    The rule is Mixtral's (and ``minillm.moe.route``'s): softmax over E in fp32, top-k,
    renormalise the k weights to sum 1. The aux loss is ``minillm.moe.load_balancing_loss``'s
    definition: ``E * sum_e (count_e / (N*k)) * mean_n probs[n, e]``.
    """
    logits = logits_NE.detach().reshape(-1, logits_NE.shape[-1])
    n, e = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    if ids_NK is None or weights_NK is None:
        w, ids = torch.topk(probs, top_k, dim=-1)
        weights_NK, ids_NK = w / w.sum(dim=-1, keepdim=True), ids
    ids = ids_NK.detach().reshape(n, -1).long()
    k = ids.shape[1]
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    aux = e * torch.sum(counts.float() / (n * k) * probs.mean(dim=0))
    return RoutingRecord(
        module=block,
        router=router,
        call_index=call_index,
        layer=layer_of(block),
        num_experts=e,
        top_k=k,
        top_k_ids=ids.cpu().clone(),
        top_k_weights=weights_NK.detach().reshape(n, -1).float().cpu().clone(),
        router_probs=probs.cpu().clone(),
        tokens_per_expert=counts.cpu().clone(),
        aux_loss=float(aux),
    )


class BlockRoutingProbe(Probe):
    """Routing of an MoE block whose output is ``(y, router_logits (N, E))`` and which has
    ``top_k`` (or ``num_experts_per_tok``) and a ``gate`` router. Ignores other outputs."""

    name = "routing"

    def on_forward(self, ctx, name, call_index, module, args, kwargs, output) -> None:
        if not (isinstance(output, tuple) and len(output) >= 2):
            return
        logits = output[1]
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            return
        top_k = getattr(module, "top_k", None) or getattr(module, "num_experts_per_tok", None)
        if top_k is None:
            ctx.note("probe", "MoE block has no top_k attribute: routing not recorded", name)
            return
        router = f"{name}.gate" if name else "gate"
        ctx.add_routing(_routing_record(name, router, call_index, logits, int(top_k)))


class TopKRouterProbe(Probe):
    """Routing of a router module returning ``(router_logits (N, E), top_k_weights (N, k),
    top_k_index (N, k))`` (HF transformers v5 ``MixtralTopKRouter``); the MoE block is the
    router's parent module."""

    name = "routing"

    def on_forward(self, ctx, name, call_index, module, args, kwargs, output) -> None:
        if not (isinstance(output, tuple) and len(output) == 3):
            return
        logits, weights, ids = output
        block = name.rpartition(".")[0]
        ctx.add_routing(
            _routing_record(block, name, call_index, logits, ids.shape[-1], weights, ids)
        )


# -- attention ----------------------------------------------------------------------------------
class EagerAttentionProbe(Probe):
    """Attention probabilities from a module that returns them when its ``return_attn_weights``
    flag is set (``MiniLLMAttention``: output ``(attn_output, attn_weights (B, H, T, S),
    present)``). Attached only for requested modules; the flag is restored on exit."""

    name = "attention"

    def attach(self, name, module, ctx):
        if not ctx.wants_attention(name):
            return []
        handles: list[Any] = []
        if hasattr(module, "return_attn_weights"):
            handles.append(_Restore(module, "return_attn_weights", module.return_attn_weights))
            module.return_attn_weights = True
        return handles + super().attach(name, module, ctx)

    def on_forward(self, ctx, name, call_index, module, args, kwargs, output) -> None:
        w = output[1] if isinstance(output, tuple) and len(output) >= 2 else None
        if not isinstance(w, torch.Tensor):
            ctx.note("probe", "attention module returned no weights", name, call_index)
            return
        ctx.add_attention(
            AttentionRecord(name, call_index, layer_of(name), "eager", w.detach().float().cpu())
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class QKAttentionProbe(Probe):
    """Attention probabilities recomputed from the q_proj/k_proj outputs of an HF Llama-style
    attention module (``head_dim``, ``num_key_value_groups``, ``scaling`` attributes; kwargs
    ``position_embeddings=(cos, sin)`` and ``attention_mask``), following HF's
    ``eager_attention_forward``: ``softmax(q_rot k_rot^T * scaling + mask)`` in fp32, with
    ``rotate_half`` RoPE and the KV heads repeated to H. A ``None`` mask means causal (with
    ``config.sliding_window`` when set); a bool mask keeps True entries; a float mask is added.
    A call whose keys include cached positions is skipped with a note.
    """

    name = "attention"

    def attach(self, name, module, ctx):
        if not ctx.wants_attention(name):
            return []
        q_mod, k_mod = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
        if not isinstance(q_mod, nn.Module) or not isinstance(k_mod, nn.Module):
            ctx.note("probe", "attention module has no q_proj/k_proj: probs not recorded", name)
            return []
        state: dict[str, Any] = {}
        counter = [0]

        def pre(mod, args, kwargs):
            if ctx.active:
                state.clear()
                state["open"] = True
                state["kwargs"] = kwargs
                state["hidden"] = args[0] if args else kwargs.get("hidden_states")
            return None

        def grab(key):
            def hook(mod, args, output):
                if state.get("open") and key not in state:
                    state[key] = output.detach()
                return None

            return hook

        def post(mod, args, kwargs, output):
            if not ctx.active or not state.get("open"):
                return None
            ci = counter[0]
            counter[0] += 1
            try:
                with torch.no_grad():
                    probs = self._recompute(mod, state)
                if probs is None:
                    ctx.note(
                        "probe",
                        "attention over cached keys cannot be recomputed from q/k: skipped",
                        name,
                        ci,
                    )
                else:
                    ctx.add_attention(
                        AttentionRecord(name, ci, layer_of(name), "recomputed", probs.cpu())
                    )
            except Exception as exc:
                ctx.error(self, name, exc)
            finally:
                state.clear()
            return None

        return [
            module.register_forward_pre_hook(pre, with_kwargs=True),
            q_mod.register_forward_hook(grab("q")),
            k_mod.register_forward_hook(grab("k")),
            module.register_forward_hook(post, with_kwargs=True),
        ]

    @staticmethod
    def _recompute(mod: nn.Module, state: dict[str, Any]) -> torch.Tensor | None:
        q_out, k_out = state.get("q"), state.get("k")
        if q_out is None or k_out is None:
            raise RuntimeError("q_proj/k_proj were not called inside the attention forward")
        kwargs = state["kwargs"]
        b, t = q_out.shape[0], q_out.shape[1]
        hd = mod.head_dim
        q = q_out.view(b, t, -1, hd).transpose(1, 2).float()
        k = k_out.view(b, t, -1, hd).transpose(1, 2).float()
        pe = kwargs.get("position_embeddings")
        if pe is not None:
            cos, sin = (x.float().unsqueeze(1) for x in pe)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        groups = getattr(mod, "num_key_value_groups", q.shape[1] // k.shape[1])
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
        scaling = getattr(mod, "scaling", hd**-0.5)
        scores = torch.matmul(q, k.transpose(2, 3)) * scaling
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            if mask.shape[-1] != t:
                return None  # keys include cached positions
            mask = mask[..., :t, :t]
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            else:
                scores = scores + mask.float()
        else:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            layer_idx = getattr(mod, "layer_idx", 0)
            if cache is not None and hasattr(cache, "get_seq_length"):
                if cache.get_seq_length(layer_idx) > t:
                    return None
            i = torch.arange(t, device=scores.device)
            keep = i[None, :] <= i[:, None]
            window = getattr(getattr(mod, "config", None), "sliding_window", None)
            if window:
                keep = keep & (i[:, None] - i[None, :] < window)
            scores = scores.masked_fill(~keep, float("-inf"))
        return torch.softmax(scores, dim=-1)


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
register_probe("MixtralTopKRouter", TopKRouterProbe())
register_probe("MiniLLMAttention", EagerAttentionProbe())
_qk = QKAttentionProbe()
for _name in ("LlamaAttention", "MixtralAttention", "MistralAttention", "Qwen2Attention"):
    register_probe(_name, _qk)
