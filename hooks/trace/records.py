"""The records a capture produces: light dataclasses with ``to_dict`` / ``from_dict`` for JSON.

Tensors carried by records (routing ids/weights/probabilities, attention probabilities) are not
part of ``to_dict``; :class:`hooks.Trace` saves them to safetensors under the keys that
:meth:`RoutingRecord.tensor_items` / :meth:`AttentionRecord.tensor_items` name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from hooks.tensors.stats import TensorStats, decode_float, encode_float

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def layer_of(name: str) -> int | None:
    """Decoder layer index parsed from a qualified name (``model.layers.3.mlp`` -> 3), else None."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


@dataclass(slots=True)
class TensorInfo:
    """One tensor seen at a module boundary.

    Attributes:
        path: where it sits in the call, e.g. ``args[0]``, ``kwargs.position_embeddings[0]``,
            ``out[0]``, ``out.logits``.
        shape: its shape.
        dtype: dtype name without the ``torch.`` prefix (``float32``, ``int64``).
        requires_grad: whether autograd tracked it.
        stats: its statistics (``None`` only when they could not be computed, e.g. complex).
        kept: key of the full tensor in ``Trace.tensors`` when it was kept, else ``None``.
    """

    path: str
    shape: list[int]
    dtype: str
    requires_grad: bool = False
    stats: TensorStats | None = None
    kept: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "requires_grad": self.requires_grad,
            "stats": None if self.stats is None else self.stats.to_dict(),
            "kept": self.kept,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorInfo:
        st = d.get("stats")
        return cls(
            path=d["path"],
            shape=[int(s) for s in d["shape"]],
            dtype=d["dtype"],
            requires_grad=bool(d.get("requires_grad", False)),
            stats=None if st is None else TensorStats.from_dict(st),
            kept=d.get("kept"),
        )


@dataclass(slots=True)
class CallRecord:
    """One forward call of one module.

    Attributes:
        index: position in ``Trace.forward`` (execution order: the order calls *start*, so a
            parent precedes its children).
        module: qualified name as in ``model.named_modules()`` (``""`` for the root).
        module_type: class name of the module.
        call_index: 0 for the module's first call in this capture, 1 for its second, ...
        depth: nesting depth among recorded calls (0 for the outermost).
        parent: ``index`` of the enclosing recorded call, or ``None``.
        end_order: order in which calls *finished* (children before their parent).
        inputs: tensors among the positional and keyword arguments, with statistics taken
            before the call ran (so an in-place module does not overwrite them).
        outputs: tensors found in the output (inside tuples, lists, dicts, dataclasses and HF
            ``ModelOutput``s).
        time_ms: wall time of the call in milliseconds, children included.
        notes: what could not be captured for this call, in words.
        recomputed: how many times activation checkpointing re-ran this call during backward
            (``torch.utils.checkpoint``, HF ``gradient_checkpointing_enable``). A re-run is not
            a new call: it is kept here, and the gradients it produced are recorded for this
            call.
    """

    index: int
    module: str
    module_type: str
    call_index: int
    depth: int = 0
    parent: int | None = None
    end_order: int = -1
    inputs: list[TensorInfo] = field(default_factory=list)
    outputs: list[TensorInfo] = field(default_factory=list)
    time_ms: float = 0.0
    notes: list[str] = field(default_factory=list)
    recomputed: int = 0

    @property
    def key(self) -> tuple[str, int]:
        """``(module, call_index)``: identifies the call across traces of the same model."""
        return (self.module, self.call_index)

    def output(self, path: str = "out") -> TensorInfo | None:
        """The output tensor at ``path`` (default: the bare output), else None."""
        for t in self.outputs:
            if t.path == path:
                return t
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "module": self.module,
            "module_type": self.module_type,
            "call_index": self.call_index,
            "depth": self.depth,
            "parent": self.parent,
            "end_order": self.end_order,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "time_ms": self.time_ms,
            "notes": list(self.notes),
            "recomputed": self.recomputed,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CallRecord:
        return cls(
            index=int(d["index"]),
            module=d["module"],
            module_type=d["module_type"],
            call_index=int(d["call_index"]),
            depth=int(d.get("depth", 0)),
            parent=d.get("parent"),
            end_order=int(d.get("end_order", -1)),
            inputs=[TensorInfo.from_dict(t) for t in d.get("inputs", [])],
            outputs=[TensorInfo.from_dict(t) for t in d.get("outputs", [])],
            time_ms=float(d.get("time_ms", 0.0)),
            notes=list(d.get("notes", [])),
            recomputed=int(d.get("recomputed", 0)),
        )


