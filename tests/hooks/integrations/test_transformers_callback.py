"""``hooks.integrations.transformers.MdbCallback`` in a real ``transformers.Trainer`` on a tiny
Llama (CPU): the training is one mdb run with the Trainer's logged losses, captures of the
watched steps and the loop doctor's findings with the Trainer's own optimizer and scheduler.
"""

from __future__ import annotations

import pytest
import torch

from hooks.store.store import RunStore
from tests.families import hf_llama, ids

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        x = ids(1, 16, seed=i)[0]
        return {"input_ids": x, "labels": x}


def _train(tmp_path, name, model=None, optimizers=(None, None), **extra):
    from hooks.integrations.transformers import MdbCallback

    model = model if model is not None else hf_llama()[0]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=4, logging_steps=1, learning_rate=1e-3,
        warmup_steps=2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, **extra)
    cb = MdbCallback(name, db=tmp_path / "mdb.sqlite", every=2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(),
                                   callbacks=[cb], optimizers=optimizers)
    trainer.train()
    with RunStore(tmp_path / "mdb.sqlite") as store:
        info = store.run(name)
        rows = store.metrics(info.id)
        return info, rows, store.internals_steps(info.id), store.findings(info.id), trainer


def test_a_trainer_run_is_one_mdb_run_with_no_finding(tmp_path, monkeypatch):
    from hooks.doctor.loop import checks as loop_checks

    compared = []
    original = loop_checks.accumulation_findings

    def spy(step, acc, per, tokens, usual):
        compared.append((acc, per, tokens))
        return original(step, acc, per, tokens, usual)

    monkeypatch.setattr(loop_checks, "accumulation_findings", spy)
    info, rows, captured, findings, trainer = _train(tmp_path, "hf")
    assert info.status == "finished" and info.total_steps == 4
    assert [r.step for r in rows] == [1, 2, 3, 4]
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert [r.values["loss"] for r in rows] == pytest.approx(logged, rel=1e-6)
    assert captured == [2, 4]  # every=2
    assert findings == []  # Trainer: no-decay groups, loss / items in the window, sched/step
    # the accumulation check ran at the watched steps 2 and 4: the real .grad (before the
    # Trainer's clipping) is the token-weighted sum of the micro-batches' own-mean gradients
    assert len(compared) == 2
    for acc, per, tokens in compared:
        assert tokens == [2 * 15, 2 * 15]  # 2 rows of 16 labels, shifted: 15 targets a row
        ref = sum(g * (n / sum(tokens)) for g, n in zip(per, tokens, strict=True))
        cos = float(acc @ ref / (acc.norm() * ref.norm()))
        assert cos > 0.9999 and float(acc.norm() / ref.norm()) == pytest.approx(1, rel=1e-3)


def test_a_trainer_with_a_decay_everything_optimizer_is_caught(tmp_path):
    model, _ = hf_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    info, _, _, findings, _ = _train(tmp_path, "hf-wd", model=model, optimizers=(opt, sched))
    wd = [f for f in findings if f.kind == "weight_decay"]
    norms = sorted(n for n, p in model.named_parameters() if p.ndim < 2)
    assert {f.subject for f in wd} == {"param group 0", "param group 0 (embeddings)"}
    got = [f for f in wd if f.subject == "param group 0"][0].detail["params"]
    assert len(got) == len(norms) and all(n.endswith("norm.weight") for n in got)


def test_missing_library_and_bad_options_say_one_line():
    from hooks.integrations.transformers import MdbCallback

    with pytest.raises(TypeError, match="unexpected keyword argument 'evry'"):
        MdbCallback("x", evry=3)
    with pytest.raises(ValueError, match="every=-1"):
        MdbCallback("x", every=-1)


class _OneBadBatch(torch.utils.data.IterableDataset):
    """The same sequence every step (it is memorised fast), but step ``bad``'s, which is
    random: its loss jumps. Iterable: no sampler shuffles the order."""

    def __init__(self, steps: int, bad: int):
        self.steps, self.bad = steps, bad

    def __iter__(self):
        for step in range(1, self.steps + 1):
            x = ids(1, 16, seed=1000 + step if step == self.bad else 0)[0]
            yield {"input_ids": x, "labels": x}


def test_a_trainer_step_whose_loss_spikes_is_captured_before_its_update(tmp_path):
    from hooks.integrations.transformers import MdbCallback
    from hooks.train.trainer import load_trace

    bad, steps = 30, 34
    model = hf_llama()[0]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=1, max_steps=steps,
        logging_steps=1, learning_rate=3e-3, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0)
    cb = MdbCallback("hf-spike", db=tmp_path / "mdb.sqlite", every=1000)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_OneBadBatch(steps, bad),
                                   callbacks=[cb])
    trainer.train()
    with RunStore(tmp_path / "mdb.sqlite") as store:
        info = store.run("hf-spike")
        steps_captured = store.internals_steps(info.id)
        assert bad in steps_captured
        trace = load_trace(store, info.id, bad)
    meta = trace.meta
    assert meta["trigger"]["reason"] in ("loss spike", "gradient-norm spike")
    x = ids(1, 16, seed=1000 + bad)
    assert torch.equal(trace.tensors["batch/input_ids"], x)
    assert torch.equal(trace.tensors["batch/labels"], x)
    assert trace.backward  # the replay ran the backward of the model's own loss
