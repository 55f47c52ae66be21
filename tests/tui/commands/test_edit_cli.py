"""``mdb capture --edit`` and ``mdb diff --edit``: edits from the command line; bad specs are one
line, exit 2, and nothing runs (the model's forward is never called)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hooks
from tui.cli import main

TINY = ["--preset", "tiny", "--seq-len", "16"]
ATTN = "model.layers.1.self_attn"


def _head_zeroed_loss(h: int) -> tuple[float, float]:
    """(loss as is, loss with head h of layer 1 zeroed in o_proj's weights) of the workload
    the options build, computed here without mdb's edits."""
    import argparse

    from tui.commands.options import add_model_arguments
    from tui.commands.workload import build_workload

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    w = build_workload(parser.parse_args(TINY))
    ref = copy.deepcopy(w.model)
    o = ref.model.layers[1].self_attn.o_proj
    dh = o.in_features // ref.config.num_attention_heads
    with torch.no_grad():
        base = float(w.batch.call(w.model).loss)
        o.weight[:, h * dh:(h + 1) * dh] = 0
        return base, float(w.batch.call(ref).loss)


def test_capture_edit_writes_the_edited_step_and_what_was_applied(tmp_path, capsys):
    out = tmp_path / "e.mdbtrace"
    assert main(["capture", *TINY, "--edit", f"zero {ATTN} head=2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"edit: zero {ATTN} head=2: 1 of 1 call(s) changed" in text
    trace = hooks.Trace.load(out)
    (rec,) = trace.edits
    assert rec.applied and rec.hooked == f"{ATTN}.o_proj"
    base, edited = _head_zeroed_loss(2)
    assert abs(trace.meta["loss"] - edited) < 1e-5 and abs(edited - base) > 1e-6


def test_diff_edit_table_has_the_loss_change_on_top(capsys):
    assert main(["diff", "--edit", f"zero {ATTN} head=2", *TINY, "--table", "--limit", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    base, edited = _head_zeroed_loss(2)
    assert lines[0] == f"loss {base:.6g} → {edited:.6g} (Δ {edited - base:+.3g})"
    assert lines[1].startswith(f"edit: zero {ATTN} head=2")
    assert any("B - A per module call" in ln for ln in lines)


def test_diff_edit_json_changes_nothing_before_the_edited_call(capsys):
    assert main(["diff", "--edit", "scale model.layers.1.mlp by=0", *TINY, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["edits"][0]["changed"] == 1
    rel = {(r["module"], r["tensor"]): float(r["relative"]) for r in doc["forward"]}
    assert rel[("model.layers.0", "out[0]")] == 0.0 and rel[("model.embed_tokens", "out")] == 0
    assert rel[("model.layers.1.mlp", "out[1]")] == 0.0  # the router logits: before the edit
    assert rel[("model.layers.1.mlp", "out[0]")] > 0 and rel[("lm_head", "out")] > 0


def test_diff_edit_patch_from_source_ids(capsys):
    ids = ",".join(str(i % 50 + 3) for i in range(16))
    assert main(["diff", "--edit", "patch model.layers.0 from=clean", "--source-ids", ids,
                 *TINY, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["edits"][0]["spec"] == "patch model.layers.0 from=clean"  # as typed
    assert doc["edits"][0]["changed"] == 1


FACTORY = textwrap.dedent("""
    import pathlib, torch
    from torch import nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16)

        def forward(self, ids):
            pathlib.Path(__file__).with_name("ran").write_text("forward ran")
            return self.head(self.emb(ids)).mean()

    def build():
        return M(), torch.zeros(2, 4, dtype=torch.long)
""")


BAD = [
    (["capture", "--edit", "zero nothing"], "no module matches 'nothing'"),
    (["capture", "--edit", "zero head head=0"], "attention"),
    (["capture", "--edit", "frob head"], "unknown operation"),
    (["capture", "--edit", "patch head from=x"], "give the patch source"),
    (["capture", "--edit", "zero head", "--source-ids", "1,2"], "for a 'patch' edit"),
    (["diff", "--edit", "zero head expert=1"], "MoE block"),
    (["diff", "--edit", "scale head by=inf"], "finite"),
    (["diff", "--edit", "patch emb from=s", "--source-ids", "1,2,3"], "the batch is 2×4"),
    (["diff", "a.mdbtrace", "b.mdbtrace", "--edit", "zero head"], "one of them"),
    (["diff"], "one of them"),
]


def _bad_argv(tmp_path, argv):
    (tmp_path / "fac.py").write_text(FACTORY)
    extra = ["--model", f"{tmp_path / 'fac.py'}:build"]
    if argv[0] == "capture":
        extra += ["--out", str(tmp_path / "o.mdbtrace")]
    if argv[1:2] == ["a.mdbtrace"] or argv == ["diff"]:
        extra = []
    return [*argv, *extra]


@pytest.mark.parametrize("argv, words", BAD)
def test_bad_specs_are_one_line_exit_2_and_nothing_runs(tmp_path, capsys, argv, words):
    assert main(_bad_argv(tmp_path, argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mdb: error:") and words in err[0], err
    assert not (tmp_path / "ran").exists()  # the model's forward never ran
    assert not (tmp_path / "o.mdbtrace").exists()


@pytest.mark.slow
@pytest.mark.parametrize("argv, words", [BAD[0], BAD[7]])
def test_bad_specs_in_a_process_of_their_own(tmp_path, argv, words):
    proc = subprocess.run([sys.executable, "-m", "tui.cli", *_bad_argv(tmp_path, argv)],
                          cwd=Path.cwd(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mdb: error:") and words in err[0], err
    assert not (tmp_path / "ran").exists()


def test_diff_a_b_still_needs_both(capsys):
    assert main(["diff", "only-a.mdbtrace"]) == 2
    assert "give the trace to compare it with" in capsys.readouterr().err


def test_diff_edit_patch_from_the_batch_s_own_text_changes_nothing(capsys):
    from tests.conftest import SAMPLES

    text = (SAMPLES / "alice.txt").read_text(encoding="utf-8")[:32]  # the batch's 2×16 bytes
    assert main(["diff", "--edit", "patch model.layers.0 from=clean", "--source-text", text,
                 *TINY, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (rec,) = doc["edits"]
    assert rec["calls"] == 1 and rec["changed"] == 0 and "changed nothing" in rec["note"]
    assert doc["loss_a"] == doc["loss_b"]


def test_diff_edit_patch_from_a_source_batch_function(tmp_path, capsys):
    (tmp_path / "src.py").write_text("import torch\n\ndef clean():\n"
                                     "    return torch.arange(32).view(2, 16) + 40\n")
    assert main(["diff", "--edit", "patch model.layers.1 from=x", "--source-batch",
                 f"{tmp_path / 'src.py'}:clean", *TINY, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["edits"][0]["changed"] == 1 and doc["loss_a"] != doc["loss_b"]


def test_a_patch_echoes_the_source_name_typed(capsys):
    """Issue 35: ``from=clean`` was printed back as ``from=source``."""
    ids = ",".join(str(i % 50 + 3) for i in range(16))
    assert main(["diff", "--edit", "patch model.layers.0 from=clean", "--source-ids", ids,
                 *TINY]) == 0
    out = capsys.readouterr().out
    assert "patch model.layers.0 from=clean" in out and "from=source" not in out
