"""``mdb ablate`` on its screen: stopping the workers with Ctrl-C (or ``x``) there, then ``q``,
ends the command like a Ctrl-C in a terminal does: runs interrupted, exit 130."""

from __future__ import annotations

import asyncio
import sys

import pytest

from hooks.store.store import RunStore
from tests.conftest import wait_until
from tests.hooks.train.test_ablate import ABL_TOML
from tui.cli import main
from tui.screens.compare import CompareApp

NAMES = ["abl-attention=mha", "abl-attention=gqa"]


def _steps(db) -> dict[str, int]:
    if not db.exists():
        return {}
    with RunStore(db) as store:
        return {r.name: r.last_step or 0 for r in store.runs()}


def _drive(keys: list[str], db):
    """CompareApp.run under a Pilot at 80×24: once both runs have steps, press ``keys[0]``
    (the stop), wait for the workers to end, then press the rest."""

    def run(self, *args, **kwargs):
        async def drive():
            async with self.run_test(size=(80, 24)) as pilot:
                await wait_until(pilot, lambda: min(_steps(db).get(n, 0) for n in NAMES) >= 2,
                                 timeout=240)  # the workers trained
                await pilot.press(keys[0])
                controller = self.compare.controller
                await wait_until(pilot, lambda: not controller.running(), timeout=300)
                for key in keys[1:]:
                    await pilot.press(key)
            return 0

        return asyncio.run(drive())

    return run


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["ctrl+c", "x"])
def test_stopping_on_the_screen_then_q_exits_130(tmp_path, monkeypatch, capsys, stop):
    toml = tmp_path / "tiny.toml"
    toml.write_text(ABL_TOML)
    db = tmp_path / "mdb.sqlite"
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)  # a terminal: the screen opens
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(CompareApp, "run", _drive([stop, "q"], db))
    code = main(["ablate", "--vary", "attention=mha,gqa", "--jobs", "2", "--config", str(toml),
                 "--db", str(db), "--steps", "100000", "--seq-len", "16", "--batch-size", "4"])
    out = capsys.readouterr().out
    assert code == 130, out
    with RunStore(db) as store:
        runs = {r.name: r for r in store.runs()}
    assert set(runs) == set(NAMES)
    assert all((r.status, r.reason) == ("interrupted", "SIGINT") for r in runs.values())
