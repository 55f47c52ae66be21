"""Triggered capture of ``run.watch(model, every, optimizer=)``: the step whose loss spikes is
captured before its update, with its batch, and the run trains bit for bit as without it.

References are computed here with plain torch: the parameters of the same loop run without
mdb (``torch.equal``), the spiking step's loss recomputed from the stored batch and the
weights the step used, and its per-token losses from ``F.cross_entropy(reduction="none")``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import hooks
from hooks.store.store import RunStore
from hooks.train.trainer import load_trace

V, T, B = 29, 12, 4
SPIKE_AT = 40  # the step whose batch is unlike every other one
STEPS = 70


class TinyLM(nn.Module):
    """Embedding → dropout → MLP → logits; returns ``(logits, loss)`` like nanoGPT, the loss
    over ``targets`` (B, T), unshifted."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.drop = nn.Dropout(0.1)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, V)

    def forward(self, idx, targets):
        h = self.drop(self.emb(idx))
        logits = self.head(h + self.mlp(h))
        loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        return logits, loss


def _batches() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, V, (B, T), generator=g)
    y = (x * 7 + 3) % V  # a mapping the model learns quickly
    bad_x = torch.randint(0, V, (B, T), generator=g)
    bad_y = torch.randint(0, V, (B, T), generator=g)  # nothing it has seen: the loss jumps
    return {s: ((bad_x, bad_y) if s == SPIKE_AT else (x, y)) for s in range(1, STEPS + 1)}


def _train(model, batches, run=None, weights=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if run is not None:
        run.watch(model, every=1000, optimizer=opt)
    losses = {}
    for step in range(1, STEPS + 1):
        if weights is not None:  # what the step's forward uses: its weights and RNG state
            weights[step] = (copy.deepcopy(model.state_dict()), torch.get_rng_state())
        x, y = batches[step]
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = float(loss.detach())
        if run is not None:
            run.log(loss=loss)
    return losses


def test_triggered_capture_leaves_training_bit_identical_and_stores_the_batch(tmp_path):
    torch.manual_seed(0)
    init = TinyLM()
    batches = _batches()

    plain = copy.deepcopy(init)
    torch.manual_seed(1)  # the dropout stream: the same for both runs
    ref_losses = _train(plain, batches)

    watched = copy.deepcopy(init)
    weights: dict[int, dict] = {}
    db = tmp_path / "runs.sqlite"
    torch.manual_seed(1)
    with hooks.run("spiky", db=db) as run:
        losses = _train(watched, batches, run, weights)

    # the training run is unchanged, bit for bit
    for (name, a), (_, b) in zip(plain.named_parameters(), watched.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert losses == ref_losses
    assert ref_losses[SPIKE_AT] > 3 * ref_losses[SPIKE_AT - 1]  # the fixture does spike

    with RunStore(db) as store:
        info = store.run("spiky")
        # every=1000: only triggered steps are stored, the first one the spiking step
        assert store.internals_steps(info.id)[0] == SPIKE_AT
        trace = load_trace(store, info.id, SPIKE_AT)
    meta = trace.meta
    assert meta["trigger"]["reason"] == "loss spike"
    assert meta["spike"]["line"].startswith(f"step {SPIKE_AT} (loss spike)")
    x, y = batches[SPIKE_AT]
    assert torch.equal(trace.tensors["batch/arg0"], x)
    assert torch.equal(trace.tensors["batch/arg1"], y)

    # the stored loss, recomputed by plain torch from the stored batch and the step's weights
    # (and its RNG state: the dropout mask of the training forward)
    model = TinyLM()
    state, rng = weights[SPIKE_AT]
    model.load_state_dict(state)
    torch.set_rng_state(rng)
    h = model.drop(model.emb(trace.tensors["batch/arg0"]))
    logits = model.head(h + model.mlp(h))
    ce = F.cross_entropy(logits.reshape(-1, V), trace.tensors["batch/arg1"].reshape(-1),
                         reduction="none")
    assert abs(float(ce.mean().detach()) - meta["loss"]) <= 1e-5 * max(1.0, meta["loss"])
    assert abs(meta["trigger"]["loss"] - ref_losses[SPIKE_AT]) <= 1e-6 * ref_losses[SPIKE_AT]

    # the top-loss tokens against F.cross_entropy(reduction="none")
    top = meta["spike"]["top_tokens"]
    want = torch.topk(ce, 5)
    assert [t["row"] * T + t["position"] for t in top] == want.indices.tolist()
    for t, v in zip(top, want.values.tolist(), strict=True):
        assert abs(t["loss"] - v) <= 1e-4 * max(1.0, v)
        assert t["target"] == int(y.reshape(-1)[t["row"] * T + t["position"]])


def test_gradient_norm_spike_triggers_too(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    batches = _batches()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights fixed: only the batch moves
    x, y = batches[1]
    with hooks.run("gspike", db=tmp_path / "r.sqlite") as run:
        run.watch(model, every=1000, optimizer=opt)
        for step in range(1, 31):
            _, loss = model(x, y)
            loss = loss * (50.0 if step == 25 else 1.0)  # same loss value scale
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.log(ce=float(loss))
    with RunStore(tmp_path / "r.sqlite") as store:
        info = store.run("gspike")
        trace = load_trace(store, info.id, 25)
    assert trace.meta["trigger"]["reason"] in ("loss spike", "gradient-norm spike")
    assert trace.meta["trigger"]["grad_norm"] > 10 * trace.meta["trigger"]["grad_baseline"]
