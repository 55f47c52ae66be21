"""The training loop, checkpoints and the overfit run: metrics against recomputation,
controls, NaN location, checkpoints, resume."""

from __future__ import annotations

import copy
import math
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hooks.train.trainer as training
from hooks.store.store import RunStore
from hooks.train.checkpoint import load_checkpoint, save_checkpoint
from hooks.train.overfit import OverfitOptions, OverfitSession, default_overfit_text
from hooks.train.trainer import (
    TrainControl,
    Trainer,
    expert_load,
    load_trace,
    locate_nonfinite,
    signal_exit_code,
)
from minillm import MiniLLM, load_preset
from tests.conftest import wait_for as _wait_for
from tests.models import tiny_config, tiny_setup
from tui.screens.live_data import metric_values

TEXT = "人工智能正在改变世界。" * 2


pytestmark = pytest.mark.usefixtures("one_thread")


def test_expert_load_matches_a_loop_count():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(50, 4, generator=g), torch.randn(50, 4, generator=g) * 3]
    got = expert_load(logits, top_k=2)
    for layer, lg in zip(got, logits, strict=True):
        counts = [0] * 4
        for row in lg.tolist():
            order = sorted(range(4), key=lambda e: -row[e])
            for e in order[:2]:
                counts[e] += 1
        assert layer == pytest.approx([c / 100 for c in counts])
        assert sum(layer) == pytest.approx(1.0)


def test_step_metrics_match_a_recomputation():
    model, batch, opt = tiny_setup()
    ref = copy.deepcopy(model)
    trainer = Trainer(model, batch, opt, total_steps=1)
    report = trainer.train_step()
    row = report.metrics
    assert list(metric_values(row)) == ["ce", "aux", "total", "grad_norm", "lr", "step_time",
                                        "tokens_per_s", "steps_per_s"]
    m = SimpleNamespace(step=row.step, expert_load=row.expert_load, **metric_values(row))

    out = ref(batch["input_ids"])
    logits = out.logits
    ids = batch["input_ids"]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert m.ce == pytest.approx(float(ce.detach()), rel=1e-5)
    # aux: coef * E * sum_e f_e P_e, recomputed from the router logits
    (rl,) = out.router_logits
    probs = torch.softmax(rl.float(), -1)
    top = probs.argmax(-1)  # top-1
    f = torch.bincount(top, minlength=2).float() / rl.shape[0]
    aux = ref.config.router_aux_loss_coef * 2 * (f * probs.mean(0)).sum()
    assert m.aux == pytest.approx(float(aux.detach()), rel=1e-5)
    assert m.total == pytest.approx(m.ce + m.aux, rel=1e-6)
    (ce + aux).backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters()))
    assert m.grad_norm == pytest.approx(float(norm), rel=1e-5)
    assert m.expert_load == [pytest.approx((f).tolist())]
    assert m.lr == 1e-2 and m.step == 1 and m.step_time > 0
    assert m.tokens_per_s == pytest.approx(24 / m.step_time)
    assert m.steps_per_s == pytest.approx(1 / m.step_time)
    # the update is AdamW's: same as torch's optimizer applied to the reference gradients
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=n)


class CountingControl(TrainControl):
    """Controls that count the loop's waits: the loop waits only after it decided not to
    step, so a wait taken after a known point proves that no step started in between (no
    sleep-based "nothing happened" window)."""

    def __init__(self, paused: bool = False) -> None:
        super().__init__(paused)
        self.waits = 0
        self._seen = threading.Condition()

    def _wait(self, timeout: float) -> None:
        with self._seen:
            self.waits += 1
            self._seen.notify_all()
        super()._wait(timeout)

    def wait_for_wait(self, after: int, timeout: float = 60.0) -> int:
        """Block until the loop has waited more than ``after`` times; return the count."""
        with self._seen:
            assert self._seen.wait_for(lambda: self.waits > after, timeout), "no wait"
            return self.waits


