"""``mdb overfit --model module:function``: seed 000's test C ("memorise one batch") on the
user's own model — a nanoGPT ``(idx, targets)``, an HF Llama, a CNN with a ``loss_fn``, an HF
Mixtral (router aux loss and expert load) — with the run store, resume from the same factory
and a one-line refusal when the factory's model changed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hooks.store.store import RunStore
from hooks.train.overfit import ModelOverfitOptions, ModelOverfitSession, resume_session
from tests.conftest import REPO, drawn
from tests.families import FAMILIES
from tests.processes import one_error_line as _one_error_line
from tui.cli import main
from tui.commands.overfit import _build_workload
from tui.screens.live_data import metric_values

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES_PY = REPO / "tests" / "families.py"


def _spec(family: str) -> str:
    return f"{FAMILIES_PY}:{FAMILIES[family].build.__name__}"


def _session(tmp_path, family: str, steps: int, name: str = "m", **kw) -> ModelOverfitSession:
    if FAMILIES[family].hf:
        pytest.importorskip("transformers")
    store = RunStore(tmp_path / "mdb.sqlite", create=True)
    opts = ModelOverfitOptions(model=_spec(family), steps=steps, **kw)
    return ModelOverfitSession.create(store, name, opts, _build_workload)


def _independent_ce(session: ModelOverfitSession, family: str) -> float:
    """Cross-entropy of the trained model on its batch, recomputed with torch's own function
    from the raw outputs (not the model's loss, not mdb's)."""
    model, batch = session.model, session.batch
    with torch.no_grad():
        if family == "nanogpt":
            idx, targets = batch.args
            logits, _ = model(idx)
            return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                         targets.reshape(-1)))
        if family == "llama":
            ids = batch.kwargs["input_ids"]
            logits = model(input_ids=ids).logits
            return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                         ids[:, 1:].reshape(-1)))
        model.train()  # BatchNorm: the statistics of the batch, as in training
        (x,) = batch.args
        return float(F.cross_entropy(model(x), batch.targets))


@pytest.mark.parametrize("family, steps, names", [
    ("nanogpt", 60, ["loss", "grad_norm", "lr", "step_time", "tokens_per_s", "steps_per_s"]),
    ("llama", 60, ["loss", "grad_norm", "lr", "step_time", "tokens_per_s", "steps_per_s"]),
    # a CNN: the loss is the factory's loss_fn; no token ids, so no tokens/s
    ("cnn", 100, ["loss", "grad_norm", "lr", "step_time", "steps_per_s"]),
])
def test_user_model_memorises_its_batch(tmp_path, family, steps, names):
    session = _session(tmp_path, family, steps)
    assert session.metric_names == names and session.loss_metrics == ["loss"]
    first_ce = _independent_ce(session, family)
    result = session.run()
    assert (result.status, result.last_step) == ("finished", steps)
    with RunStore(tmp_path / "mdb.sqlite") as store:
        run = store.run("m")
        rows = store.metrics(run.id)
        assert run.config["workload"] == "model" and run.config["metrics"] == names
        assert run.config["loss_source"] == {"nanogpt": "out[1]", "llama": "out.loss",
                                             "cnn": "loss_fn(out, batch)"}[family]
    values = [metric_values(r, names) for r in rows]
    assert [r.step for r in rows] == list(range(1, steps + 1))
    assert all(set(v) == set(names) for v in values)  # no aux, no ce: the model has none
    assert all(r.expert_load is None for r in rows)
    # the first logged loss is the model's loss at its initial weights (recomputed by torch)
    assert values[0]["loss"] == pytest.approx(first_ce, rel=1e-4)
    assert first_ce > 2.0  # ln(128) = 4.85 for the LMs, ln(10) = 2.30 for the CNN
    assert values[-1]["loss"] < 0.05
    assert _independent_ce(session, family) < 0.05


def test_moe_user_model_records_router_aux_and_expert_load(tmp_path):
    session = _session(tmp_path, "mixtral", 3, every=3)
    assert session.metric_names[:2] == ["loss", "aux"] and session.has_experts
    assert session.top_k == 2
    session.run()
    with RunStore(tmp_path / "mdb.sqlite") as store:
        run = store.run("m")
        assert run.config["moe"] is True and run.config["top_k"] == 2
        rows = store.metrics(run.id)
        assert store.internals_steps(run.id) == [3]
    load = rows[-1].expert_load
    assert len(load) == 2 and all(len(layer) == 4 for layer in load)
    for layer in load:  # fractions of the N·k routed slots
        assert sum(layer) == pytest.approx(1.0)
    # the router aux loss is the model's own (HF: k × the balanced value 1.0 at the floor)
    assert 1.0 < metric_values(rows[0], session.metric_names)["aux"] < 4.0


def test_resume_rebuilds_the_model_from_the_factory_and_equals_a_straight_run(tmp_path):
    session = _session(tmp_path, "nanogpt", 12)
    session.run(on_step=lambda r: r.step == 5 and session.control.stop("x"))
    store = session.store
    assert store.run("m").checkpoint_step == 5
    resumed = resume_session(store, "m", build=_build_workload)
    assert isinstance(resumed, ModelOverfitSession) and resumed.trainer.step == 5
    resumed.run()
    run = store.run("m")
    assert (run.status, run.last_step, run.attempt) == ("finished", 12, 2)
    straight = _session(tmp_path / "b", "nanogpt", 12)
    straight.run()
    for (n, p), q in zip(straight.model.named_parameters(), resumed.model.parameters(),
                         strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    a = [metric_values(r, resumed.metric_names)["loss"] for r in store.metrics(run.id)]
    with RunStore(tmp_path / "b" / "mdb.sqlite") as other:
        b = [metric_values(r, resumed.metric_names)["loss"]
             for r in other.metrics(other.run("m").id)]
    assert a == b


_FACTORY = """
import torch
from torch import nn
import torch.nn.functional as F

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, {width})
        self.head = nn.Linear({width}, 32)

    def forward(self, idx, targets):
        logits = self.head(self.emb(idx))
        return logits, F.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))

