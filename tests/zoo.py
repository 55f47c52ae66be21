"""A zoo of deliberately broken minillm variants, one per mistake the doctor must catch.

Built in the tests only (never in the product) by swapping a module's class for a subclass
with a broken ``forward`` (``module.__class__ = Broken``: weights stay), by replacing a
submodule, or by a state-dict round trip. Every builder returns ``(model, batch)`` like a
``--model module:function`` factory, on the ``tiny`` preset (V=256, D=32, 2 layers, H=4,
Hkv=2, 4 experts top-2, 128 positions) with a (2, 64) batch.

:data:`EXPECTED` says which checks each variant must fail, and which co-failures are inherent.
:data:`EXPECTED_OTHER` holds broken variants of models that are not minillm (a nanoGPT, HF
Llama, HF Mixtral; the HF ones need ``transformers``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minillm import MiniLLM
from minillm.attention import MiniLLMAttention, causal_mask
from minillm.layers import MiniLLMRMSNorm, MiniLLMRotaryEmbedding, apply_rotary_pos_emb
from minillm.moe import load_balancing_loss
from tests.models import SEQ, batch_for, tiny  # noqa: F401  (the zoo's size; re-exported)


# -- attention variants ------------------------------------------------------------------------
class _EagerAttention(MiniLLMAttention):
    """An eager attention with hooks for the broken variants below (same weights)."""

    def _kv(self, k, v):
        n = self.num_key_value_groups
        return k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)

    def _mask(self, t, s, device):
        return causal_mask(t, s, device)

    def _rope(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)

    def _softmax(self, scores):
        return torch.softmax(scores.float(), dim=-1).to(scores.dtype)

    def forward(self, hidden_states, position_embeddings=None, past_key_value=None,
                use_cache=False):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, self.num_key_value_heads,
                                            self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, self.num_key_value_heads,
                                            self.head_dim).transpose(1, 2)
        if position_embeddings is not None:
            q, k = self._rope(q, k, *position_embeddings)
        k, v = self._kv(k, v)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        mask = self._mask(t, t, hidden_states.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = self._softmax(scores)
        out = torch.matmul(probs.to(v.dtype), v).transpose(1, 2).reshape(b, t, -1)
        weights = probs if self.return_attn_weights else None
        return self.o_proj(out), weights, None


class RepeatAttention(_EagerAttention):
    """Seed 003's GQA bug: ``repeat`` tiles the KV heads, so query head h reads h % Hkv."""

    def _kv(self, k, v):
        n = self.num_key_value_groups
        return k.repeat(1, n, 1, 1), v.repeat(1, n, 1, 1)


class NoMaskAttention(_EagerAttention):
    """The causal mask dropped: every position attends to the whole sequence."""

    def _mask(self, t, s, device):
        return None


class InvertedMaskAttention(_EagerAttention):
    """The mask on the wrong side of the diagonal: position i sees j ≥ i only."""

    def _mask(self, t, s, device):
        return causal_mask(t, s, device).T.contiguous()


class HalfSoftmaxAttention(_EagerAttention):
    """Softmax asked for in the scores' dtype (``dtype=scores.dtype``: bf16 under autocast,
    which no autocast rule changes) instead of fp32. (A plain ``softmax(scores)`` is nanoGPT's
    eager path: CUDA autocast runs it in fp32, so it is not a mistake.)"""

    def _softmax(self, scores):
        return torch.softmax(scores, dim=-1, dtype=scores.dtype)


class QOnlyRopeAttention(_EagerAttention):
    """RoPE applied to the queries only: scores no longer depend on the key's position."""

    def _rope(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)[0], k


def _swap_attention(model: MiniLLM, cls: type) -> MiniLLM:
    for layer in model.model.layers:
        layer.self_attn.__class__ = cls
    return model


def gqa_repeat():
    """``repeat`` instead of ``repeat_interleave`` for the KV heads."""
    m = _swap_attention(tiny(), RepeatAttention)
    return m, batch_for(m)


def no_causal_mask():
    """The causal mask dropped."""
    m = _swap_attention(tiny(), NoMaskAttention)
    return m, batch_for(m)


def inverted_mask():
    """The causal mask inverted (future visible, past hidden)."""
    m = _swap_attention(tiny(), InvertedMaskAttention)
    return m, batch_for(m)


def rope_q_only():
    """Keys left unrotated."""
    m = _swap_attention(tiny(), QOnlyRopeAttention)
    return m, batch_for(m)


def bf16_softmax():
    """Attention softmax without the fp32 upcast."""
    m = _swap_attention(tiny(), HalfSoftmaxAttention)
    return m, batch_for(m)


# -- init / tying ------------------------------------------------------------------------------
def std1_tied_init():
    """Seed 000's init: the tied embedding keeps ``nn.Embedding``'s N(0, 1)."""
    m = tiny()
    with torch.no_grad():
        nn.init.normal_(m.model.embed_tokens.weight, 0.0, 1.0)
    return m, batch_for(m)


