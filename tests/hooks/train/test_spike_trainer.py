"""The built-in trainer's triggered capture (``mdb overfit``): the spiking step is captured
before its update, with its batch, and the weights after 70 steps are bit for bit those of
the same training without it (``torch.equal``)."""

from __future__ import annotations

import copy

import torch

from hooks.train.trainer import Trainer
from tests.hooks.recorder.test_spike_capture import SPIKE_AT, STEPS, T, TinyLM, _batches


def _train(model, spikes: bool):
    batches = _batches()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tr = Trainer(model, lambda step: batches[step], opt, total_steps=STEPS, spikes=spikes)
    torch.manual_seed(1)
    reports = []
    tr.run(on_step=reports.append)
    return reports


def test_trainer_captures_the_spiking_step_and_trains_the_same():
    torch.manual_seed(0)
    init = TinyLM()
    plain, watched = copy.deepcopy(init), copy.deepcopy(init)
    ref = _train(plain, spikes=False)
    got = _train(watched, spikes=True)
    for (name, a), (_, b) in zip(plain.named_parameters(), watched.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert [r.metrics.values for r in ref if r.trace is not None] == []
    traced = [r for r in got if r.trace is not None]
    assert traced and traced[0].step == SPIKE_AT
    trace = traced[0].trace
    assert trace.meta["trigger"]["reason"] == "loss spike"
    assert trace.meta["loss"] == ref[SPIKE_AT - 1].metrics.values["loss"]
    x, y = _batches()[SPIKE_AT]
    assert torch.equal(trace.tensors["batch/arg0"], x)
    assert torch.equal(trace.tensors["batch/arg1"], y)
    assert traced[0].internals is not None and traced[0].internals_tensors is not None
    top = trace.meta["spike"]["top_tokens"]
    assert len(top) == 5 and all(0 <= t["position"] < T for t in top)