@dataclass(slots=True)
class GradRecord:
    """The gradient of the loss with respect to one recorded forward output.

    Attributes:
        index: position in ``Trace.backward`` (the order autograd produced the gradients).
        forward_index: ``index`` of the :class:`CallRecord` whose output this is the gradient of.
        module: qualified name of that module.
        module_type: its class name.
        call_index: its call index.
        output: path of the output tensor within the call (``out``, ``out[0]``, ``out.logits``).
        shape: gradient shape (equals the output's shape).
        dtype: gradient dtype name.
        stats: gradient statistics.
        kept: key of the full gradient in ``Trace.tensors`` when kept, else ``None``.
    """

    index: int
    forward_index: int
    module: str
    module_type: str
    call_index: int
    output: str
    shape: list[int]
    dtype: str
    stats: TensorStats | None = None
    kept: str | None = None

    @property
    def key(self) -> tuple[str, int, str]:
        """``(module, call_index, output)``: identifies the gradient across traces."""
        return (self.module, self.call_index, self.output)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "forward_index": self.forward_index,
            "module": self.module,
            "module_type": self.module_type,
            "call_index": self.call_index,
            "output": self.output,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "stats": None if self.stats is None else self.stats.to_dict(),
            "kept": self.kept,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GradRecord:
        st = d.get("stats")
        return cls(
            index=int(d["index"]),
            forward_index=int(d["forward_index"]),
            module=d["module"],
            module_type=d["module_type"],
            call_index=int(d["call_index"]),
            output=d["output"],
            shape=[int(s) for s in d["shape"]],
            dtype=d["dtype"],
            stats=None if st is None else TensorStats.from_dict(st),
            kept=d.get("kept"),
        )


@dataclass(slots=True)
class ParamGradRecord:
    """Gradient statistics of one parameter after the backward pass(es) of a capture.

    Attributes:
        name: qualified parameter name (tied parameters appear once, under their first name).
        shape: parameter shape.
        status: ``"ok"``; ``"zero"`` (a gradient that is exactly zero everywhere); ``"none"``
            (``.grad`` is None: the parameter is not in the loss's graph); ``"stale"`` (``.grad``
            exists but no gradient reached it during this capture); ``"frozen"``
            (``requires_grad=False``).
        grad_norm: L2 norm of ``.grad`` (None unless a gradient exists).
        grad_abs_max: largest absolute gradient entry.
        nan_count: NaN entries in the gradient.
        inf_count: Inf entries in the gradient.
        weight_norm: L2 norm of the parameter itself.
        ratio: ``grad_norm / weight_norm`` (None when the weight norm is 0 or no gradient).
    """

    name: str
    shape: list[int]
    status: str
    grad_norm: float | None = None
    grad_abs_max: float | None = None
    nan_count: int = 0
    inf_count: int = 0
    weight_norm: float | None = None
    ratio: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "status": self.status,
            "grad_norm": encode_float(self.grad_norm),
            "grad_abs_max": encode_float(self.grad_abs_max),
            "nan_count": self.nan_count,
            "inf_count": self.inf_count,
            "weight_norm": encode_float(self.weight_norm),
            "ratio": encode_float(self.ratio),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParamGradRecord:
        return cls(
            name=d["name"],
            shape=[int(s) for s in d["shape"]],
            status=d["status"],
            grad_norm=decode_float(d.get("grad_norm")),
            grad_abs_max=decode_float(d.get("grad_abs_max")),
            nan_count=int(d.get("nan_count", 0)),
            inf_count=int(d.get("inf_count", 0)),
            weight_norm=decode_float(d.get("weight_norm")),
            ratio=decode_float(d.get("ratio")),
        )


#: ``RoutingRecord.scoring`` values and what they mean.
SCORINGS = {
    "softmax": "softmax over all E",
    "sigmoid": "sigmoid per expert",
    "unknown": "rule unknown",
}