def build():
    x = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    return Tiny(), (x[:, :-1], x[:, 1:])

def no_loss():
    return Tiny().emb, torch.zeros(2, 8, dtype=torch.long)
"""


def test_cli_model_run_resume_and_a_changed_factory_refused(tmp_path, capsys, monkeypatch):
    factory = tmp_path / "mymodel.py"
    factory.write_text(textwrap.dedent(_FACTORY.format(width=16)))
    db = tmp_path / "runs" / "mdb.sqlite"
    monkeypatch.chdir(tmp_path)  # a relative path, as a user types it
    assert main(["overfit", "--headless", "--model", "mymodel.py:build", "--steps", "4",
                 "--db", str(db), "--run", "t", "--every", "2"]) == 0
    out = capsys.readouterr().out
    assert "mdb overfit: run t · Tiny from mymodel.py:build" in out and "loss = out[1]" in out
    assert "run t finished: step 4/4, loss " in out
    with RunStore(db) as store:
        run = store.run("t")
        assert run.config["model_path"] == f"{factory.resolve()}:build"
        assert store.internals_steps(run.id) == [2, 4]
        assert store.internals(run.id, 2)["meta"]["loss_source"] == "out[1]"
    # the resume imports the stored absolute path: it works from any directory
    monkeypatch.chdir(REPO)
    assert main(["overfit", "--headless", "--resume", "t", "--steps", "6", "--db", str(db)]) == 0
    assert "run t finished: step 6/6" in capsys.readouterr().out
    # the factory now builds another model: the changed file is not imported unless named
    # again; named, its model is refused in one line; the run left as it was
    factory.write_text(textwrap.dedent(_FACTORY.format(width=24)))
    assert main(["overfit", "--headless", "--resume", "t", "--steps", "8", "--db", str(db)]) == 2
    assert "changed since the run was made" in _one_error_line(capsys)
    assert main(["overfit", "--headless", "--resume", "t", "--steps", "8", "--db", str(db),
                 "--model", f"{factory}:build"]) == 2
    line = _one_error_line(capsys)
    assert f"cannot resume 't': the model from {factory}:build no longer matches its " \
           "checkpoint of step 6: emb.weight is (32, 24) in the model, (32, 16) in the " \
           "checkpoint (2 tensors differ)" in line
    with RunStore(db) as store:
        run = store.run("t")
        assert (run.status, run.last_step, run.attempt) == ("finished", 6, 2)


@pytest.mark.parametrize("argv, message", [
    (["--model", "mymodel.py:build", "--text", "x.txt"], "--text does not apply with --model"),
    (["--model", "mymodel.py:build", "--seq-len", "4", "--batch-size", "2"],
     "--seq-len, --batch-size does not apply with --model"),
    (["--model", "mymodel.py:no_loss"], "the model returned no loss"),
    (["--model", "mymodel.py:nope"], "has no function nope"),
    (["--model", "missing.py:build"], "no such file"),
])
def test_cli_model_bad_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch, argv, message):
    (tmp_path / "mymodel.py").write_text(textwrap.dedent(_FACTORY.format(width=16)))
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "mdb.sqlite"
    assert main(["overfit", "--headless", "--db", str(db), "--steps", "2", *argv]) == 2
    assert message in _one_error_line(capsys)
    if db.exists():
        with RunStore(db) as store:
            assert store.runs() == []  # nothing registered for a run that could not start


async def test_live_screen_of_a_user_model_shows_what_it_logs(tmp_path):
    """No `aux nan`, no MoE panel, no sample: the loss, and the table of the other metrics."""
    from tests.conftest import wait_until
    from tui.live_app import make_overfit_app

    session = _session(tmp_path, "nanogpt", 15)
    app = make_overfit_app(session, chart_interval=0.05, text_interval=0.05)
    screen = app.live
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: screen.ended is not None)
        await drawn(pilot, app.live)
        status = str(app.screen.query_one("#live-status").render())
        assert "finished" in status and "step 15/15" in status and "loss " in status
        assert "aux" not in status and "nan" not in status and "|g| " in status
        assert not app.screen.query_one("#live-experts").display
        assert not app.screen.query_one("#live-sample").display
        table = str(app.screen.query_one("#live-table").render())
        assert "▸grad_norm" in table and "lr" in table and "0.003" in table
        assert "loss" not in table  # losses are charted, not tabled
        chart = app.screen.query_one("#live-loss")
        assert [s.name for s in chart.series] == ["loss"]
        assert chart.series[0].ys[-1] == pytest.approx(screen.series.value("loss"), rel=0.5)
        title = str(app.screen.query_one("#title").render())
        assert "NanoGPT from" in title
        await pilot.press("q")
    assert app.return_code == 0


def test_families_path_is_what_the_readme_names():
    assert Path(FAMILIES_PY).exists()
