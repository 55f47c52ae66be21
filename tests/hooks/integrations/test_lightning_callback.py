"""``hooks.integrations.lightning.MdbCallback`` in a real ``lightning.Trainer`` (CPU, a tiny LM,
gradient accumulation 2, a warmup scheduler stepped per optimizer step, validation): one mdb
run with the logged losses, the watched steps' captures and the loop doctor's findings with
the Trainer's own optimizer and scheduler."""

from __future__ import annotations

import pytest
import torch

from hooks.store.store import RunStore
from tests.loop_models import TinyLM, batches, no_decay_groups

pl = pytest.importorskip("lightning.pytorch")

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


class _Module(pl.LightningModule):
    def __init__(self, decay_everything: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.lm = TinyLM(p=0.1)
        self.decay_everything = decay_everything

    def forward(self, input_ids, labels=None):
        return self.lm(input_ids, labels=labels)

    def training_step(self, batch, batch_idx):
        loss = self(**batch)[1]
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(**batch)[1])

    def configure_optimizers(self):
        params = self.parameters() if self.decay_everything else no_decay_groups(self)
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(tmp_path, name, module):
    from hooks.integrations.lightning import MdbCallback

    data = [{k: v[0] for k, v in b.items()} for b in batches(16, b=1)]
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    val = torch.utils.data.DataLoader(data[:4], batch_size=2)
    cb = MdbCallback(name, db=tmp_path / "mdb.sqlite", every=2)
    trainer = pl.Trainer(max_steps=4, accumulate_grad_batches=2, accelerator="cpu", devices=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, val_check_interval=4,
                         num_sanity_val_steps=0, default_root_dir=str(tmp_path),
                         callbacks=[cb])
    trainer.fit(module, loader, val)
    with RunStore(tmp_path / "mdb.sqlite") as store:
        info = store.run(name)
        return (info, store.metrics(info.id), store.internals_steps(info.id),
                store.findings(info.id), trainer)


def test_a_lightning_run_is_one_mdb_run_with_no_finding(tmp_path, monkeypatch):
    from hooks.doctor.loop import checks as loop_checks

    compared = []
    original = loop_checks.accumulation_findings

    def spy(step, acc, per, tokens, usual):
        compared.append((acc, per, tokens))
        return original(step, acc, per, tokens, usual)

    monkeypatch.setattr(loop_checks, "accumulation_findings", spy)
    info, rows, captured, findings, trainer = _fit(tmp_path, "pl", _Module())
    assert info.status == "finished" and trainer.global_step == 4
    assert [r.step for r in rows] == [1, 2, 3, 4]
    assert all("loss" in r.values for r in rows) and "val_loss" in rows[-1].values
    assert captured == [2, 4]
    assert findings == []
    # the accumulation check ran after Lightning's closure (2 micro-batches, each loss / 2)
    assert [len(per) for _, per, _ in compared] == [2, 2]
    for acc, per, tokens in compared:
        ref = sum(g * (n / sum(tokens)) for g, n in zip(per, tokens, strict=True))
        assert float(acc @ ref / (acc.norm() * ref.norm())) > 0.9999


def test_a_lightning_decay_everything_optimizer_is_caught(tmp_path):
    _, _, _, findings, _ = _fit(tmp_path, "pl-wd", _Module(decay_everything=True))
    wd = {f.subject: f for f in findings if f.kind == "weight_decay"}
    assert sorted(wd["param group 0"].detail["params"]) == sorted(
        n for n, p in _Module().named_parameters() if p.ndim < 2)
    assert wd["param group 0 (embeddings)"].detail["params"] == ["lm.embed.weight"]


class _Memorise(pl.LightningModule):
    """TinyLM without dropout, Adam at 1e-2: one batch repeated is memorised within a few
    steps, so a random batch's loss jumps far above the running median."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lm = TinyLM(p=0.0)

    def forward(self, input_ids, labels=None):
        return self.lm(input_ids, labels=labels)

    def training_step(self, batch, batch_idx):
        loss = self(**batch)[1]
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_a_lightning_step_whose_loss_spikes_is_captured_before_its_update(tmp_path):
    """Step ``bad`` trains on a random batch after 29 steps of one memorised batch: its loss
    spikes, and the step is captured (replayed before the optimizer applies it) with its own
    input ids, although ``every`` never comes."""
    from hooks.integrations.lightning import MdbCallback
    from hooks.train.trainer import load_trace

    bad, steps = 30, 34
    same = batches(1, b=2, seed=0)[0]
    odd = batches(1, b=2, seed=7)[0]
    data = [odd if step == bad else same for step in range(1, steps + 1)]
    loader = torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)
    cb = MdbCallback("pl-spike", db=tmp_path / "mdb.sqlite", every=1000)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[cb])
    trainer.fit(_Memorise(), loader)
    with RunStore(tmp_path / "mdb.sqlite") as store:
        info = store.run("pl-spike")
        assert bad in store.internals_steps(info.id)
        trace = load_trace(store, info.id, bad)
    assert trace.meta["trigger"]["reason"] in ("loss spike", "gradient-norm spike")
    assert torch.equal(trace.tensors["batch/input_ids"], odd["input_ids"])
    assert trace.forward  # the module's own forward ran under the capture
