"""The step view of a capture whose step turned NaN from one rank's FSDP2 shard: a real 2-rank
job (``tests/fsdp_worker.py --scenario nan``, gloo, CPU) that writes a NaN into rank 1's shard
of ``blocks.1.w2.weight`` and captures every step. Rank 0's capture of step 7 (its own shard
is finite) opens at the first NaN, ``blocks.1.w2``'s output, and must say which weight, and
which rank's shard, held the NaN: in the hint, the call's notes and the gradients view."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]
SIZE = (160, 30)
NOTE = "blocks.1.w2.weight: its weight holds 1 NaN of 128 values, in rank 1's shard"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nan_db(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("nanshard")
    db = tmp / "m.sqlite"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("MDB_DB", None)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "tests" / "fsdp_worker.py"), "--db", str(db), "--name", "nan", "--out",
         str(tmp), "--steps", "10", "--scenario", "nan", "--watch-every", "1"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=600, start_new_session=True,
        stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return db


@pytest.mark.asyncio
async def test_step_view_opened_at_the_first_nan_names_the_ranks_shard(nan_db):
    from tui.app import make_step_app
    from tui.commands.step import load_run_trace
    from tui.screens.gradients import GradientsScreen
    from tui.screens.stepper import Stepper
    from tui.widgets.call_details import CallDetails

    trace = load_run_trace("nan@7", str(nan_db))
    assert trace.meta["rank"] == 0
    stepper = Stepper(trace)
    hit = stepper.first_nonfinite()
    assert (hit.direction, hit.module) == ("forward", "blocks.1.w2")
    notes = CallDetails.render_details(stepper, 200).plain.split("── notes")[-1]
    assert NOTE in notes
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        hint = screen.query_one("#hint")
        await wait_until(pilot, lambda: "opened at the first" in getattr(hint, "_mdb_text", ""))
        assert screen.stepper.module == "blocks.1.w2"
        assert NOTE in hint._mdb_text, hint._mdb_text
        await pilot.press("g")
        await wait_until(pilot, lambda: isinstance(app.screen, GradientsScreen))
        grads = app.screen.query_one("#hint")
        assert NOTE in getattr(grads, "_mdb_text", ""), grads._mdb_text