def test_controls_pause_single_step_resume_stop():
    model, batch, opt = tiny_setup()
    control = CountingControl(paused=True)
    trainer = Trainer(model, batch, opt, total_steps=10_000)
    steps: list[int] = []
    states: list[str] = []
    result = {}

    def go():
        result["r"] = trainer.run(control, on_step=lambda r: steps.append(r.step),
                                  on_state=states.append)

    t = threading.Thread(target=go)
    t.start()
    control.wait_for_wait(0)  # the loop decided to wait before any step
    assert steps == [] and states == ["paused"]
    waits = control.waits
    control.step_once(3)
    _wait_for(lambda: len(steps) == 3)
    control.wait_for_wait(waits)  # and waits again after the third: no fourth step began
    assert steps == [1, 2, 3] and control.paused
    control.resume()
    _wait_for(lambda: len(steps) > 10)
    assert states[:2] == ["paused", "running"]
    control.pause()
    _wait_for(lambda: states[-1] == "paused")
    n = len(steps)
    control.wait_for_wait(control.wait_for_wait(0))  # two decisions to wait in a row
    assert len(steps) == n
    control.stop("user")
    t.join(60)
    r = result["r"]
    assert (r.status, r.last_step, r.reason) == ("interrupted", n, "user")
    assert steps == list(range(1, n + 1))


def test_capture_request_records_internals_and_can_pause_after():
    model, batch, opt = tiny_setup()
    control = CountingControl()
    control.request_capture(pause_after=True)
    reports = []
    trainer = Trainer(model, batch, opt, total_steps=5)
    t = threading.Thread(target=lambda: trainer.run(control, on_step=reports.append))
    t.start()
    control.wait_for_wait(0)  # paused after the captured step, and not stepping
    assert len(reports) == 1 and reports[0].paused_after and control.paused
    first = reports[0]
    assert first.trace is not None and first.internals["kind"] == "mdb-trace"
    names = {r["module"] for r in first.internals["forward"]}
    assert "model.layers.0.self_attn.q_proj" in names
    # the capture's statistics are of this step: its loss, recomputed from the trace's meta
    assert first.trace.meta["loss"] == pytest.approx(metric_values(first.metrics)["total"])
    control.resume()
    t.join(60)
    assert [r.step for r in reports] == [1, 2, 3, 4, 5]
    assert all(r.internals is None for r in reports[1:])


def test_capture_request_while_paused_runs_exactly_one_captured_step():
    model, batch, opt = tiny_setup()
    control = CountingControl(paused=True)
    reports = []
    trainer = Trainer(model, batch, opt, total_steps=50)
    t = threading.Thread(target=lambda: trainer.run(control, on_step=reports.append))
    t.start()
    waits = control.wait_for_wait(0)
    assert reports == []
    control.request_capture(pause_after=True)
    _wait_for(lambda: bool(reports))
    control.wait_for_wait(waits)  # waiting again after the captured step
    assert [r.step for r in reports] == [1] and control.paused
    assert reports[0].internals is not None and reports[0].internals["kind"] == "mdb-trace"
    # the request was consumed: the next step is not captured
    control.step_once()
    _wait_for(lambda: len(reports) == 2)
    assert reports[1].step == 2 and reports[1].internals is None
    control.stop()
    t.join(60)
    assert len(reports) == 2


def test_capture_every_n():
    model, batch, opt = tiny_setup()
    trainer = Trainer(model, batch, opt, total_steps=6, capture_every=3)
    reports = []
    trainer.run(on_step=reports.append)
    assert [r.step for r in reports if r.internals] == [3, 6]
    assert [r.trace.step for r in reports if r.trace is not None] == [3, 6]


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 1)
        self.poison = False

    def forward(self, x):
        h = self.a(x)
        if self.poison:
            h = _NanGrad.apply(h)
        return SimpleNamespace(loss=self.b(h).pow(2).mean())


