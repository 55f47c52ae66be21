"""The variants of ``mdb ablate``: seed 000's controlled-variable experiment as configs.

Seed 000's fourth next step fixes everything but one architectural choice — MHA / GQA / MQA,
RoPE / learned positions, MoE / one FFN — and its fifth extends RoPE past the training length.
:func:`expand_variants` turns ``--vary`` specs into the configs of that experiment: each
variant starts from one base config and changes only its own field(s); several ``--vary``
combine as a cartesian product. Bad input raises :class:`AblateError` with one line, before
anything is built or written.

The named ablations (anything else is a :class:`minillm.MiniLLMConfig` field, e.g.
``num_key_value_heads=1,2,4``):

=================  ==========================================================================
``attention``      ``mha``: Hkv = H; ``mqa``: Hkv = 1; ``gqa``: the base's Hkv when it lies
                   strictly between 1 and H, else the smallest divisor of H above 1 (H = 8: 2,
                   seed 000's test B)
``positions``      ``rope`` or ``learned`` (``position_embedding``; learned positions drop the
                   base's ``rope_scaling``, which only RoPE has)
``ffn``            ``dense``: ``num_local_experts = 0`` (one SwiGLU of the same width I);
                   ``moe``: the base's experts, or 4 experts top-2 from a dense base
``rope_scaling``   ``none``, ``linear`` (position interpolation, every position divided by the
                   factor, in training too), ``dynamic`` (dynamic NTK: unchanged up to the
                   original length, which is the training length T, then a base that grows with
                   the length), factor = longest evaluation length / T
=================  ==========================================================================

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from hooks.store.store import RunStoreError, validate_run_name
from minillm import MiniLLMConfig

__all__ = [
    "ABLATIONS",
    "AblateError",
    "Vary",
    "Variant",
    "eval_lengths_for",
    "expand_variants",
    "parse_vary",
]

#: The named ablations and their values.
ABLATIONS: dict[str, tuple[str, ...]] = {
    "attention": ("mha", "gqa", "mqa"),
    "positions": ("rope", "learned"),
    "ffn": ("moe", "dense"),
    "rope_scaling": ("none", "linear", "dynamic"),
}
#: Most variants one ablation may have (each is a training process).
MAX_VARIANTS = 64
#: Fields that cannot be varied directly (derived, or tables).
_NOT_VARIABLE = {"rope_scaling", "head_dim"}


class AblateError(ValueError):
    """Bad ``--vary`` input or a variant that is no valid config (one line)."""


@dataclass(frozen=True)
class Vary:
    """One ``--vary FIELD=V1,V2,...``: a named ablation or a config field, and its values."""

    field: str
    values: tuple[str, ...]


@dataclass
class Variant:
    """One configuration of the experiment.

    Attributes:
        name: The run's name: the prefix, then ``field=value`` per varied field joined by
            ``+`` (``abl-attention=mha``, ``abl-attention=mha+ffn=dense``).
        label: The same without the prefix.
        choices: ``{field: value}`` as given on the command line.
        changes: The config fields this variant sets, ``{field: value}``.
        config: The variant's validated :class:`MiniLLMConfig`.
    """

    name: str
    label: str
    choices: dict[str, str]
    changes: dict[str, Any]
    config: MiniLLMConfig = field(repr=False)


def parse_vary(text: str) -> Vary:
    """``"attention=mha,gqa"`` → ``Vary("attention", ("mha", "gqa"))``.

    Raises:
        AblateError: no ``=``, an unknown field, an empty or repeated value, or a named
            ablation's unknown value (the message lists the known ones).
    """
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise AblateError(f"--vary {text!r}: write FIELD=VALUE,VALUE (e.g. attention=mha,gqa,mqa)")
    values = tuple(v.strip() for v in rest.split(","))
    if not rest.strip() or any(not v for v in values):
        raise AblateError(f"--vary {text!r}: empty value; write {name}=VALUE,VALUE")
    if len(set(values)) != len(values):
        raise AblateError(f"--vary {text!r}: a value is given twice")
    if name in ABLATIONS:
        unknown = [v for v in values if v not in ABLATIONS[name]]
        if unknown:
            raise AblateError(f"--vary {name}: unknown value {unknown[0]!r}; choose from "
                              f"{', '.join(ABLATIONS[name])}")
        return Vary(name, values)
    fields = {f for f in MiniLLMConfig().to_dict()} - _NOT_VARIABLE
    if name not in fields:
        raise AblateError(
            f"--vary {name}: not an ablation ({', '.join(ABLATIONS)}) nor a config field "
            f"({', '.join(sorted(fields))})")
    return Vary(name, values)


def _parse_field(base: MiniLLMConfig, name: str, text: str) -> Any:
    current = getattr(base, name)
    try:
        if isinstance(current, bool):
            if text.lower() not in ("true", "false"):
                raise ValueError
            return text.lower() == "true"
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
    except ValueError:
        kind = "true or false" if isinstance(current, bool) else type(current).__name__
        raise AblateError(f"--vary {name}: {text!r} is not {kind}") from None
    return text


def _gqa_heads(base: MiniLLMConfig) -> int:
    h, kv = base.num_attention_heads, base.num_key_value_heads
    if 1 < kv < h:
        return kv
    for d in range(2, h):
        if h % d == 0:
            return d
    raise AblateError(f"--vary attention=gqa: {h} query heads have no KV-head count strictly "
                      f"between 1 and {h}; choose a config with more heads")


def _changes(base: MiniLLMConfig, name: str, value: str, seq_len: int,
             factor: float) -> dict[str, Any]:
    if name == "attention":
        kv = {"mha": base.num_attention_heads, "mqa": 1}.get(value) or _gqa_heads(base)
        return {"num_key_value_heads": kv}
    if name == "positions":
        if value == "learned":
            return {"position_embedding": "learned", "rope_scaling": None}
        return {"position_embedding": "rope"}
    if name == "ffn":
        if value == "dense":
            return {"num_local_experts": 0}
        if base.num_local_experts:
            return {"num_local_experts": base.num_local_experts,
                    "num_experts_per_tok": base.num_experts_per_tok}
        return {"num_local_experts": 4, "num_experts_per_tok": 2}
    if name == "rope_scaling":
        if value == "none":
            return {"rope_scaling": None}
        return {"rope_scaling": {"rope_type": value, "factor": float(factor),
                                 "original_max_position_embeddings": int(seq_len)}}
    return {name: _parse_field(base, name, value)}


def eval_lengths_for(varies: list[Vary], seq_len: int) -> list[int]:
    """The held-out lengths each variant is evaluated at: T, 2T and 4T when ``rope_scaling``
    is varied (the length-extrapolation study), else T."""
    if any(v.field == "rope_scaling" for v in varies):
        return [seq_len, 2 * seq_len, 4 * seq_len]
    return [seq_len]


def expand_variants(base: MiniLLMConfig, varies: list[Vary], *, prefix: str = "abl-",
                    seq_len: int, eval_lengths: list[int] | None = None) -> list[Variant]:
    """Every combination of the ``varies`` values, as validated configs.

    Each variant is ``base`` with its fields changed; when the longest evaluation length
    exceeds the base's ``max_position_embeddings`` every variant gets that length (all alike,
    so they still differ only in the varied fields).

    Args:
        base: The config the variants start from (``vocab_size`` as trained).
        varies: The parsed ``--vary`` options, in order (the name follows it).
        prefix: Prefix of the run names.
        seq_len: T, the training length (the original length of ``rope_scaling`` variants).
        eval_lengths: Held-out lengths (default :func:`eval_lengths_for`); the RoPE scaling
            factor is the longest over T.

    Raises:
        AblateError: no ``--vary``, a field varied twice, too many variants, a run name that
            is not valid, or a variant that is no valid config (which one and why).
    """
    if not varies:
        raise AblateError("give at least one --vary FIELD=VALUE,VALUE (e.g. attention=mha,gqa)")
    names = [v.field for v in varies]
    for n in names:
        if names.count(n) > 1:
            raise AblateError(f"--vary {n} is given twice; list all its values in one --vary")
    total = 1
    for v in varies:
        total *= len(v.values)
    if total > MAX_VARIANTS:
        raise AblateError(f"{total} variants (at most {MAX_VARIANTS}); vary fewer values")
    lengths = eval_lengths or eval_lengths_for(varies, seq_len)
    longest = max(lengths + [seq_len])
    if longest > base.max_position_embeddings:
        base = base.replace(max_position_embeddings=longest)
    factor = max(1.0, longest / seq_len)
    out = []
    for combo in itertools.product(*(v.values for v in varies)):
        choices = dict(zip(names, combo, strict=True))
        changes: dict[str, Any] = {}
        for n, value in choices.items():
            changes.update(_changes(base, n, value, seq_len, factor))
        label = "+".join(f"{n}={value}" for n, value in choices.items())
        name = f"{prefix}{label}"
        try:
            validate_run_name(name)
        except RunStoreError as exc:
            raise AblateError(str(exc)) from None
        try:
            config = base.replace(**changes)
        except ValueError as exc:
            raise AblateError(f"variant {label}: {exc}") from None
        out.append(Variant(name, label, choices, changes, config))
    return out
