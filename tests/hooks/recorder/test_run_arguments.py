"""``run.log`` and ``run.watch`` refuse what they cannot record, at once, with an error that
names the argument (issue 32, item 12): a complex value, ``step=True``, ``every=1.5`` /
``nan`` / ``10**30``, a negative ``attention_bytes``, a second ``run.watch``. What was refused
stores nothing; the expected rows are read back with plain ``sqlite3``."""

from __future__ import annotations

import inspect
import math
import sqlite3

import numpy as np
import pytest
import torch
from torch import nn

import hooks


@pytest.fixture
def db(tmp_path):
    return tmp_path / "mdb.sqlite"


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _steps(db) -> list[tuple]:
    """``(step, metric name, value)`` of every stored scalar, in step order."""
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT s.step, n.name, s.value FROM scalars AS s JOIN metric_names"
                            " AS n ON n.run_id = s.run_id AND n.id = s.metric ORDER BY s.step,"
                            " n.name").fetchall()
    finally:
        conn.close()


def _captured(db) -> list[int]:
    conn = sqlite3.connect(db)
    try:
        return [s for (s,) in conn.execute("SELECT step FROM internals ORDER BY step")]
    finally:
        conn.close()


@pytest.mark.parametrize("value", [torch.tensor(1 + 2j), torch.tensor([3 - 1j]), 1 + 2j,
                                   np.complex128(1 + 2j)], ids=["tensor", "1-elem", "py", "np"])
def test_a_complex_value_is_refused_naming_the_metric(db, value):
    with hooks.run("c", db=db) as run:
        with pytest.raises(TypeError, match=r"run\.log\(phase=\.\.\.\): expected a real number, "
                                            r"got a complex"):
            run.log(loss=0.5, phase=value)
        run.log(loss=torch.tensor(0.25))  # the run goes on: this is step 1
    assert _steps(db) == [(1, "loss", 0.25)]


@pytest.mark.parametrize("step", [True, False])
def test_a_bool_is_not_a_step(db, step):
    with hooks.run("b", db=db) as run:
        with pytest.raises(TypeError, match=rf"run\.log\(step=\.\.\.\): expected an integer, "
                                            rf"got a bool \({step}\)"):
            run.log(step=step, loss=1.0)
        run.log(loss=2.0)
        run.log(step=np.int64(5), loss=3.0)  # integers of numpy still are steps
    assert _steps(db) == [(1, "loss", 2.0), (5, "loss", 3.0)]


@pytest.mark.parametrize("every, error, message", [
    (1.5, TypeError, r"run\.watch\(every=\.\.\.\): expected an integer, got float 1\.5"),
    (math.nan, TypeError, r"run\.watch\(every=\.\.\.\): expected an integer, got float nan"),
    (True, TypeError, r"run\.watch\(every=\.\.\.\): expected an integer, got a bool"),
    (10**30, ValueError, r"watch\(every=<an integer of 100 bits>\): steps go up to 2\*\*63 - 1"),
    (2**63, ValueError, r"watch\(every=9223372036854775808\): steps go up to 2\*\*63 - 1"),
    (0, ValueError, r"watch\(every=0\): must be 1 or more"),
])
def test_watch_every_is_a_positive_integer_the_store_can_hold(db, every, error, message):
    model = _mlp()
    with hooks.run("e", db=db) as run:
        with pytest.raises(error, match=message):
            run.watch(model, every=every)
        assert not model._forward_hooks and not model._forward_pre_hooks  # nothing attached
        run.watch(model, every=2**63 - 1)  # the largest: accepted, and the one watch
    assert _captured(db) == []


@pytest.mark.parametrize("key", ["attention_bytes", "keep_bytes"])
def test_watch_byte_budgets_are_checked_at_once(db, key):
    model = _mlp()
    with hooks.run("a", db=db) as run:
        with pytest.raises(ValueError, match=rf"run\.watch\({key}=-1\): a budget in bytes, 0 "):
            run.watch(model, every=1, **{key: -1})
        with pytest.raises(TypeError, match=rf"run\.watch\({key}=\.\.\.\): expected an "
                                            "integer, got float 1.5"):
            run.watch(model, every=1, **{key: 1.5})
        assert not model._forward_hooks and not model._forward_pre_hooks
        run.watch(model, every=1, **{key: 0})
        x = torch.randn(3, 4)
        model(x).sum().backward()
        run.log(loss=1.0)
    assert _captured(db) == [1]


def test_a_second_watch_is_refused_naming_the_first(db):
    model, other = _mlp(), _mlp()
    x = torch.randn(3, 4)
    with hooks.run("w", db=db) as run:
        run.watch(model, every=2)
        line = inspect.currentframe().f_lineno - 1
        with pytest.raises(RuntimeError, match=rf"run w: watch\(Sequential, every=2\) at "
                                               rf"test_run_arguments\.py:{line} came first; a "
                                               "run watches one model, once"):
            run.watch(other, every=1)
        assert not other._forward_hooks and not other._forward_pre_hooks
        for _ in range(4):
            model(x).sum().backward()
            run.log(loss=1.0)
    assert _captured(db) == [2, 4]  # the first watch, unchanged