@dataclass(slots=True)
class RoutingRecord:
    """What one MoE layer's router decided in one call (N = B*T tokens, E experts, k = top-k).

    Attributes:
        module: qualified name of the MoE block (e.g. ``model.layers.0.mlp``).
        router: qualified name of the router module whose logits are recorded (e.g.
            ``model.layers.0.mlp.gate``); ``""`` when no logits were identified.
        call_index: call index of the MoE block.
        layer: decoder layer index parsed from the name, or None.
        num_experts: E.
        top_k: k.
        top_k_ids: (N, k) int64 expert ids, in the order the block passed them.
        top_k_weights: (N, k) fp32 routing weights as the block applies them.
        router_probs: (N, E) fp32 softmax over all E of the router logits: only when that is
            the model's own rule (``scoring == "softmax"``), else None.
        tokens_per_expert: (E,) int64 number of (token, slot) assignments per expert; sums to N*k.
        aux_loss: this layer's Switch load-balancing loss without coefficient,
            ``E * sum_e f_e * P_e`` with ``f_e = tokens_per_expert[e] / (N*k)`` and ``P_e`` the
            mean router probability of expert e (``minillm.moe.load_balancing_loss``); 1.0 when
            perfectly balanced. None where it is not defined (the rule is not a softmax over
            all E).
        source: ``"experts"`` (ids and weights read from the call of the block's experts
            module: what the model used), ``"router"`` (what a router returned, read by a
            registered :class:`hooks.TopKRouterProbe`), ``"topk"`` (the ids of the ``topk``
            the block ran over its router's scores and the weights it computed from that
            ``topk``'s values: a block whose experts are called one by one, or found from what
            it computes, :mod:`hooks.probes.routing_ops`) or ``"recomputed"`` (from the router
            logits with the block's own rule: minillm, HF v4 blocks returning
            ``(y, router_logits)``).
        scoring: a key of :data:`SCORINGS`, verified against the ids and weights used.
        normalized: the top-k weights were renormalised to sum 1 (None: unknown).
        scale: constant factor on the weights (``routed_scaling_factor``); None for 1.
        score_bias: the choice ranked scores plus a bias (``e_score_correction_bias``); the
            weights use the scores without it.
        groups: ``[G, kept]`` for group-limited top-k (``n_group``, ``topk_group``), else None.
        group_score: how groups were ranked: ``"top2_sum"`` (DeepSeek-V3) or ``"max"``.
        router_logits: (N, E) fp32 logits as the router returned them, or None.
        router_scores: (N, E) fp32 sigmoid scores (``scoring == "sigmoid"``), else None.
        note: why something is missing (no logits, rule unknown), or ``""``.
    """

    module: str
    router: str
    call_index: int
    layer: int | None
    num_experts: int
    top_k: int
    top_k_ids: torch.Tensor
    top_k_weights: torch.Tensor
    router_probs: torch.Tensor | None
    tokens_per_expert: torch.Tensor
    aux_loss: float | None
    source: str = "experts"
    scoring: str = "softmax"
    normalized: bool | None = None
    scale: float | None = None
    score_bias: bool = False
    groups: list[int] | None = None
    group_score: str | None = None
    router_logits: torch.Tensor | None = None
    router_scores: torch.Tensor | None = None
    note: str = ""

    _TENSORS = ("top_k_ids", "top_k_weights", "router_probs", "tokens_per_expert",
                "router_logits", "router_scores")
    _REQUIRED = ("top_k_ids", "top_k_weights", "tokens_per_expert")

    def rule_text(self) -> str:
        """The rule in words, e.g. ``sigmoid per expert + bias on the choice, group-limited
        top-2 (2 of 4 groups), renormalised, ×2.5``."""
        if self.scoring == "unknown":
            return "rule unknown"
        parts = [SCORINGS.get(self.scoring, self.scoring)]
        if self.score_bias:
            parts[0] += " + bias on the choice"
        top = f"top-{self.top_k}"
        if self.groups:
            top = f"group-limited {top} ({self.groups[1]} of {self.groups[0]} groups)"
        parts.append(top)
        if self.normalized is True:
            parts.append("renormalised (= softmax over the k chosen logits)"
                         if self.scoring == "softmax" else "renormalised")
        elif self.normalized is False:
            parts.append("not renormalised")
        if self.scale is not None:
            parts.append(f"×{self.scale:.4g}")
        return ", ".join(parts)

    def aux_loss_reason(self) -> str:
        """Why :attr:`aux_loss` is None (``""`` when it is given)."""
        if self.aux_loss is not None:
            return ""
        if self.scoring == "unknown":
            return "the router's rule is unknown"
        return (f"the router scores with {SCORINGS.get(self.scoring, self.scoring)}; the Switch "
                "loss E·Σ f·P needs a softmax over all E")

    def tensor_items(self, prefix: str) -> dict[str, torch.Tensor]:
        """The record's tensors keyed ``f"{prefix}/{field}"`` for safetensors (None left out)."""
        out = {}
        for n in self._TENSORS:
            t = getattr(self, n)
            if t is not None:
                out[f"{prefix}/{n}"] = t
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "router": self.router,
            "call_index": self.call_index,
            "layer": self.layer,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "aux_loss": encode_float(self.aux_loss),
            "tokens_per_expert_list": self.tokens_per_expert.tolist(),
            "source": self.source,
            "scoring": self.scoring,
            "normalized": self.normalized,
            "scale": encode_float(self.scale),
            "score_bias": self.score_bias,
            "groups": self.groups,
            "group_score": self.group_score,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str):
        """Inverse of :meth:`to_dict` + :meth:`tensor_items`. Traces written before the rule
        was recorded read as softmax over E, renormalised, recomputed (their only probes)."""
        old = "scoring" not in d
        return cls(
            module=d["module"],
            router=d["router"],
            call_index=int(d["call_index"]),
            layer=d.get("layer"),
            num_experts=int(d["num_experts"]),
            top_k=int(d["top_k"]),
            aux_loss=decode_float(d.get("aux_loss")),
            source=d.get("source", "recomputed" if old else "experts"),
            scoring=d.get("scoring", "softmax"),
            normalized=d.get("normalized", True if old else None),
            scale=decode_float(d.get("scale")),
            score_bias=bool(d.get("score_bias", False)),
            groups=d.get("groups"),
            group_score=d.get("group_score"),
            note=d.get("note", ""),
            **{n: (tensors[f"{prefix}/{n}"] if n in cls._REQUIRED else
                   tensors.get(f"{prefix}/{n}")) for n in cls._TENSORS},
        )


