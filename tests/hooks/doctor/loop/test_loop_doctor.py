"""The training-loop doctor (``run.watch(model, every, optimizer=, scheduler=)``): each bug of
docs/loop-doctor.md in a loop written here is caught with its step and subject, and the same
loop without the bug gets no finding. The expected numbers are computed here, independently
(token counts from the labels, warmup lengths from the scheduler's own arguments, dtype
limits from ``torch.finfo``).
"""

from __future__ import annotations

import pytest
import torch

from tests.loop_models import TinyLM, batches, no_decay_groups, run_loop

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def db(tmp_path):
    return tmp_path / "runs" / "mdb.sqlite"


def _tokens(b) -> int:
    return int((b["labels"][:, 1:] != -100).sum())


def _accumulating(mode: str, ga: int = 4, n: int = 12, masked=None, every: int = 1):
    """A loop of ``n`` micro-batches, ``ga`` per optimizer step (a last partial window when
    ``ga`` does not divide ``n``), dropout 0.1 on, gradients clipped after backward; ``mode``
    says how each micro-batch's mean loss is scaled before backward."""

    def loop(run):
        torch.manual_seed(0)
        model = TinyLM(p=0.1)
        opt = torch.optim.AdamW(no_decay_groups(model), lr=1e-2)
        run.watch(model, every=every, optimizer=opt)
        data = batches(n, masked=masked)
        for start in range(0, n, ga):
            window = data[start:start + ga]
            total = sum(_tokens(b) for b in window)
            for i, b in enumerate(window):
                _, loss = model(**b)
                scale = {"tokens": _tokens(b) / total, "drop_last": _tokens(b) / total,
                         "sum": 1.0, "mean": 1 / len(window),
                         "full": 1 / ga}[mode]
                if mode == "drop_last" and i == len(window) - 1:
                    continue  # forward ran, its loss never reaches backward
                (loss * scale).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
            run.log(loss=loss)

    return loop


def _only(found, kind):
    return [f for f in found if f.kind == kind]


# -- 1. gradient accumulation ---------------------------------------------------------------------
def test_accumulation_normalised_by_tokens_is_healthy(db):
    assert run_loop(db, _accumulating("tokens", masked=[0, 6, 3, 9])) == []


def test_accumulation_summed_not_averaged_is_a_factor_of_the_count(db):
    found = _only(run_loop(db, _accumulating("sum")), "grad_accumulation")
    assert len(found) == 1
    f = found[0]
    assert (f.step, f.subject) == (1, "gradient scale")
    assert f.detail["factor"] == pytest.approx(4.0, rel=1e-3)  # 4 micro-batches, summed
    assert "summed" in f.line


def test_accumulation_per_micro_batch_means_of_unequal_tokens_change_direction(db):
    masked = [0, 6, 3, 9]
    found = _only(run_loop(db, _accumulating("mean", masked=masked)), "grad_accumulation")
    assert len(found) == 1 and (found[0].step, found[0].subject) == (1, "micro-batch weights")
    d = found[0].detail
    data = batches(4, masked=masked)
    n = [_tokens(b) for b in data]
    assert d["tokens"] == n  # counted from the logits' gradient, here from the labels
    assert d["weights"] == pytest.approx([0.25] * 4, abs=1e-4)
    assert d["expected"] == pytest.approx([x / sum(n) for x in n], abs=1e-6)
    assert d["cosine"] < 0.99


def test_accumulation_last_window_divided_by_the_full_count(db):
    # 10 micro-batches at 4 per step: 3 optimizer steps, the last of 2 micro-batches
    found = _only(run_loop(db, _accumulating("full", n=10)), "grad_accumulation")
    assert len(found) == 1 and (found[0].step, found[0].subject) == (3, "gradient scale")
    assert found[0].detail["factor"] == pytest.approx(2 / 4, rel=1e-3)
    assert "last window of 2" in found[0].line
    assert run_loop(db, _accumulating("mean", n=10), name="ok") == []


def test_accumulation_micro_batch_left_out(db):
    found = _only(run_loop(db, _accumulating("drop_last")), "grad_accumulation")
    assert len(found) == 1 and (found[0].step, found[0].subject) == (1, "micro-batches")
    assert found[0].detail["weights"][3] == pytest.approx(0.0, abs=1e-4)
    assert "4 of 4" in found[0].line


