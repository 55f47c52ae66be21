"""A zoo of *correct* models from many families, each built tiny from its config (random
weights, no hub), as users bring them to mdb.

Every builder returns ``(model, batch)`` like a ``--model module:function`` factory, with a
batch that carries the model's own loss convention (HF ``labels``, nanoGPT ``(idx, targets)``,
a classifier's ``(x, y)``). :data:`FAMILIES` maps a name to its builder and to what the model
is (``kind``: ``decoder``, ``encoder``, ``encoder-decoder`` or ``other``; ``moe``: has sparse
MoE blocks; ``attention``: how attention is computed).

The HF builders need ``transformers`` (the test extra); tests that use them skip without it.
Built in the tests only, never in the product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

V = 128  # vocabulary of every language model here
B, T = 2, 16  # the batch every builder returns


def ids(b: int = B, t: int = T, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _lm(model: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    x = ids()
    return model, {"input_ids": x, "labels": x}


_DECODER = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                bos_token_id=1, eos_token_id=2)


def _hf(name: str, model_cls: str = "ForCausalLM", **fields: Any) -> nn.Module:
    import transformers

    config = getattr(transformers, f"{name}Config")(**fields)
    torch.manual_seed(0)
    return getattr(transformers, f"{name}{model_cls}")(config).eval()


# -- HF decoder-only, dense -------------------------------------------------------------------
def hf_llama():
    return _lm(_hf("Llama", **_DECODER))


def hf_mistral():
    return _lm(_hf("Mistral", **_DECODER, sliding_window=8))


def hf_qwen3():
    return _lm(_hf("Qwen3", **_DECODER, head_dim=16))


def hf_gemma():
    return _lm(_hf("Gemma", **_DECODER, head_dim=16))


def hf_phi3():  # fused qkv_proj and gate_up_proj
    return _lm(_hf("Phi3", **_DECODER, pad_token_id=0))


def hf_gpt2():  # fused c_attn (Conv1D), learned positions, MHA
    model, batch = _lm(_hf("GPT2", "LMHeadModel", vocab_size=V, n_embd=64, n_layer=2, n_head=4,
                   n_positions=64, bos_token_id=1, eos_token_id=2))
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's name maps to no loss: say it
    return model, batch


# -- HF decoder-only, MoE ---------------------------------------------------------------------
def hf_mixtral():
    return _lm(_hf("Mixtral", **_DECODER, num_local_experts=4, num_experts_per_tok=2,
                   output_router_logits=True))


def hf_qwen2_moe():
    return _lm(_hf("Qwen2Moe", **_DECODER, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   output_router_logits=True))


def hf_qwen3_moe():  # q_norm / k_norm per head
    return _lm(_hf("Qwen3Moe", **_DECODER, head_dim=16, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, output_router_logits=True))


def hf_olmoe():  # q_norm / k_norm over all heads jointly
    return _lm(_hf("Olmoe", **_DECODER, num_experts=4, num_experts_per_tok=2,
                   output_router_logits=True))


def hf_deepseek_v3():  # MLA attention; sigmoid router with bias and group-limited top-k
    fields = dict(_DECODER, num_key_value_heads=4)
    return _lm(_hf("DeepseekV3", **fields, n_routed_experts=8, num_experts_per_tok=2,
                   n_group=2, topk_group=1, moe_intermediate_size=32, n_shared_experts=1,
                   first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def hf_gpt_oss():  # attention sinks, router with bias
    return _lm(_hf("GptOss", **_DECODER, head_dim=16, num_local_experts=4,
                   num_experts_per_tok=2, sliding_window=8, output_router_logits=True,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def hf_granite_moe():
    return _lm(_hf("GraniteMoe", **_DECODER, num_local_experts=4, num_experts_per_tok=2,
                   output_router_logits=True))


# -- HF encoders and encoder-decoders ---------------------------------------------------------
def hf_bert():  # bidirectional encoder, masked-LM labels
    model = _hf("Bert", "ForMaskedLM", vocab_size=V, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=96, max_position_embeddings=64)
    x = ids()
    labels = torch.full_like(x, -100)
    labels[:, ::4] = x[:, ::4]
    return model, {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": labels}


def hf_t5():  # encoder-decoder: the decoder's inputs come from the labels
    model = _hf("T5", "ForConditionalGeneration", vocab_size=V, d_model=64, d_kv=16, d_ff=96,
                num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                pad_token_id=0)
    return model, {"input_ids": ids(), "labels": ids(seed=1)}


# -- our own models ---------------------------------------------------------------------------
class _CausalSelfAttention(nn.Module):
    """nanoGPT's attention: fused ``c_attn``, SDPA with ``is_causal`` (``flash=True``) or the
    hand-written masked softmax."""

    def __init__(self, d: int, h: int, block: int, flash: bool = True, causal: bool = True):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.n_head, self.flash, self.causal = h, flash, causal
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            if self.causal:
                att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))


class _Block(nn.Module):
    def __init__(self, d, h, block, flash, causal):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = _CausalSelfAttention(d, h, block, flash, causal)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """karpathy/nanoGPT's ``GPT`` in miniature: ``forward(idx, targets=None)`` returns
    ``(logits, loss)``; ``loss`` is None without targets."""

    def __init__(self, vocab=V, d=64, h=4, n_layer=2, block=64, flash=True, causal=True):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d),
            h=nn.ModuleList([_Block(d, h, block, flash, causal) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.block = block
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        b, t = idx.shape
        if t > self.block:
            raise ValueError(f"cannot forward a sequence of length {t}, block size is {self.block}")
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for blk in self.transformer.h:
            x = blk(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-1)
        return logits, loss


def nanogpt_batch(b: int = B, t: int = T, seed: int = 0):
    x = ids(b, t + 1, seed=seed)
    return x[:, :-1], x[:, 1:]


def nanogpt(flash: bool = True, causal: bool = True):
    torch.manual_seed(0)
    return NanoGPT(flash=flash, causal=causal), nanogpt_batch()


def nanogpt_eager():
    return nanogpt(flash=False)


class EncoderLM(nn.Module):
    """A causal LM on ``nn.TransformerEncoder`` (``nn.MultiheadAttention`` inside)."""

    def __init__(self, vocab=V, d=64, h=4, n_layer=2, block=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        layer = nn.TransformerEncoderLayer(d, h, 96, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, labels=None):
        t = input_ids.shape[1]
        x = self.embed(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device)
        logits = self.head(self.encoder(x, mask=mask, is_causal=True))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1))
        return {"logits": logits, "loss": loss}


def transformer_encoder():
    torch.manual_seed(0)
    return _lm(EncoderLM())


class LSTMLM(nn.Module):
    """A two-layer LSTM language model: ``forward(x, y)`` returns the loss only."""

    def __init__(self, vocab=V, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, num_layers=2, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, x, y=None):
        h, _ = self.lstm(self.embed(x))
        logits = self.head(h)
        if y is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def lstm():
    torch.manual_seed(0)
    return LSTMLM(), nanogpt_batch()


class SmallCNN(nn.Module):
    """An image classifier: ``forward(x)`` returns logits (B, 10); the loss is the user's."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.features(x))