def test_nonfinite_gradient_fails_and_skips_update(monkeypatch):
    """A NaN made inside a custom autograd function's backward: the gradient of ``a``'s output
    is the first non-finite one the capture sees (backward), and the update is skipped."""
    torch.manual_seed(0)
    toy = _Toy()
    toy.poison = True
    before = {n: p.detach().clone() for n, p in toy.named_parameters()}
    x = torch.randn(4, 3)
    with torch.no_grad():
        expected = float(toy(x).loss)
    opt = torch.optim.SGD(toy.parameters(), lr=0.1)
    trainer = Trainer(toy, {"x": x}, opt, total_steps=3)
    reports = []
    result = trainer.run(on_step=reports.append)
    assert result.status == "failed" and result.failure.what == "gradient"
    assert (result.failure.module, result.failure.located_by) == ("a", "capture")
    for n, p in toy.named_parameters():
        torch.testing.assert_close(p, before[n])
    # the failed step's row: the loss it computed (finite), the NaN gradient norm as None
    (report,) = reports
    values = metric_values(report.metrics, ["loss", "grad_norm", "lr"])
    assert report.failure is result.failure and trainer.step == 1
    assert values["loss"] == pytest.approx(expected, rel=1e-6)
    assert values["grad_norm"] is None and values["lr"] == 0.1


def test_generic_model_without_ce_or_routers_logs_only_what_exists():
    torch.manual_seed(0)
    toy = _Toy()
    x = torch.randn(4, 3)
    opt = torch.optim.SGD(toy.parameters(), lr=0.1)
    expected = float(toy(x).loss.detach())
    report = Trainer(toy, lambda step: {"x": x}, opt, total_steps=1).train_step()
    values = metric_values(report.metrics, ["loss", "grad_norm", "lr", "step_time",
                                            "steps_per_s"])
    # no ce, no aux (the model computes neither), no tokens/s (x is no batch of token ids)
    assert set(values) == {"loss", "grad_norm", "lr", "step_time", "steps_per_s"}
    assert values["loss"] == pytest.approx(expected)
    assert report.metrics.expert_load is None


def test_locate_nonfinite_fallback_innermost_first():
    model, batch, _ = tiny_setup()
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.fill_(float("inf"))
    module, detail = locate_nonfinite(model, lambda: model(batch["input_ids"]))
    assert module == "model.layers.0.mlp.gate"
    assert detail == "its output (Linear) holds 48 NaN of 48 values"  # Inf·x + -Inf·y = NaN


def test_checkpoint_resume_is_bitwise_identical(tmp_path):
    model, batch, opt = tiny_setup()
    straight = Trainer(model, batch, opt, total_steps=20)
    straight.run(on_step=lambda r: r.step == 10 and save_checkpoint(
        tmp_path / "ck", model, opt, step=10, extra={"note": (1, 2), "x": float("inf")}))
    # fresh objects, different init, restored from the checkpoint of step 10
    model2, batch2, opt2 = tiny_setup(seed=123)
    meta = load_checkpoint(tmp_path / "ck", model2, opt2)
    assert meta["step"] == 10 and meta["extra"] == {"note": (1, 2), "x": float("inf")}
    assert model2.weights_tied
    Trainer(model2, batch, opt2, total_steps=20, start_step=10).run()
    for (n, p), q in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q), n
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for k in s1:
        for name in s1[k]:
            assert torch.equal(torch.as_tensor(s1[k][name]), torch.as_tensor(s2[k][name]))


def test_checkpoint_does_not_fit_another_model(tmp_path):
    model, _, opt = tiny_setup()
    save_checkpoint(tmp_path / "ck", model, opt, step=1)
    other = MiniLLM(tiny_config(hidden_size=32))
    with pytest.raises(ValueError, match="does not fit the model"):
        load_checkpoint(tmp_path / "ck", other)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nothing", model)
    sgd = torch.optim.SGD(model.parameters(), lr=1)
    with pytest.raises(ValueError, match="AdamW state, not SGD"):
        load_checkpoint(tmp_path / "ck", model, sgd)


