"""Where a NaN started, named exactly on every path (issue 18, part 2).

The reference in every test is the test's own construction: the one weight it poisons, or the
one projection that it makes return NaN from finite inputs. The attention of :class:`TinyGPT`
is our own code, so the two behaviours that fused kernels differ on are both covered on any
machine: ``propagate`` (a NaN query row gives NaN probabilities, the loss is NaN) and ``mask``
(NaN probabilities are returned as 0, as some CPUs' fused SDPA does: the loss stays finite and
the gradients turn NaN).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hooks
from hooks.store.store import RunStore
from hooks.train import trainer as trainer_mod
from hooks.train.trainer import Trainer

V, D, T, B = 17, 16, 8, 2


class QProj(nn.Linear):
    """A query projection that, while ``poison`` is set, returns NaN in its first output
    feature from finite inputs: the one place a NaN is born."""

    poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.poison:
            y = y.clone()
            y[..., 0] = float("nan")
        return y


class Attn(nn.Module):
    def __init__(self, swallow: bool) -> None:
        super().__init__()
        self.swallow = swallow
        self.q_proj, self.k_proj = QProj(D, D), nn.Linear(D, D)
        self.v_proj, self.o_proj = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        if self.swallow:  # what a kernel that drops NaN does: the row comes back as 0
            p = torch.nan_to_num(p, nan=0.0)
        return self.o_proj(p @ v)


class Block(nn.Module):
    def __init__(self, swallow: bool) -> None:
        super().__init__()
        self.attn = Attn(swallow)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class TinyGPT(nn.Module):
    """Logits (B, T, V) from token ids (B, T); the loss is the caller's."""

    def __init__(self, swallow: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(swallow), Block(swallow)])
        self.head = nn.Linear(D, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class WithLoss(nn.Module):
    """TinyGPT returning ``(logits, loss)`` for :class:`hooks.train.trainer.Trainer`."""

    def __init__(self, swallow: bool) -> None:
        super().__init__()
        self.gpt = TinyGPT(swallow)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        logits = self.gpt(idx)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


Q = "gpt.blocks.1.attn.q_proj"


def _train_until_poisoned(swallow: bool, monkeypatch, capture_works: bool = True):
    if not capture_works:
        def broken(*args, **kwargs):
            raise RuntimeError("the capture engine broke")
        monkeypatch.setattr(trainer_mod, "_maybe_capture", broken)
    torch.manual_seed(0)
    model = WithLoss(swallow)
    idx, targets = _data()
    q = model.gpt.blocks[1].attn.q_proj
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def on_step(report):
        q.poison = report.step == 3  # step 4's forward makes the NaN

    trainer = Trainer(model, (idx, targets), opt, total_steps=10)
    result = trainer.run(on_step=on_step)
    return model, result


@pytest.mark.parametrize("capture_works", [True, False])
@pytest.mark.parametrize("swallow", [False, True])
def test_a_nan_born_in_a_projection_is_named_whatever_the_attention_does(
        monkeypatch, swallow, capture_works):
    model, result = _train_until_poisoned(swallow, monkeypatch, capture_works)
    f = result.failure
    assert result.status == "failed" and result.last_step == 4
    # the symptom differs with the attention's behaviour; the origin does not
    assert f.what == ("gradient" if swallow else "loss")
    assert (f.step, f.module, f.direction) == (4, Q, "forward")
    assert f"holds {B * T} NaN of {B * T * D} values" in f.detail
    assert f.located_by == ("capture" if capture_works else "forward hooks")
    if swallow:
        assert f.note is not None and f.note.startswith("the loss stayed finite")
        if capture_works:  # the capture names the call that returned finite values
            assert "gpt.blocks.1.attn (Attn) returned finite values" in f.note
    else:
        assert f.note is None
    # one sentence: what, where, when; the module named once
    assert result.reason.startswith(f"non-finite {f.what} at step 4, first in {Q} (forward): ")
    assert result.reason.count("q_proj") == 1
    # the failed update was skipped: every weight is still finite
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_the_swallowing_path_really_keeps_the_loss_finite():
    """The premise of the mask case, checked on the model itself: NaN queries, finite loss,
    NaN gradients; the propagate case gives a NaN loss."""
    idx, targets = _data()
    for swallow, loss_finite in ((True, True), (False, False)):
        torch.manual_seed(0)
        model = WithLoss(swallow)
        model.gpt.blocks[1].attn.q_proj.poison = True
        _, loss = model(idx, targets)
        assert bool(torch.isfinite(loss)) is loss_finite
        if loss_finite:
            loss.backward()
            assert not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                           if p.grad is not None)