#: ``AttentionRecord.source`` values and what they mean.
ATTENTION_SOURCES = {
    "sdpa": "recomputed from the q, k, mask and scale of the model's scaled_dot_product_attention "
            "call",
    "softmax": "the output of the model's own softmax over the keys",
    "eager": "the weights the attention module returned",
    "recomputed": "recomputed from q_proj/k_proj outputs (traces of older mdb)",
}


@dataclass(slots=True)
class AttentionRecord:
    """Attention probabilities of one attention call.

    Attributes:
        module: qualified name of the module that made the call (the innermost module running).
        call_index: that module's call index.
        layer: decoder layer index parsed from the name, or None.
        source: a key of :data:`ATTENTION_SOURCES`.
        probs: (B, H, T_q, T_k) fp32 probabilities; each row sums to 1, except rows whose keys
            are all masked (0 under SDPA, NaN from a hand-written softmax) and rows of a softmax
            that also covered non-key columns (attention sinks: see ``note``).
        mask: bool, broadcastable to ``probs``: True where the key took part (SDPA's
            ``attn_mask`` convention); None when not recorded.
        num_heads: H, query heads at the call (None: unknown).
        num_kv_heads: distinct key/value heads at the call: ``k``'s heads under
            ``enable_gqa``, fewer when K/V were repeated to H heads before the call (found by
            comparing the heads), None when the keys were not seen.
        kv_detail: how the KV heads were read: ``"enable_gqa"``, ``"repeated"`` (identical
            consecutive heads in ``k``), ``"heads"`` (as many KV heads as query heads) or ``""``.
        dropout: dropout probability the call applied after these probabilities.
        note: anything else a reader must know, or ``""``.
    """

    module: str
    call_index: int
    layer: int | None
    source: str
    probs: torch.Tensor
    mask: torch.Tensor | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    kv_detail: str = ""
    dropout: float = 0.0
    note: str = ""

    def nbytes(self) -> int:
        """Bytes held by the record's tensors."""
        n = self.probs.numel() * self.probs.element_size()
        if self.mask is not None:
            n += self.mask.numel() * self.mask.element_size()
        return n

    def tensor_items(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}/probs": self.probs}
        if self.mask is not None:
            out[f"{prefix}/mask"] = self.mask
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "call_index": self.call_index,
            "layer": self.layer,
            "source": self.source,
            "shape": list(self.probs.shape),
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "kv_detail": self.kv_detail,
            "dropout": self.dropout,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str):
        return cls(
            module=d["module"],
            call_index=int(d["call_index"]),
            layer=d.get("layer"),
            source=d["source"],
            probs=tensors[f"{prefix}/probs"],
            mask=tensors.get(f"{prefix}/mask"),
            num_heads=d.get("num_heads"),
            num_kv_heads=d.get("num_kv_heads"),
            kv_detail=d.get("kv_detail", ""),
            dropout=float(d.get("dropout", 0.0)),
            note=d.get("note", ""),
        )