def untied_by_assign():
    """A state-dict round trip with ``load_state_dict(assign=True)``: each key becomes its own
    Parameter, so ``lm_head`` and ``embed_tokens`` stop sharing storage (values still equal)."""
    m = tiny()
    state = {k: v.detach().clone() for k, v in m.state_dict().items()}
    m.load_state_dict(state, assign=True)
    return m, batch_for(m)


# -- MoE ---------------------------------------------------------------------------------------
class DetachedAuxMiniLLM(MiniLLM):
    """The aux loss computed from detached router logits: it no longer trains the router."""

    def forward(self, input_ids, labels=None, past_key_values=None, use_cache=False,
                output_attentions=False):
        out = super().forward(input_ids, labels=None, past_key_values=past_key_values,
                              use_cache=use_cache, output_attentions=output_attentions)
        cfg = self.config
        aux = cfg.router_aux_loss_coef * sum(
            load_balancing_loss(r.detach(), cfg.num_local_experts, cfg.num_experts_per_tok)
            for r in out.router_logits
        )
        out.aux_loss = aux
        if labels is not None:
            v = out.logits.shape[-1]
            out.ce_loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, v).float(),
                                          labels[:, 1:].reshape(-1))
            out.loss = out.ce_loss + aux
        return out


def aux_detached():
    m = tiny()
    m.__class__ = DetachedAuxMiniLLM
    return m, batch_for(m)


DEAD_LAYER, DEAD_EXPERT = 1, 2


def dead_expert():
    """A router whose bias pushes one expert's logit down by 30: it never wins a token."""
    m = tiny()
    block = m.model.layers[DEAD_LAYER].mlp
    old = block.gate
    gate = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        gate.weight.copy_(old.weight)
        gate.bias.zero_()
        gate.bias[DEAD_EXPERT] = -30.0
    block.gate = gate
    return m, batch_for(m)


# -- positions ---------------------------------------------------------------------------------
SHORT_TABLE = 64


def short_rope_table():
    """A RoPE table built for 64 positions while max_position_embeddings is 128."""
    m = tiny()
    rot = m.model.rotary_emb
    rot.cos_cached = rot.cos_cached[:SHORT_TABLE].clone()
    rot.sin_cached = rot.sin_cached[:SHORT_TABLE].clone()
    return m, batch_for(m)


class WrappedRotary(MiniLLMRotaryEmbedding):
    """A RoPE table of 64 positions indexed modulo its length: no error, wrong angles."""

    def forward(self, position_ids):
        return super().forward(position_ids % SHORT_TABLE)


def wrapped_rope_table():
    m = tiny()
    m.model.rotary_emb.__class__ = WrappedRotary
    return m, batch_for(m)


# -- numerics ----------------------------------------------------------------------------------
class NaNRMSNorm(MiniLLMRMSNorm):
    """``x / sqrt(mean(x²) - 1)``: a sign slip that takes the root of a negative number."""

    def forward(self, hidden_states):
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) - 1.0)
        return self.weight * x.to(hidden_states.dtype)


NAN_MODULE = "model.layers.1.post_attention_layernorm"


def nan_layer():
    m = tiny()
    m.model.layers[1].post_attention_layernorm.__class__ = NaNRMSNorm
    return m, batch_for(m)


class HalfStatsRMSNorm(MiniLLMRMSNorm):
    """RMSNorm computing mean(x²) and rsqrt in the input dtype (no fp32 upcast)."""

    def forward(self, hidden_states):
        x = hidden_states
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                              + self.variance_epsilon))


def bf16_norm_stats():
    m = tiny()
    for mod in m.modules():
        if isinstance(mod, MiniLLMRMSNorm):
            mod.__class__ = HalfStatsRMSNorm
    return m, batch_for(m)


def frozen_body():
    """Every weight frozen but the final norm: nothing else can learn, so the batch cannot be
    memorised (gradient flow reports the frozen tensors as frozen, not broken)."""
    m = tiny()
    for name, p in m.named_parameters():
        p.requires_grad_(name == "model.norm.weight")
    return m, batch_for(m)


def correct():
    """The unmodified tiny minillm."""
    m = tiny()
    return m, batch_for(m)


