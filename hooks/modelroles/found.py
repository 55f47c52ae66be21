"""What :mod:`hooks.modelroles` found: one record per role, each saying how it was found.

Dimension legend: B batch, T positions, D hidden size, H query heads, Hkv key/value heads,
Dh head dim, E experts, k experts per token.

``how`` is one of :data:`HOW`: ``"declared"`` (``hooks.roles(model, ...)`` or the model's
``__mdb_roles__``), ``"traced"`` (read from the ops of one forward) or ``"named"`` (HF's
names: ``q_proj``, ``c_attn``, ``num_heads``, ``get_output_embeddings``...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: How a role was found, strongest first (a declaration wins over the others).
HOW = ("declared", "traced", "named")


@dataclass(frozen=True)
class Columns:
    """A projection, or a slice of its output columns (a fused q|k|v Linear's q part).

    Attributes:
        module: the projection's qualified name.
        start: first output column.
        stop: one past the last output column (``stop - start`` = H·Dh for q, Hkv·Dh for k, v).
    """

    module: str
    start: int
    stop: int

    @property
    def width(self) -> int:
        """Number of columns, ``stop - start``."""
        return self.stop - self.start

    def describe(self) -> str:
        """``blocks.0.attn.qkv[0:64]``."""
        return f"{self.module}[{self.start}:{self.stop}]"

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "start": self.start, "stop": self.stop}


@dataclass
class AttentionRole:
    """One attention module: where the softmax over scores (or the SDPA call) runs.

    Attributes:
        name: the attention module's qualified name (the smallest module holding the softmax
            or SDPA call, its q/k/v projections and its o projection).
        how: ``declared``, ``traced`` or ``named``.
        num_heads: H, query heads (None when unknown).
        num_kv_heads: Hkv, key/value heads (None when unknown; H for plain multi-head).
        head_dim: Dh (None when unknown).
        q: the query projection's output columns (a fused projection's slice), or None.
        k: the same for keys.
        v: the same for values.
        o: the output projection's qualified name: its input is the heads' outputs
            concatenated, (..., H·Dh), head h at columns ``[h·Dh, (h+1)·Dh)``; None when not
            found.
        kernel: ``"softmax"`` (an eager softmax over scores), ``"sdpa"``
            (``F.scaled_dot_product_attention``) or ``""`` (not traced).
        detail: the evidence, in words.
        q_norm: the norm the queries go through between their projection and the scores
            (Qwen3's, OLMoE's ``q_norm``), or None.
        k_norm: the same for the keys (its output holds the keys each KV head reads).
        rotary: the module whose position table rotates the queries and keys on their way
            to the scores (RoPE; a :class:`Rotary` of :attr:`Roles.rotary`), or None: read
            from the trace only.
    """

    name: str
    how: str
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    q: Columns | None = None
    k: Columns | None = None
    v: Columns | None = None
    o: str | None = None
    kernel: str = ""
    detail: str = ""
    q_norm: str | None = None
    k_norm: str | None = None
    rotary: str | None = None

    def head_columns(self, head: int) -> tuple[int, int]:
        """``(start, stop)`` of head ``head``'s columns in the o projection's input,
        ``[head·Dh, (head+1)·Dh)``.

        Raises:
            ValueError: H or Dh unknown, or ``head`` not in ``0..H-1``.
        """
        if not self.num_heads or not self.head_dim:
            raise ValueError(f"{self.name}: its heads are not known")
        if not 0 <= head < self.num_heads:
            raise ValueError(f"{self.name} has {self.num_heads} heads (0…{self.num_heads - 1}); "
                             f"head {head} is out of range")
        return head * self.head_dim, (head + 1) * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "how": self.how, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                **{p: (c.to_dict() if c is not None else None)
                   for p, c in (("q", self.q), ("k", self.k), ("v", self.v))},
                "o": self.o, "kernel": self.kernel, "detail": self.detail,
                "q_norm": self.q_norm, "k_norm": self.k_norm, "rotary": self.rotary}


@dataclass
class MoERole:
    """One sparse MoE block: its router and its experts.

    Attributes:
        name: the block's qualified name (the router's parent module).
        how: ``declared``, ``traced`` or ``named``.
        router: the router's qualified name (its output: (N, E) logits), or None.
        experts: the experts' qualified name (an ``nn.ModuleList`` of per-expert MLPs, or a
            fused experts module), or None.
        num_experts: E, or None.
        top_k: k, when traced (the ``topk`` the router's scores went through), else None.
        detail: the evidence, in words.
    """

    name: str
    how: str
    router: str | None = None
    experts: str | None = None
    num_experts: int | None = None
    top_k: int | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "how": self.how, "router": self.router,
                "experts": self.experts, "num_experts": self.num_experts, "top_k": self.top_k,
                "detail": self.detail}


@dataclass(frozen=True)
class Found:
    """A single-module role (the LM head, the final norm).

    Attributes:
        module: its qualified name.
        how: ``declared``, ``traced`` or ``named``.
        detail: the evidence, in words.
    """

    module: str
    how: str
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "how": self.how, "detail": self.detail}


@dataclass
class Rotary:
    """RoPE: a table of cos/sin (or complex) values by position that rotates pairs of the
    queries' and keys' channels on their way to the attention scores.

    Attributes:
        module: the module that makes the table (traced: the module that returns it, holds it
            as a buffer, or computes its cos/sin in its own forward, ``""`` for the model
            itself; named: a module named ``*rotary_emb`` or of a class named like
            ``Rotary``; declared: any module the declaration names).
        how: ``declared``, ``traced`` or ``named``.
        attention: the attention modules whose queries or keys it rotates (traced), in the
            order they ran; [] when not traced.
        channels: channels rotated per head, 2 × the distinct frequencies of the table
            (traced), or None.
        detail: the evidence, in words.
    """

    module: str
    how: str
    attention: list[str] = field(default_factory=list)
    channels: int | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "how": self.how, "attention": list(self.attention),
                "channels": self.channels, "detail": self.detail}


@dataclass
class Roles:
    """Every role of one model (:func:`hooks.modelroles.find_roles`).

    Attributes:
        attention: the attention modules, in the order they ran (traced) or appear.
        lm_head: the Linear whose output is the logits, or None.
        final_norm: the last norm before the LM head, or None.
        moe: the MoE blocks.
        notes: what the reader should know: where the trace and the names disagree, why the
            forward could not be traced, what the trace could not tell.
        traced: whether one forward was traced (False: declared and named roles only).
        trace_error: the exception the traced forward raised, or None (its message is in
            ``notes``; kept so a command can locate it in the model's code).
        norms: every normalisation module (LayerNorm, RMSNorm, one's own): a module without
            children whose forward ran ``layer_norm``, ``rms_norm`` or ``rsqrt`` (traced), a
            class named like a norm (named), the declared final norm; in module order.
        rotary: every RoPE table (:class:`Rotary`): declared, traced (a position table that
            rotates the queries or keys between their projection and the scores), named; in
            module order.
    """

    attention: list[AttentionRole] = field(default_factory=list)
    lm_head: Found | None = None
    final_norm: Found | None = None
    moe: list[MoERole] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    traced: bool = False
    trace_error: BaseException | None = field(default=None, repr=False, compare=False)
    norms: list[Found] = field(default_factory=list)
    rotary: list[Rotary] = field(default_factory=list)

    def attention_of(self, name: str) -> AttentionRole | None:
        """The attention role of module ``name``, or None."""
        return next((a for a in self.attention if a.name == name), None)

    def moe_of(self, name: str) -> MoERole | None:
        """The MoE block that module ``name`` is, or whose experts or router it is, or None."""
        return next((m for m in self.moe if name in (m.name, m.experts, m.router)), None)

    def to_dict(self) -> dict[str, Any]:
        return {"attention": [a.to_dict() for a in self.attention],
                "lm_head": self.lm_head.to_dict() if self.lm_head else None,
                "final_norm": self.final_norm.to_dict() if self.final_norm else None,
                "moe": [m.to_dict() for m in self.moe], "notes": list(self.notes),
                "traced": self.traced, "norms": [n.to_dict() for n in self.norms],
                "rotary": [r.to_dict() for r in self.rotary]}