def cnn():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(1))

    def loss_fn(output, batch):
        return F.cross_entropy(output, batch.targets)

    import hooks

    return SmallCNN(), hooks.Batch(args=(x,), targets=y), loss_fn


@dataclass(frozen=True)
class Family:
    """One entry of the zoo.

    Attributes:
        build: the factory (returns ``(model, batch)`` or ``(model, batch, loss_fn)``).
        kind: ``decoder`` (causal LM), ``encoder`` (bidirectional), ``encoder-decoder`` or
            ``other`` (not a sequence model).
        moe: whether the model has sparse MoE blocks.
        hf: whether it needs transformers.
    """

    build: Any
    kind: str = "decoder"
    moe: bool = False
    hf: bool = True


FAMILIES: dict[str, Family] = {
    "llama": Family(hf_llama),
    "mistral": Family(hf_mistral),
    "qwen3": Family(hf_qwen3),
    "gemma": Family(hf_gemma),
    "phi3": Family(hf_phi3),
    "gpt2": Family(hf_gpt2),
    "mixtral": Family(hf_mixtral, moe=True),
    "qwen2_moe": Family(hf_qwen2_moe, moe=True),
    "qwen3_moe": Family(hf_qwen3_moe, moe=True),
    "olmoe": Family(hf_olmoe, moe=True),
    "deepseek_v3": Family(hf_deepseek_v3, moe=True),
    "gpt_oss": Family(hf_gpt_oss, moe=True),
    "granite_moe": Family(hf_granite_moe, moe=True),
    "bert": Family(hf_bert, kind="encoder"),
    "t5": Family(hf_t5, kind="encoder-decoder"),
    "nanogpt": Family(nanogpt, hf=False),
    "nanogpt_eager": Family(nanogpt_eager, hf=False),
    "transformer_encoder": Family(transformer_encoder, hf=False),
    "lstm": Family(lstm, hf=False),
    "cnn": Family(cnn, kind="other", hf=False),
}