# -- a healthy loop ------------------------------------------------------------------------------
@pytest.mark.slow
def test_healthy_loop_has_no_finding_over_200_steps(db):
    """AdamW with no-decay groups, accumulation normalised by token count (uneven counts),
    a warmup scheduler stepped per optimizer step, dropout on, gradients clipped, evaluation
    under model.eval() and no_grad every 20 steps; watched every 10 steps."""
    from transformers import get_linear_schedule_with_warmup

    def loop(run):
        torch.manual_seed(0)
        model = TinyLM(p=0.1)
        opt = torch.optim.AdamW(no_decay_groups(model), lr=3e-3)
        sched = get_linear_schedule_with_warmup(opt, 20, 200)
        run.watch(model, every=10, optimizer=opt, scheduler=sched)
        data = batches(16, masked=[0, 5, 2, 8, 1, 0, 7, 3])
        val = batches(1, seed=1)[0]
        for step in range(1, 201):
            window = [data[(4 * step + i) % len(data)] for i in range(4)]
            total = sum(_tokens(b) for b in window)
            for b in window:
                _, loss = model(**b)
                (loss * _tokens(b) / total).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
            values = {"loss": loss}
            if step % 20 == 0:
                model.eval()
                with torch.no_grad():
                    values["val_loss"] = model(**val)[1]
                model.train()
            run.log(**values)
        assert run.step == 200
        seen.append(run._doctor)

    seen = []
    assert run_loop(db, loop) == []
    doctor = seen[0]  # the checks ran: nothing vacuous
    assert doctor._accum_checks == 3 and doctor._no_grad_windows == 20


def test_the_example_of_the_guide_runs_and_finds_what_it_says(tmp_path, monkeypatch):
    """docs/loop-doctor.md's first example, run as printed: the five findings its text
    lists."""
    import re

    from hooks.store.store import RunStore
    from tests.conftest import REPO

    guide = (REPO / "docs" / "loop-doctor.md").read_text(encoding="utf-8")
    block = re.findall(r"^```python\n(.*?)\n```", guide, re.S | re.M)[0]
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match="lr_scheduler.step"):  # torch sees bug 3 too
        exec(compile(block, "docs/loop-doctor.md", "exec"), {"__name__": "guide"})
    with RunStore(tmp_path / "runs" / "loop-doctor.sqlite") as store:
        found = store.findings(store.run("loop-bugs").id)
    got = {(f.kind, f.subject, f.step) for f in found}
    assert got == {("weight_decay", "param group 0", 1),
                   ("weight_decay", "param group 0 (embeddings)", 1),
                   ("grad_accumulation", "gradient scale", 5),
                   ("scheduler_steps", "LinearLR", 5),
                   ("scheduler_steps", "learning rate", 5)}
    scale = [f for f in found if f.kind == "grad_accumulation"][0]
    assert scale.detail["factor"] == pytest.approx(4.0, rel=1e-3)
    assert [f for f in found if f.subject == "param group 0"][0].detail["params"] == [
        "norm.weight", "norm.bias", "head.bias"]
    assert "100-step warmup ends after 25 optimizer steps" in [
        f for f in found if f.subject == "LinearLR"][0].line


def test_the_replays_are_not_in_the_watched_step_s_capture(db):
    """The accumulation check replays the 4 micro-batches while the capture of that step
    records: the stored capture holds the loop's 4 forwards only (6 modules each)."""
    from hooks.store.store import RunStore

    found = run_loop(db, _accumulating("tokens", n=8), name="cap")
    assert found == []
    with RunStore(db) as store:
        forward = store.internals(store.run("cap").id, 1)["forward"]
    roots = [r for r in forward if r["module"] == ""]
    assert len(roots) == 4 and len(forward) == 4 * len(list(TinyLM().modules()))


# -- accumulation per loss component (issue 34) ----------------------------------------------------
def _moe_accumulating(aux_like_lm: bool, ga: int = 4):
    """minillm's tiny MoE (loss = ce_loss + aux_loss) accumulated over ``ga`` micro-batches, the
    LM term divided over the window; the aux term divided the same way (fixed) or added whole
    on each micro-batch (the bug: HF's num_items_in_batch normalises the LM loss only)."""
    from tests.models import batch_for, tiny

    def loop(run):
        torch.manual_seed(0)
        model = tiny()
        opt = torch.optim.AdamW(no_decay_groups(model), lr=1e-3)
        run.watch(model, every=1, optimizer=opt)
        data = [batch_for(model) for _ in range(ga)]
        for i, b in enumerate(data):
            b["input_ids"] = torch.randint(0, model.config.vocab_size, b["input_ids"].shape,
                                           generator=torch.Generator().manual_seed(i))
            b["labels"] = b["input_ids"].clone()
        out = None
        for b in data:
            out = model(**b)
            aux = out.aux_loss / ga if aux_like_lm else out.aux_loss
            (out.ce_loss / ga + aux).backward()
        opt.step()
        opt.zero_grad()
        run.log(loss=out.loss)

    return loop


def test_accumulation_fits_the_aux_term_apart_from_the_lm_term(db):
    found = _only(run_loop(db, _moe_accumulating(aux_like_lm=False)), "grad_accumulation")
    aux = [f for f in found if f.subject == "aux loss normalisation"]
    assert len(aux) == 1, [(f.subject, f.line) for f in found]
    d = aux[0].detail
    assert d["lm_factor"] == pytest.approx(1.0, rel=1e-3)
    assert d["aux_factor"] == pytest.approx(4.0, rel=1e-3)  # added whole on 4 micro-batches
    assert "4 micro-batches" in aux[0].line
    assert [f.subject for f in found] == ["aux loss normalisation"]  # one factor hides it
    assert run_loop(db, _moe_accumulating(aux_like_lm=True), name="ok") == []
