"""`MiniLLMConfig`: one dataclass with Hugging Face's Llama/Mixtral field names.

Derived fields are computed and every field validated in ``__post_init__``; each problem raises
one ``ValueError`` that names the field and the fix. Configs load from presets
(:mod:`minillm.presets`) and from TOML files (``MiniLLMConfig.from_toml``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

POSITION_EMBEDDINGS = ("rope", "learned")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
ROPE_SCALING_TYPES = ("linear", "dynamic")


def default_intermediate_size(hidden_size: int, multiple_of: int = 128) -> int:
    """SwiGLU hidden width: 8/3 · D rounded up to a multiple of ``multiple_of``.

    The 8/3 keeps a three-matrix SwiGLU at the parameter count of a 4·D two-matrix MLP
    (Shazeer 2020, "GLU Variants Improve Transformer"); seed 000 rounds up to 128.
    ``default_intermediate_size(256) == 768``.
    """
    width = int(8 * hidden_size / 3)
    return multiple_of * math.ceil(width / multiple_of)


@dataclass
class MiniLLMConfig:
    """Hyper-parameters of a :class:`minillm.MiniLLM`, with Hugging Face field names.

    The defaults are seed 000's default model: V=1000, D=256, 4 layers, 8 query heads, 2 KV
    heads, 8 experts with top-2 routing, SwiGLU width 768 (19,796,224 parameters, the same
    count as a HF ``MixtralForCausalLM`` of the same config with tied embeddings).

    Attributes:
        vocab_size: V, number of token ids.
        hidden_size: D, the residual stream width.
        intermediate_size: SwiGLU width I; ``None`` derives 8/3·D rounded up to 128.
        num_hidden_layers: L, decoder layers.
        num_attention_heads: H, query heads; head_dim = D / H must be even (RoPE pairs).
        num_key_value_heads: KV heads; H must be a multiple. H = MHA, 1 = MQA, between = GQA.
        num_local_experts: E, experts per MoE layer; 0 makes every layer a dense SwiGLU MLP.
        num_experts_per_tok: k, experts each token is routed to (1..E).
        max_position_embeddings: longest sequence the model accepts (the RoPE table length,
            or the learned position table's size). Longer inputs raise ``ValueError``.
        rms_norm_eps: epsilon inside RMSNorm's square root.
        rope_theta: RoPE base θ (10,000 as in RoFormer; Llama 3 uses 500,000).
        rope_scaling: ``None`` or ``{"rope_type": "linear" | "dynamic", "factor": f}`` (a finite
            f in [1, max_position_embeddings]) with an optional positive integer
            ``"original_max_position_embeddings"`` (default: max_position_embeddings / f).
            ``linear`` is position interpolation (Chen et al. 2023, arXiv:2306.15595): every
            position is divided by f. ``dynamic`` is dynamic NTK scaling (as HF's
            ``_compute_dynamic_ntk_parameters``): up to the original length RoPE is unchanged;
            beyond it θ grows with the sequence length.
        position_embedding: ``"rope"`` (rotary, in attention) or ``"learned"`` (a GPT-2 style
            table added to the token embeddings; an ablation).
        router_aux_loss_coef: weight of the load-balancing loss in ``loss``.
        tie_word_embeddings: share the LM head's weight with ``embed_tokens``.
        initializer_range: std of the N(0, σ²) init of embeddings and linear layers.
        attention_dropout: dropout on attention probabilities in training.
        attn_implementation: ``"sdpa"`` (``F.scaled_dot_product_attention``) or ``"eager"``
            (explicit softmax; returns probabilities, for the debugger).
        hidden_act: only ``"silu"`` (SwiGLU) is supported.
    """

    vocab_size: int = 1000
    hidden_size: int = 256
    intermediate_size: int | None = None
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    position_embedding: str = "rope"
    router_aux_loss_coef: float = 0.01
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    attention_dropout: float = 0.0
    attn_implementation: str = "sdpa"
    hidden_act: str = "silu"
    head_dim: int = field(init=False)

    def __post_init__(self) -> None:
        if self.intermediate_size is None:
            self.intermediate_size = default_intermediate_size(self.hidden_size)
        self._validate()
        self.head_dim = self.hidden_size // self.num_attention_heads

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.num_local_experts, int) or self.num_local_experts < 0:
            raise ValueError(
                f"num_local_experts must be 0 (dense MLP) or a positive integer, "
                f"got {self.num_local_experts!r}"
            )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}); pick a head count that divides it"
            )
        head_dim = self.hidden_size // self.num_attention_heads
        if self.position_embedding == "rope" and head_dim % 2 != 0:
            raise ValueError(
                f"head_dim = hidden_size / num_attention_heads = {head_dim} is odd; RoPE rotates "
                f"dimension pairs, so choose hidden_size and num_attention_heads with an even ratio"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}); each KV head serves a whole "
                f"group of query heads"
            )
        if self.num_local_experts > 0 and not (
            1 <= self.num_experts_per_tok <= self.num_local_experts
        ):
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_local_experts ({self.num_local_experts})"
            )
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"position_embedding must be one of {POSITION_EMBEDDINGS}, "
                f"got {self.position_embedding!r}"
            )
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, "
                f"got {self.attn_implementation!r}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {self.hidden_act!r}")
        if not isinstance(self.num_experts_per_tok, int) or isinstance(
                self.num_experts_per_tok, bool):
            raise ValueError(
                f"num_experts_per_tok must be an integer, got {self.num_experts_per_tok!r}")
        for name, lo, lo_ok, hi in (("rms_norm_eps", 0.0, False, None),
                                    ("rope_theta", 0.0, False, None),
                                    ("router_aux_loss_coef", 0.0, True, None),
                                    ("initializer_range", 0.0, False, None),
                                    ("attention_dropout", 0.0, True, 1.0)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if (value < lo if lo_ok else value <= lo) or (hi is not None and value >= hi):
                rng = (f"in [{lo:g}, {hi:g})" if hi is not None
                       else (">= 0" if lo_ok else "positive"))
                raise ValueError(f"{name} must be {rng}, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be true or false, got "
                             f"{self.tie_word_embeddings!r}")
        if self.rope_scaling is not None:
            self._validate_rope_scaling()

    def _validate_rope_scaling(self) -> None:
        rs = self.rope_scaling
        if not isinstance(rs, dict):
            raise ValueError(
                "rope_scaling must be a table like {rope_type = 'linear', factor = 2.0}"
            )
        kind = rs.get("rope_type", rs.get("type"))
        if kind not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type must be one of {ROPE_SCALING_TYPES}, got {kind!r}"
            )
        factor = rs.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) \
                or not math.isfinite(factor) or factor < 1:
            raise ValueError(f"rope_scaling.factor must be a finite number >= 1, got {factor!r}")
        if self.position_embedding != "rope":
            raise ValueError("rope_scaling needs position_embedding = 'rope'")
        unknown = set(rs) - {"rope_type", "type", "factor", "original_max_position_embeddings"}
        if unknown:
            raise ValueError(f"rope_scaling has unknown keys {sorted(unknown)}")
        if factor > self.max_position_embeddings:
            raise ValueError(
                f"rope_scaling.factor ({factor:g}) must be at most max_position_embeddings "
                f"({self.max_position_embeddings}): the original context it stretches, "
                f"max_position_embeddings / factor, keeps at least one position")
        orig = rs.get("original_max_position_embeddings")
        if orig is not None and (not isinstance(orig, int) or isinstance(orig, bool)
                                 or orig <= 0):
            raise ValueError(f"rope_scaling.original_max_position_embeddings must be a "
                             f"positive integer, got {orig!r}")
        if kind == "dynamic" and self.hidden_size // self.num_attention_heads < 4:
            raise ValueError("dynamic rope_scaling needs head_dim = hidden_size / "
                             "num_attention_heads of at least 4 (its θ grows with the exponent "
                             "head_dim / (head_dim - 2))")

    # ------------------------------------------------------------------ derived
    @property
    def num_key_value_groups(self) -> int:
        """Query heads per KV head (``n_rep``): query head h reads KV head h // n_rep."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_moe(self) -> bool:
        """True when the MLPs are top-k mixtures of experts (``num_local_experts > 0``)."""
        return self.num_local_experts > 0

    @property
    def rope_scaling_type(self) -> str | None:
        """``"linear"``, ``"dynamic"`` or ``None``."""
        if not self.rope_scaling:
            return None
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))

    @property
    def original_max_position_embeddings(self) -> int:
        """The context length the RoPE frequencies were trained for (before scaling)."""
        if not self.rope_scaling:
            return self.max_position_embeddings
        orig = self.rope_scaling.get("original_max_position_embeddings")
        if orig is None:
            orig = int(self.max_position_embeddings / float(self.rope_scaling["factor"]))
        return int(orig)

    def parameter_count(self) -> int:
        """Parameters the model of this config has, computed from the fields alone (before
        anything is allocated; equals ``MiniLLM(config).num_parameters()``).

        Embedding V·D (+ V·D untied LM head, + P·D learned positions); per layer two RMSNorm
        weights 2·D, attention D·H·Dh + 2·D·Hkv·Dh + H·Dh·D, and either a router D·E plus E
        SwiGLU experts of 3·D·I or one SwiGLU MLP 3·D·I; the final norm D.
        """
        d, v, h, kv, hd = (self.hidden_size, self.vocab_size, self.num_attention_heads,
                           self.num_key_value_heads, self.hidden_size // self.num_attention_heads)
        i = self.intermediate_size
        mlp = (d * self.num_local_experts + self.num_local_experts * 3 * d * i
               if self.num_local_experts else 3 * d * i)
        layer = 2 * d + d * h * hd + 2 * d * kv * hd + h * hd * d + mlp
        total = v * d + self.num_hidden_layers * layer + d
        if not self.tie_word_embeddings:
            total += v * d
        if self.position_embedding == "learned":
            total += self.max_position_embeddings * d
        return total

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """The constructor arguments as a JSON/TOML-friendly dict (derived fields excluded)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MiniLLMConfig:
        """Build a config from a dict of field names; unknown keys raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(
                f"unknown config field(s) {', '.join(unknown)}; known fields: "
                f"{', '.join(sorted(names))}"
            )
        for key, value in data.items():
            if key in {"rope_scaling"}:
                continue
            if isinstance(value, (dict, list)):
                raise ValueError(f"config field {key} must be a single value, got {value!r}")
        return cls(**data)

    @classmethod
    def from_toml(cls, path: str | Path) -> MiniLLMConfig:
        """Load a config from a TOML file of top-level field names (``[rope_scaling]`` table).

        Raises:
            FileNotFoundError: the file does not exist.
            ValueError: the file is not valid TOML or a field is unknown or invalid.
        """
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path} is not valid TOML: {exc}") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 text") from None
        data.pop("description", None)
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> MiniLLMConfig:
        """A copy with ``changes`` applied and validated again."""
        data = self.to_dict()
        data.update(changes)
        return type(self).from_dict(data)
