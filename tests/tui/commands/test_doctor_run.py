"""``mdb doctor --run NAME`` and ``mdb runs`` on the training-loop doctor's findings of a real
``hooks.run`` loop (weight decay on norm weights and embeddings, the scheduler stepped per
micro-batch), and their bad input (one line, exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.loop_models import TinyLM, batches, run_loop
from tui.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _buggy(run):
    torch.manual_seed(0)
    m = TinyLM()
    o = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)  # decays everything
    sched = torch.optim.lr_scheduler.LinearLR(o, start_factor=0.01, total_iters=40)
    run.watch(m, every=2, optimizer=o, scheduler=sched)
    for step in range(2):
        for b in batches(2, seed=step):
            _, loss = m(**b)
            (loss / 2).backward()
            sched.step()  # per micro-batch: the bug
        o.step()
        o.zero_grad()
        run.log(loss=loss)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("runs") / "mdb.sqlite"
    found = run_loop(path, _buggy, name="buggy")
    assert {f.kind for f in found} == {"weight_decay", "scheduler_steps"}
    run_loop(path, lambda run: run.log(loss=1.0), name="clean")
    return path


def test_doctor_run_table(db, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    assert main(["doctor", "--run", "buggy", "--db", str(db)]) == 1  # an error finding
    out = capsys.readouterr().out
    assert "run buggy · finished" in out and "4 finding(s)" in out
    assert "weight_decay" in out and "WARN" in out and "ERROR" in out
    assert "scheduler_steps" in out
    assert main(["doctor", "--run", "buggy", "--db", str(db), "--wide"]) == 1  # one line each
    out = capsys.readouterr().out
    assert "40-step warmup ends after 20 optimizer steps" in out


def test_doctor_run_json_and_a_clean_run(db, capsys):
    assert main(["doctor", "--run", "buggy", "--db", str(db), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"] == {"findings": 4, "errors": 3, "warnings": 1}
    sched = [f for f in doc["findings"] if f["subject"] == "LinearLR"][0]
    assert (sched["step"], sched["detail"]["scheduler_steps"], sched["detail"]["warmup"]) == \
        (2, 2, 40)
    assert main(["doctor", "--run", "clean", "--db", str(db)]) == 0
    assert "run clean: no finding" in capsys.readouterr().out


def test_runs_lists_the_loop_findings(db, capsys):
    assert main(["runs", "--json", "--db", str(db)]) == 0
    recs = {r["name"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    kinds = [f["kind"] for f in recs["buggy"]["findings"]]
    assert kinds.count("weight_decay") == 2 and recs["clean"]["findings"] == []
    assert "4 loop finding(s) (mdb doctor --run buggy)" in recs["buggy"]["details"]


@pytest.mark.parametrize("argv,says", [
    (["--run", "nope"], "nope"),
    (["--run", "buggy", "--model", "x:y"], "--run and --model are exclusive"),
    (["--run", "buggy", "--tui"], "--run and --tui are exclusive"),
    (["--db", "x.sqlite"], "--db goes with --run"),
])
def test_doctor_run_bad_input(db, capsys, argv, says):
    argv = argv + ([] if "--db" in argv else ["--db", str(db)])
    assert main(["doctor", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mdb: error:") and says in err[0]
