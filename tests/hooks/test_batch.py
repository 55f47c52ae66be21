"""hooks.batch: the loss and batch conventions every user-model path shares."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hooks
from hooks.batch import Batch, BatchError, from_factory, select_loss
from tests import families


def test_nanogpt_tuple_loss_is_its_cross_entropy():
    model, (idx, tgt) = families.nanogpt()
    out = model(idx, tgt)
    choice = select_loss(out)
    assert choice.source == "out[1]" and not choice.fallback
    logits = out[0]
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
    assert float(choice.loss) == pytest.approx(float(ref), rel=1e-6)
    assert choice.describe() == "loss = out[1]"


def test_loss_attribute_and_key_come_first():
    model, batch = families.hf_llama()
    out = Batch.of(batch).call(model)
    assert select_loss(out).source == "out.loss"
    model, batch = families.transformer_encoder()
    assert select_loss(Batch.of(batch).call(model)).source == "out['loss']"


def test_a_given_loss_fn_wins_and_sees_the_batch():
    model, batch, loss_fn = families.cnn()
    out = batch.call(model)
    choice = select_loss(out, loss_fn, batch)
    assert choice.source == "loss_fn(out, batch)"
    assert float(choice.loss) == pytest.approx(float(F.cross_entropy(out, batch.targets)))
    # explicit beats the model's own loss
    model, raw = families.hf_llama()
    b = Batch.of(raw)
    out = b.call(model)
    choice = select_loss(out, lambda o, bb: o.logits.square().mean(), b)
    assert float(choice.loss) == pytest.approx(float(out.logits.square().mean()))


def test_mean_of_the_output_only_when_nothing_else_exists_and_it_says_so():
    model = nn.Linear(4, 3)
    out = model(torch.randn(2, 4))
    choice = select_loss(out)
    assert choice.fallback and choice.source == "mean(out)"
    assert "returned no loss" in choice.describe()
    assert float(choice.loss) == pytest.approx(float(out.mean()))
    # a nanoGPT called without targets returns (logits, None): the mean of the logits
    model, (idx, _) = families.nanogpt()
    choice = select_loss(model(idx))
    assert choice.fallback and choice.source == "mean(out[0])"


def test_several_unnamed_scalars_are_refused_with_what_to_do():
    a = torch.tensor(1.0, requires_grad=True) * 2
    b = torch.tensor(2.0, requires_grad=True) * 3
    with pytest.raises(BatchError, match=r"out\[0\], out\[1\].*loss_fn"):
        select_loss((a, b))
    # only one of them carries a graph: that one
    assert select_loss((a, torch.tensor(3.0))).source == "out[0]"


def test_loss_fn_must_return_a_scalar():
    with pytest.raises(BatchError, match="0-dim"):
        select_loss(torch.zeros(3), lambda o, b: o, None)


def test_positional_arguments_get_their_forward_names_and_roles():
    model, batch = families.nanogpt()
    b = Batch.of(batch)
    roles = {s.name: s.role for s in b.slots(model)}
    assert roles == {"idx": "ids", "targets": "targets"}
    assert b.ids(model) is batch[0]
    model, batch = families.lstm()
    assert {s.name: s.role for s in Batch.of(batch).slots(model)} == {"x": "ids", "y": "targets"}
    model, batch = families.hf_bert()
    roles = {s.name: s.role for s in Batch.of(batch).slots(model)}
    assert roles == {"input_ids": "ids", "attention_mask": "mask", "labels": "targets"}


def test_a_float_input_named_x_is_not_token_ids():
    model, batch, _ = families.cnn()
    assert batch.ids(model) is None
    assert [s.role for s in batch.slots(model)] == ["other"]


def test_token_labels_from_text_tokenizer_or_ids():
    ids = torch.tensor([[5, 6], [7, 8]])
    assert Batch((ids,)).token_labels() == ["5", "6", "7", "8"]
    assert Batch((ids,), token_text=list("abcd")).token_labels() == list("abcd")

    class Tok:
        def convert_ids_to_tokens(self, xs):
            return [f"<{x}>" for x in xs]

    assert Batch((ids,), tokenizer=Tok()).token_labels() == ["<5>", "<6>", "<7>", "<8>"]


def test_from_factory_checks_what_it_got():
    model = nn.Linear(2, 2)
    m, b, fn = from_factory((model, torch.zeros(1, 2)))
    assert m is model and isinstance(b, hooks.Batch) and fn is None
    with pytest.raises(BatchError, match=r"\(model, batch\) or \(model, batch, loss_fn\)"):
        from_factory(model)
    with pytest.raises(BatchError, match="torch.nn.Module"):
        from_factory(("model", torch.zeros(1)))
    with pytest.raises(BatchError, match="callable"):
        from_factory((model, torch.zeros(1), 3))
    with pytest.raises(BatchError, match="hooks.Batch"):
        from_factory((model, 3))
