"""``hooks.patch_sweep`` and ``hooks.attribution_patch`` against plain-torch references computed
here: one forward pass per cell with a hook of the test's own that writes the clean activation
into the corrupted run, and the metric written out by hand (log-softmax, gather); attribution as
the derivative of the metric along ``a_corrupt + α (a_clean − a_corrupt)`` at α = 0, one
backward pass per cell."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hooks
from hooks.whatif.sweep import parse_over
from tests import families

pytest.importorskip("transformers")

ATOL = 1e-5  # fp32 logits of a few units: batching and rounding stay at ~1e-6


def pair(family: str):
    model, batch = getattr(families, family)()
    ids = batch["input_ids"]
    x = ids.clone()
    x[:, 3] = (x[:, 3] + 7) % families.V
    x[:, 9] = (x[:, 9] + 5) % families.V
    return model, {"input_ids": ids}, {"input_ids": x}


def blocks_of(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def out_proj_of(block):
    attn = block.attn if hasattr(block, "attn") else block.self_attn
    return attn.c_proj if hasattr(attn, "c_proj") else attn.o_proj


def ref_loss(logits, ids):
    logp = torch.log_softmax(logits.double(), -1)[:, :-1]
    return float(-logp.gather(-1, ids[:, 1:, None]).mean())


def ref_logit_diff(logits, a, b):
    return float((logits[:, -1, a] - logits[:, -1, b]).double().mean())


def clean_acts(model, clean):
    """Each block's output and each output projection's input on the clean batch."""
    outs, zs, handles = [], [], []
    for blk in blocks_of(model):
        handles.append(blk.register_forward_hook(
            lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o).detach())))
        handles.append(out_proj_of(blk).register_forward_pre_hook(
            lambda m, a: zs.append(a[0].detach())))
    with torch.no_grad():
        model(**clean)
    for h in handles:
        h.remove()
    return outs, zs


def patched_logits(model, corrupt, module, fn, pre=False):
    if pre:
        h = module.register_forward_pre_hook(lambda m, a: (fn(a[0].clone()),))
    else:
        def hook(m, a, o):
            t = o[0] if isinstance(o, tuple) else o
            t = fn(t.clone())
            return (t, *o[1:]) if isinstance(o, tuple) else t
        h = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model(**corrupt).logits
    finally:
        h.remove()


def ref_positions(model, clean, corrupt, metric):
    outs, _ = clean_acts(model, clean)
    blocks = blocks_of(model)
    t = clean["input_ids"].shape[1]
    vals = torch.zeros(len(blocks), t, dtype=torch.float64)
    for layer, blk in enumerate(blocks):
        for p in range(t):
            def fn(h, layer=layer, p=p):
                h[:, p] = outs[layer][:, p]
                return h
            vals[layer, p] = metric(patched_logits(model, corrupt, blk, fn))
    return vals


def ref_heads(model, clean, corrupt, metric):
    _, zs = clean_acts(model, clean)
    blocks = blocks_of(model)
    h_n, dh = model.config.num_attention_heads, model.config.hidden_size // \
        model.config.num_attention_heads
    vals = torch.zeros(len(blocks), h_n, dtype=torch.float64)
    for layer, blk in enumerate(blocks):
        for h in range(h_n):
            def fn(z, layer=layer, h=h):
                z[..., h * dh:(h + 1) * dh] = zs[layer][..., h * dh:(h + 1) * dh]
                return z
            vals[layer, h] = metric(patched_logits(model, corrupt, out_proj_of(blk), fn, True))
    return vals


FAMILIES = ["hf_gpt2", "hf_llama"]


# Granite MoE hands its blocks a key/value cache even without use_cache: resumed calls get none
@pytest.mark.parametrize("family", [*FAMILIES, "hf_granite_moe"])
def test_layers_by_positions_equals_one_hooked_run_per_cell(family):
    model, clean, corrupt = pair(family)
    ids = clean["input_ids"]
    ref = ref_positions(model, clean, corrupt, lambda lg: ref_loss(lg, ids))
    s = hooks.patch_sweep(model, clean, corrupt, over="layers×positions", metric="loss")
    assert s.values.shape == (2, 16)
    assert s.rows == [n for n, m in model.named_modules() if m in list(blocks_of(model))]
    torch.testing.assert_close(s.values.double(), ref, atol=ATOL, rtol=0)
    with torch.no_grad():
        assert s.clean == pytest.approx(ref_loss(model(**clean).logits, ids), abs=ATOL)
        assert s.corrupt == pytest.approx(ref_loss(model(**corrupt).logits, ids), abs=ATOL)
    assert s.method == "patch" and s.over == "layers×positions"
    assert not any("whole forward passes" in n for n in s.notes)  # resumed at each block


@pytest.mark.parametrize("family", FAMILIES)
def test_heads_equal_one_hooked_run_per_head(family):
    model, clean, corrupt = pair(family)
    metric = "logit_diff:5,7"
    ref = ref_heads(model, clean, corrupt, lambda lg: ref_logit_diff(lg, 5, 7))
    s = hooks.patch_sweep(model, clean, corrupt, over="heads", metric=metric)
    assert s.values.shape == (2, 4)
    torch.testing.assert_close(s.values.double(), ref, atol=ATOL, rtol=0)


def test_logit_diff_positions_and_chunks_give_the_same_sweep():
    model, clean, corrupt = pair("hf_llama")
    ref = ref_positions(model, clean, corrupt, lambda lg: ref_logit_diff(lg, 3, 4))
    whole = hooks.patch_sweep(model, clean, corrupt, metric="logit_diff:3,4")
    chunked = hooks.patch_sweep(model, clean, corrupt, metric="logit_diff:3,4", chunk=3)
    torch.testing.assert_close(whole.values.double(), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(chunked.values, whole.values, atol=ATOL, rtol=0)
    assert whole.notes == []  # the last position is read: nothing unreachable


def test_layers_patch_the_whole_stream_and_restore_the_clean_end():
    model, clean, corrupt = pair("hf_gpt2")
    s = hooks.patch_sweep(model, clean, corrupt, over="layers")
    assert s.values.shape == (2,)
    torch.testing.assert_close(s.values.double(), torch.full((2,), s.clean, dtype=torch.float64),
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(s.normalized(), torch.ones(2), atol=1e-3, rtol=0)


def test_normalized_is_zero_at_the_corrupt_end_and_one_at_the_clean_end():
    v = torch.tensor([[1.0, 2.0], [3.0, 1.5]])
    s = hooks.Sweep("layers×positions", "loss", "patch", v, ["a", "b"], clean=3.0, corrupt=1.0)
    torch.testing.assert_close(s.normalized(), torch.tensor([[0.0, 0.5], [1.0, 0.25]]))
    flat = hooks.Sweep("layers", "loss", "patch", torch.ones(2), ["a", "b"], 1.0, 1.0)
    assert torch.isnan(flat.normalized()).all()


def test_the_unread_last_position_of_the_loss_is_said_and_changes_nothing():
    model, clean, corrupt = pair("hf_gpt2")
    s = hooks.patch_sweep(model, clean, corrupt)
    assert s.values[:, -1].tolist() == pytest.approx([s.corrupt] * 2, abs=ATOL)
    assert any("position 15" in n and "cannot change" in n for n in s.notes)


@pytest.mark.parametrize("text", ["layers×positions", "layersxpositions", "layers*positions",
                                  "Layers x Positions".replace(" x ", "x")])
def test_over_aliases(text):
    assert parse_over(text) == "layers×positions"


@pytest.mark.parametrize("kwargs, says", [
    (dict(over="tokens"), "over='tokens'"),
    (dict(metric="accuracy"), "give one of loss"),
    (dict(metric="logit_diff:5"), "two tokens"),
    (dict(metric="logit_diff:5,999"), "outside the vocabulary"),
    (dict(metric="logit_diff:cat,dog"), "no tokenizer"),
])
def test_bad_arguments_are_one_line(kwargs, says):
    model, clean, corrupt = pair("hf_gpt2")
    with pytest.raises(ValueError, match=says) as err:
        hooks.patch_sweep(model, clean, corrupt, **kwargs)
    assert "\n" not in str(err.value)


def test_a_loss_that_counts_nothing_and_a_bad_chunk_are_refused():
    model, clean, corrupt = pair("hf_gpt2")
    none = {**clean, "labels": torch.full_like(clean["input_ids"], -100)}
    with pytest.raises(ValueError, match="counts no token"):
        hooks.patch_sweep(model, none, corrupt)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        hooks.patch_sweep(model, clean, corrupt, chunk=0)


def test_batches_of_different_shapes_are_refused():
    model, clean, _ = pair("hf_gpt2")
    short = {"input_ids": clean["input_ids"][:, :8]}
    with pytest.raises(ValueError, match="same"):
        hooks.patch_sweep(model, clean, short)


# -- attribution patching -------------------------------------------------------------------
def ref_attribution_positions(model, clean, corrupt, metric):
    """d metric / d α of the corrupted run with block l's output at position p moved to
    a + α (a_clean − a), at α = 0."""
    outs, _ = clean_acts(model, clean)
    model_outs, _ = clean_acts(model, corrupt)
    blocks = blocks_of(model)
    t = clean["input_ids"].shape[1]
    vals = torch.zeros(len(blocks), t, dtype=torch.float64)
    for layer, blk in enumerate(blocks):
        for p in range(t):
            alpha = torch.zeros((), requires_grad=True)

            def hook(m, a, o, layer=layer, p=p, alpha=alpha):
                h = o[0] if isinstance(o, tuple) else o
                d = torch.zeros_like(h)
                d[:, p] = outs[layer][:, p] - model_outs[layer][:, p]
                h = h + alpha * d
                return (h, *o[1:]) if isinstance(o, tuple) else h
            handle = blk.register_forward_hook(hook)
            try:
                logits = model(**corrupt).logits
                (g,) = torch.autograd.grad(metric(logits), alpha)
            finally:
                handle.remove()
            vals[layer, p] = float(g)
    return vals


def torch_loss(logits, ids):
    logp = torch.log_softmax(logits.float(), -1)[:, :-1]
    return -logp.gather(-1, ids[:, 1:, None]).mean()


@pytest.mark.parametrize("family", FAMILIES)
def test_attribution_is_the_directional_derivative_at_the_corrupted_run(family):
    model, clean, corrupt = pair(family)
    ids = clean["input_ids"]
    ref = ref_attribution_positions(model, clean, corrupt, lambda lg: torch_loss(lg, ids))
    a = hooks.attribution_patch(model, clean, corrupt)
    assert a.method == "attribution" and a.values.shape == (2, 16)
    torch.testing.assert_close((a.values - a.corrupt).double(), ref, atol=ATOL, rtol=0)
    for p in model.parameters():
        assert p.grad is None  # the activations' gradients only


def test_attribution_heads_sum_the_positions_of_each_head():
    model, clean, corrupt = pair("hf_llama")
    _, zc = clean_acts(model, clean)
    a = hooks.attribution_patch(model, clean, corrupt, over="heads", metric="logit_diff:5,7")
    # reference: d/dα with the whole head slice moved along its clean - corrupted difference
    _, zr = clean_acts(model, corrupt)
    vals = torch.zeros(2, 4, dtype=torch.float64)
    for layer, blk in enumerate(model.model.layers):
        for h in range(4):
            alpha = torch.zeros((), requires_grad=True)

            def pre(m, args, layer=layer, h=h, alpha=alpha):
                z = args[0]
                d = torch.zeros_like(z)
                d[..., h * 16:(h + 1) * 16] = (zc[layer] - zr[layer])[..., h * 16:(h + 1) * 16]
                return (z + alpha * d,)
            handle = blk.self_attn.o_proj.register_forward_pre_hook(pre)
            try:
                lg = model(**corrupt).logits
                (g,) = torch.autograd.grad((lg[:, -1, 5] - lg[:, -1, 7]).mean(), alpha)
            finally:
                handle.remove()
            vals[layer, h] = float(g)
    torch.testing.assert_close((a.values - a.corrupt).double(), vals, atol=ATOL, rtol=0)


def test_attribution_correlates_with_the_exact_sweep_on_a_small_change():
    model, clean, _ = pair("hf_llama")
    ids = clean["input_ids"]
    x = ids.clone()
    x[:, 3] = (x[:, 3] + 1) % families.V
    corrupt = {"input_ids": x}
    exact = hooks.patch_sweep(model, clean, corrupt, metric="logit_diff:5,7")
    est = hooks.attribution_patch(model, clean, corrupt, metric="logit_diff:5,7")
    assert est.corrupt == pytest.approx(exact.corrupt, abs=ATOL)
    assert est.clean == pytest.approx(exact.clean, abs=ATOL)
    assert est.correlation(exact) > 0.5


# -- a model whose blocks cannot be resumed from their recorded arguments --------------------
class Stashing(nn.Module):
    """A tiny LM whose blocks read the batch's ids from their parent (not their arguments):
    resuming them on more rows than recorded fails, so the sweep runs whole passes."""

    def __init__(self, v=11, d=8, layers=2) -> None:
        super().__init__()
        self.embed = nn.Embedding(v, d)
        self.layers = nn.ModuleList(StashBlock(self, d, v) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, v, bias=False)
        self.stash = None

    def forward(self, input_ids):
        self.stash = input_ids
        h = self.embed(input_ids)
        for blk in self.layers:
            h = blk(h)
        return self.lm_head(self.norm(h))


class StashBlock(nn.Module):
    def __init__(self, parent, d, v) -> None:
        super().__init__()
        self.parent = [parent]  # not a child module
        self.lin = nn.Linear(d, d)
        self.pos = nn.Embedding(v, d)

    def forward(self, h):
        return h + torch.tanh(self.lin(h)) + self.pos(self.parent[0].stash)


def test_a_block_that_reads_outside_its_arguments_gets_whole_passes_and_a_note():
    torch.manual_seed(0)
    model = Stashing().eval()
    ids = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
    x = ids.clone()
    x[:, 2] = (x[:, 2] + 3) % 11
    s = hooks.patch_sweep(model, ids, x, metric="logit_diff:1,2")
    assert any("whole forward passes" in n for n in s.notes)
    ref = torch.zeros(2, 6, dtype=torch.float64)
    outs = []
    hs = [b.register_forward_hook(lambda m, a, o: outs.append(o.detach())) for b in model.layers]
    with torch.no_grad():
        model(ids)
    for h in hs:
        h.remove()
    for layer, blk in enumerate(model.layers):
        for p in range(6):
            def hook(m, a, o, layer=layer, p=p):
                o = o.clone()
                o[:, p] = outs[layer][:, p]
                return o
            handle = blk.register_forward_hook(hook)
            with torch.no_grad():
                lg = model(x)
            handle.remove()
            ref[layer, p] = ref_logit_diff(lg, 1, 2)
    torch.testing.assert_close(s.values.double(), ref, atol=ATOL, rtol=0)