def test_signal_exit_codes():
    assert signal_exit_code("SIGINT") == 130
    assert signal_exit_code("SIGTERM") == 143
    assert signal_exit_code("SIGHUP") == 129
    assert signal_exit_code("stopped") is None and signal_exit_code(None) is None


def _tiny_options(**kw) -> OverfitOptions:
    cfg = tiny_config().to_dict()
    base = dict(text=TEXT, model_config=cfg, preset=None, steps=20, lr=1e-2, sample_every=5,
                sample_tokens=6)
    base.update(kw)
    return OverfitOptions(**base)


def test_overfit_session_writes_every_step_and_resumes(tmp_path):
    db = tmp_path / "mdb.sqlite"
    store = RunStore(db, create=True)
    session = OverfitSession.create(store, "r", _tiny_options(steps=12, every=6))
    session.control.stop("SIGTERM")  # stops before the first step
    res = session.run()
    assert (res.status, res.last_step) == ("interrupted", 0)
    run = store.run("r")
    assert run.status == "interrupted" and run.reason == "SIGTERM" and run.checkpoint_step == 0

    session = OverfitSession.resume(store, "r")
    seen = []
    session.run(on_step=lambda r: (seen.append(r.step), r.step == 7 and session.control.stop("x")))
    run = store.run("r")
    assert (run.status, run.last_step, run.checkpoint_step, run.attempt) == (
        "interrupted", 7, 7, 2)
    s2 = OverfitSession.resume(store, "r", steps=15)
    assert s2.trainer.step == 7
    s2.run()
    run = store.run("r")
    assert (run.status, run.last_step, run.total_steps, run.attempt) == ("finished", 15, 15, 3)
    rows = store.metrics(run.id)
    assert [m.step for m in rows] == list(range(1, 16))
    assert [s.step for s in store.samples(run.id)] == [1, 5, 8, 10, 15]
    assert store.internals_steps(run.id) == [6, 12]
    assert run.config["text"] == TEXT and run.config["resolved_model_config"]["vocab_size"] == 11
    assert store.integrity_check() == "ok"

    # the resumed run equals an uninterrupted one: compare final weights with a fresh 15 steps
    fresh_store = RunStore(tmp_path / "b.sqlite", create=True)
    fresh = OverfitSession.create(fresh_store, "r", _tiny_options(steps=15, every=6))
    fresh.run()
    for (n, p), q in zip(fresh.model.named_parameters(), s2.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    ce_a = [m.ce for m in store.metrics(run.id)]
    ce_b = [m.ce for m in fresh_store.metrics(fresh_store.run("r").id)]
    assert ce_a == ce_b


def _line_of(code: str) -> str:
    """``test_training.py:N: CODE`` for the first line of this file that holds ``code``."""
    lines = Path(__file__).read_text(encoding="utf-8").splitlines()
    n = next(i for i, x in enumerate(lines, 1) if x.strip() == code)
    return f"{Path(__file__).name}:{n}: {code}"


def _crash_at(session, step: int, exc: BaseException) -> None:
    """Make the batch of ``step`` raise ``exc`` (the loop itself raises, not the model)."""
    original = session.trainer.batch

    def batch(s: int):
        if s == step:
            raise exc
        return original(s) if callable(original) else original

    session.trainer.batch = batch


def test_a_loop_that_raises_is_failed_with_a_checkpoint_of_the_last_recorded_step(tmp_path):
    store = RunStore(tmp_path / "mdb.sqlite", create=True)
    session = OverfitSession.create(store, "crash", _tiny_options(steps=20, every=0))
    _crash_at(session, 5, RuntimeError("the data loader broke"))
    with pytest.raises(RuntimeError, match="the data loader broke"):
        session.run()
    run = store.run("crash")
    assert (run.status, run.last_step, run.checkpoint_step) == ("failed", 4, 4)
    # the exception and where it was raised (hooks.errors.describe_error: the user's line)
    line = _line_of("raise exc")
    assert run.reason == f"at step 5: RuntimeError: the data loader broke — at {line}"
    # the crash checkpoint holds the weights after step 4, and a resume continues from it
    fresh = MiniLLM(session.config)
    meta = load_checkpoint(session.checkpoint_path, fresh)
    assert meta["step"] == 4 and session.checkpoint_path.name == "step-00000004"
    for (n, p), q in zip(session.model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), n
    resumed = OverfitSession.resume(store, "crash")
    assert resumed.trainer.step == 4
    assert resumed.run().status == "finished"
    assert [m.step for m in store.metrics(run.id)] == list(range(1, 21))


def test_a_crash_checkpoint_that_cannot_be_written_is_said_in_the_run(tmp_path, monkeypatch):
    import hooks.train.overfit as overfit

    store = RunStore(tmp_path / "mdb.sqlite", create=True)
    session = OverfitSession.create(store, "crash", _tiny_options(steps=20, every=0))
    _crash_at(session, 5, RuntimeError("the data loader broke"))
    real = overfit.save_checkpoint

    def save(path, model, optimizer, *, step, extra=None):
        if step == 4:
            raise OSError(30, "Read-only file system")
        return real(path, model, optimizer, step=step, extra=extra)

    monkeypatch.setattr(overfit, "save_checkpoint", save)
    with pytest.raises(RuntimeError):
        session.run()
    run = store.run("crash")
    assert (run.status, run.last_step, run.checkpoint_step) == ("failed", 4, 0)
    assert run.reason == (f"at step 5: RuntimeError: the data loader broke — at "
                          f"{_line_of('raise exc')}; checkpoint of step 4 failed: Read-only file "
                          "system, a resume starts from step 0")
    assert session.checkpoint_error == "checkpoint of step 4 failed: Read-only file system"


def test_kill_between_checkpoint_write_and_record_resumes_from_the_recorded_one(tmp_path):
    """A writer killed after writing a newer checkpoint but before the store recorded it: the
    resume loads the checkpoint the database names (CI once caught the old single-directory
    layout overwritten with step 10 while the database said 5)."""
    store = RunStore(tmp_path / "mdb.sqlite", create=True)
    session = OverfitSession.create(store, "r", _tiny_options(steps=40, every=0,
                                                               checkpoint_every=5))
    session.run(on_step=lambda r: r.step == 7 and session.control.stop("x"))
    assert store.run("r").checkpoint_step == 7
    recorded = session.checkpoint_path
    weights_at_7 = {n: p.detach().clone() for n, p in session.model.named_parameters()}
    # what `kill -9` leaves: the next checkpoint complete on disk, the database not updated
    session.trainer.step = 10
    orphan = save_checkpoint(session.checkpoint_root / "step-00000010", session.model,
                             session.optimizer, step=10)
    assert orphan.is_dir() and recorded.is_dir() and orphan != recorded

    resumed = OverfitSession.resume(store, "r", steps=12)
    assert resumed.trainer.step == 7
    for n, p in resumed.model.named_parameters():
        torch.testing.assert_close(p, weights_at_7[n], rtol=0, atol=0, msg=n)
    resumed.run()
    run = store.run("r")
    assert (run.status, run.last_step, run.checkpoint_step) == ("finished", 12, 12)
    assert [m.step for m in store.metrics(run.id)] == list(range(1, 13))
    # only the recorded checkpoint is left
    assert sorted(d.name for d in session.checkpoint_root.iterdir()) == ["step-00000012"]
    assert resumed.checkpoint_path == session.checkpoint_root / "step-00000012"


def test_captured_step_round_trips_through_the_store(tmp_path):
    store = RunStore(tmp_path / "mdb.sqlite", create=True)
    s = OverfitSession.create(store, "c", _tiny_options(steps=3, every=2))
    reports = []
    s.run(on_step=reports.append)
    live = reports[1].trace
    run_id = store.run("c").id
    assert store.internals_steps(run_id) == [2] and load_trace(store, run_id, 1) is None
    with RunStore(tmp_path / "mdb.sqlite") as reader:
        loaded = load_trace(reader, run_id, 2)
    assert loaded.step == 2 and len(loaded.forward) == len(live.forward) > 0
    assert [r.module for r in loaded.forward] == [r.module for r in live.forward]
    assert loaded.meta["tokens"] == list(TEXT) and loaded.meta["run"] == "c"
    assert loaded.meta["ce_loss"] == pytest.approx(reports[1].metrics.ce)
    want, got = live.all_tensors(), loaded.all_tensors()
    assert set(want) == set(got) and any(k.startswith("attention/") for k in want)
    assert any(k.startswith("routing/") for k in want)
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_overfit_windows_with_seq_len_and_batch_size(tmp_path):
    store = RunStore(tmp_path / "mdb.sqlite", create=True)
    s = OverfitSession.create(store, "w", _tiny_options(seq_len=5, batch_size=3))
    b = s._batch_for(4)
    assert b["input_ids"].shape == (3, 5)
    text_ids = s.ids[0].tolist()
    for row in b["input_ids"].tolist():
        starts = [i for i in range(len(text_ids) - 4) if text_ids[i : i + 5] == row]
        assert starts  # every window is a slice of the text
    assert torch.equal(s._batch_for(4)["input_ids"], b["input_ids"])  # reproducible per step


def test_overfit_bad_options_raise_one_line(tmp_path):
    store = RunStore(tmp_path / "mdb.sqlite", create=True)
    for kw, msg in [
        ({"steps": 0}, "--steps"),
        ({"lr": -1.0}, "--lr"),
        ({"batch_size": 0}, "--batch-size"),
        ({"seq_len": 1}, "--seq-len"),
        ({"text": ""}, "empty"),
        ({"seq_len": 100, "text": "ab" * 100}, "max_position_embeddings"),
    ]:
        with pytest.raises(ValueError, match=msg):
            OverfitSession.create(store, "bad", _tiny_options(**kw))
    assert store.runs() == []  # nothing registered for a run that could not start


@pytest.mark.slow
def test_seed_claim_default_overfit_reaches_ce_below_005_by_step_300(tmp_path):
    """Seed 000 test C: the default overfit config memorises the sentence (CE < 0.05 by 300)."""
    text, _ = default_overfit_text()
    assert text == "人工智能正在改变世界。" * 6
    opts = OverfitOptions(text=text, model_config=load_preset("seed-test-c").to_dict(),
                          sample_every=0)
    assert (opts.steps, opts.lr, opts.seed) == (300, 3e-3, 0)
    store = RunStore(tmp_path / "mdb.sqlite", create=True)
    session = OverfitSession.create(store, "seed", opts)
    cfg = session.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.num_local_experts, cfg.num_experts_per_tok) == (
            128, 4, 4, 1, 4, 2)
    result = session.run()
    assert result.status == "finished" and result.last_step == 300
    rows = store.metrics(store.run("seed").id)
    assert len(rows) == 300 and rows[-1].ce < 0.05
    # independent check on the final weights: torch's cross-entropy of the shifted text
    ids = session.ids
    with torch.no_grad():
        logits = session.model(ids).logits
    ce = F.cross_entropy(logits[0, :-1], ids[0, 1:])
    assert float(ce) < 0.05
    # and greedy decoding from the first 4 characters reproduces the text
    prompt, cont = session.greedy_sample()
    assert prompt + cont == text[: len(prompt) + len(cont)]


