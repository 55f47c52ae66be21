"""The decoder-only model: pre-norm blocks of GQA attention and a SwiGLU MLP or MoE.

Module names are Hugging Face's, so ``model.layers.0.self_attn.q_proj.weight`` and
``model.layers.0.mlp.gate.weight`` mean what they mean in ``MixtralForCausalLM``.

Dimension legend: B batch, T sequence, D hidden size, V vocabulary, E experts, N = B·T.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from minillm.attention import KVCache, MiniLLMAttention, padding_attention_mask
from minillm.config import MiniLLMConfig
from minillm.convert import config_from_hf, state_dict_from_hf
from minillm.layers import MiniLLMRMSNorm, MiniLLMRotaryEmbedding
from minillm.moe import MiniLLMMLP, MiniLLMSparseMoeBlock, load_balancing_loss


@dataclass
class MiniLLMOutput:
    """What :meth:`MiniLLM.forward` returns.

    Attributes:
        logits: (B, T, V) next-token logits.
        loss: ce_loss + aux_loss (scalar) when labels were given, else None.
        ce_loss: mean cross-entropy over the shifted, non-ignored labels (nats), or None.
        aux_loss: ``router_aux_loss_coef · Σ_layers load_balancing_loss`` (scalar; zero for
            a dense model). Perfectly balanced routing gives coef × number of MoE layers.
        aux_losses: (L_moe,) per-layer load-balancing losses, without the coefficient.
        router_logits: one (N, E) tensor per MoE layer.
        past_key_values: one (keys, values) pair per layer when ``use_cache``, a
            :class:`PastKeyValues` (a tuple that also carries the ids).
        attentions: one (B, H, T, S) probability tensor per layer when ``output_attentions``.
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    aux_losses: torch.Tensor | None = None
    router_logits: tuple[torch.Tensor, ...] = field(default_factory=tuple)
    past_key_values: tuple[KVCache, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class PastKeyValues(tuple):
    """The KV cache :meth:`MiniLLM.forward` returns with ``use_cache``: one ``(keys, values)``
    pair per layer, each (B, Hkv, S, Dh) with keys already rotated — a plain tuple of them, as
    before — plus the token ids it was computed from.

    The ids are what makes the cache exact for dynamic-NTK RoPE (``rope_scaling`` of type
    ``dynamic``). Its rotation base depends on the sequence length S once S exceeds the
    original length L, so a longer sequence rotates *every* position differently. Caching keys
    before rotation would fix only the first layer: the hidden states after the first
    attention layer, and hence the keys and values of every later layer, depend on S as well
    (measured: a 2-layer model's layer-0 output at position 7 changes by 0.16 between S = 8
    and S = 9 when L = 8). So past L nothing cached can be reused, and a dynamic-NTK model
    handed a cache recomputes the whole sequence from these ids: a cached decode equals full
    recomputation (at the cost of full recomputation) instead of drifting from it. Within L,
    and for every other position scheme, the cache is used as usual.

    Attributes:
        input_ids: (B, S) int64, the ids of every cached position (``None`` when the cache was
            extended from a plain tuple whose ids were not known).
    """

    input_ids: torch.Tensor | None

    def __new__(cls, layers, input_ids: torch.Tensor | None = None) -> PastKeyValues:
        self = super().__new__(cls, layers)
        self.input_ids = input_ids
        return self


class MiniLLMDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Shape:
        hidden_states (B, T, D), attention_mask (B, 1, T, S) bool or None (see
        :func:`minillm.attention.padding_attention_mask`) -> (hidden_states (B, T, D),
        router_logits (N, E) or None, attn_weights or None, present KVCache or None).
    """

    def __init__(self, config: MiniLLMConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = MiniLLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MiniLLMAttention(config, layer_idx)
        self.post_attention_layernorm = MiniLLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe:
            self.mlp: nn.Module = MiniLLMSparseMoeBlock(config)
        else:
            self.mlp = MiniLLMMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_value: KVCache | None = None,
        use_cache: bool = False,
        attention_mask: torch.Tensor | None = None,
    ):
        # the mask is passed only when there is one, so attention modules written before it
        # existed (and subclasses that override forward) keep working on unpadded batches
        masked = {} if attention_mask is None else {"attention_mask": attention_mask}
        attn_out, attn_weights, present = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            past_key_value=past_key_value,
            use_cache=use_cache,
            **masked,
        )
        hidden_states = hidden_states + attn_out
        mlp_out = self.mlp(self.post_attention_layernorm(hidden_states))
        router_logits = None
        if isinstance(mlp_out, tuple):
            mlp_out, router_logits = mlp_out
        return hidden_states + mlp_out, router_logits, attn_weights, present


class MiniLLMModel(nn.Module):
    """Embedding, position information, the decoder layers and the final norm (no LM head).

    Shape:
        input_ids (B, T) int64, attention_mask (B, S) or None (S = past + T) -> hidden states
        (B, T, D), plus per-layer extras (see :meth:`MiniLLM.forward`).
    """

    def __init__(self, config: MiniLLMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        else:
            self.rotary_emb = MiniLLMRotaryEmbedding(config)
        self.layers = nn.ModuleList(
            MiniLLMDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = MiniLLMRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        past_key_values: tuple[KVCache, ...] | None = None,
        use_cache: bool = False,
        attention_mask: torch.Tensor | None = None,
    ):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values else 0
        limit = self.config.max_position_embeddings
        if past_len + t > limit:
            raise ValueError(
                f"sequence of {past_len + t} positions is longer than max_position_embeddings "
                f"({limit}); use a shorter input or a config with a larger "
                f"max_position_embeddings"
            )
        mask_4d = None
        if attention_mask is None:
            position_ids = torch.arange(past_len, past_len + t, device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand(b, t)
        else:
            check_attention_mask(attention_mask, b, past_len + t)
            position_ids = positions_from_mask(attention_mask)[:, past_len:]
            mask_4d = padding_attention_mask(attention_mask, t)
        if past_len and self._recompute_past(position_ids):
            return self._recompute(input_ids, past_key_values, use_cache, attention_mask)
        hidden_states = self.embed_tokens(input_ids)
        position_embeddings = None
        if self.config.position_embedding == "learned":
            hidden_states = hidden_states + self.embed_positions(position_ids)
        else:
            position_embeddings = self.rotary_emb(position_ids)

        router_logits, attentions, presents = [], [], []
        for i, layer in enumerate(self.layers):
            hidden_states, r_logits, attn_w, present = layer(
                hidden_states,
                position_embeddings=position_embeddings,
                past_key_value=past_key_values[i] if past_key_values else None,
                use_cache=use_cache,
                **({} if mask_4d is None else {"attention_mask": mask_4d}),
            )
            if r_logits is not None:
                router_logits.append(r_logits)
            attentions.append(attn_w)
            presents.append(present)
        cache = None
        if use_cache:
            if not past_len:
                known = input_ids
            else:
                past_ids = getattr(past_key_values, "input_ids", None)
                known = None if past_ids is None else torch.cat((past_ids, input_ids), dim=1)
            cache = PastKeyValues(presents, input_ids=known)
        return self.norm(hidden_states), router_logits, attentions, cache

    def _recompute_past(self, position_ids: torch.Tensor) -> bool:
        """Whether a cached call must recompute every position: dynamic-NTK RoPE with some row
        longer than the original length (see :class:`PastKeyValues`)."""
        rope = getattr(self, "rotary_emb", None)
        if rope is None or rope.scaling_type != "dynamic":
            return False
        return int(position_ids.max()) + 1 > rope.original_max_position_embeddings

    def _recompute(self, input_ids, past_key_values, use_cache, attention_mask):
        """The cached call of a dynamic-NTK model past its original length: the whole sequence
        (the cache's ids, then ``input_ids``) run again, the outputs of the last T positions
        returned — exactly what full recomputation gives them."""
        past_ids = getattr(past_key_values, "input_ids", None)
        past_len = past_key_values[0][0].shape[2]
        if past_ids is None or tuple(past_ids.shape) != (input_ids.shape[0], past_len):
            raise ValueError(
                "a dynamic-NTK model past its original length "
                f"({self.rotary_emb.original_max_position_embeddings}) rotates every position "
                "with a base that depends on the sequence length, so its cache cannot be "
                "reused: pass the past_key_values this model returned (they carry the ids "
                "to recompute from) or the whole sequence without a cache"
            )
        b, t = input_ids.shape
        full_ids = torch.cat((past_ids.to(input_ids.device), input_ids), dim=1)
        masked = {} if attention_mask is None else {"attention_mask": attention_mask}
        hidden, router_logits, attentions, cache = self.forward(full_ids, use_cache=use_cache,
                                                                **masked)
        s = full_ids.shape[1]
        router_logits = [r.view(b, s, -1)[:, s - t :].reshape(b * t, -1) for r in router_logits]
        attentions = [None if a is None else a[:, :, s - t :] for a in attentions]
        return hidden[:, s - t :], router_logits, attentions, cache


def check_attention_mask(attention_mask: torch.Tensor, b: int, s: int) -> None:
    """Raise ``ValueError`` unless ``attention_mask`` is a (B, S) mask of 0/1 (or bool) values."""
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (b, s):
        shape = tuple(getattr(attention_mask, "shape", ()))
        raise ValueError(
            f"attention_mask must be (B, past + T) = ({b}, {s}) with 1 for real tokens and 0 "
            f"for padding, got shape {shape}"
        )
    if attention_mask.dtype != torch.bool and bool(
        ((attention_mask != 0) & (attention_mask != 1)).any()
    ):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real tokens)")


def positions_from_mask(attention_mask_BS: torch.Tensor) -> torch.Tensor:
    """Position ids (B, S) int64 of a padded batch: each real token's index among the real
    tokens of its row, ``cumsum(mask) - 1`` (HF's ``generate``), so a left-padded row's first
    real token is at position 0 like the same row unpadded. Pads get the position of the last
    real token before them (0 before the first); nothing reads it."""
    return (attention_mask_BS.long().cumsum(-1) - 1).clamp_min(0)


def _next_token_ce(
    logits: torch.Tensor, labels: torch.Tensor, real_BT: torch.Tensor | None
) -> torch.Tensor:
    """Cross-entropy (fp32) of the logits at t against ``labels[:, t+1]``, ``-100`` ignored;
    with ``real_BT`` only where the target and the position predicting it are real tokens."""
    targets = labels[:, 1:]
    if real_BT is not None:
        targets = targets.masked_fill(~(real_BT[:, 1:] & real_BT[:, :-1]), -100)
    return F.cross_entropy(
        logits[:, :-1, :].reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=-100,
    )


def _last_real_logits(logits: torch.Tensor, mask: torch.Tensor, t: int) -> torch.Tensor:
    """(B, V) fp32 logits at the last real token of each row (the prompt's, then the newest
    one) of a step's (B, t, V) ``logits``; ``mask`` is (B, S) over all S positions so far."""
    s = mask.shape[1]
    last = s - 1 - mask.flip(-1).int().argmax(-1)
    at = (last - (s - t)).clamp_min(0)
    return logits[torch.arange(logits.shape[0]), at].float()


def _pick_next(
    next_logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """(B, 1) next ids: the argmax at ``temperature == 0``, else a sample of
    ``softmax(logits / temperature)`` over the ``top_k`` largest logits when given."""
    if temperature == 0:
        return next_logits.argmax(dim=-1, keepdim=True)
    next_logits = next_logits / temperature
    if top_k is not None:
        kth = torch.topk(next_logits, min(top_k, next_logits.shape[-1])).values
        next_logits = next_logits.masked_fill(next_logits < kth[:, -1:], float("-inf"))
    probs = torch.softmax(next_logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


class MiniLLM(nn.Module):
    """A Llama/Mixtral-style causal language model: ``model`` (a :class:`MiniLLMModel`) and a
    ``lm_head`` tied to the token embedding by default.

    Args:
        config: the :class:`MiniLLMConfig`; validated on construction.

    Example:
        >>> cfg = MiniLLMConfig()
        >>> model = MiniLLM(cfg)
        >>> out = model(torch.randint(0, 1000, (2, 64)), labels=...)
    """

    def __init__(self, config: MiniLLMConfig) -> None:
        super().__init__()
        self.config = config
        self.model = MiniLLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()
        if config.tie_word_embeddings:
            self.tie_weights()

    # ------------------------------------------------------------------ weights
    def init_weights(self) -> None:
        """Initialise every weight; makes the first loss on random tokens ≈ ln(V).

        ============================  ===================  =====================================
        weight                        init                 why
        ============================  ===================  =====================================
        embed_tokens, embed_positions N(0, 0.02²)          GPT-2/Llama practice. With a tied
                                                           head, logits = norm(x)·Eᵀ have std
                                                           ≈ 0.02·√D ≈ 0.3 at D=256, so softmax
                                                           starts near uniform: loss ≈ ln V.
                                                           (nn.Embedding's N(0, 1) gives std
                                                           ≈ √D ≈ 16 and a first loss ≈ 248.)
        every nn.Linear               N(0, 0.02²), no bias same scale for q/k/v/o, router, MLPs
        lm_head (untied)              N(0, 0.02²)          as above
        RMSNorm weights               1                    identity scale
        ============================  ===================  =====================================

        ``initializer_range`` in the config sets the 0.02.
        """
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, MiniLLMRMSNorm):
                nn.init.ones_(module.weight)

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the same Parameter as ``model.embed_tokens.weight``."""
        self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def weights_tied(self) -> bool:
        """True when the LM head and the embedding share one storage."""
        return self.lm_head.weight.data_ptr() == self.model.embed_tokens.weight.data_ptr()

    def num_parameters(self) -> int:
        """Unique parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    @classmethod
    def from_hf(cls, hf_model: nn.Module, *, max_position_embeddings: int | None = None) -> MiniLLM:
        """A MiniLLM with the same config and weights as a HF causal LM instance.

        Args:
            hf_model: a ``LlamaForCausalLM`` or ``MixtralForCausalLM`` (e.g. built from a
                config, no hub access needed).
            max_position_embeddings: the longest input the MiniLLM accepts (default: HF's
                ``max_position_embeddings``; for dynamic-NTK RoPE, whose HF value is the
                original length L that longer inputs may exceed, L × factor — see
                :func:`minillm.convert.max_positions_from_hf`).

        Returns:
            A MiniLLM in the same train/eval mode and dtype; its logits match HF's to float
            tolerance.

        Raises:
            ValueError: unsupported architecture features (see
                :func:`minillm.convert.config_from_hf`) or weights that do not map one to one.
        """
        config = config_from_hf(hf_model.config, max_position_embeddings=max_position_embeddings)
        model = cls(config)
        state = state_dict_from_hf(hf_model.state_dict(), config)
        if config.tie_word_embeddings:
            state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"HF weights do not map onto MiniLLM: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        model.to(dtype=next(hf_model.parameters()).dtype)
        model.train(hf_model.training)
        return model

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        past_key_values: tuple[KVCache, ...] | None = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> MiniLLMOutput:
        """Run the model.

        Args:
            input_ids: (B, T) int64 token ids in [0, V).
            labels: optional (B, T) int64, aligned with ``input_ids`` like HF: the logits at
                position t are scored against ``labels[:, t+1]`` (the shift happens here);
                ``-100`` entries are ignored. With ``attention_mask``, a target counts only
                where it and the position predicting it are both real tokens (labels at pads
                are ignored, and nothing is predicted from a pad).
            past_key_values: the ``past_key_values`` of an earlier call (KV cache); new
                positions continue after the cached ones. A dynamic-NTK model past its
                original length recomputes the whole sequence from the ids the cache carries
                (:class:`PastKeyValues`), so the result equals a call without cache.
            attention_mask: optional (B, S) padding mask, 1 for real tokens and 0 for pads,
                over the cached and the new positions (S = past + T), left or right padding
                (HF's convention). Pads are masked out as keys; positions count real tokens
                only (:func:`positions_from_mask`), so every real token's logits equal those of
                its row run unpadded; the aux loss counts real tokens only.
            use_cache: return ``past_key_values`` for incremental decoding.
            output_attentions: compute attention through the eager path and return the
                probabilities (B, H, T, S) per layer.

        Returns:
            A :class:`MiniLLMOutput`.

        Raises:
            ValueError: input_ids not 2-D, more positions than ``max_position_embeddings``, or
                an ``attention_mask`` that is not (B, past + T) of 0/1.
        """
        hidden, router_logits, attentions, presents = self._decode(
            input_ids, past_key_values, use_cache, output_attentions, attention_mask
        )
        logits = self.lm_head(hidden)

        real_BT = None
        if attention_mask is not None:
            real_BT = attention_mask[:, attention_mask.shape[1] - input_ids.shape[1] :].bool()
        aux_losses, aux_loss = self._aux_losses(router_logits, real_BT, logits)

        ce_loss = loss = None
        if labels is not None:
            ce_loss = _next_token_ce(logits, labels, real_BT)
            loss = ce_loss + aux_loss
        return MiniLLMOutput(
            logits=logits,
            loss=loss,
            ce_loss=ce_loss,
            aux_loss=aux_loss,
            aux_losses=aux_losses,
            router_logits=tuple(router_logits),
            past_key_values=presents if use_cache else None,
            attentions=tuple(attentions) if output_attentions else None,
        )

    def _decode(
        self,
        input_ids: torch.Tensor,
        past_key_values: tuple[KVCache, ...] | None,
        use_cache: bool,
        output_attentions: bool,
        attention_mask: torch.Tensor | None,
    ) -> tuple:
        """The decoder stack's ``(hidden, router_logits, attentions, presents)``; with
        ``output_attentions`` each attention returns its probabilities for this call only."""
        attn_modules = []
        if output_attentions:
            for layer in self.model.layers:
                if not layer.self_attn.return_attn_weights:
                    layer.self_attn.return_attn_weights = True
                    attn_modules.append(layer.self_attn)
        try:
            return self.model(
                input_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **({} if attention_mask is None else {"attention_mask": attention_mask}),
            )
        finally:
            for m in attn_modules:
                m.return_attn_weights = False

    def _aux_losses(
        self, router_logits: list, real_BT: torch.Tensor | None, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each MoE layer's load-balancing loss over the real tokens (``real_BT``, or all)
        and their sum × ``router_aux_loss_coef``; fp32 zeros for a dense model."""
        cfg = self.config
        if router_logits:
            real_N = None if real_BT is None else real_BT.reshape(-1)
            aux_losses = torch.stack(
                [
                    load_balancing_loss(
                        r if real_N is None else r[real_N],
                        cfg.num_local_experts,
                        cfg.num_experts_per_tok,
                    )
                    for r in router_logits
                ]
            )
            aux_loss = cfg.router_aux_loss_coef * aux_losses.sum()
        else:
            aux_losses = logits.new_zeros(0, dtype=torch.float32)
            aux_loss = logits.new_zeros((), dtype=torch.float32)
        return aux_losses, aux_loss

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Extend ``input_ids`` by ``max_new_tokens`` tokens.

        ``temperature == 0`` is greedy (argmax); otherwise tokens are sampled from
        ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely ids when
        given. With ``use_cache`` each step feeds only the new token and reuses the KV cache;
        the result equals full recomputation (tested). With dynamic-NTK RoPE, a step past the
        original length recomputes the whole sequence (the rotation of every position changes
        with the length, see :class:`PastKeyValues`): still equal, no faster than
        ``use_cache=False`` there.

        Args:
            input_ids: (B, T0) prompt ids.
            max_new_tokens: number of tokens to append; the total may not exceed
                ``max_position_embeddings``.
            temperature: 0 for greedy, > 0 to sample.
            top_k: keep only the k largest logits before sampling.
            use_cache: reuse keys/values of earlier positions.
            generator: a ``torch.Generator`` for reproducible sampling.
            attention_mask: optional (B, T0) padding mask of a padded batch of prompts (1 real,
                0 pad; left padding is usual, right padding works too): each row continues
                from its last real token, as if it were generated alone.

        Returns:
            (B, T0 + max_new_tokens) int64 ids (pads stay where they were).

        Raises:
            ValueError: the total length exceeds ``max_position_embeddings``, a negative
                temperature, or an ``attention_mask`` that is not (B, T0) of 0/1.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        total = input_ids.shape[1] + max_new_tokens
        if total > self.config.max_position_embeddings:
            raise ValueError(
                f"prompt + max_new_tokens = {total} exceeds max_position_embeddings "
                f"({self.config.max_position_embeddings})"
            )
        mask = attention_mask
        if mask is not None:
            check_attention_mask(mask, *input_ids.shape)
        was_training = self.training
        self.eval()
        try:
            ids = input_ids
            past = None
            step_input = ids
            for _ in range(max_new_tokens):
                if mask is None:
                    out = self(step_input, past_key_values=past, use_cache=use_cache)
                    next_logits = out.logits[:, -1, :].float()
                else:
                    out = self(
                        step_input, past_key_values=past, use_cache=use_cache, attention_mask=mask
                    )
                    next_logits = _last_real_logits(out.logits, mask, step_input.shape[1])
                next_id = _pick_next(next_logits, temperature, top_k, generator)
                ids = torch.cat((ids, next_id), dim=1)
                if mask is not None:
                    mask = torch.cat((mask, mask.new_ones(mask.shape[0], 1)), dim=1)
                if use_cache:
                    past, step_input = out.past_key_values, next_id
                else:
                    step_input = ids
            return ids
        finally:
            self.train(was_training)
