"""``hooks.patch_sweep``, ``hooks.attribution_patch``, ``hooks.logit_attribution`` and the
mid-block lens exact against the peers, TransformerLens 4.3 and nnsight 0.8 (the ``test`` extra),
on the same tiny GPT-2 and Llama built from a config (no hub).

TransformerLens 4 wraps a model already built (``build_bridge_from_module`` with the model's
config: nothing is downloaded); it is given a deep copy, since the bridge replaces submodules in
place. Compatibility mode is not enabled, so its logits are the HF model's own and no per-position
shift has to be taken out (``logit_diff`` would be blind to one anyway; ``loss`` is compared as a
log-probability, which is). Attribution patching is TransformerLens's demo convention: the
corrupted run's gradient times (clean − corrupted), computed here with TransformerLens hooks that
keep the corrupted activations and their gradients. nnsight patches the clean activations into
the corrupted run inside its own trace, one cell per trace.

Each test skips, saying why, only when the peer cannot be imported.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hooks
from tests import families

pytest.importorskip("transformers")

ATOL = 1e-5
#: TransformerLens's sweeps run one forward pass per cell with its hook machinery: seconds.
pytestmark = pytest.mark.slow
ARCH = {"hf_gpt2": "GPT2LMHeadModel", "hf_llama": "LlamaForCausalLM"}
FAMILIES = list(ARCH)


def _tl():
    pytest.importorskip("transformer_lens", reason="TransformerLens (the test extra) is "
                             "not installed")
    from transformer_lens import patching
    from transformer_lens.model_bridge.sources import build_bridge_from_module
    return patching, build_bridge_from_module


def _nnsight():
    mod = pytest.importorskip("nnsight", reason="nnsight (the test extra) is not installed")
    return mod.NNsight


def pair(family):
    model, batch = getattr(families, family)()
    ids = batch["input_ids"]
    x = ids.clone()
    x[:, 3] = (x[:, 3] + 7) % families.V
    x[:, 9] = (x[:, 9] + 5) % families.V
    return model, ids, x


def bridge(model, family):
    _, build = _tl()
    return build(copy.deepcopy(model), ARCH[family], hf_config=model.config)


def loss_metric(ids):
    def metric(logits):
        logp = F.log_softmax(logits.float(), -1)[:, :-1]
        return -logp.gather(-1, ids[:, 1:, None]).mean()
    return metric


def diff_metric(a, b):
    return lambda logits: (logits[:, -1, a] - logits[:, -1, b]).mean()


# -- TransformerLens -------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_layers_by_positions_equals_transformer_lens(family):
    patching, _ = _tl()
    model, ids, x = pair(family)
    br = bridge(model, family)
    _, cache = br.run_with_cache(ids)
    metric = loss_metric(ids)
    post = patching.generic_activation_patch(
        br, x, cache, metric, patch_setter=patching.layer_pos_patch_setter,
        activation_name="resid_post", index_axis_names=("layer", "pos"))
    pre = patching.get_act_patch_resid_pre(br, x, cache, metric)
    s = hooks.patch_sweep(model, {"input_ids": ids}, {"input_ids": x}, metric="loss")
    torch.testing.assert_close(s.values, post.float(), atol=ATOL, rtol=0)
    # a block's output is the next block's resid_pre
    torch.testing.assert_close(s.values[:-1], pre[1:].float(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_heads_equal_transformer_lens_head_out_all_pos(family):
    patching, _ = _tl()
    model, ids, x = pair(family)
    br = bridge(model, family)
    _, cache = br.run_with_cache(ids)
    ref = patching.get_act_patch_attn_head_out_all_pos(br, x, cache, diff_metric(5, 7))
    s = hooks.patch_sweep(model, {"input_ids": ids}, {"input_ids": x}, over="heads",
                          metric="logit_diff:5,7")
    torch.testing.assert_close(s.values, ref.float(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("over", ["layers×positions", "heads"])
def test_attribution_equals_transformer_lens_demo_convention(family, over):
    model, ids, x = pair(family)
    br = bridge(model, family)
    heads = over == "heads"
    names = [f"blocks.{i}.attn.hook_z" if heads else f"blocks.{i}.hook_resid_post"
             for i in range(2)]
    _, clean_cache = br.run_with_cache(ids, names_filter=lambda n: n in names)
    kept = {}

    def keep(name):
        def hook(act, hook):
            act.retain_grad()
            kept[name] = act
            return act
        return hook

    logits = br.run_with_hooks(x, fwd_hooks=[(n, keep(n)) for n in names])
    metric = loss_metric(ids)(logits)
    metric.backward()
    rows = []
    for n in names:
        d = (clean_cache[n] - kept[n].detach()) * kept[n].grad
        rows.append(d.sum((0, 1, 3)) if heads else d.sum((0, 2)))
    ref = torch.stack(rows)
    a = hooks.attribution_patch(model, {"input_ids": ids}, {"input_ids": x}, over=over)
    torch.testing.assert_close(a.values - a.corrupt, ref.detach().float(), atol=ATOL, rtol=0)
    assert a.corrupt == pytest.approx(float(metric.detach()), abs=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_logit_attribution_equals_transformer_lens_with_the_frozen_scale(family):
    model, ids, _ = pair(family)
    br = bridge(model, family)
    _, cache = br.run_with_cache(ids)
    token = 9
    u = br.W_U[:, token].double()  # (D,)
    g = dict(br.ln_final.named_parameters())["_original_component.weight"].double()
    heads = cache.stack_head_results(layer=-1, pos_slice=-1, apply_ln=True)  # (L·H, B, D)
    comps, labels = cache.decompose_resid(layer=-1, pos_slice=-1, apply_ln=True,
                                          return_labels=True)
    got = hooks.logit_attribution(model, {"input_ids": ids}, tokens=token)
    ref_heads = (heads.double() * g) @ u  # (L·H, B)
    torch.testing.assert_close(got.heads.permute(1, 2, 0).reshape(8, -1), ref_heads,
                               atol=ATOL, rtol=0)
    by = dict(zip(labels, (comps.double() * g) @ u, strict=True))
    torch.testing.assert_close(got.attention.T, torch.stack([by["0_attn_out"], by["1_attn_out"]]),
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(got.mlp.T, torch.stack([by["0_mlp_out"], by["1_mlp_out"]]),
                               atol=ATOL, rtol=0)
    embed = by["embed"] + by.get("pos_embed", 0)
    torch.testing.assert_close(got.embed, embed, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_mid_lens_equals_transformer_lens_resid_mid(family):
    model, ids, _ = pair(family)
    br = bridge(model, family)
    _, cache = br.run_with_cache(ids)
    lens = hooks.logit_lens(model, {"input_ids": ids})
    for layer in range(2):
        mid = cache[f"blocks.{layer}.hook_resid_mid"]
        ref = br.unembed(br.ln_final(mid))
        torch.testing.assert_close(F.log_softmax(lens.logits(layer, "mid"), -1),
                                   F.log_softmax(ref.float(), -1), atol=ATOL, rtol=0)


# -- nnsight ---------------------------------------------------------------------------------
def _blocks(nm, family):
    return nm.transformer.h if family == "hf_gpt2" else nm.model.layers


def _proj(block, family):
    return block.attn.c_proj if family == "hf_gpt2" else block.self_attn.o_proj


@pytest.mark.parametrize("family", FAMILIES)
def test_sweeps_equal_nnsight(family):
    NNsight = _nnsight()
    model, ids, x = pair(family)
    nm = NNsight(model)
    outs, zs = [], []
    with nm.trace(input_ids=ids):
        for layer in range(2):
            zs.append(_proj(_blocks(nm, family)[layer], family).input.save())
            outs.append(_blocks(nm, family)[layer].output.save())
    metric = loss_metric(ids)
    ref = torch.zeros(2, 16)
    for layer in range(2):
        for p in range(16):
            with torch.no_grad(), nm.trace(input_ids=x):
                _blocks(nm, family)[layer].output[:, p] = outs[layer][:, p]
                logits = nm.lm_head.output.save()
            ref[layer, p] = metric(logits)
    s = hooks.patch_sweep(model, {"input_ids": ids}, {"input_ids": x})
    torch.testing.assert_close(s.values, ref, atol=ATOL, rtol=0)
    ref_h = torch.zeros(2, 4)
    for layer in range(2):
        for h in range(4):
            with torch.no_grad(), nm.trace(input_ids=x):
                z = _proj(_blocks(nm, family)[layer], family).input
                z[..., h * 16:(h + 1) * 16] = zs[layer][..., h * 16:(h + 1) * 16]
                logits = nm.lm_head.output.save()
            ref_h[layer, h] = diff_metric(5, 7)(logits)
    sh = hooks.patch_sweep(model, {"input_ids": ids}, {"input_ids": x}, over="heads",
                           metric="logit_diff:5,7")
    torch.testing.assert_close(sh.values, ref_h, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_attribution_equals_nnsight_gradients(family):
    NNsight = _nnsight()
    model, ids, x = pair(family)
    nm = NNsight(model)
    clean = []
    with torch.no_grad(), nm.trace(input_ids=ids):
        for layer in range(2):
            clean.append(_blocks(nm, family)[layer].output.save())
    acts, grads = [], []
    with nm.trace(input_ids=x):
        hs = [_blocks(nm, family)[layer].output for layer in range(2)]
        for h in hs:
            acts.append(h.save())
        logits = nm.lm_head.output
        m = (logits[:, -1, 5] - logits[:, -1, 7]).mean()
        with m.backward():
            for h in reversed(hs):
                grads.append(h.grad.save())
    grads.reverse()
    ref = torch.stack([((c - a.detach()) * g).sum((0, 2))
                       for c, a, g in zip(clean, acts, grads, strict=True)])
    got = hooks.attribution_patch(model, {"input_ids": ids}, {"input_ids": x},
                                  metric="logit_diff:5,7")
    torch.testing.assert_close(got.values - got.corrupt, ref.detach(), atol=ATOL, rtol=0)
