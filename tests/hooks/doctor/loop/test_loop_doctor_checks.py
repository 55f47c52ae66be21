"""The training-loop doctor's other findings (scheduler, weight decay, train/eval modes,
zero_grad, the optimizer's parameters, labels, padding, precision): each bug in a loop written
here is caught with its step and subject, the same loop without it gets no finding; and
``watch``'s keywords are checked at once.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import get_linear_schedule_with_warmup

import hooks
from hooks.store.store import RunStore
from tests.loop_models import TinyLM, batches, no_decay_groups, run_loop

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def db(tmp_path):
    return tmp_path / "runs" / "mdb.sqlite"


def _only(found, kind):
    return [f for f in found if f.kind == kind]


def _simple(*, groups=True, zero=True, eval_mode=True, sched_per_micro=False, ga=1, steps=4,
            every=1, model=None, opt=None, shift_labels=False, train_mode=True, warmup=100):
    """One loop with switches for the bugs; the defaults are healthy."""

    def loop(run):
        torch.manual_seed(0)
        m = model if model is not None else TinyLM(p=0.1)
        o = opt(m) if opt is not None else torch.optim.AdamW(
            no_decay_groups(m) if groups else m.parameters(), lr=1e-3, weight_decay=0.1)
        sched = get_linear_schedule_with_warmup(o, num_warmup_steps=warmup,
                                                num_training_steps=1000)
        run.watch(m, every=every, optimizer=o, scheduler=sched)
        data = batches(steps * ga + 2)
        for step in range(steps):
            m.train(train_mode)
            for i in range(ga):
                b = data[step * ga + i]
                labels = b["labels"][:, 1:] if shift_labels else b["labels"]
                _, loss = m(b["input_ids"][:, : labels.shape[1]] if shift_labels
                            else b["input_ids"], labels=labels)
                (loss / ga).backward()
                if sched_per_micro:
                    sched.step()
            o.step()
            if not sched_per_micro:
                sched.step()
            if zero:
                o.zero_grad()
            if eval_mode:
                m.eval()
            with torch.no_grad():
                m(**data[-1])
            m.train()
            run.log(loss=loss)

    return loop


def test_healthy_simple_loop_has_no_finding(db):
    assert run_loop(db, _simple(ga=2)) == []


# -- 2. the scheduler -----------------------------------------------------------------------------
def test_scheduler_stepped_per_micro_batch(db):
    found = _only(run_loop(db, _simple(ga=4, sched_per_micro=True, warmup=100)),
                  "scheduler_steps")
    by = {f.subject: f for f in found}
    f = by["LambdaLR"]
    assert f.step == 1 and f.detail["scheduler_steps"] == 4 and f.detail["optimizer_steps"] == 1
    assert f.detail["warmup"] == 100
    assert "100-step warmup ends after 25 optimizer steps" in f.line
    # and the LR the micro-batches of one optimizer step ran with differs
    lr = by["learning rate"]
    assert lr.step == 1
    expect = [1e-3 * i / 100 for i in range(4)]  # linear warmup: lr·step/100
    assert [x[0] for x in lr.detail["lrs"]] == pytest.approx(expect)


# -- 3. weight decay ------------------------------------------------------------------------------
def test_weight_decay_on_norms_biases_and_embeddings(db):
    found = _only(run_loop(db, _simple(groups=False)), "weight_decay")
    by = {f.subject: f for f in found}
    err = by["param group 0"]
    model = TinyLM()
    small = sorted(n for n, p in model.named_parameters() if p.ndim < 2)
    assert sorted(err.detail["params"]) == small and err.detail["severity"] == "error"
    assert err.step == 1 and err.detail["weight_decay"] == 0.1
    emb = by["param group 0 (embeddings)"]
    assert emb.detail["params"] == ["embed.weight"] and emb.detail["severity"] == "warning"
    # the effect it warns of: AdamW with wd 0.1, lr 1e-3 and a zero gradient moves a norm
    # weight of 1.0 to 1 - 1e-4
    w = nn.Parameter(torch.ones(3))
    o = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.1)
    w.grad = torch.zeros(3)
    o.step()
    assert float(w.detach()[0]) == pytest.approx(1 - 1e-4, abs=1e-7)


# -- 4. train and eval modes ----------------------------------------------------------------------
def test_no_grad_forward_in_train_mode_with_dropout(db):
    found = _only(run_loop(db, _simple(eval_mode=False)), "train_eval")
    assert len(found) == 1
    assert (found[0].step, found[0].subject) == (1, "model.train()")
    assert found[0].detail["modules"] == ["drop"]
    # without dropout, a no_grad forward in train mode computes what eval would: no finding
    assert run_loop(db, _simple(eval_mode=False, model=TinyLM(p=0.0)), name="nodrop") == []


def test_backward_through_an_eval_mode_forward(db):
    found = _only(run_loop(db, _simple(train_mode=False)), "train_eval")
    assert [(f.step, f.subject) for f in found] == [(1, "model.eval()")]


# -- 5. zero_grad ---------------------------------------------------------------------------------
def test_zero_grad_missing(db):
    found = run_loop(db, _simple(zero=False, every=2))
    z = _only(found, "zero_grad")
    assert len(z) == 1 and (z[0].step, z[0].subject) == (2, "optimizer.zero_grad")
    assert "head.weight" in z[0].detail["params"]
    assert not _only(found, "grad_accumulation")  # stale gradients: that check says nothing


# -- 6. the optimizer's parameters ----------------------------------------------------------------
def test_optimizer_params_missing_twice_and_never_a_gradient(db):
    def opt(m):
        extra = nn.Parameter(torch.zeros(3))  # held, never in the forward
        m.register_parameter("unused", extra)
        held = [p for n, p in m.named_parameters() if not n.startswith("head.")]
        return torch.optim.SGD([{"params": held + [m.norm.weight]}], lr=1e-3)

    with pytest.warns(UserWarning, match="duplicate parameters"):
        found = _only(run_loop(db, _simple(opt=opt, every=1, steps=4)), "optimizer_params")
    lines = {f.subject: f for f in found}
    missing = [f for f in found if "never change" in f.line][0]
    assert missing.detail["params"] == ["head.weight", "head.bias"] and missing.step == 1
    twice = [f for f in found if "held twice" in f.line][0]
    assert twice.detail["params"] == ["norm.weight"]
    never = lines["no gradient"]
    assert never.detail["params"] == ["unused"] and never.step == 3


def test_optimizer_holding_every_trainable_parameter_once_is_healthy(db):
    def opt(m):
        m.embed.weight.requires_grad_(False)  # frozen, not held: fine
        return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1e-3)

    assert run_loop(db, _simple(opt=opt)) == []


# -- 7. labels ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shift,name", [(0, "same-position"), (2, "shifted twice")])
def test_labels_not_next_token(db, shift, name):
    found = _only(run_loop(db, _simple(model=TinyLM(shift=shift))), "labels")
    assert len(found) == 1 and (found[0].step, found[0].subject) == (1, "labels")
    assert found[0].detail["alignment"] == shift and name in found[0].line
    assert found[0].detail["shares"][str(shift)] == 1.0


def test_labels_shifted_by_the_loop_and_not_by_the_model(db):
    # nanoGPT style: model(x, y) with y = x shifted by the loop, scored at the same position
    model = TinyLM(shift=0)
    assert _only(run_loop(db, _simple(model=model, shift_labels=False)), "labels") != []
    assert run_loop(db, _nanogpt_loop(), name="nano") == []


def _nanogpt_loop():
    def loop(run):
        torch.manual_seed(0)
        m = TinyLM(p=0.0, shift=0)
        o = torch.optim.AdamW(no_decay_groups(m), lr=1e-3)
        run.watch(m, every=1, optimizer=o)
        for b in batches(3):
            ids = b["input_ids"]
            _, loss = m(ids[:, :-1], labels=ids[:, 1:])  # targets shifted here, once
            loss.backward()
            o.step()
            o.zero_grad()
            run.log(loss=loss)

    return loop


# -- 8. padding -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bug", [True, False])
def test_pad_positions_counted_in_the_loss(db, bug):
    def loop(run):
        torch.manual_seed(0)
        m = TinyLM(p=0.0)
        o = torch.optim.AdamW(no_decay_groups(m), lr=1e-3)
        run.watch(m, every=1, optimizer=o)
        for b in batches(2):
            mask = torch.ones_like(b["input_ids"])
            mask[:, -4:] = 0  # 4 right pads a row
            ids = b["input_ids"].masked_fill(mask == 0, 0)
            labels = ids if bug else ids.masked_fill(mask == 0, -100)
            _, loss = m(ids, labels=labels, attention_mask=mask)
            loss.backward()
            o.step()
            o.zero_grad()
            run.log(loss=loss)

    found = run_loop(db, loop)
    if not bug:
        assert found == []
        return
    (f,) = _only(found, "padding")
    assert (f.step, f.subject) == (1, "loss")
    assert f.detail["pads"] == 2 * 4 and f.detail["counted"] == 2 * 4  # every pad is a target


# -- 9. precision ---------------------------------------------------------------------------------
def test_bf16_parameters_without_a_master_copy_lose_updates(db):
    # 64 updates of 1e-3 onto 1.0: fp32 reaches 1.064, bf16 stays 1.0 (independent reference)
    one = torch.ones((), dtype=torch.bfloat16)
    for _ in range(64):
        one = one + torch.tensor(1e-3, dtype=torch.bfloat16)
    assert float(one) == 1.0

    def loop(run, dtype):
        torch.manual_seed(0)
        w = nn.Linear(8, 8, bias=False).to(dtype)
        nn.init.ones_(w.weight)
        o = torch.optim.SGD(w.parameters(), lr=1e-3)
        run.watch(w, every=1, optimizer=o)
        for _ in range(3):
            x = torch.ones(4, 8, dtype=dtype)
            w(x).float().mean().backward()
            o.step()
            o.zero_grad()
            run.log(loss=1.0)

    found = run_loop(db, lambda r: loop(r, torch.bfloat16))
    (f,) = _only(found, "precision")
    assert (f.step, f.subject) == (1, "parameter updates") and f.detail["params"] == ["weight"]
    assert f.detail["lost"] == f.detail["updated"] == 64
    assert run_loop(db, lambda r: loop(r, torch.float32), name="fp32") == []


@pytest.mark.parametrize("eps,bug", [(1e-8, True), (1e-4, False)])
def test_adam_eps_below_the_state_dtype(db, eps, bug):
    assert (float(torch.tensor(eps, dtype=torch.float16)) == 0.0) == bug  # the reference

    def loop(run):
        w = nn.Linear(4, 4).half()
        o = torch.optim.Adam([{"params": [w.weight]}, {"params": [w.bias], "eps": 1e-3}],
                             lr=1e-3, eps=eps)
        run.watch(w, every=1, optimizer=o)
        run.log(loss=1.0)

    found = _only(run_loop(db, loop), "precision")
    if not bug:
        assert found == []
        return
    (f,) = found
    assert (f.step, f.subject) == (1, "param group 0 eps")
    tiny = torch.finfo(torch.float16).tiny * torch.finfo(torch.float16).eps
    assert f.detail["smallest"] == pytest.approx(tiny) and math.isclose(tiny, 5.96e-8,
                                                                        rel_tol=1e-3)


# -- watch's keywords ------------------------------------------------------------------------------
def test_watch_keywords_fail_at_once(db):
    m = TinyLM()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    other = torch.optim.SGD(m.parameters(), lr=0.1)
    with hooks.run("kw", db=db) as run:
        with pytest.raises(TypeError, match="unexpected keyword argument 'optimiser'"):
            run.watch(m, optimiser=o)
        with pytest.raises(TypeError, match="torch.optim.Optimizer, got str"):
            run.watch(m, optimizer="adam")
        with pytest.raises(TypeError, match="lr_scheduler"):
            run.watch(m, optimizer=o, scheduler=o)
        with pytest.raises(ValueError, match="another optimizer"):
            run.watch(m, optimizer=o, scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
        assert run._doctor is None and not m._forward_pre_hooks  # nothing attached
        sched = torch.optim.lr_scheduler.StepLR(o, 1)
        run.watch(m, every=2, scheduler=sched)  # the scheduler's optimizer is watched
        assert run._doctor.optimizer is o
        for i, b in enumerate(batches(2)):
            assert ("step" in vars(sched)) == (i == 1)  # wrapped in step 2's window only
            _, loss = m(**b)
            loss.backward()
            o.step()
            sched.step()
            o.zero_grad()
            run.log(loss=loss)
        assert "step" not in vars(sched) and "zero_grad" not in vars(o)  # restored
    assert not m._forward_pre_hooks and not m._forward_hooks
    with RunStore(db) as store:
        assert store.findings(store.run("kw").id) == []


@pytest.mark.parametrize("bug", [True, False])
def test_pad_positions_counted_in_the_moe_aux_loss(db, bug):
    """minillm's tiny MoE (4 experts, top-2) on right-padded rows: its aux loss counts real
    tokens only; a variant that drops the mask from the aux loss (transformers #28505) is
    caught. The reference: appending pads changes the buggy aux loss, not the healthy one."""
    from tests.zoo import tiny

    model = tiny()
    original = model._aux_losses
    if bug:
        model._aux_losses = lambda r, real, logits: original(r, None, logits)
    ids = torch.randint(0, model.config.vocab_size, (2, 16),
                        generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, -6:] = 0
    with torch.no_grad():  # the independent reference
        padded = model(ids, attention_mask=mask).aux_loss
        real = model(ids[:, :10]).aux_loss
    assert (abs(float(padded) - float(real)) > 1e-6) == bug

    def loop(run):
        o = torch.optim.AdamW(no_decay_groups(model), lr=1e-3)
        run.watch(model, every=1, optimizer=o)
        for _ in range(2):
            model(ids, labels=ids, attention_mask=mask).loss.backward()
            o.step()
            o.zero_grad()
            run.log(loss=1.0)

    found = run_loop(db, loop)
    if not bug:
        assert found == []
        return
    (f,) = found
    assert (f.kind, f.step, f.subject) == ("padding", 1, "aux loss")
    assert f.detail["pads"] == 12 and f.detail["counted"] == 12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gradients_accumulated_in_bf16(db, dtype):
    """8 micro-batches accumulated into bf16 .grad drift from the fp32 sum of their gradients;
    fp32 .grad does not. The reference, here: the micro-batches' gradients of the model's
    weights summed one by one in the dtype against the same sum in fp64."""
    torch.manual_seed(0)
    ref_model = TinyLM(p=0.0).to(dtype)
    grads = [torch.autograd.grad(ref_model(**b)[1] / 8, list(ref_model.parameters()))
             for b in batches(8)]
    acc = [torch.zeros_like(g) for g in grads[0]]
    for gs in grads:
        acc = [a + g for a, g in zip(acc, gs, strict=True)]
    exact = [sum(gs[i].double() for gs in grads) for i in range(len(acc))]
    num = sum(float((a.double() - e).norm() ** 2) for a, e in zip(acc, exact, strict=True))
    rel = num ** 0.5 / sum(float(e.norm() ** 2) for e in exact) ** 0.5
    assert (rel > 1e-3) == (dtype == torch.bfloat16)

    def loop(run):
        torch.manual_seed(0)
        m = TinyLM(p=0.0).to(dtype)
        o = torch.optim.AdamW(no_decay_groups(m), lr=1e-3)
        run.watch(m, every=1, optimizer=o)
        data = batches(8)
        for b in data:
            (m(**b)[1] / 8).backward()
        o.step()
        o.zero_grad()
        run.log(loss=1.0)

    found = [f for f in run_loop(db, loop) if f.subject == "gradient accumulation"]
    if dtype == torch.float32:
        assert found == []
        return
    (f,) = found
    assert (f.kind, f.step) == ("precision", 1) and f.detail["micro_batches"] == 8
    assert f.detail["relative_error"] > 1e-3


def test_an_instance_method_patched_before_is_restored(db):
    """A ``zero_grad`` the user (or a library) set on the optimizer instance before is put
    back after each watched step, not replaced by the class's."""
    m = TinyLM()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    calls = []
    own = o.zero_grad

    def mine(set_to_none=True):
        calls.append(1)
        own(set_to_none=set_to_none)

    o.zero_grad = mine
    with hooks.run("own", db=db) as run:
        run.watch(m, every=1, optimizer=o)
        for b in batches(2):
            m(**b)[1].backward()
            o.step()
            o.zero_grad()
            run.log(loss=1.0)
    assert vars(o)["zero_grad"] is mine and len(calls) == 2  # called through the wrapper


def test_an_amp_grad_scaler_is_not_a_gradient_scale_bug(db):
    """A GradScaler's loss scale stays in ``.grad`` until ``unscale_``: a healthy AMP loop
    (loss / ga, unscale_, clipping, scaler.step) gets no accumulation finding."""

    def loop(run):
        torch.manual_seed(0)
        m = TinyLM(p=0.0)
        o = torch.optim.AdamW(no_decay_groups(m), lr=1e-3, weight_decay=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        run.watch(m, every=1, optimizer=o)
        data = batches(8)
        for step in range(3):
            for i in range(2):
                _, loss = m(**data[2 * step + i])
                scaler.scale(loss / 2).backward()
            scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(o)
            scaler.update()
            o.zero_grad()
            run.log(loss=loss)

    assert _only(run_loop(db, loop), "grad_accumulation") == []


def test_nearly_parallel_micro_batch_gradients_are_not_a_direction_change():
    """Two micro-batch gradients 1e-4 apart, .grad their proper mean plus noise 3e-3: many
    weight vectors fit, and the one-batch gradient explains .grad: nothing to report (the
    normal equations' fit read [0.69, 0.31] here)."""
    from hooks.doctor.loop.checks import accumulation_findings

    g = torch.Generator().manual_seed(0)
    base = torch.randn(4000, generator=g, dtype=torch.float64)
    g1, g2 = base, base + 1e-4 * torch.randn(4000, generator=g, dtype=torch.float64)
    acc = 0.5 * g1 + 0.5 * g2 + 3e-3 * torch.randn(4000, generator=g, dtype=torch.float64)
    assert accumulation_findings(1, acc.float(), [g1.float(), g2.float()], [10, 10], 2) == []
    # a real direction change (means over 10 and 30 tokens) on distinct gradients is found
    g3 = torch.randn(4000, generator=g, dtype=torch.float64)
    found = accumulation_findings(1, (0.5 * g1 + 0.5 * g3).float(), [g1.float(), g3.float()],
                                  [10, 30], 2)
    assert [f["subject"] for f in found] == ["micro-batch weights"]