def test_a_poisoned_weight_is_named_as_the_parameter_that_holds_it(monkeypatch):
    """minillm with its own (fused, machine-dependent) attention: a NaN in q_proj's weight is
    named as that parameter, whether this CPU's SDPA keeps the loss finite or not."""
    from minillm import MiniLLM
    from tests.models import tiny_config

    torch.manual_seed(0)
    model = MiniLLM(tiny_config(num_hidden_layers=2))
    ids = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    w = model.model.layers[1].self_attn.q_proj.weight

    def on_step(report):
        if report.step == 3:
            with torch.no_grad():
                w[0, 0] = float("nan")

    result = Trainer(model, {"input_ids": ids, "labels": ids}, opt, total_steps=10).run(
        on_step=on_step)
    f = result.failure
    assert (f.step, f.module, f.direction, f.located_by) == (
        4, "model.layers.1.self_attn.q_proj", "parameter", "parameters")
    assert f.detail == f"its weight holds 1 NaN of {w.numel()} values"
    assert f.what in ("loss", "gradient")  # the kernel's choice, not the origin


# -- hooks.run: the user's own loop ---------------------------------------------------------


def _user_loop(db, name, *, poison, swallow=False, pass_optimizer=True, every=5, steps=12,
               log_grad_norm=False):
    """A plain loop: forward, CE, backward, AdamW step, then ``run.log``; ``poison(model,
    step)`` runs before each step's forward."""
    torch.manual_seed(0)
    model = TinyGPT(swallow)
    idx, targets = _data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with hooks.run(name, db=db) as run:
        run.watch(model, every=every, optimizer=opt if pass_optimizer else None)
        for step in range(1, steps + 1):
            poison(model, step)
            loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
            opt.zero_grad()
            loss.backward()
            gn = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            opt.step()
            run.log(loss=loss, **({"grad_norm": gn} if log_grad_norm else {}))
    with RunStore(db) as store:
        info = store.run(name)
    return run, info


def _nan_weight_before(at: int):
    def poison(model, step):
        if step == at:
            with torch.no_grad():
                model.blocks[1].mlp[0].weight[3, 5] = float("nan")
    return poison


@pytest.mark.parametrize("pass_optimizer", [True, False])
def test_a_nan_weight_before_an_uncaptured_step_is_named_at_that_step(tmp_path, pass_optimizer):
    run, info = _user_loop(tmp_path / "r.sqlite", "w", poison=_nan_weight_before(7),
                           pass_optimizer=pass_optimizer)
    expected = {"step": 7, "metric": "loss", "module": "blocks.1.mlp.0",
                "direction": "parameter", "detail": f"its weight holds 1 NaN of {2 * D * D} values"}
    assert run.nonfinite == expected and info.nonfinite == expected
    assert info.nonfinite_line() == (
        f"non-finite loss at step 7, first in blocks.1.mlp.0 (parameter): its weight holds 1 NaN "
        f"of {2 * D * D} values")


def _nan_query_at(at: int):
    def poison(model, step):
        model.blocks[1].attn.q_proj.poison = step == at
    return poison


def test_a_swallowed_nan_in_a_user_loop_is_named_before_the_update(tmp_path):
    """Loss finite, gradients NaN: with ``optimizer=`` the step pre-hook locates it while the
    weights are still the forward's."""
    run, info = _user_loop(tmp_path / "r.sqlite", "s", poison=_nan_query_at(7), swallow=True)
    nf = info.nonfinite
    assert (nf["step"], nf["metric"], nf["module"], nf["direction"]) == (
        7, "gradient", "blocks.1.attn.q_proj", "forward")
    assert f"holds {B * T} NaN of {B * T * D} values" in nf["detail"]
    assert nf["note"].startswith("the model's output stayed finite: blocks.1.attn (Attn)")


def test_a_propagated_nan_in_a_user_loop_is_named_without_the_optimizer(tmp_path):
    run, info = _user_loop(tmp_path / "r.sqlite", "p", poison=_nan_query_at(7),
                           pass_optimizer=False)
    nf = info.nonfinite
    assert (nf["step"], nf["metric"], nf["module"], nf["direction"]) == (
        7, "loss", "blocks.1.attn.q_proj", "forward")
    assert "while its inputs were finite" in nf["detail"]


def test_a_swallowed_nan_without_the_optimizer_is_not_blamed_on_a_wrong_module(tmp_path):
    """Without ``optimizer=`` the NaN gradient reaches every weight before ``log()``: mdb says
    it cannot tell, and how to, instead of naming the embedding."""
    run, info = _user_loop(tmp_path / "r.sqlite", "n", poison=_nan_query_at(7), swallow=True,
                           pass_optimizer=False, log_grad_norm=True)
    nf = info.nonfinite
    assert (nf["step"], nf["metric"], nf["module"]) == (7, "grad_norm", None)
    assert "run.watch(model, optimizer=opt)" in nf["detail"]
    assert info.nonfinite_line().startswith("non-finite grad_norm at step 7 (module not located")


