"""``mdb doctor`` on the command line: table, JSON, exit codes, --only, --model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hooks.doctor.model import CHECKS
from tui.cli import main

REPO = Path(__file__).resolve().parents[3]
ZOO = str(REPO / "tests" / "zoo.py")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _no_columns(monkeypatch):
    """Piped output is full width unless $COLUMNS says otherwise: start without it."""
    monkeypatch.delenv("COLUMNS", raising=False)


def test_json_for_tiny_minillm(capsys):
    rc = main(["doctor", "--preset", "tiny", "--json"])
    out = capsys.readouterr().out
    doc = json.loads(out)
    assert rc == 0
    assert doc["model"].startswith("minillm tiny")
    assert [r["id"] for r in doc["results"]] == [c.id for c in CHECKS]
    status = {r["key"]: r["status"] for r in doc["results"]}
    assert status["overfit"] == "skip" and status["packing"] == "n/a"  # no position_ids
    assert all(r["status"] == "pass" for r in doc["results"]
               if r["key"] not in ("overfit", "packing"))
    assert doc["summary"]["failed"] == [] and doc["summary"]["counts"] == {
        "pass": len(CHECKS) - 2, "skip": 1, "n/a": 1}
    assert set(doc["results"][0]) == {"id", "key", "name", "status", "evidence", "hint",
                                      "module", "data", "seconds"}


def test_json_stdout_holds_only_the_document_when_user_code_prints(capsys, tmp_path):
    factory = tmp_path / "chatty.py"
    factory.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from tests.families import NanoGPT, nanogpt_batch\n"
        "class Chatty(NanoGPT):\n"
        "    def forward(self, idx, targets=None):\n"
        "        print('forward called')\n"
        "        return super().forward(idx, targets)\n"
        "def build():\n"
        "    print('number of parameters: 0.11M')\n"
        "    return Chatty(), nanogpt_batch()\n")
    rc = main(["doctor", "--model", f"{factory}:build", "--json"])
    cap = capsys.readouterr()
    doc = json.loads(cap.out)  # the whole of stdout is the document
    assert rc == 0
    assert "number of parameters: 0.11M" in cap.err and "forward called" in cap.err
    assert doc["kind"]["kind"] == "decoder" and doc["kind"]["source"] == "targets"
    assert doc["summary"]["failed"] == []


def test_the_table_says_na_and_the_kind_of_model(capsys):
    pytest.importorskip("transformers")
    rc = main(["doctor", "--model", f"{REPO / 'tests' / 'families.py'}:hf_bert", "--only",
               "causality,gqa"])
    out = capsys.readouterr().out
    assert rc == 0  # n/a does not change the exit code
    assert "kind: bidirectional encoder (HF BertForMaskedLM is a masked LM)" in out
    assert out.count("N/A") == 2 and "2 checks · 2 n/a" in out
    assert "bidirectional encoder by design" in out


def test_table_on_stdout(capsys):
    rc = main(["doctor", "--preset", "tiny", "--only", "1,tied"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Initial loss vs ln(V)" in out and "Tied embedding / LM head" in out
    assert "Causality" not in out  # --only
    assert out.count("PASS") == 2
    assert "2 checks · 2 pass" in out
    assert "\x1b[" not in out  # no colour codes when not a terminal


def test_a_failing_user_model_exits_1_and_names_the_module(capsys):
    rc = main(["doctor", "--model", f"{ZOO}:gqa_repeat", "--only", "gqa,causality"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL" in out and "→ model.layers.0.self_attn" in out
    assert "repeat_interleave" in out


def test_json_of_a_failing_model(capsys):
    rc = main(["doctor", "--model", f"{ZOO}:no_causal_mask", "--only", "2", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert doc["summary"]["failed"] == ["causality"]
    assert doc["results"][0]["module"] == "model.layers.0.self_attn"


def test_unknown_check_is_bad_input(capsys):
    rc = main(["doctor", "--preset", "tiny", "--only", "1,bogus"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("mdb: error: --only: unknown check 'bogus'")
    assert "Traceback" not in err


def test_bad_model_spec_is_bad_input(capsys):
    rc = main(["doctor", "--model", "no_such_module_xyz:build"])
    assert rc == 2
    assert "mdb: error: --model" in capsys.readouterr().err


def test_json_and_tui_are_exclusive(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--json", "--tui"])
    assert exc.value.code == 2


@pytest.mark.slow
def test_piped_subprocess_exit_codes():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run([sys.executable, "-m", "tui.cli", "doctor", "--preset", "tiny",
                         "--only", "tied"], cwd=REPO, capture_output=True, text=True, env=env,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "PASS" in ok.stdout and "\x1b[" not in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "tui.cli", "doctor", "--model",
                          f"{ZOO}:untied_by_assign", "--only", "tied"], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 1, bad.stderr
    assert "FAIL" in bad.stdout and "load_state_dict(assign=True)" in bad.stdout


# -- widths: piped at full width or $COLUMNS, never ~140 regardless --------------------------
def test_piped_table_is_full_width_one_line_per_check(capsys):
    rc = main(["doctor", "--preset", "tiny", "--only", "1,6,tied"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 3  # one line per check: nothing wrapped
    assert all("PASS" in r for r in rows)
    assert max(len(line) for line in out.splitlines()) > 140  # the evidence is not cut


def test_columns_80_puts_the_hint_under_the_evidence(capsys, monkeypatch):
    from rich.cells import cell_len

    monkeypatch.setenv("COLUMNS", "80")
    rc = main(["doctor", "--model", f"{ZOO}:gqa_repeat", "--only", "gqa,tied"])
    out = capsys.readouterr().out
    assert rc == 1
    assert all(cell_len(line) <= 80 for line in out.splitlines())
    flat = " ".join(out.split())
    assert "evidence · hint" in flat and "gqa" in flat and "FAIL" in flat
    assert "hint: " in flat and "repeat_interleave" in flat
    assert "→ model.layers.0.self_attn" in flat
    monkeypatch.setenv("COLUMNS", "60")
    assert main(["doctor", "--model", f"{ZOO}:gqa_repeat", "--only", "gqa", "--wide"]) == 1
    wide = capsys.readouterr().out
    assert len([line for line in wide.splitlines() if line.startswith("│")]) == 1


def test_tui_with_a_model_that_raises_is_one_line(capsys, monkeypatch, tmp_path):
    """The checks survive it (they skip), the step capture after them does not: one line
    naming the module and the file:line, exit 1, before any screen opens."""
    import tui.commands.process as process

    src = tmp_path / "flaky_model.py"
    src.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Flaky(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = nn.Embedding(32, 16)\n"
        "        self.proj = nn.Linear(16, 32)\n"
        "    def forward(self, ids):\n"
        "        return self.proj(self.emb(ids).view(-1, 7))\n\n"
        "def build():\n"
        "    return Flaky(), torch.randint(0, 32, (2, 8))\n")
    monkeypatch.setattr(process, "require_terminal", lambda *a, **k: None)
    rc = main(["doctor", "--model", f"{src}:build", "--tui"])
    err = capsys.readouterr().err
    assert rc == 1
    lines = [line for line in err.splitlines() if line.startswith("mdb: error:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert "RuntimeError" in lines[0] and "flaky_model.py:10" in lines[0]
