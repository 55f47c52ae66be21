"""``hooks.Batch.target_layout`` and ``hooks.Batch.resized``: one batch adapter for every
convention (HF-aligned labels, nanoGPT's shifted targets, masked-LM labels, seq2seq labels,
class labels), checked by running the models on the rewritten batches and comparing with their
own losses."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hooks.batch import Batch, BatchError
from tests import families

HAS_HF = importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(not HAS_HF, reason="needs transformers")


def test_layouts_of_the_zoo_batches():
    model, batch = families.nanogpt()
    assert Batch.of(batch).target_layout(model).kind == "shifted"
    model, batch = families.lstm()
    assert Batch.of(batch).target_layout(model).kind == "shifted"
    model, batch = families.transformer_encoder()
    assert Batch.of(batch).target_layout(model).kind == "aligned"
    model, batch, _ = families.cnn()
    assert batch.target_layout(model).kind == "class"
    assert Batch((torch.zeros(2, 5, dtype=torch.long),)).target_layout().kind == "none"


@needs_hf
def test_layouts_of_hf_batches():
    model, batch = families.hf_bert()
    layout = Batch.of(batch).target_layout(model)
    assert layout.kind == "masked" and layout.ignore == -100
    model, batch = families.hf_t5()
    assert Batch.of(batch).target_layout(model).kind == "seq2seq"
    model, batch = families.hf_llama()
    assert Batch.of(batch).target_layout(model).kind == "aligned"


def test_nanogpt_targets_are_rewritten_to_the_next_tokens():
    model, batch = families.nanogpt()
    b = Batch.of(batch).resized(model, batch_size=3, seq_len=10, vocab_size=families.V, seed=4)
    idx, tgt = b.args
    assert idx.shape == tgt.shape == (3, 10)
    g = torch.Generator().manual_seed(4)  # the ids are the generator's first draw
    assert torch.equal(idx, torch.randint(0, families.V, (3, 10), generator=g))
    assert torch.equal(tgt[:, :-1], idx[:, 1:])
    with torch.no_grad():
        logits, loss = model(*b.args)  # the old code crashed here: 128 ids vs 64 targets
    ref = F.cross_entropy(logits.reshape(-1, families.V), tgt.reshape(-1))
    assert float(loss) == pytest.approx(float(ref), rel=1e-6)
    # dropped: a trailing optional positional is left out, the model returns (logits, None)
    d = Batch.of(batch).resized(model, ids=idx, targets="drop")
    assert len(d.args) == 1 and model(*d.args)[1] is None


def test_lstm_drop_and_given_ids():
    model, batch = families.lstm()
    new = torch.tensor([[1, 2, 3, 4]])
    b = Batch.of(batch).resized(model, ids=new, vocab_size=families.V)
    assert torch.equal(b.args[1][:, :-1], torch.tensor([[2, 3, 4]]))
    assert b.args[1].shape == (1, 4)
    d = Batch.of(batch).resized(model, ids=new, targets="drop")
    assert model(*d.args).shape == (1, 4, families.V)  # logits without y


@needs_hf
def test_bert_masked_labels_keep_their_share_of_positions():
    model, batch = families.hf_bert()
    b = Batch.of(batch).resized(model, batch_size=3, seq_len=20, vocab_size=families.V)
    ids, labels = b.kwargs["input_ids"], b.kwargs["labels"]
    keep = labels != -100
    assert ids.shape == labels.shape == (3, 20)
    assert torch.equal(labels[keep], ids[keep])
    assert keep.float().mean().item() == pytest.approx(0.25, abs=0.05)  # every 4th, as given
    assert torch.equal(b.kwargs["attention_mask"], torch.ones(3, 20, dtype=torch.long))
    with torch.no_grad():
        out = model(**b.kwargs)
    ref = F.cross_entropy(out.logits.reshape(-1, families.V), labels.reshape(-1),
                          ignore_index=-100)
    assert float(out.loss) == pytest.approx(float(ref), rel=1e-5)


@needs_hf
def test_t5_decoder_inputs_come_from_labels_or_are_given():
    model, batch = families.hf_t5()
    b = Batch.of(batch).resized(model, batch_size=2, seq_len=12, vocab_size=families.V,
                                targets="drop")
    assert "labels" not in b.kwargs
    labels_like = b.kwargs["decoder_input_ids"]
    assert labels_like.shape == (2, 12) and bool((labels_like[:, 0] == 0).all())  # start id
    with torch.no_grad():
        assert model(**b.kwargs).logits.shape == (2, 12, families.V)
    dec = torch.randint(0, families.V, (2, 7))
    g = Batch.of(batch).resized(model, ids=batch["input_ids"], targets="drop", decoder_ids=dec)
    assert torch.equal(g.kwargs["decoder_input_ids"], dec)
    # rewritten labels: the model derives its decoder inputs from them, as HF does
    r = Batch.of(batch).resized(model, seq_len=12, vocab_size=families.V)
    with torch.no_grad():
        out = model(**r.kwargs)
    ref = F.cross_entropy(out.logits.reshape(-1, families.V), r.kwargs["labels"].reshape(-1))
    assert float(out.loss) == pytest.approx(float(ref), rel=1e-5)


def test_masks_positions_and_other_tensors_follow_the_new_shape():
    class M(nn.Module):
        def forward(self, input_ids, key_padding_mask=None, position_ids=None,
                    token_type_ids=None, cache_position=None, labels=None):
            return input_ids

    ids = torch.zeros(2, 5, dtype=torch.long)
    raw = {"input_ids": ids, "key_padding_mask": torch.tensor([[0, 0, 0, 1, 1]] * 2).bool(),
           "position_ids": torch.arange(5).expand(2, 5),
           "token_type_ids": torch.tensor([[0] * 5, [1] * 5]),
           "cache_position": torch.arange(5), "labels": ids}
    b = Batch.of(raw).resized(M(), ids=torch.ones(3, 4, dtype=torch.long))
    assert not bool(b.kwargs["key_padding_mask"].any())  # padding masks: nothing padded
    assert b.kwargs["key_padding_mask"].shape == (3, 4)
    assert torch.equal(b.kwargs["position_ids"], torch.arange(4).expand(3, 4))
    assert torch.equal(b.kwargs["token_type_ids"], torch.tensor([[0] * 4, [1] * 4, [0] * 4]))
    assert torch.equal(b.kwargs["cache_position"], torch.arange(4))
    assert torch.equal(b.kwargs["labels"], torch.ones(3, 4, dtype=torch.long))


def test_class_targets_of_a_loss_fn_follow_the_batch_size():
    class Clf(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, tokens):
            return self.head(self.emb(tokens).mean(1))

    b = Batch((torch.zeros(2, 6, dtype=torch.long),), targets=torch.tensor([1, 2]))
    assert b.target_layout(Clf()).kind == "class"
    r = b.resized(Clf(), batch_size=5, vocab_size=10)
    assert torch.equal(r.targets, torch.tensor([1, 2, 1, 2, 1]))
    assert r.args[0].shape == (5, 6)


def test_what_the_adapter_cannot_do_is_said():
    model, batch, _ = families.cnn()
    with pytest.raises(BatchError, match="no \\(B, T\\) integer token ids"):
        batch.resized(model, seq_len=4)
    model, batch = families.nanogpt()
    with pytest.raises(BatchError, match="vocabulary size"):
        Batch.of(batch).resized(model, seq_len=4)
    with pytest.raises(BatchError, match="'rewrite' or 'drop'"):
        Batch.of(batch).resized(model, ids=batch[0], targets="keep")
