"""``--model FILE:FUNCTION`` with the examples in samples/user_models.py (any nn.Module)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import SAMPLES
from tui.cli import main
from tui.commands.capturing import capture_step
from tui.commands.workload import load_user_workload

EXAMPLES = SAMPLES / "user_models.py"


def test_small_cnn_summary_lists_every_layer_and_the_mean_loss(capsys):
    assert main(["summary", "--model", f"{EXAMPLES}:small_cnn"]) == 0
    out = capsys.readouterr().out
    assert out.count("Conv2d") == 2 and "AdaptiveAvgPool2d" in out
    workload = load_user_workload(f"{EXAMPLES}:small_cnn")
    expected = workload.model(*workload.args).float().mean().item()  # the reference: no hooks
    trace = capture_step(load_user_workload(f"{EXAMPLES}:small_cnn"), attention=False)
    assert trace.meta["loss"] == pytest.approx(expected, rel=1e-6)
    assert trace.meta["loss_source"] == "mean(out)" and trace.meta["loss_fallback"] is True
    assert "no loss: mean(out) = " in out


def test_hf_mixtral_workload_records_routing_for_every_layer():
    pytest.importorskip("transformers")
    workload = load_user_workload(f"{EXAMPLES}:hf_mixtral")
    torch.manual_seed(0)
    trace = capture_step(workload, attention=False)
    assert [r.module for r in trace.routing] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for rec in trace.routing:
        assert rec.top_k_ids.shape == (64, 2)
        assert int(rec.tokens_per_expert.sum()) == 64 * 2


def test_a_model_file_imports_the_module_beside_it(tmp_path, monkeypatch, capsys):
    """``--model path/file.py:fn`` runs the file with its folder on the import path, as
    ``python path/file.py`` would: ``from myloop_model import Net`` finds myloop_model.py."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "myloop_model", raising=False)
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "myloop_model.py").write_text(
        "from torch import nn\n\n\nclass Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(4, 3)\n\n"
        "    def forward(self, x):\n        return self.fc(x)\n")
    (folder / "factory.py").write_text(
        "import torch\n\nfrom myloop_model import Net\n\n\n"
        "def build():\n    return Net(), torch.ones(2, 4)\n")
    monkeypatch.chdir(tmp_path)  # the folder is not the current directory
    assert main(["summary", "--model", "proj/factory.py:build"]) == 0
    out = capsys.readouterr()
    assert "Net from factory.py:build" in out.out and "fc" in out.out and out.err == ""


def test_folders_named_like_mdbs_packages_beside_the_model_do_not_shadow_them(tmp_path):
    """``--model DIR/m.py:build`` puts DIR on sys.path; a ``minillm/`` or ``hooks/`` folder
    there (as ``tests/`` has) must not take the place of mdb's own packages."""
    from tests.processes import run_mdb

    for name in ("minillm", "hooks"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('the wrong package')\n")
    (tmp_path / "m.py").write_text(
        "import torch\nfrom minillm import MiniLLM, load_preset\n\n\n"
        "def build():\n    torch.manual_seed(0)\n    model = MiniLLM(load_preset('tiny'))\n"
        "    return model, torch.randint(0, 256, (1, 8))\n")
    elsewhere = tmp_path / "cwd"  # not the model's folder: python -m puts the cwd first
    elsewhere.mkdir()
    proc = run_mdb(["summary", "--model", f"{tmp_path}/m.py:build"], cwd=elsewhere, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "MiniLLM" in proc.stdout
