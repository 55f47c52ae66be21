"""Edits by role (issue 36, items 1 and 6) exact against the peers, TransformerLens 4.3 and
nnsight 0.8 (the ``test`` extra), on the same tiny GPT-2 and Llama built from a config (no
hub): a head patched from a source run (TransformerLens's ``hook_z`` of that head; nnsight's
slice of the o projection's input), a steering vector added to a block's output
(``hook_resid_post``; the block's output), and a head's pattern, q, k or v patched
(``hook_pattern``, ``hook_q``/``hook_k``/``hook_v``), within 1e-5.

TransformerLens is built as in test_sweep_peers.py (``build_bridge_from_module`` on a deep copy,
compatibility mode off); log-probabilities are compared, which a per-position shift of the
logits would not change.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hooks
from tests.hooks.whatif.test_sweep_peers import FAMILIES, _blocks, _nnsight, _proj, bridge, pair

pytest.importorskip("transformers")
ATOL = 1e-5
pytestmark = pytest.mark.slow
LAYER, HEAD, DH = 1, 2, 16
ATTN = {"hf_gpt2": "transformer.h.{}.attn", "hf_llama": "model.layers.{}.self_attn"}
BLOCK = {"hf_gpt2": "transformer.h.{}", "hf_llama": "model.layers.{}"}


def _logp(logits):
    return F.log_softmax(logits.float(), -1)


def _mdb(model, ids, spec, src=None):
    with torch.no_grad(), hooks.capture(model, edits=[spec],
                                        sources={"s": src} if src is not None else None) as tr:
        out = model(input_ids=ids).logits
    assert tr.edits[0].applied and tr.edits[0].note is None
    return _logp(out)


def _vector(model):
    d = model.config.hidden_size
    return torch.randn(d, generator=torch.Generator().manual_seed(3))


@pytest.fixture
def vector_file(tmp_path):
    from safetensors.torch import save_file

    def write(v):
        path = tmp_path / "steer.safetensors"
        save_file({"steer": v}, str(path))
        return path
    return write


# -- TransformerLens -----------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_head_patch_equals_transformer_lens_hook_z(family):
    pytest.importorskip("transformer_lens", reason="TransformerLens (the test extra) is not "
                        "installed")
    model, ids, src = pair(family)
    br = bridge(model, family)
    name = f"blocks.{LAYER}.attn.hook_z"
    _, cache = br.run_with_cache(src, names_filter=lambda n: n == name)

    def patch(z, hook):  # (B, T, H, Dh)
        z = z.clone()
        z[:, :, HEAD] = cache[name][:, :, HEAD]
        return z

    with torch.no_grad():
        ref = br.run_with_hooks(ids, fwd_hooks=[(name, patch)])
        plain = br(ids)
    got = _mdb(model, ids, f"patch {ATTN[family].format(LAYER)} head={HEAD} from=s", src)
    torch.testing.assert_close(got, _logp(ref), atol=ATOL, rtol=0)
    assert (got - _logp(plain)).abs().max() > 1e-3  # the patch mattered


@pytest.mark.parametrize("family", FAMILIES)
def test_steering_vector_equals_transformer_lens_resid_post(family, vector_file):
    pytest.importorskip("transformer_lens", reason="TransformerLens (the test extra) is not "
                        "installed")
    model, ids, _ = pair(family)
    br = bridge(model, family)
    v = _vector(model)
    with torch.no_grad():
        ref = br.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_post",
                                                 lambda x, hook: x + 4.0 * v)])
    path = vector_file(v)
    got = _mdb(model, ids, f"add {BLOCK[family].format(0)} vector={path} scale=4")
    torch.testing.assert_close(got, _logp(ref), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("part, hook", [("pattern", "hook_pattern"), ("q", "hook_q"),
                                        ("k", "hook_k"), ("v", "hook_v")])
def test_pattern_and_q_k_v_patches_equal_transformer_lens(family, part, hook):
    """TransformerLens's hook_pattern (B, H, T, S) and hook_q/k/v (B, T, H or Hkv, Dh, before
    any rotation) of one head taken from the source run; with GQA a k/v head is a KV head in
    both."""
    pytest.importorskip("transformer_lens", reason="TransformerLens (the test extra) is not "
                        "installed")
    model, ids, src = pair(family)
    br = bridge(model, family)
    name = f"blocks.{LAYER}.attn.{hook}"
    _, cache = br.run_with_cache(src, names_filter=lambda n: n == name)
    h = 1

    def patch(x, hook):
        x = x.clone()
        if part == "pattern":
            x[:, h] = cache[name][:, h]
        else:
            x[:, :, h] = cache[name][:, :, h]
        return x

    with torch.no_grad():
        ref = br.run_with_hooks(ids, fwd_hooks=[(name, patch)])
    got = _mdb(model, ids, f"patch {ATTN[family].format(LAYER)} {part} head={h} from=s", src)
    torch.testing.assert_close(got, _logp(ref), atol=ATOL, rtol=0)


# -- nnsight -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_head_patch_and_steering_equal_nnsight(family, vector_file):
    NNsight = _nnsight()
    model, ids, src = pair(family)
    nm = NNsight(model)
    with torch.no_grad(), nm.trace(input_ids=src):
        z_src = _proj(_blocks(nm, family)[LAYER], family).input.save()
    a, b = HEAD * DH, (HEAD + 1) * DH
    with torch.no_grad(), nm.trace(input_ids=ids):
        z = _proj(_blocks(nm, family)[LAYER], family).input
        z[..., a:b] = z_src[..., a:b]
        ref = nm.lm_head.output.save()
    got = _mdb(model, ids, f"patch {ATTN[family].format(LAYER)} head={HEAD} from=s", src)
    torch.testing.assert_close(got, _logp(ref), atol=ATOL, rtol=0)
    v = _vector(model)
    with torch.no_grad(), nm.trace(input_ids=ids):
        _blocks(nm, family)[0].output[:] = _blocks(nm, family)[0].output + 4.0 * v
        ref_v = nm.lm_head.output.save()
    got_v = _mdb(model, ids, f"add {BLOCK[family].format(0)} vector={vector_file(v)} scale=4")
    torch.testing.assert_close(got_v, _logp(ref_v), atol=ATOL, rtol=0)