# ---------------------------------------------------------------------------------------------
# Gradient norms that overflow fp32 (`mdb overfit --lr 5`), and the scan before zero_grad
# ---------------------------------------------------------------------------------------------


def test_total_norm_of_huge_finite_gradients_does_not_overflow():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, 32, generator=g) * 3e25, torch.randn(100, generator=g) * 1e20,
             torch.zeros(5), torch.randn(7, 3, generator=g).to(torch.bfloat16) * 1e30]
    assert all(bool(torch.isfinite(t).all()) for t in grads)
    assert math.isinf(float(torch.nn.utils.get_total_norm(grads)))  # fp32 squares overflow
    # reference: every element in float64 (no element squared exceeds float64's range)
    ref = math.sqrt(math.fsum(float(x) ** 2 for t in grads for x in t.double().flatten()))
    assert training.total_norm(grads) == pytest.approx(ref, rel=1e-6)
    small = [torch.randn(10, generator=g)]
    assert training.total_norm(small) == pytest.approx(float(small[0].double().norm()), rel=1e-6)
    assert training.total_norm([]) == 0.0
    nan = [grads[0], torch.tensor([1.0, float("nan")])]
    inf = [grads[0], torch.tensor([1.0, float("inf")])]
    assert math.isnan(training.total_norm(nan)) and training.total_norm(inf) == math.inf


