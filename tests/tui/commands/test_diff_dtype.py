"""``mdb diff --dtype`` (:func:`tui.commands.diff_dtype.run_dtype`) on a model of the test's own
whose RMSNorm squares in fp16 (tests/hooks/whatif/test_precision.py's ``NormNet``): printed, as
JSON, and in the diff screen (Pilot) with the first divergent call on top."""

from __future__ import annotations

import argparse
import json

import pytest
from textual.widgets import DataTable, Static

from tests.hooks.whatif.test_precision import NormNet, _batch
from tui.commands.diff_dtype import run_dtype
from tui.commands.options import add_model_arguments

FACTORY = "tests/tui/commands/test_diff_dtype.py"


def naive_norm_net():
    """A ``--model`` factory: the fp16-squaring norm with activations of 300."""
    return NormNet(), _batch()


def fp32_norm_net():
    return NormNet(fp32_norm=True), _batch()


def _args(dtype: str, factory: str, **extra) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--model", f"{FACTORY}:{factory}"])
    args.dtype, args.threads, args.limit = dtype, 1, 10
    for k, v in extra.items():
        setattr(args, k, v)
    return args


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("COLUMNS", raising=False)


def test_piped_it_names_the_norm_and_prints_the_table(capsys):
    assert run_dtype(_args("float16", "naive_norm_net", table=True)) == 0
    out = capsys.readouterr().out
    assert "against a deep copy cast to float16" in out
    assert "16 × eps(float16)" in out
    line = next(x for x in out.splitlines() if x.startswith("first divergent call:"))
    assert "norm#0 (forward)" in line and "a norm that squares in fp16" in line
    assert "B - A per module call" in out


def test_json_with_the_norm_in_fp32_says_nothing_diverged(capsys):
    assert run_dtype(_args("float16", "fp32_norm_net", json=True)) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dtype"] == "float16" and doc["how"] == "cast"
    assert doc["first_divergent"] is None and doc["first_nonfinite"] is None
    assert doc["tolerance"] == pytest.approx(16 * 2**-10)


async def test_the_screen_shows_the_first_divergent_call_on_top_and_its_row():
    from hooks.whatif.precision import precision_diff
    from tui.commands.diff_dtype import make_precision_app
    from tui.screens.diff import CallPairScreen
    from tui.screens.precision_diff import PrecisionDiffScreen

    pd = precision_diff(NormNet(), _batch(), "float16")
    app = make_precision_app(pd)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, PrecisionDiffScreen)
        first = str(screen.query_one("#precision-first", Static).render())
        assert first.startswith("first divergent: norm#0 (forward)")
        table = screen.query_one("#diff-table", DataTable)
        row = screen.rows[table.cursor_row]["diff"]
        assert (row.direction, row.module) == ("forward", "norm")
        await pilot.press("j", "v")
        assert table.cursor_row == screen.divergent_row()
        await pilot.press("enter")
        assert isinstance(app.screen, CallPairScreen)
