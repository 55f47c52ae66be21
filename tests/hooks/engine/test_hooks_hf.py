"""hooks.capture on HF transformers models built from tiny configs (no hub access).

HF's own numbers are the reference: ``ModelOutput`` fields, the router's returned top-k,
``load_balancing_loss_func``, and the eager attention weights from ``output_attentions``.
"""

from __future__ import annotations

import pytest
import torch

import hooks

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def mixtral(attn: str = "eager") -> MixtralForCausalLM:
    torch.manual_seed(0)
    cfg = MixtralConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2, attn_implementation=attn
    )
    return MixtralForCausalLM(cfg)


def llama(attn: str = "eager") -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL, attn_implementation=attn))


IDS = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))


def test_llama_model_output_dict_fields_are_recorded_with_gradients():
    model = llama()
    with hooks.capture(model) as tr:
        out = model(IDS, labels=IDS)
        out.loss.backward()
    root = tr.call("")
    paths = [t.path for t in root.outputs]
    assert "out.loss" in paths and "out.logits" in paths
    logits = out.logits.detach().double()
    st = root.output("out.logits").stats
    assert st.mean == pytest.approx(logits.mean().item(), rel=1e-5)
    assert st.std == pytest.approx(logits.std().item(), rel=1e-5)
    assert root.output("out.loss").stats.mean == pytest.approx(out.loss.item(), rel=1e-6)
    # a non-tensor part of the ModelOutput (the KV cache object) is said, not dropped silently
    assert any("DynamicCache" in n for n in root.notes) or model.config.use_cache is False
    # one gradient record per recorded output that required grad, e.g. every decoder layer
    for i in range(2):
        (g,) = tr.grads(f"model.layers.{i}")
        assert g.stats.numel == 2 * 10 * 32 and g.stats.finite
    assert tr.params["model.layers.0.self_attn.q_proj.weight"].status == "ok"
    assert tr.routing == []


def test_mixtral_router_probe_equals_hf_router_and_aux_loss():
    model = mixtral()
    k, e = model.config.num_experts_per_tok, model.config.num_local_experts
    got = {}

    def spy(name):
        def hook(mod, args, out):
            got[name] = tuple(t.detach().clone() for t in out)

        return hook

    handles = [
        model.get_submodule(f"model.layers.{i}.mlp.gate").register_forward_hook(spy(i))
        for i in range(2)
    ]
    with hooks.capture(model) as tr:
        out = model(IDS, labels=IDS, output_router_logits=True)
        out.loss.backward()
    for h in handles:
        h.remove()
    assert [r.module for r in tr.routing] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for i, r in enumerate(tr.routing):
        logits, weights, ids = got[i]  # what HF's router returned to its block
        assert r.router == f"model.layers.{i}.mlp.gate"
        assert torch.equal(r.top_k_ids, ids)
        torch.testing.assert_close(r.top_k_weights, weights.float())
        torch.testing.assert_close(r.router_probs, torch.softmax(logits.float(), -1))
        assert r.tokens_per_expert.tolist() == torch.bincount(ids.reshape(-1), minlength=e).tolist()
        # HF's loss for one layer divides counts by N (not N*k): exactly k times ours
        hf_one = load_balancing_loss_func((logits,), e, k)
        assert r.aux_loss * k == pytest.approx(hf_one.item(), rel=1e-5)
    torch.testing.assert_close(
        torch.stack([torch.as_tensor(r.router_probs) for r in tr.routing]),
        torch.stack([torch.softmax(t.detach().float(), -1) for t in out.router_logits]),
    )
    # the (fused) experts' parameters got gradients; the router too (through the weights)
    assert tr.params["model.layers.0.mlp.experts.gate_up_proj"].status == "ok"
    assert tr.params["model.layers.0.mlp.gate.weight"].status == "ok"


@pytest.mark.parametrize("factory", [llama, mixtral], ids=["llama", "mixtral"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_probs_equal_hf_eager_weights(factory, impl):
    model = factory(impl)
    with hooks.capture(model, attention=True) as tr:
        out_captured = model(IDS)
    reference = factory("eager")
    reference.load_state_dict(model.state_dict())
    ref = reference(IDS, output_attentions=True).attentions
    assert [a.module for a in tr.attention] == [f"model.layers.{i}.self_attn" for i in range(2)]
    for a, w in zip(tr.attention, ref, strict=True):
        assert a.source == ("softmax" if impl == "eager" else "sdpa")
        assert a.probs.shape == (2, 4, 10, 10)
        torch.testing.assert_close(a.probs, w.detach().float(), rtol=1e-5, atol=1e-6)
    # the capture did not change the model's computation
    torch.testing.assert_close(out_captured.logits, model(IDS).logits, rtol=0, atol=0)


def test_attention_with_padding_mask():
    model = llama("eager")
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding in the second sequence
    with hooks.capture(model, attention=["model.layers.0.self_attn"]) as tr:
        ref = model(IDS, attention_mask=mask, output_attentions=True).attentions[0]
    (a,) = tr.attention
    keep = mask[1].bool()
    torch.testing.assert_close(a.probs[1][..., keep], ref[1][..., keep].detach().float())
    assert torch.all(a.probs[1][..., ~keep][:, 3:] == 0)


def test_attention_not_requested_adds_no_hooks():
    model = llama("sdpa")
    attn = model.get_submodule("model.layers.0.self_attn")
    with hooks.capture(model) as tr:
        n_q_hooks = len(attn.q_proj._forward_hooks)
        model(IDS)
    assert tr.attention == []
    assert n_q_hooks == 1  # only the capture's own record hook


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_kv_cache_step_attends_to_every_cached_key(impl):
    model = llama(impl)
    out = model(IDS, use_cache=True)
    reference = llama("eager")
    reference.load_state_dict(model.state_dict())
    ref_out = reference(IDS, use_cache=True)
    ref = reference(IDS[:, -1:], cache=ref_out.cache, use_cache=True,
                    output_attentions=True).attentions
    with hooks.capture(model, attention=True) as tr:
        model(IDS[:, -1:], cache=out.cache, use_cache=True)
    assert [a.probs.shape for a in tr.attention] == [(2, 4, 1, 11)] * 2
    for a, w in zip(tr.attention, ref, strict=True):
        torch.testing.assert_close(a.probs, w.detach().float(), rtol=1e-5, atol=1e-6)