@dataclass(slots=True)
class ProbeRecord:
    """Output of a user probe (see :class:`hooks.Probe`) for one call.

    Attributes:
        probe: the probe's name.
        module: qualified module name.
        call_index: the module's call index.
        values: JSON-serialisable values.
        tensors: tensors by name (saved via safetensors).
    """

    probe: str
    module: str
    call_index: int
    values: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def tensor_items(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}/{k}": v for k, v in self.tensors.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "probe": self.probe,
            "module": self.module,
            "call_index": self.call_index,
            "values": self.values,
            "tensor_names": sorted(self.tensors),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str):
        return cls(
            probe=d["probe"],
            module=d["module"],
            call_index=int(d["call_index"]),
            values=dict(d.get("values", {})),
            tensors={k: tensors[f"{prefix}/{k}"] for k in d.get("tensor_names", [])},
        )


@dataclass(slots=True)
class ModuleInfo:
    """One entry of ``model.named_modules()``, so a saved trace can draw the module tree.

    Attributes:
        name: qualified name (``""`` for the root).
        module_type: class name.
        depth: number of dots in the name plus one (0 for the root).
        own_params: parameters registered directly on this module (elements, not tensors).
        total_params: parameters of this module and all its descendants (tied ones once).
    """

    name: str
    module_type: str
    depth: int
    own_params: int
    total_params: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module_type": self.module_type,
            "depth": self.depth,
            "own_params": self.own_params,
            "total_params": self.total_params,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModuleInfo:
        return cls(
            name=d["name"],
            module_type=d["module_type"],
            depth=int(d["depth"]),
            own_params=int(d["own_params"]),
            total_params=int(d["total_params"]),
        )


@dataclass(slots=True)
class Note:
    """Something the capture could not record, said in words.

    Attributes:
        kind: ``non_tensor_output``, ``no_grad``, ``compiled``, ``budget``, ``probe``,
            ``no_backward``, ``hook_error``, ``unsupported``, ``routing`` (an MoE block whose
            routing was not recorded), ``attention`` (attention not recorded or cut),
            ``recomputed`` (activation checkpointing re-ran calls during backward),
            ``recompute_differs`` (a re-run gave other values than the forward call) or
            ``fast_path`` (the hooks turned off a PyTorch fast path), ``edit`` (an edit of
            ``capture(edits=...)`` that changed nothing, or was not applied),
            ``modified_in_place`` (tensors written in place after their hook, before the
            statistics worker read them: their statistics are not recorded) or
            ``nonfinite_origin`` (a NaN/Inf recorded beside such tensors: its origin may be
            earlier than the module named).
        module: qualified module name, or None for the whole capture.
        call_index: the call it is about, or None.
        message: one line for a person.
    """

    kind: str
    message: str
    module: str | None = None
    call_index: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "module": self.module,
            "call_index": self.call_index,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Note:
        return cls(
            kind=d["kind"],
            message=d["message"],
            module=d.get("module"),
            call_index=d.get("call_index"),
        )


@dataclass(slots=True)
class NonFinite:
    """Where NaN/Inf first appeared (see :meth:`hooks.Trace.first_nonfinite`).

    Attributes:
        direction: ``"forward"`` or ``"backward"``.
        index: index into ``Trace.forward`` or ``Trace.backward``.
        module: qualified module name.
        module_type: class name.
        call_index: the module's call index.
        tensor: path of the offending tensor (``out[0]``; for backward, the output whose
            gradient is non-finite).
        stats: the offending tensor's statistics (``nan_count``, ``inf_count`` > 0).
    """

    direction: str
    index: int
    module: str
    module_type: str
    call_index: int
    tensor: str
    stats: TensorStats

    def describe(self) -> str:
        """One line, e.g. ``forward: model.layers.0.mlp.experts.3.down_proj (Linear) call 0
        out: 12 NaN, 0 Inf of 4096``."""
        return (
            f"{self.direction}: {self.module or '<root>'} ({self.module_type}) call "
            f"{self.call_index} {self.tensor}: {self.stats.nan_count} NaN, "
            f"{self.stats.inf_count} Inf of {self.stats.numel}"
        )
