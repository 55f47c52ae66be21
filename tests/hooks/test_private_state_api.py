"""The public APIs that replaced reaching into another object's private state (#33 item 3):
``Capture.paused()``, ``NonFiniteSentinel.replaying`` and ``RunStore.transaction()``.

References are independent of the code under test: the calls of a model counted by our own
forward hooks, the inputs seen by a module, and SQLite's own ``in_transaction`` flag.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hooks.engine.capture import capture
from hooks.nonfinite.origin import NonFiniteSentinel


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_capture_paused_records_nothing_inside_the_block_and_again_after() -> None:
    torch.manual_seed(0)
    model = Two()
    x1, x2, x3 = torch.randn(3, 4), torch.randn(5, 4), torch.randn(7, 4)
    cap = capture(model, grads=False, params=False)
    cap.start()
    model(x1)
    with cap.paused():
        assert cap.recording is False and cap.active is False
        model(x2)
    assert cap.recording is True
    model(x3)
    trace = cap.stop()
    # the batch sizes recorded by module ``a``: the first and third forward only
    seen = [c.inputs[0].shape[0] for c in trace.forward if c.module == "a"]
    assert seen == [3, 7]


def test_capture_paused_resumes_after_an_exception_and_leaves_an_idle_capture_idle() -> None:
    model = Two()
    cap = capture(model, grads=False, params=False)
    with cap.paused():  # not started: stays not recording
        assert cap.recording is False
    assert cap.recording is False
    cap.start()
    with pytest.raises(ValueError), cap.paused():
        raise ValueError("boom")
    assert cap.recording is True
    model(torch.randn(2, 4))
    trace = cap.stop()
    assert [c.module for c in trace.forward if c.module in ("a", "b")] == ["a", "b"]
    with cap.paused():  # stopped: stays stopped
        pass
    assert cap.recording is False


def test_sentinel_replaying_is_true_only_during_its_own_rerun_of_the_forward() -> None:
    torch.manual_seed(0)
    model = Two()
    seen: list[bool] = []
    sentinel = NonFiniteSentinel(model)
    model.a.register_forward_hook(lambda m, a, o: seen.append(sentinel.replaying))
    try:
        assert sentinel.replaying is False
        model(torch.randn(2, 4))  # finite: no re-run
        assert seen == [False]
        with torch.no_grad():
            model.b.bias[0] = float("nan")  # the output is NaN; the origin is a weight
            model.a.bias[0] = float("inf")
        model(torch.randn(2, 4))
        symptom, origin = sentinel.take()
        assert symptom == "model output"
        assert sentinel.replaying is False
    finally:
        sentinel.remove()
    # a NaN weight answers without a re-run: the user's forward only
    assert seen == [False, False]


def test_sentinel_replaying_is_seen_by_hooks_during_a_replay_origin_rerun() -> None:
    torch.manual_seed(0)

    class Blows(nn.Module):  # finite weights, a non-finite activation: located by a re-run
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(self.a(x) - 1e9)

    model = Blows()
    seen: list[bool] = []
    sentinel = NonFiniteSentinel(model)
    model.a.register_forward_hook(lambda m, a, o: seen.append(sentinel.replaying))
    try:
        model(torch.randn(2, 4))
        symptom, origin = sentinel.take()
    finally:
        sentinel.remove()
    assert symptom == "model output" and origin is not None
    # the user's forward, then the sentinel's re-run of it
    assert seen == [False, True]
    assert sentinel.replaying is False


def test_runstore_transaction_is_a_write_transaction(tmp_path) -> None:
    from hooks.store.store import RunStore

    store = RunStore(str(tmp_path / "runs.sqlite"), create=True)
    try:
        assert store.connection.in_transaction is False
        with store.transaction() as conn:
            assert conn is store.connection
            assert conn.in_transaction is True
            conn.execute("CREATE TABLE t (x)")
            conn.execute("INSERT INTO t VALUES (1)")
        assert store.connection.in_transaction is False
        assert [tuple(r) for r in store.connection.execute("SELECT x FROM t")] == [(1,)]
        with pytest.raises(RuntimeError), store.transaction() as conn:
            conn.execute("INSERT INTO t VALUES (2)")
            raise RuntimeError("rolled back")
        assert [tuple(r) for r in store.connection.execute("SELECT x FROM t")] == [(1,)]
    finally:
        store.close()