#: variant -> (checks that must fail, {check: why it also fails inherently}, module to name)
EXPECTED: dict[str, tuple[set[str], dict[str, str], str | None]] = {
    "correct": (set(), {}, None),
    "gqa_repeat": ({"gqa"}, {}, "model.layers.0.self_attn"),
    "no_causal_mask": ({"causality"}, {}, "model.layers.0.self_attn"),
    "inverted_mask": ({"causality"}, {}, "model.layers.0.self_attn"),
    "std1_tied_init": ({"init-loss"}, {"init": "the init report names the same N(0, 1) "
                                               "embedding against initializer_range"}, "lm_head"),
    "aux_detached": ({"grad-flow"}, {}, "model.layers.0.mlp.gate"),
    "short_rope_table": ({"rope"}, {}, "model.rotary_emb"),
    "wrapped_rope_table": ({"rope"}, {}, "model.rotary_emb"),
    "rope_q_only": ({"rope"}, {}, "model.layers.0.self_attn"),
    "dead_expert": ({"routing"}, {}, f"model.layers.{DEAD_LAYER}.mlp"),
    "nan_layer": ({"nonfinite"}, {"grad-flow": "NaN activations give NaN gradients"},
                  NAN_MODULE),
    "untied_by_assign": ({"tied"}, {}, "lm_head"),
    "bf16_norm_stats": ({"numerics"}, {}, "model.layers.0.input_layernorm"),
    "bf16_softmax": ({"numerics"}, {}, "model.layers.0.self_attn"),
}

#: Variants only the slow overfit check catches (run with ``overfit=True``).
EXPECTED_OVERFIT: dict[str, tuple[set[str], dict[str, str], str | None]] = {
    "frozen_body": ({"overfit"}, {}, None),
}

BUILDERS = {
    "correct": correct,
    "gqa_repeat": gqa_repeat,
    "no_causal_mask": no_causal_mask,
    "inverted_mask": inverted_mask,
    "std1_tied_init": std1_tied_init,
    "aux_detached": aux_detached,
    "short_rope_table": short_rope_table,
    "wrapped_rope_table": wrapped_rope_table,
    "rope_q_only": rope_q_only,
    "dead_expert": dead_expert,
    "nan_layer": nan_layer,
    "untied_by_assign": untied_by_assign,
    "bf16_norm_stats": bf16_norm_stats,
    "bf16_softmax": bf16_softmax,
    "frozen_body": frozen_body,
}



# -- broken models that are not minillm ------------------------------------------------------
def nanogpt_no_mask():
    """A nanoGPT-style model (``(idx, targets)``, ``(logits, loss)``) whose attention calls
    SDPA with ``is_causal=False``: every position sees the whole sequence."""
    from tests.families import nanogpt

    return nanogpt(causal=False)


def _tiled_llama_attention():
    from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

    class TiledRepeatLlamaAttention(LlamaAttention):
        """HF ``LlamaAttention`` with ``repeat_kv`` replaced by seed 003's tiled
        ``k.repeat(1, n_rep, 1, 1)``: query head h reads KV head h % Hkv."""

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                    cache=None, **kwargs):
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
            k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
            v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
            if cache is not None:  # keeps the KV cache as HF's does: only the GQA bug remains
                k, v = cache.update(k, v, self.layer_idx)
            n = self.num_key_value_groups
            k, v = k.repeat(1, n, 1, 1), v.repeat(1, n, 1, 1)  # the bug: tiles the KV heads
            mask = attention_mask[..., : k.shape[-2]] if attention_mask is not None else None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                                 is_causal=mask is None and q.shape[2] > 1)
            out = out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
            return self.o_proj(out), None

    return TiledRepeatLlamaAttention


def llama_tiled_repeat_kv():
    """HF Llama (H=4, Hkv=2) whose attention expands KV heads with a tiled repeat."""
    from tests.families import hf_llama

    model, batch = hf_llama()
    cls = _tiled_llama_attention()
    for layer in model.model.layers:
        layer.self_attn.__class__ = cls
    return model, batch


def mixtral_detached_router():
    """HF Mixtral whose router returns detached logits: the top-k weights and the aux loss are
    computed from them, so no loss reaches the router's weight."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    from tests.families import hf_mixtral

    class DetachedRouter(MixtralTopKRouter):
        def forward(self, hidden_states):
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            logits = F.linear(hidden_states, self.weight).detach()  # the bug
            probs = torch.softmax(logits.float(), dim=-1)
            top, idx = torch.topk(probs, self.top_k, dim=-1)
            return logits, top / top.sum(dim=-1, keepdim=True), idx

    model, batch = hf_mixtral()
    for layer in model.model.layers:
        layer.mlp.gate.__class__ = DetachedRouter
    return model, batch


#: broken non-minillm variant -> (builder, checks that must fail, module to name, needs HF)
EXPECTED_OTHER: dict[str, tuple[Any, set[str], str | None, bool]] = {
    "nanogpt_no_mask": (nanogpt_no_mask, {"causality"}, "transformer.h.0.attn", False),
    "llama_tiled_repeat_kv": (llama_tiled_repeat_kv, {"gqa"}, "model.layers.0.self_attn", True),
    "mixtral_detached_router": (mixtral_detached_router, {"grad-flow"},
                                "model.layers.0.mlp.gate", True),
}