def test_a_captured_step_names_the_same_origin(tmp_path):
    """Step 5 is captured (every=5): the sentinel only reads the weights; the answer is the
    same parameter."""
    run, info = _user_loop(tmp_path / "r.sqlite", "c", poison=_nan_weight_before(5))
    assert (info.nonfinite["step"], info.nonfinite["module"], info.nonfinite["direction"]) == (
        5, "blocks.1.mlp.0", "parameter")


def test_watch_refuses_an_optimizer_that_is_not_one(tmp_path):
    with hooks.run("x", db=tmp_path / "r.sqlite") as run, pytest.raises(TypeError, match="Optim"):
        run.watch(TinyGPT(), optimizer="adam")


def test_nan_in_the_data_is_said_to_come_in_with_the_inputs(tmp_path):
    """A NaN in the batch, not in the model: the first call that sees it is named with the
    input that already held it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with hooks.run("d", db=tmp_path / "r.sqlite") as run:
        run.watch(model, every=5)
        for step in range(1, 9):
            xb = x.clone()
            if step == 7:
                xb[3, 1] = float("nan")
            loss = F.mse_loss(model(xb), y)
            loss.backward()
            model.zero_grad()
            run.log(loss=loss)
    nf = run.nonfinite
    assert (nf["step"], nf["module"], nf["direction"]) == (7, "0", "forward")
    assert "its input args[0] already held 1 NaN of 64 values" in nf["detail"]


def test_the_next_step_locates_it_when_the_weights_stayed_finite(tmp_path):
    """Swallowed NaN, no ``optimizer=``, a loop that skips non-finite updates: the weights are
    still finite at ``log()``, so the next step is captured and names the projection."""
    torch.manual_seed(0)
    model = TinyGPT(swallow=True)
    idx, targets = _data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with hooks.run("nx", db=tmp_path / "r.sqlite") as run:
        run.watch(model, every=5)
        for step in range(1, 10):
            model.blocks[1].attn.q_proj.poison = step in (7, 8)
            loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
            opt.zero_grad()
            loss.backward()
            gn = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            if torch.isfinite(gn):
                opt.step()
            run.log(loss=loss, grad_norm=gn)
    nf = run.nonfinite
    assert (nf["step"], nf["metric"], nf["module"], nf["direction"]) == (
        7, "grad_norm", "blocks.1.attn.q_proj", "forward")
    assert nf["detail"].endswith("(at step 8, the next step, captured to locate it)")



def test_the_cheap_checks_tell_overflowing_finite_values_from_nan_and_inf():
    """The per-step checks sum (one pass); finite values whose sum overflows are still finite,
    and a single NaN or Inf anywhere is found (torch.isfinite is the reference)."""
    from hooks.nonfinite.origin import _any_nonfinite, first_nonfinite_tensor

    big = torch.full((10,), 3e38)  # finite, its sum is inf in fp32
    assert bool(torch.isfinite(big).all()) and not math.isfinite(float(big.sum()))
    assert first_nonfinite_tensor((big, {"x": big})) is None
    assert not _any_nonfinite([big, torch.ones(3)])
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.ones(64)
        t[17] = bad
        assert first_nonfinite_tensor([big, t]) is t
        assert _any_nonfinite([big, t])


def test_a_swallowed_nan_on_a_captured_step_is_named_from_the_capture(tmp_path):
    """Step 5 is captured (every=5): the step pre-hook sees NaN gradients but leaves the
    origin to the capture's trace, which saw the projection's NaN output (not the embedding,
    the first parameter whose gradient is NaN)."""
    run, info = _user_loop(tmp_path / "r.sqlite", "cs", poison=_nan_query_at(5), swallow=True)
    nf = info.nonfinite
    assert (nf["step"], nf["metric"], nf["module"], nf["direction"]) == (
        5, "gradient", "blocks.1.attn.q_proj", "forward")
    assert nf["note"].startswith("the model's output stayed finite: blocks.1.attn (Attn)")


def test_a_nan_made_by_the_loss_function_is_said_so(monkeypatch):
    """Every module output is finite and the loss function makes the NaN: the failure says so,
    with the capture broken too (the forward-hook locator answers)."""
    def broken(*args, **kwargs):
        raise RuntimeError("the capture engine broke")

    monkeypatch.setattr(trainer_mod, "_maybe_capture", broken)
    torch.manual_seed(0)
    model = TinyGPT()
    idx, targets = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(logits, batch):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) * float("nan")

    result = Trainer(model, (idx,), opt, total_steps=3, loss_fn=loss_fn).run()
    f = result.failure
    assert (f.step, f.what, f.module) == (1, "loss", None)
    assert "no module output was non-finite: the loss itself is" in result.reason
    assert "float64" not in result.reason
