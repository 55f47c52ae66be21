"""The views of a sharded run: ``mdb overfit --nproc 2 --fsdp`` (a real 2-rank FSDP2 job, gloo,
CPU) opened with ``mdb step --run NAME@STEP`` (its gradients view), ``mdb watch`` and its ``k``
ranks screen.

The full-tensor numbers themselves are checked against a single-process run in
``tests/hooks/train/test_fsdp.py``; here the views must show those stored numbers, the unsharded
parameters (names and shapes from a model built here from the run's config), and say when an
activation's statistics count every rank's piece while its shape is this rank's.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from textual.widgets import DataTable

from hooks.store.store import RunStore
from tests.conftest import wait_until
from tests.processes import mdb_env

SIZE = (80, 24)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fsdp_db(tmp_path_factory) -> Path:
    """A finished 2-rank FSDP2 overfit run ``f`` of 10 steps, captured at steps 5 and 10."""
    tmp = tmp_path_factory.mktemp("fsdp")
    db = tmp / "m.sqlite"
    done = subprocess.run(
        [sys.executable, "-m", "tui.cli", "overfit", "--nproc", "2", "--fsdp", "--headless",
         "--steps", "10", "--every", "5", "--db", str(db), "--run", "f"],
        cwd=tmp, env=mdb_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=900, start_new_session=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return db


def test_activation_statistics_count_every_ranks_batch_and_replicas_once(fsdp_db):
    """The overfit text is periodic, so the two ranks' windows are cyclic shifts of the same
    characters: their embeddings differ, though their elements' bit patterns sum the same (an
    order-blind checksum took rank 1's for a replica of rank 0's and counted half the job)."""
    from tui.commands.step import load_run_trace

    trace = load_run_trace("f@10", str(fsdp_db))
    with RunStore(fsdp_db) as store:
        run = store.run("f")
        seq, batch = run.config["seq_len"], run.config["batch_size"]
    by_module = {c.module: c for c in trace.forward}
    embed = by_module["model.embed_tokens"].outputs[0]
    assert embed.shape == [batch, seq, 128]
    assert embed.stats.numel == 2 * math.prod(embed.shape)  # two ranks, two different batches
    for out in by_module["model.rotary_emb"].outputs:  # cos/sin of the same positions: replicas
        assert out.stats.numel == math.prod(out.shape)


@pytest.mark.asyncio
async def test_step_view_of_a_sharded_capture_shows_unsharded_parameters_and_says_so(fsdp_db):
    from minillm import MiniLLM, MiniLLMConfig
    from tui.app import make_step_app
    from tui.commands.step import load_run_trace
    from tui.screens.gradients import GradientsScreen
    from tui.screens.stepper import Stepper
    from tui.widgets import fmt
    from tui.widgets.call_details import CallDetails

    trace = load_run_trace("f@10", str(fsdp_db))
    with RunStore(fsdp_db) as store:
        run = store.run("f")
        cfg = MiniLLMConfig.from_dict(run.config["resolved_model_config"])
        stored = {p["name"]: p for p in store.internals(run.id, 10)["params"]}
    reference = {n: list(p.shape) for n, p in MiniLLM(cfg).named_parameters()}
    # whose batch the shapes, routing and attention are
    assert trace.meta["description"].endswith(" · rank 0 of 2")
    assert (trace.meta["rank"], trace.meta["world_size"]) == (0, 2)
    stepper = Stepper(trace)
    assert stepper.jump_module("model.embed_tokens")
    text = CallDetails.render_details(stepper, 200).plain.replace("\n", " ")
    embed = stepper.call.outputs[0]
    label = embed.path.removeprefix("out.")
    assert ("statistics of the whole job's tensor, every rank's piece: "
            f"{label} {embed.stats.numel:,} values (this rank's {fmt.dims(embed.shape)}: "
            f"{math.prod(embed.shape):,})") in text
    # the histogram covers the whole job's values too, and its title says so
    assert (f"values of {embed.path} · whole job, {embed.stats.numel:,} values (this rank's "
            f"{fmt.dims(embed.shape)})") in text
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g")
        await wait_until(pilot, lambda: isinstance(app.screen, GradientsScreen))
        table = app.screen.query_one("#grads", DataTable)
        names = [str(k.value) for k in table.rows]
        assert sorted(names) == sorted(stored)
        assert {n: stored[n]["shape"] for n in names} == {n: reference[n] for n in names}
        for name in names:
            assert table.get_row(name)[2] == fmt.sci(stored[name]["grad_norm"])


@pytest.mark.asyncio
async def test_watch_of_a_sharded_run_shows_its_ranks_and_k_opens_them(fsdp_db):
    from tui.live_app import make_watch_app
    from tui.screens.live_ranks import RanksScreen, RanksSummary

    with RunStore(fsdp_db) as store:
        run = store.run("f")
        last = {r: store.rank_steps(run.id, rank=r)[-1].values for r in (0, 1)}
        app = make_watch_app(store, run)
        async with app.run_test(size=SIZE) as pilot:
            summary = app.live.query_one(RanksSummary)
            await wait_until(pilot, lambda: summary.polls >= 1 and summary.series.step == 10)
            line = summary.summary().plain
            assert "2 ranks" in line and "@10" in line
            await pilot.press("k")
            await wait_until(pilot, lambda: isinstance(app.screen, RanksScreen))
            screen = app.screen
            await wait_until(pilot, lambda: screen.redraws >= 1)
            rows = screen.table_text().plain.splitlines()
            for r in (0, 1):
                row = next(x for x in rows if x.split()[:1] == [str(r)])
                assert "finished" in row
            assert last[0]["ce"] != last[1]["ce"]  # each rank its own windows
