"""``hooks.logit_attribution`` and ``Lens.logits(layer, where="mid")`` against references
computed here from HF's own modules: the residual in the middle of a block is the input of its
second norm (``post_attention_layernorm``, GPT-2's ``ln_2``), read by a hook of the test's own;
the shares of the logit are the test's own einsums of the captured tensors with the model's
weights, the final norm's scale taken from ``torch.var`` / the mean square."""

from __future__ import annotations

import pytest
import torch

import hooks
from tests import families

pytest.importorskip("transformers")


def second_norm(block):
    return block.ln_2 if hasattr(block, "ln_2") else block.post_attention_layernorm


def blocks_of(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def final_norm(model):
    return model.transformer.ln_f if hasattr(model, "transformer") else model.model.norm


@pytest.mark.parametrize("family", ["hf_gpt2", "hf_llama"])
def test_mid_lens_reads_the_input_of_the_blocks_second_norm(family):
    model, batch = getattr(families, family)()
    mids = []
    hs = [second_norm(b).register_forward_pre_hook(lambda m, a: mids.append(a[0].detach()))
          for b in blocks_of(model)]
    with torch.no_grad():
        model(**batch)
        refs = [model.lm_head(final_norm(model)(m)) for m in mids]
    for h in hs:
        h.remove()
    lens = hooks.logit_lens(model, batch)
    for layer, ref in enumerate(refs):
        torch.testing.assert_close(lens.logits(layer, where="mid"), ref.float(), atol=1e-5,
                                   rtol=0)
    assert not torch.allclose(lens.logits(0, "mid"), lens.logits(0))
    with pytest.raises(ValueError, match="where='middle'"):
        lens.logits(0, where="middle")


def _captured(model, batch):
    """Each block's input and output, each output projection's input, the final residual."""
    ins, outs, zs = [], [], []
    handles = []
    for b in blocks_of(model):
        handles.append(b.register_forward_pre_hook(lambda m, a: ins.append(a[0].detach())))
        handles.append(b.register_forward_hook(
            lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o).detach())))
        attn = b.attn if hasattr(b, "attn") else b.self_attn
        proj = attn.c_proj if hasattr(attn, "c_proj") else attn.o_proj
        handles.append(proj.register_forward_pre_hook(lambda m, a: zs.append(a[0].detach())))
    with torch.no_grad():
        logits = model(**batch).logits
    for h in handles:
        h.remove()
    return ins, outs, zs, logits


@pytest.mark.parametrize("family", ["hf_gpt2", "hf_llama"])
def test_shares_through_the_frozen_final_norm_add_up_to_the_logit(family):
    model, batch = getattr(families, family)()
    ins, outs, zs, logits = _captured(model, batch)
    token = 9
    got = hooks.logit_attribution(model, batch, tokens=token, position=-1)
    x = outs[-1][:, -1].double()
    norm = final_norm(model)
    gpt2 = family == "hf_gpt2"
    if gpt2:  # LayerNorm: centre, divide by the frozen sigma, times the weight
        def p(c):
            return c - c.mean(-1, keepdim=True)
        s = 1 / torch.sqrt(x.var(-1, unbiased=False) + norm.eps)
        g = norm.weight.detach().double()
    else:  # RMSNorm: divide by the frozen rms, times the weight
        def p(c):
            return c
        s = 1 / torch.sqrt(x.pow(2).mean(-1) + norm.variance_epsilon)
        g = norm.weight.detach().double()
    u = model.lm_head.weight.detach().double()[token]

    def share(c):
        return (p(c.double()) * s.view(-1, *([1] * (c.dim() - 2)), 1) * g * u).sum(-1)

    blocks = torch.stack([share(o[:, -1] - i[:, -1]) for i, o in zip(ins, outs, strict=True)], 1)
    torch.testing.assert_close(got.blocks, blocks, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.embed, share(ins[0][:, -1]), atol=1e-6, rtol=0)
    torch.testing.assert_close(got.scale, s, atol=1e-6, rtol=1e-6)
    # heads: z_h times that slice of the output projection's weight
    h_n, dh = 4, 16
    heads = []
    for b, z in zip(blocks_of(model), zs, strict=True):
        attn = b.attn if gpt2 else b.self_attn
        w = (attn.c_proj.weight.T if gpt2 else attn.o_proj.weight).detach().double()  # (D, HDh)
        zh = z[:, -1].double()
        heads.append(torch.stack([share(zh[:, h * dh:(h + 1) * dh] @ w[:, h * dh:(h + 1) * dh].T)
                                  for h in range(h_n)], 1))
    torch.testing.assert_close(got.heads, torch.stack(heads, 1), atol=1e-6, rtol=0)
    # the whole adds up to the model's logit
    total = got.embed + got.blocks.sum(1) + got.bias
    torch.testing.assert_close(total, logits[:, -1, token].double(), atol=1e-5, rtol=0)
    assert got.error < 1e-5 and got.notes == []
    torch.testing.assert_close(got.attention + got.mlp, got.blocks)


def test_default_token_is_each_rows_top1_and_bad_input_is_one_line():
    model, batch = families.hf_llama()
    with torch.no_grad():
        top = model(**batch).logits[:, 4].argmax(-1)
    got = hooks.logit_attribution(model, batch, position=4)
    assert got.tokens.tolist() == top.tolist() and got.position == 4
    for kwargs, says in [(dict(position=16), "out of range"), (dict(tokens=500), "vocabulary"),
                         (dict(tokens=[1, 2, 3]), "3 ids")]:
        with pytest.raises(ValueError, match=says):
            hooks.logit_attribution(model, batch, **kwargs)
