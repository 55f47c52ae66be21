"""``mdb overfit``'s verdict, read from a run store holding a loss series designed here: the
expected steps are read off the series by hand."""

from __future__ import annotations

import hooks
from hooks.store.store import RunStore
from hooks.train.verdict import THRESHOLD, overfit_verdict

TEXT = "abcdefghij" * 3


def _ce(step: int) -> float:
    if step <= 30:
        return 3.0 * (0.8 ** step)  # 0.0032 < 0.05 from step 19 on (3·0.8^19 = 0.0433)
    if 60 <= step <= 62:
        return 2.0  # a spike of three steps
    if 63 <= step <= 65:
        return 0.2  # not yet back under 0.05
    return 0.001


def _record(db, name: str, steps: int, sample: str) -> None:
    with hooks.run(name, db=db) as run:
        for step in range(1, steps + 1):
            if step == steps:
                run.log_sample(step, TEXT[:4], sample)
            run.log(ce=_ce(step))


def test_memorised_with_a_spike_that_recovered(tmp_path):
    db = tmp_path / "r.sqlite"
    _record(db, "good", 100, TEXT[4:14])
    with RunStore(db) as store:
        v = overfit_verdict(store, store.run("good"), "ce", TEXT)
    assert THRESHOLD == 0.05
    assert v.memorised and v.sample_ok and v.sample_step == 100
    assert v.first_below == 19  # 3·0.8^18 = 0.054, 3·0.8^19 = 0.043
    assert v.below_from == 66  # 63 … 65 are 0.2
    assert [o.spike.step for o in v.spikes] == [60]
    o = v.spikes[0]
    assert o.peak == 2.0 and o.recovered_at == 66
    assert abs(o.before - 0.001) < 1e-12  # the median of steps 50 … 59
    lines = v.lines()
    assert lines[0].startswith("verdict: memorised — ce first below 0.05 at step 19; below 0.05 "
                               "from step 66 to the end (100)")
    assert lines[1].startswith("spike at step 60: ce 0.001 → 2 (6 steps); ")
    assert "recovered by step 66" in lines[1]


def test_a_wrong_sample_or_a_high_loss_is_not_memorised(tmp_path):
    db = tmp_path / "r.sqlite"
    _record(db, "wrong", 100, "abcdeXghij")
    _record(db, "short", 62, TEXT[4:14])  # ends inside the spike
    with RunStore(db) as store:
        wrong = overfit_verdict(store, store.run("wrong"), "ce", TEXT)
        short = overfit_verdict(store, store.run("short"), "ce", TEXT)
    assert not wrong.memorised and wrong.sample_ok is False
    assert "differs from the text" in wrong.lines()[0]
    assert not short.memorised and short.below_from is None
    assert short.lines()[0].startswith("verdict: not memorised — ce 2 at step 62 is not below")
    assert short.spikes[0].recovered_at is None
    assert "not recovered by the end" in short.lines()[1]


def test_warmup_cosine_schedule_follows_its_formula_and_constant_is_none():
    import math

    from hooks.train.overfit_options import OverfitOptions, schedule_lr

    assert OverfitOptions(text="ab").schedule == "constant"  # the default: the tutorial's run
    assert schedule_lr("constant", 3e-3, 300) is None
    lr_at = schedule_lr("warmup-cosine", 3e-3, 300)
    assert lr_at(1) == 3e-3 / 20 and lr_at(20) == 3e-3
    mid = 20 + (300 - 20) / 2  # half way through the decay: (0.1 + 1) / 2 of lr
    assert abs(lr_at(mid) - 3e-3 * 0.55) < 1e-12
    assert abs(lr_at(300) - 3e-4) < 1e-12
    assert abs(lr_at(100) - 3e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * 80 / 280)))) < 1e-12
