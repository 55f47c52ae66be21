"""An edit that cannot change the loss is said (issue 36, item 5): a ``patch … pos=-1`` changes
the last position, whose logits HF's shifted loss never reads; the loss of the edited step is the
step's own to the last bit, and the edit's line says why instead of "1 of 1 call(s) changed"."""

from __future__ import annotations

import torch

import hooks
from hooks.whatif.rerun import loss_reads, rerun_edited
from tests.zoo import batch_for, tiny
from tui.cli import main


def _step(model, batch):
    with hooks.capture(model) as a:
        loss = model(**batch).loss
        loss.backward()
    return a, float(loss.detach())


def test_a_last_position_patch_is_said_not_to_reach_the_loss_and_does_not():
    model = tiny()
    batch = batch_for(model)
    a, loss = _step(model, batch)
    b = rerun_edited(a, ["patch model.layers.0 from=rolled pos=-1"])
    assert b.edits[0].applied
    # the reference: the loss is the step's own, exactly
    assert b.meta["loss"] == loss
    text = b.edits[0].describe()
    assert "1 of 1 call(s) changed, but pos=-1 lies after the last position the loss reads" \
        in text and "cannot change" in text
    assert any("pos=-1" in n.message for n in b.notes if n.kind == "edit")


def test_a_patch_the_loss_reads_keeps_the_plain_count():
    model = tiny()
    batch = batch_for(model)
    a, loss = _step(model, batch)
    b = rerun_edited(a, ["patch model.layers.0 from=rolled pos=-2"])
    assert b.edits[0].describe().endswith("1 of 1 call(s) changed")
    assert b.meta["loss"] != loss  # it reads position T-2: the loss moves


def test_loss_reads_follows_the_targets():
    model = tiny()
    ids = torch.arange(12).view(2, 6) % 11
    assert loss_reads(model, {"input_ids": ids, "labels": ids}) == [0, 1, 2, 3, 4]
    labels, mask = ids.clone(), torch.ones_like(ids)
    labels[:, 3:], mask[:, 3:] = -100, 0  # right padding: ignored where the mask is 0
    assert loss_reads(model, {"input_ids": ids, "labels": labels, "attention_mask": mask}) \
        == [0, 1]
    assert loss_reads(model, {"input_ids": ids, "labels": ids}, loss_fn=lambda o, b: 0) is None


def test_mdb_diff_edit_says_it_on_the_edit_line(capsys):
    ids = ",".join(str(i % 50 + 3) for i in range(16))
    assert main(["diff", "--edit", "patch model.layers.0 from=clean pos=-1", "--source-ids", ids,
                 "--preset", "tiny", "--seq-len", "16", "--batch-size", "1", "--table"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("edit: patch"))
    assert "lies after the last position the loss reads (14)" in line


def test_a_causal_lm_scoring_one_token_reads_the_position_before_it():
    from tests import families

    model, batch = families.hf_gpt2()
    ids = batch["input_ids"]
    labels = torch.full_like(ids, -100)
    labels[:, 9] = ids[:, 9]  # only token 9 is scored: read at position 8
    assert loss_reads(model, {"input_ids": ids, "labels": labels}) == [8]
