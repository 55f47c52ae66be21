"""SVG snapshots of the main views at 80×24 (pytest-textual-snapshot), on the tiny preset.

Update after an intended change with ``pytest tests/test_tui_snapshots.py --snapshot-update``
and look at the SVGs in ``tests/__snapshots__/`` before committing them.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tui.app import make_step_app
from tui.commands._common import add_model_arguments, build_workload, capture_step


@pytest.fixture(scope="module")
def trace():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reductions in one fixed order: the same digits every run
    try:
        parser = argparse.ArgumentParser()
        add_model_arguments(parser)
        args = parser.parse_args(["--preset", "tiny", "--seq-len", "16", "--seed", "0"])
        return capture_step(build_workload(args), attention=True)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "keys",
    [
        pytest.param(("n",) * 13, id="step-forward"),
        pytest.param(("b", "n", "n", "n", "n", "n", "n", "n", "n"), id="step-backward"),
        pytest.param(("r",), id="router"),
        pytest.param(("a", "l"), id="attention"),
        pytest.param(("g",), id="gradients"),
        pytest.param(("question_mark",), id="help"),
    ],
)
def test_view_snapshot(snap_compare, trace, keys):
    assert snap_compare(make_step_app(trace), press=keys, terminal_size=(80, 24))


def test_too_small_snapshot(snap_compare, trace):
    assert snap_compare(make_step_app(trace), terminal_size=(70, 20))
