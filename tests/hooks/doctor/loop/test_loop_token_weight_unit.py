"""The loop doctor's per-token weight (``hooks.doctor.loop.watch.token_weight``): the weight ``c``
a cross-entropy loss gives each scored position, read back from the gradient of the logits,
against the ``c`` the test builds the loss with (a mean, a sum, HF's sum over
``num_items_in_batch``); and, through ``run.watch``, a loop whose loss is divided by the
window's token count as HF's Trainer does it (no division by the accumulation steps) is
healthy. The latter was caught only by the HF Trainer integration test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hooks.doctor.loop.watch import token_weight
from tests.loop_models import TinyLM, V, batches, run_loop

pytestmark = pytest.mark.usefixtures("one_thread")


def _logits_grad(reduction_weight: float, masked: int = 0):
    """(logits (2, 6, V), d loss / d logits, scored positions) for ``loss = c · Σ CE`` over
    the labels that are not -100."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, V, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (2, 6), generator=g)
    if masked:
        labels[:, -masked:] = -100
    ce = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100,
                         reduction="sum")
    (grad,) = torch.autograd.grad(ce * reduction_weight, logits)
    return logits.detach(), grad, int((labels != -100).sum())


@pytest.mark.parametrize("masked", [0, 2])
@pytest.mark.parametrize("how", ["mean", "sum", "window"])
def test_token_weight_is_the_weight_the_loss_was_built_with(how, masked):
    n = 12 - 2 * masked
    c = {"mean": 1 / n, "sum": 1.0, "window": 1 / 37}[how]  # window: num_items_in_batch=37
    logits, grad, scored = _logits_grad(c, masked)
    assert scored == n
    got = token_weight(logits, grad)
    assert got is not None
    assert got[1] == n
    assert got[0] == pytest.approx(c, rel=1e-4)


def test_no_scored_position_has_no_weight():
    logits, grad, _ = _logits_grad(1.0)
    assert token_weight(logits, torch.zeros_like(grad)) is None


class _ItemsLM(TinyLM):
    """HF's causal-LM loss with ``num_items_in_batch``: the summed CE over the shifted labels
    divided by the window's count (a mean when it is not given)."""

    def forward(self, input_ids, labels=None, attention_mask=None, num_items_in_batch=None):
        logits, _ = super().forward(input_ids)
        if labels is None:
            return logits, None
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                             ignore_index=-100, reduction="sum")
        n = num_items_in_batch if num_items_in_batch is not None else \
            int((labels[:, 1:] != -100).sum())
        return logits, ce / n


def test_a_loss_over_the_window_s_token_count_is_healthy(tmp_path):
    ga, steps = 4, 2

    def loop(run):
        torch.manual_seed(0)
        model = _ItemsLM(p=0.0)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        run.watch(model, every=1, optimizer=opt)
        data = batches(ga * steps, masked=[0, 5, 2, 8])  # unequal token counts
        for start in range(0, len(data), ga):
            window = data[start:start + ga]
            items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)
            for b in window:
                _, loss = model(**b, num_items_in_batch=items)
                loss.backward()
            opt.step()
            opt.zero_grad()
            run.log(loss=loss)

    found = run_loop(tmp_path / "runs" / "mdb.sqlite", loop)
    assert [f for f in found if f.kind == "grad_accumulation"] == []
    assert found == []
