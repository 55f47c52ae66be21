"""The spike's story against references computed here: per-token losses of HF-style labels
(shifted, ``-100`` ignored) from ``F.cross_entropy(reduction="none")``, and which gradient grew
first in a history of norms written by hand."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hooks.recorder.story import gradient_growth, grown, token_losses, top_tokens


def test_token_losses_of_hf_labels_are_shifted_and_ignore_minus_100():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    labels[1, 3] = -100

    class Out:  # an HF ModelOutput's attribute
        pass

    out = Out()
    out.logits = logits
    losses, targets, shifted = token_losses(out, (), {"labels": labels})
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1),
                          reduction="none").reshape(2, 6)
    assert shifted and torch.equal(targets, labels[:, 1:])
    assert math.isnan(float(losses[1, 2]))  # label position 3 predicted from position 2
    keep = labels[:, 1:] != -100
    torch.testing.assert_close(losses[keep], ref[keep])
    top = top_tokens(losses, targets, shifted, k=3)
    want = torch.topk(torch.where(keep, ref, torch.tensor(-math.inf)).reshape(-1), 3)
    for t, i, v in zip(top, want.indices.tolist(), want.values.tolist(), strict=True):
        b, p = divmod(i, 6)
        assert (t["row"], t["position"]) == (b, p + 1)  # the predicted token's position
        assert t["target"] == int(labels[b, p + 1]) and abs(t["loss"] - v) < 1e-5


def test_the_gradient_that_grew_first_is_named_with_its_ratio():
    steps = list(range(1, 31))
    norms = torch.ones(30, 3)
    norms[:, 1] = 2.0
    norms[24, 2] = 5.0  # parameter c: 5× its median at step 25
    norms[26:, 1] = 20.0  # parameter b: 10× its median from step 27 (the spike)
    out = gradient_growth(steps, norms, ["a", "b", "c"])
    assert out["first"]["name"] == "c" and out["first"]["step"] == 25
    assert out["first"]["ratio"] == 5.0
    assert out["largest"]["name"] == "b" and out["largest"]["ratio"] == 10.0
    assert gradient_growth(steps[:10], norms[:10], ["a", "b", "c"]) is None  # too few steps


def test_internals_grow_against_their_median_over_earlier_captures():
    history = [{"out:x": 1.0, "grad:w": 2.0}, {"out:x": 3.0, "grad:w": 2.0},
               {"out:x": 2.0, "grad:w": 4.0}]
    now = {"out:x": 2.5, "grad:w": 30.0}
    out = grown(now, history)
    assert out["first"]["name"] == "grad:w" and out["first"]["ratio"] == 15.0  # median 2
    assert out["largest"]["name"] == "grad:w" and out["captures"] == 3
    assert grown(now, []) is None


def test_adam_update_ratio_is_the_update_the_optimizer_then_applies():
    from hooks.recorder.story import adam_ratios

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(lin.parameters(), lr=1e-2)
    for _ in range(3):  # moments and step count in the state
        lin(torch.randn(5, 8)).pow(2).mean().backward()
        want_before = {n: p.detach().clone() for n, p in lin.named_parameters()}
        got = adam_ratios(opt, list(lin.named_parameters()))
        opt.step()
        opt.zero_grad()
        for n, p in lin.named_parameters():
            ref = float((p.detach() - want_before[n]).norm() / want_before[n].norm())
            assert abs(got[f"adam:{n}"] - ref) <= 1e-4 * ref, n
    assert adam_ratios(torch.optim.SGD(lin.parameters(), lr=0.1), []) == {}