class _Huge(nn.Module):
    """A loss whose gradients are finite but whose squares overflow fp32 (|g| ~ 1e25)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return SimpleNamespace(loss=self.a(x).sum() * 1e25)


def test_huge_finite_gradients_train_on_and_are_clipped_exactly():
    torch.manual_seed(0)
    model = _Huge()
    x = torch.ones(2, 4)
    ref = copy.deepcopy(model)
    ref(x).loss.backward()
    want = math.sqrt(math.fsum(float(v) ** 2 for p in ref.parameters()
                               for v in p.grad.double().flatten()))
    opt = torch.optim.SGD(model.parameters(), lr=1e-26)
    trainer = Trainer(model, {"x": x}, opt, total_steps=1, grad_clip=1.0)
    report = trainer.train_step()
    assert report.failure is None  # it used to fail: "no non-finite gradient found"
    assert metric_values(report.metrics)["grad_norm"] == pytest.approx(want, rel=1e-6)
    clipped = math.sqrt(sum(float(p.grad.double().norm()) ** 2 for p in model.parameters()))
    assert clipped == pytest.approx(1.0, rel=1e-5)  # torch's clip rule: max_norm / (norm + 1e-6)


def test_nonfinite_gradient_is_found_before_anything_clears_it(monkeypatch):
    """The capture engine is there but names no module (as for a NaN made inside a custom
    autograd function): the parameter scan must see the step's own gradients — it ran after
    the rerun's zero_grad(set_to_none=True) and found none."""
    monkeypatch.setattr(training, "trace_origin", lambda trace, stayed_finite=None: None)
    torch.manual_seed(0)
    toy = _Toy()
    toy.poison = True
    opt = torch.optim.SGD(toy.parameters(), lr=0.1)
    result = Trainer(toy, {"x": torch.randn(4, 3)}, opt, total_steps=3).run()
    f = result.failure
    assert (result.status, f.what, f.module, f.direction) == ("failed", "gradient", "a",
                                                              "gradient")
    assert f.located_by == "gradients"  # the first parameter with a NaN gradient: a.weight
    assert f.detail == "the gradient of its weight holds 9 NaN of 9 values"


def test_install_stop_signals_leaves_an_ignored_signal_ignored():
    """``nohup`` (SIGHUP) and ``&`` (SIGINT) ask a process to ignore them: every mdb run (the
    headless trainer, mdb ablate's workers) keeps them ignored, and restores what was there."""
    import signal

    from hooks.train.trainer import TrainControl, install_stop_signals

    before = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        control = TrainControl()
        restore = install_stop_signals(control)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
        restore()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is before[signal.SIGTERM]
    finally:
        for s, h in before.items():
            signal.signal(s, h)
