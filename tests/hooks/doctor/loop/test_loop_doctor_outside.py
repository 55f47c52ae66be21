"""The loop doctor where the loop does the work the model does not: a loss computed outside
the model (``F.cross_entropy(model(x).view(-1, V), y.view(-1))``) under gradient
accumulation, an evaluation right after a watched step's ``log()``, and memory that grows
step over step (a loss summed with its graph, outputs kept in a list). Each bug in a loop
written here is named; the same loop fixed gets no finding; watching does not change the
run (the parameters are bit-identical with and without ``hooks.run``).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import hooks
from tests.loop_models import LogitsLM, V, batches, no_decay_groups, run_loop

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def db(tmp_path):
    return tmp_path / "runs" / "mdb.sqlite"


def _only(found, kind):
    return [f for f in found if f.kind == kind]


def _outside_loop(mode: str, ga: int = 4, steps: int = 3, every: int = 1, masked=None,
                  form: str = "view"):
    """The common loop of one's own: the model returns logits, the loop computes the loss;
    ``ga`` micro-batches per optimizer step; ``mode``: ``"mean"`` (loss / ga, right for
    equal token counts), ``"sum"`` (loss.backward() of the sum: the bug), ``"tokens"``
    (each micro-batch's summed loss over the window's token count: right for any counts).
    ``form``: the model is called on ``ids[:, :-1]`` and the loss is
    ``F.cross_entropy(logits.view(-1, V), …)`` (``"view"``), or it is called on the whole
    row and the loss slices the logits (``"slice"``: ``logits[:, :-1]``), or an
    ``nn.CrossEntropyLoss`` module computes it (``"module"``), or the loop writes into the
    logits first (``"inplace"``: token 0 masked out, ``logits[..., 0] = -1e4``)."""
    criterion = torch.nn.CrossEntropyLoss(ignore_index=-100)

    def mean_loss(model, b):
        if form == "slice":
            logits = model(b["input_ids"])
            return F.cross_entropy(logits[:, :-1].reshape(-1, V),
                                   b["labels"][:, 1:].reshape(-1), ignore_index=-100)
        logits = model(b["input_ids"][:, :-1])
        if form == "inplace":
            logits[..., 0] = -1e4
        if form == "module":
            return criterion(logits.reshape(-1, V), b["labels"][:, 1:].reshape(-1))
        return F.cross_entropy(logits.view(-1, V), b["labels"][:, 1:].reshape(-1),
                               ignore_index=-100)

    def train(run, model):
        torch.manual_seed(0)
        opt = torch.optim.AdamW(no_decay_groups(model), lr=1e-2)
        if run is not None:
            run.watch(model, every=every, optimizer=opt)
        data = batches(steps * ga, masked=masked)
        for step in range(steps):
            window = data[step * ga:(step + 1) * ga]
            total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)
            for b in window:
                if mode == "tokens":
                    x, y = b["input_ids"][:, :-1], b["labels"][:, 1:]
                    loss = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1),
                                           ignore_index=-100, reduction="sum") / total
                else:
                    loss = mean_loss(model, b)
                    loss = loss if mode == "sum" else loss / ga
                loss.backward()
            opt.step()
            opt.zero_grad()
            if run is not None:
                run.log(loss=loss)
        return model

    return train


# -- accumulation with the loss computed outside the model ------------------------------------
@pytest.mark.parametrize("form", ["view", "slice", "module", "inplace"])
def test_summed_accumulation_of_a_loss_computed_outside_the_model(db, form):
    torch.manual_seed(0)
    found = run_loop(db, lambda run: _outside_loop("sum", form=form)(run, LogitsLM(p=0.1)))
    (f,) = _only(found, "grad_accumulation")
    assert (f.step, f.subject) == (1, "gradient scale")
    assert f.detail["factor"] == pytest.approx(4.0, rel=1e-3)  # 4 micro-batches, summed
    assert "summed" in f.line and f.detail["evidence"]
    assert f.detail["tokens"] == [2 * 11] * 4  # read from the logits' gradient: B·(T-1)
    assert found == [f]


@pytest.mark.parametrize("mode,masked,form", [("mean", None, "view"), ("mean", None, "slice"),
                                              ("mean", None, "module"),
                                              ("mean", None, "inplace"),
                                              ("tokens", [0, 6, 3, 9], "view")])
def test_a_loss_outside_the_model_averaged_right_has_no_finding(db, mode, masked, form):
    torch.manual_seed(0)
    seen = []

    def loop(run):
        _outside_loop(mode, masked=masked, form=form)(run, LogitsLM(p=0.1))
        seen.append(run.loop_doctor)

    assert run_loop(db, loop) == []
    assert seen[0]._accum_checks == 3  # the check ran (replayed the loss), it is not silent


def test_per_micro_batch_means_of_unequal_tokens_outside_the_model(db):
    torch.manual_seed(0)
    found = run_loop(db, lambda run: _outside_loop("mean", masked=[0, 6, 3, 9])(
        run, LogitsLM(p=0.1)))
    (f,) = _only(found, "grad_accumulation")
    assert f.subject == "micro-batch weights"
    n = [22, 22 - 2 * 6, 22 - 2 * 3, 22 - 2 * 9]  # scored tokens, counted from the labels
    assert f.detail["tokens"] == n
    assert f.detail["weights"] == pytest.approx([0.25] * 4, abs=1e-4)


def test_watching_does_not_change_the_run(db):
    """The same loop (dropout on, the loss outside the model) trained with and without
    ``hooks.run`` + ``watch``: the parameters are bit-identical."""
    torch.manual_seed(0)
    plain = _outside_loop("sum", every=1)(None, LogitsLM(p=0.1))
    torch.manual_seed(0)
    with hooks.run("same", db=db) as run:
        watched = _outside_loop("sum", every=1)(run, LogitsLM(p=0.1))
    for (name, a), (_, b) in zip(plain.named_parameters(), watched.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name


# -- an evaluation right after a watched step's log() -------------------------------------------
def _eval_after_log(eval_mode: bool, every: int = 5, steps: int = 10):
    def loop(run):
        torch.manual_seed(0)
        model = LogitsLM(p=0.1)
        opt = torch.optim.AdamW(no_decay_groups(model), lr=1e-3)
        run.watch(model, every=every, optimizer=opt)
        data, val = batches(steps), batches(1, seed=1)[0]
        for step in range(1, steps + 1):
            b = data[step - 1]
            loss = F.cross_entropy(model(b["input_ids"][:, :-1]).reshape(-1, V),
                                   b["labels"][:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.log(loss=loss)
            if step % every == 0:  # validation after the step's log(), as samples/own_loop.py
                if eval_mode:
                    model.eval()
                with torch.no_grad():
                    v = F.cross_entropy(model(val["input_ids"][:, :-1]).reshape(-1, V),
                                        val["labels"][:, 1:].reshape(-1))
                model.train()
                run.log(val_loss=v, step=run.step)

    return loop


def test_an_evaluation_after_log_with_dropout_on_is_named(db):
    (f,) = run_loop(db, _eval_after_log(eval_mode=False))
    assert (f.kind, f.step, f.subject) == ("train_eval", 5, "model.train()")
    assert f.detail["modules"] == ["drop"] and "model.eval()" in f.line
    assert run_loop(db, _eval_after_log(eval_mode=True), name="ok") == []


# -- memory that grows step over step ------------------------------------------------------------
def _growing(bug: str, fixed: bool, steps: int = 4, every: int = 1):
    """``bug``: ``"sum"``: ``total = total + loss`` (the fix: ``loss.item()``); ``"keep"``:
    the logits appended to a list each step (the fix: ``logits.detach()``)."""
    lines = {}

    def loop(run):
        torch.manual_seed(0)
        model = LogitsLM(p=0.0)
        opt = torch.optim.AdamW(no_decay_groups(model), lr=1e-3)
        run.watch(model, every=every, optimizer=opt)
        total, kept = 0.0, []
        for b in batches(steps):
            lines["call"] = inspect.currentframe().f_lineno + 1
            logits = model(b["input_ids"][:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, V), b["labels"][:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            if bug == "sum":
                lines["sum"] = inspect.currentframe().f_lineno + 1
                total = total + (loss.item() if fixed else loss)
            else:
                kept.append(logits.detach() if fixed else logits)
            run.log(loss=loss)

    return loop, lines


@pytest.mark.parametrize("every", [1, 3])
def test_a_loss_summed_with_its_graph_is_named_where_it_is_made(db, every):
    loop, lines = _growing("sum", fixed=False, every=every)
    (f,) = run_loop(db, loop)
    # the step before made it (watched or not), the watched step joined it
    assert (f.kind, f.step) == ("memory_growth", 2 if every == 1 else 3)
    here = f"test_loop_doctor_outside.py:{lines['sum']}"
    assert f.subject == f"graph kept at {here}" and f.detail["shape"] == []
    assert f.detail["site"].endswith(here) and ".item()" in f.line
    assert f.detail["nodes"] > 1
    loop, _ = _growing("sum", fixed=True)
    assert run_loop(db, loop, name="ok") == []


@pytest.mark.parametrize("every", [1, 2])
def test_outputs_kept_across_steps_are_named_with_their_shape(db, every):
    loop, lines = _growing("keep", fixed=False, steps=3 * every, every=every)
    (f,) = run_loop(db, loop)
    assert (f.kind, f.step) == ("memory_growth", 3 * every)
    assert f.detail["shape"] == [2, 11, V] and f.detail["steps"] == [every, 2 * every]
    assert f.detail["kept"] == 2 and f.detail["bytes"] == 2 * (2 * 11 * V * 4)  # fp32 logits
    assert f.detail["site"].endswith(f"test_loop_doctor_outside.py:{lines['call']}")
    assert ".detach()" in f.line
    loop, _ = _growing("keep", fixed=True, steps=3 * every, every=every)
    assert run_loop(db, loop, name="ok") == []
