"""What the writer keeps about a run (schema 4, hooks.store.summary): each metric's latest
value, per-block aggregates, the capture count — compared with aggregates computed here in
plain Python from what the test logged (or, for migrated databases, from the raw rows read
with plain SQL)."""

from __future__ import annotations

import math
import random
import shutil
import sqlite3
from pathlib import Path

import pytest

from hooks.store.store import RunStore
from hooks.store.summary import BLOCK

DATA = Path(__file__).resolve().parents[2] / "data"


def _expected_blocks(logged: dict[tuple[int, str], float]) -> dict[tuple[str, int], tuple]:
    """(name, step // BLOCK) -> (first, last, count, n, min, max) and the sum, separately."""
    out: dict[tuple[str, int], list] = {}
    for (step, name), v in logged.items():
        key = (name, step // BLOCK)
        a = out.setdefault(key, [step, step, 0, 0, 0.0, None, None])
        a[0], a[1], a[2] = min(a[0], step), max(a[1], step), a[2] + 1
        if math.isfinite(v):
            a[3] += 1
            a[4] += v
            a[5] = v if a[5] is None else min(a[5], v)
            a[6] = v if a[6] is None else max(a[6], v)
    return {k: tuple(v) for k, v in out.items()}


def _stored_blocks(conn: sqlite3.Connection, run_id: int) -> dict[tuple[str, int], tuple]:
    rows = conn.execute(
        "SELECT n.name, b.block, b.first_step, b.last_step, b.count, b.n, b.total, b.lo, b.hi"
        " FROM blocks AS b JOIN metric_names AS n ON n.run_id = b.run_id AND n.id = b.metric"
        " WHERE b.run_id = ?", (run_id,)).fetchall()
    return {(r[0], r[1]): tuple(r[2:]) for r in rows}


def _check(conn: sqlite3.Connection, run_id: int, logged: dict[tuple[int, str], float],
           captured: set[int]) -> None:
    want, got = _expected_blocks(logged), _stored_blocks(conn, run_id)
    assert set(got) == set(want)
    for key, w in want.items():
        g = got[key]
        assert g[:4] == w[:4] and g[5:] == w[5:], key  # steps, counts, min, max: exact
        assert g[4] == pytest.approx(w[4], rel=1e-12, abs=1e-12), key  # the sum
    latest = dict(conn.execute(
        "SELECT n.name, l.step FROM latest AS l JOIN metric_names AS n ON n.run_id = l.run_id"
        " AND n.id = l.metric WHERE l.run_id = ?", (run_id,)).fetchall())
    names = {name for _s, name in logged}
    assert latest == {name: max(s for s, n in logged if n == name) for name in names}
    for name, step in latest.items():
        (v,) = conn.execute("SELECT l.value FROM latest AS l JOIN metric_names AS n ON"
                            " n.id = l.metric AND n.run_id = l.run_id WHERE l.run_id = ?"
                            " AND n.name = ?", (run_id, name)).fetchone()
        x = logged[(step, name)]
        assert (v is None and math.isnan(x)) or v == x
    row = conn.execute("SELECT captures, last_capture FROM summary WHERE run_id = ?",
                       (run_id,)).fetchone()
    want = (len(captured), max(captured) if captured else None)
    assert (tuple(row) if row else (0, None)) == want


def test_the_writer_keeps_blocks_latest_and_captures_exactly(tmp_path):
    rng = random.Random(5)
    logged: dict[tuple[int, str], float] = {}
    captured: set[int] = set()
    with RunStore(tmp_path / "m.sqlite", create=True) as store:
        w = store.create_run("r", {}, kind="api")
        step = 0
        for _batch in range(40):
            rows = []
            for _ in range(rng.randrange(1, 30)):
                step += rng.choice((1, 1, 1, 7, 70))  # gaps across blocks
                vals = {"loss": rng.gauss(2, 1), "lr": rng.random()}
                if rng.random() < 0.1:
                    vals["loss"] = rng.choice((math.nan, math.inf, -math.inf))
                if step % 5 == 0:
                    vals["acc"] = rng.random()
                internals = {"x": 1} if rng.random() < 0.05 else None
                if internals:
                    captured.add(step)
                rows.append(({"step": step, "wall": float(step), "values": vals}, internals,
                             None))
                logged.update({(step, k): v for k, v in vals.items()})
            w.log_steps(rows)
        # steps logged again: values replaced, a new metric added, a capture again
        again = sorted(rng.sample(sorted({s for s, _ in logged}), 20))
        w.log_steps([({"step": s, "wall": 0.0, "values": {"loss": -5.0 - s, "val": 1.0 * s}},
                      {"y": 2} if s in captured else None, None) for s in again])
        logged.update({(s, "loss"): -5.0 - s for s in again})
        logged.update({(s, "val"): 1.0 * s for s in again})
        _check(store.connection, w.run_id, logged, captured)

        # a resume deletes the rows after the checkpoint: kept aggregates follow
        ckpt = sorted({s for s, _ in logged})[len({s for s, _ in logged}) // 2]
        w.set_checkpoint(ckpt, tmp_path / "ckpt")
        w.finish("interrupted")
        w2 = store.resume_run("r")
        logged = {k: v for k, v in logged.items() if k[0] <= ckpt}
        captured = {s for s in captured if s <= ckpt}
        _check(store.connection, w2.run_id, logged, captured)
        w2.log_steps([({"step": ckpt + 1, "wall": 1.0, "values": {"loss": 123.0}}, None, None)])
        logged[(ckpt + 1, "loss")] = 123.0
        _check(store.connection, w2.run_id, logged, captured)
        assert store.summary(w2.run_id).latest["loss"] == (ckpt + 1, 123.0)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_older_databases_are_migrated_with_their_summary_filled(tmp_path, version):
    """tests/data/runstore_v3.sqlite was written by mdb's schema-3 code (a hooks.run run with
    NaN/Inf, a metric logged every 10th step, captures, a sample, a step logged again; a
    2-rank run); v1 and v2 by the code of their versions."""
    db = tmp_path / "old.sqlite"
    shutil.copyfile(DATA / f"runstore_v{version}.sqlite", db)
    with RunStore(db) as store:
        runs = store.runs()
        assert runs
        conn = store.connection
        for run in runs:
            # the raw rows, by plain SQL: what the summary must say
            raw = conn.execute(
                "SELECT s.step, n.name, s.value FROM scalars AS s JOIN metric_names AS n"
                " ON n.run_id = s.run_id AND n.id = s.metric WHERE s.run_id = ?",
                (run.id,)).fetchall()
            logged = {(s, n): math.nan if v is None else float(v) for s, n, v in raw}
            captured = {r[0] for r in conn.execute(
                "SELECT step FROM internals WHERE run_id = ?", (run.id,))}
            _check(conn, run.id, logged, captured)
        if version == 3:
            api = store.run("api3")
            assert store.summary(api.id).latest == {"loss": (150, 99.0), "lr": (150, 0.1),
                                                    "val_loss": (150, 2.0 / 150)}
            assert (store.summary(api.id).captures, store.summary(api.id).last_capture) == (
                3, 150)
            assert store.run("ddp3").world_size == 2


def _raw_buckets(logged: dict[tuple[int, str], float], name: str, ends: list[int]):
    """min/max of the finite values of ``name`` in each (previous end, end] step range."""
    out, prev = [], -math.inf
    for end in ends:
        vals = [v for (s, n), v in logged.items()
                if n == name and prev < s <= end and math.isfinite(v)]
        out.append((min(vals), max(vals)) if vals else (None, None))
        prev = end
    return out


@pytest.mark.parametrize("steps", [300, 40_000])  # buckets from the raw rows / from blocks
def test_history_buckets_keep_each_range_min_and_max(tmp_path, steps):
    rng = random.Random(steps)
    spike = rng.randrange(1, steps + 1)
    logged = {}
    with RunStore(tmp_path / "m.sqlite", create=True) as store:
        w = store.create_run("r", {}, kind="api")
        rows = []
        for s in range(1, steps + 1):
            v = 1e6 if s == spike else rng.random()
            rows.append(({"step": s, "wall": float(s), "values": {"loss": v}}, None, None))
            logged[(s, "loss")] = v
        w.log_steps(rows)
        update, hist = store.history(w.run_id, 100)
    b = hist.metrics["loss"]
    assert len(b.steps) <= 100 and (hist.first, hist.last) == (1, steps)
    assert sum(b.count) == steps and b.steps[-1] == steps
    assert list(zip(b.lo, b.hi, strict=True)) == _raw_buckets(logged, "loss", b.steps)
    assert max(b.hi) == 1e6
    assert [r.step for r in update.metrics] == list(range(max(1, steps - 63), steps + 1))
