"""``mdb memory``: the table piped, ``--json``, ``--at``, and bad input as one line. The
figures are checked against the model itself (its parameters) and against the trace's own
record; the accounting is checked against independent counts in tests/hooks/test_memory.py."""

from __future__ import annotations

import json
import re

import pytest

from minillm import MiniLLM, load_preset
from tui import cli

ANSI = re.compile(r"\x1b\[")


@pytest.fixture(autouse=True)
def _no_columns(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)


def test_table_piped_lists_every_module_and_the_totals(capsys):
    assert cli.main(["memory", "--preset", "tiny", "--seq-len", "16"]) == 0
    text = capsys.readouterr().out
    assert not ANSI.search(text)
    model = MiniLLM(load_preset("tiny"))
    rows = [line for line in text.splitlines() if line.startswith("  ") or "(root)" in line]
    assert len(rows) == len(list(model.named_modules()))
    assert "step total" in text and "peak" in text and "(AdamW, estimated)" in text


@pytest.mark.parametrize("columns", [80, 60])
def test_piped_at_columns_every_line_fits_and_no_number_is_cut(capsys, monkeypatch, columns):
    """``$COLUMNS`` piped (as ``mdb summary``): columns are left out by priority and said
    under the table, names cut; every figure printed is whole, the root's as the JSON's."""
    from hooks.whatif.memory_fit import human_bytes

    argv = ["memory", "--preset", "tiny", "--seq-len", "16"]
    assert cli.main([*argv, "--json"]) == 0
    root = json.loads(capsys.readouterr().out)["modules"][0]
    monkeypatch.setenv("COLUMNS", str(columns))
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("module"))
    end = next(i for i, line in enumerate(lines) if line.startswith(("left out", "step total")))
    table = [line for line in lines[head:end] if line.strip()]
    assert all(len(line) <= columns for line in table)
    figure = re.compile(r"(\d+(\.\d+)? (B|KiB|MiB)|—)")
    for row in table[2:]:  # after the (possibly cut) name, whole figures only, total last
        name, *rest = re.split(r"\s{2,}", row.strip())
        assert rest and all(figure.fullmatch(c) for c in rest), row
        assert re.fullmatch(r"\d+(\.\d+)? (B|KiB|MiB)", rest[-1]), row
    cells = table[2].split()
    assert cells[0] == "(root)" and " ".join(cells[-2:]) == human_bytes(root["total"])
    assert human_bytes(root["param"]) in table[2]
    assert any(line.startswith(f"left out to fit {columns} columns:") for line in lines)


def test_json_document_holds_the_models_parameter_bytes(capsys):
    assert cli.main(["memory", "--preset", "tiny", "--seq-len", "16", "--json",
                     "--optimizer", "sgd"]) == 0
    doc = json.loads(capsys.readouterr().out)
    model = MiniLLM(load_preset("tiny"))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mem = doc["memory"]
    assert mem["param_bytes"] == param_bytes == doc["modules"][0]["param"]
    assert mem["optimizer"] == "SGD" and mem["optimizer_bytes"] == param_bytes  # momentum
    assert doc["peak"]["bytes"] == max(p["live_bytes"] for p in mem["timeline"])
    assert doc["total_bytes"] == (mem["param_bytes"] + mem["buffer_bytes"] + mem["grad_bytes"]
                                  + mem["optimizer_bytes"] + mem["saved_bytes"])
    root = doc["modules"][0]
    assert root["saved"] == mem["saved_bytes"] - mem["unattributed_bytes"]


def test_at_prints_the_figure_and_how(capsys):
    assert cli.main(["memory", "--preset", "tiny", "--at", "batch=4,seq=64", "--json"]) == 0
    at = json.loads(capsys.readouterr().out)["at"]
    assert at["batch"] == 4 and at["seq"] == 64
    assert at["total_bytes"] == sum(at["terms"].values())
    assert len(at["steps"]) == 5
    assert cli.main(["memory", "--preset", "tiny", "--at", "seq=64, batch=4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("will it fit: batch 4 × seq 64 needs about") and "how:" in out


@pytest.mark.parametrize("argv,words", [
    (["--at", "batch=4"], "--at 'batch=4': expected batch=B,seq=T"),
    (["--at", "batch=0,seq=8"], "expected batch=B,seq=T"),
    (["--at", "batch=2,seq=8,seq=9"], "expected batch=B,seq=T"),
    (["--at", "batch=2,seq=x"], "expected batch=B,seq=T"),
    (["--run", "nosuch@3"], "--run nosuch@3:"),
    (["--trace", "nowhere.mdbtrace"], "--trace nowhere.mdbtrace: no such trace"),
    (["--trace", "t.mdbtrace", "--at", "batch=2,seq=8"], "needs a model mdb builds"),
])
def test_bad_input_is_one_line(capsys, tmp_path, monkeypatch, argv, words):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MDB_DB", str(tmp_path / "none.sqlite"))
    assert cli.main(["memory", *argv]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mdb: error: ") and words in err
    assert "Traceback" not in err


def test_a_trace_from_before_memory_accounting_is_one_line(capsys, tmp_path):
    assert cli.main(["capture", "--preset", "tiny", "--seq-len", "8", "--out",
                     str(tmp_path / "t.mdbtrace")]) == 0
    path = tmp_path / "t.mdbtrace" / "trace.json"
    data = json.loads(path.read_text())
    del data["memory"]  # as an older mdb wrote it
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert cli.main(["memory", "--trace", str(tmp_path / "t.mdbtrace")]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no memory fields (captured by an older mdb" in err


def test_model_and_run_sources(capsys, tmp_path):
    import torch

    import hooks
    from tests.conftest import REPO

    spec = f"{REPO / 'samples' / 'user_gpt.py'}:nanogpt_tuple"
    assert cli.main(["memory", "--model", spec, "--json", "--optimizer", "none"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["memory"]["optimizer"] is None and doc["memory"]["optimizer_bytes"] == 0

    db = tmp_path / "runs.sqlite"
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with hooks.run("memrun", db=db) as run:
        run.watch(model, every=2, optimizer=opt)
        for _ in range(2):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.log(loss=loss)
    assert cli.main(["memory", "--run", "memrun@2", "--db", str(db), "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert mem["optimizer"] == "SGD" and mem["optimizer_bytes"] == params  # momentum buffers
