"""minillm ``attention_mask``: a padded batch computes what its rows compute unpadded.

The reference for every padded row is the same row run alone without padding (and HF Llama /
Mixtral with the same mask and HF's ``cumsum(mask) - 1`` positions). Rows of different lengths
are padded on the left or the right, on the SDPA and the eager path, with and without the KV
cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import minillm.attention as attention_mod
from minillm import MiniLLM, load_preset
from minillm.moe import load_balancing_loss

LENGTHS = [11, 7, 1]  # the last row is one token: all its earlier positions are pads
V = 256
PAD_ID = 0


def make(impl: str = "sdpa", **kw) -> MiniLLM:
    torch.manual_seed(0)
    return MiniLLM(load_preset("tiny", attn_implementation=impl, **kw)).eval()


def rows(lengths=LENGTHS, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g) for n in lengths]


def pad(seqs, side: str, width: int | None = None):
    """(ids (B, S), mask (B, S), where (B,) slice of the real tokens in each padded row)."""
    width = width or max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD_ID)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    where = []
    for i, s in enumerate(seqs):
        n = len(s)
        sl = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, sl], mask[i, sl] = s, 1
        where.append(sl)
    return ids, mask, where


PATHS = [(impl, side) for impl in ("sdpa", "eager") for side in ("left", "right")]


@pytest.mark.parametrize(("impl", "side"), PATHS)
def test_padded_rows_give_the_unpadded_logits(impl, side):
    model = make(impl)
    seqs = rows()
    ids, mask, where = pad(seqs, side, width=14)
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        assert torch.isfinite(out.logits).all()
        for s, sl, logits in zip(seqs, where, out.logits, strict=True):
            alone = model(s[None]).logits[0]
            torch.testing.assert_close(logits[sl], alone, atol=1e-5, rtol=0)


def test_left_padding_without_the_mask_leaks_and_with_it_does_not():
    """The 3.12 of the issue: the pads leak in without a mask (and positions shift)."""
    model = make()
    s = rows([9])[0]
    ids, mask, (sl,) = pad([s], "left", width=13)
    with torch.no_grad():
        alone = model(s[None]).logits[0]
        leaky = (model(ids).logits[0, sl] - alone).abs().max().item()
        masked = (model(ids, attention_mask=mask).logits[0, sl] - alone).abs().max().item()
    assert leaky > 0.1 and masked < 1e-5


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_fully_masked_row_gives_no_nan_forward_or_backward(impl):
    model = make(impl).train()
    ids, mask, _ = pad(rows([6, 4]), "left")
    mask[1] = 0  # a row of pads only
    out = model(ids, labels=ids, attention_mask=mask, output_attentions=impl == "eager")
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert len(out.router_logits) == 2 and torch.isfinite(out.aux_loss)


def test_pads_are_left_out_of_the_loss():
    model = make()
    seqs = rows()
    ids, mask, where = pad(seqs, "left", width=13)
    labels = ids.clone()
    out = model(ids, labels=labels, attention_mask=mask)
    # the reference: every row's own next-token cross-entropy, pooled over all targets
    logits, targets = [], []
    for s in seqs:
        lg = model(s[None]).logits[0]
        logits.append(lg[:-1])
        targets.append(s[1:])
    ref = F.cross_entropy(torch.cat(logits), torch.cat(targets))
    torch.testing.assert_close(out.ce_loss, ref, atol=1e-5, rtol=0)
    # labels and ids at pads change nothing
    noisy_ids, noisy_labels = ids.clone(), labels.clone()
    noisy_ids[mask == 0] = 7
    noisy_labels[mask == 0] = 9
    again = model(noisy_ids, labels=noisy_labels, attention_mask=mask)
    torch.testing.assert_close(again.ce_loss, out.ce_loss, atol=1e-6, rtol=0)
    for sl, a, b in zip(where, again.logits, out.logits, strict=True):
        torch.testing.assert_close(a[sl], b[sl], atol=1e-5, rtol=0)


def test_aux_loss_counts_real_tokens_only():
    model = make()
    cfg = model.config
    seqs = rows()
    ids, mask, _ = pad(seqs, "right", width=12)
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        alone = [model(s[None]).router_logits for s in seqs]
    for layer, got in enumerate(out.aux_losses):
        real = torch.cat([a[layer] for a in alone])
        ref = load_balancing_loss(real, cfg.num_local_experts, cfg.num_experts_per_tok)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("impl", "side"), PATHS)
def test_kv_cache_with_padding_equals_the_full_forward(impl, side):
    model = make(impl)
    seqs = rows([12, 8, 5], seed=1)
    ids, mask, where = pad(seqs, side, width=14)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        first = model(ids[:, :9], attention_mask=mask[:, :9], use_cache=True)
        second = model(ids[:, 9:], attention_mask=mask, past_key_values=first.past_key_values,
                       use_cache=True)
        cached = torch.cat((first.logits, second.logits), dim=1)
        for sl, c, f in zip(where, cached, full, strict=True):
            torch.testing.assert_close(c[sl], f[sl], atol=1e-5, rtol=0)
        # and one token at a time (the generate() pattern)
        past, outs = None, []
        for j in range(ids.shape[1]):
            o = model(ids[:, j : j + 1], attention_mask=mask[:, : j + 1], past_key_values=past,
                      use_cache=True)
            past = o.past_key_values
            outs.append(o.logits)
        stepwise = torch.cat(outs, dim=1)
        for s, sl, lg in zip(seqs, where, stepwise, strict=True):
            torch.testing.assert_close(lg[sl], model(s[None]).logits[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_padded_batch_equals_each_row_alone(side, use_cache):
    model = make()
    seqs = rows([6, 3, 5], seed=2)
    ids, mask, where = pad(seqs, side)
    out = model.generate(ids, 5, attention_mask=mask, use_cache=use_cache)
    assert out.shape == (3, ids.shape[1] + 5)
    for s, sl, row in zip(seqs, where, out, strict=True):
        alone = model.generate(s[None], 5)[0]
        got = torch.cat((row[sl], row[ids.shape[1] :]))
        assert torch.equal(got, alone)


def test_eager_weights_put_nothing_on_pads():
    model = make("eager")
    ids, mask, where = pad(rows(), "left")
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
    for w in out.attentions:
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-6, rtol=0)
        real_q = mask.bool()[:, None, :, None]
        pad_k = ~mask.bool()[:, None, None, :]
        assert (w * (real_q & pad_k)).abs().max() == 0


def test_the_mask_reaches_sdpa_as_its_attn_mask(monkeypatch):
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention_mod.F, "scaled_dot_product_attention", spy)
    model = make()
    ids, mask, _ = pad(rows(), "left")
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert len(seen) == model.config.num_hidden_layers
    b, s = ids.shape
    keep = torch.tril(torch.ones(s, s, dtype=torch.bool))[None] & mask.bool()[:, None, :]
    keep |= torch.eye(s, dtype=torch.bool)[None]
    for attn_mask, causal in seen:
        assert causal is False and attn_mask.dtype == torch.bool
        assert torch.equal(attn_mask, keep[:, None])


def test_bad_masks_are_refused_in_one_line():
    model = make()
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, past \+ T\) = \(2, 5\)"):
        model(ids, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="only 0 .padding. and 1"):
        model(ids, attention_mask=torch.full((2, 5), 2))
    with pytest.raises(ValueError, match="attention_mask must be"):
        model.generate(ids, 2, attention_mask=torch.ones(5))


def test_learned_positions_follow_the_mask_too():
    model = make(position_embedding="learned")
    seqs = rows()
    ids, mask, where = pad(seqs, "left")
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
        for s, sl, lg in zip(seqs, where, out, strict=True):
            torch.testing.assert_close(lg[sl], model(s[None]).logits[0], atol=1e-5, rtol=0)


# -- HF with the same mask ---------------------------------------------------------------
@pytest.mark.parametrize("arch", ["Llama", "Mixtral"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_logits_match_hf_with_the_same_mask(arch, side):
    transformers = pytest.importorskip("transformers")
    fields = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if arch == "Mixtral":
        fields.update(num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    hf = getattr(transformers, f"{arch}ForCausalLM")(
        getattr(transformers, f"{arch}Config")(**fields)).eval()
    ours = MiniLLM.from_hf(hf).eval()
    ids, mask, where = pad(rows(), side, width=13)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # HF generate()'s rule
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        mine = ours(ids, attention_mask=mask).logits
    for sl, a, b in zip(where, mine, theirs, strict=True):
        torch.testing.assert_close(a[sl], b[sl], atol=1e-4, rtol=0)
