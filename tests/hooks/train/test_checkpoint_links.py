"""A symbolic link planted where a checkpoint goes (``step-N``, ``step-N.old``, ``step-N.tmp``
in the run's folder) is removed, never followed: what it points to is left as it was, and the
checkpoint written is a real folder holding the model's weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from hooks.train.checkpoint import save_checkpoint


@pytest.mark.parametrize("suffix", ["", ".old", ".tmp"])
def test_a_link_where_the_checkpoint_goes_is_removed_not_followed(tmp_path, suffix):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    run_dir = tmp_path / "m-checkpoints" / "r"
    run_dir.mkdir(parents=True)
    target = run_dir / "step-00000003"
    (run_dir / f"step-00000003{suffix}").symlink_to(victim, target_is_directory=True)
    model = nn.Linear(3, 2)
    save_checkpoint(target, model, None, step=3)
    assert (victim / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert target.is_dir() and not target.is_symlink()
    saved = load_file(str(target / "model.safetensors"))
    assert torch.equal(saved["weight"], model.weight.detach())
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-00000003"]
