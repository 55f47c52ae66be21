"""``mdb export`` of a run with more metric names than SQLite allows columns in a result
(issue 32, item 8): SQLite refused the one-column-per-metric pivot of 2,000 or more metrics
(``too many columns in result set``) after the CSV header was written. Every metric is
exported, exactly; a run that cannot be read writes nothing before its one error line.

The runs are written with ``hooks.run`` (and, for a torchrun job, the store's writer); every
expected value comes from :func:`value`, computed again here, and the output is read back with
the ``csv`` and ``json`` modules."""

from __future__ import annotations

import csv
import io
import json
import math
import sqlite3

import hooks
from hooks.store.store import RunStore
from tui.cli import main

METRICS = 2_500
STEPS = 4


def value(step: int, m: int) -> float | None:
    """Metric ``m`` at ``step``: ``None`` = not logged (every 7th metric at even steps), NaN
    for metric 5 at step 2, ±inf for metrics 6 and 7 at step 3, else a float of many digits."""
    if m % 7 == 3 and step % 2 == 0:
        return None
    if (m, step) == (5, 2):
        return math.nan
    if (m, step) in ((6, 3), (7, 3)):
        return math.inf if m == 6 else -math.inf
    return (m + 1) / 3 + step * 1e-7 - (m % 11) * 1234.5678


def names() -> list[str]:
    return [f"layer{m // 50}.metric_{m}" for m in range(METRICS)]


def write_run(db) -> None:
    with hooks.run("wide", db=str(db)) as run:
        for s in range(1, STEPS + 1):
            vals = {n: value(s, m) for m, n in enumerate(names())}
            run.log(step=s, **{k: v for k, v in vals.items() if v is not None})


def same(got: float, want: float) -> bool:
    return (math.isnan(got) and math.isnan(want)) or got == want


def test_csv_export_of_2500_metrics_has_every_value(tmp_path, capsys):
    db = tmp_path / "w.sqlite"
    write_run(db)
    capsys.readouterr()
    assert main(["export", "wide", "--db", str(db)]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    table = list(csv.reader(io.StringIO(out.out)))
    assert table[0] == ["step", *names()]
    assert [row[0] for row in table[1:]] == [str(s) for s in range(1, STEPS + 1)]
    for row in table[1:]:
        s = int(row[0])
        assert len(row) == METRICS + 1
        for m, cell in enumerate(row[1:]):
            want = value(s, m)
            if want is None:
                assert cell == "", (s, m)
            else:
                assert same(float(cell), want), (s, m, cell)
    # the text of a few cells, as a narrow run writes them
    assert table[2][1 + 5] == "nan" and table[3][1 + 6] == "inf" and table[3][1 + 7] == "-inf"
    assert table[1][1 + 3] == repr(value(1, 3)) and table[2][1 + 3] == ""


def test_jsonl_export_of_2500_metrics_has_every_value(tmp_path, capsys):
    db = tmp_path / "w.sqlite"
    write_run(db)
    capsys.readouterr()
    assert main(["export", "wide", "--format", "jsonl", "--db", str(db)]) == 0
    objs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["step"] for o in objs] == list(range(1, STEPS + 1))
    for o in objs:
        s = o.pop("step")
        want = {n: value(s, m) for m, n in enumerate(names()) if value(s, m) is not None}
        assert list(o) == list(want)  # the order metrics were first logged in
        assert all(same(o[k], v) for k, v in want.items()), s


def test_wide_export_of_a_distributed_run_has_a_row_per_rank(tmp_path, capsys):
    db = tmp_path / "d.sqlite"
    ns = names()
    with RunStore(db, create=True) as store:
        w = store.create_run("ddp", {}, kind="api", world_size=2)
        w.set_ranks([{"rank": 0}, {"rank": 1}])
        for rank in (0, 1):
            w.log_rank_steps(rank, [
                {"step": s, "wall": float(s),
                 "values": {n: value(s + rank, m) for m, n in enumerate(ns)
                            if value(s + rank, m) is not None}} for s in (1, 2)])
        w.finish("finished")
    assert main(["export", "ddp", "--rank", "1", "--db", str(db)]) == 0
    table = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert table[0] == ["step", "rank", *ns]
    assert [row[:2] for row in table[1:]] == [["1", "1"], ["2", "1"]]
    for row in table[1:]:
        s = int(row[0]) + 1
        for m, cell in enumerate(row[2:]):
            want = value(s, m)
            assert (cell == "") if want is None else same(float(cell), want), (s, m, cell)


def test_a_damaged_value_of_a_wide_run_is_one_line_and_no_output(tmp_path, capsys):
    db = tmp_path / "w.sqlite"
    write_run(db)
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE scalars SET value = 'oops' WHERE step = 1 AND metric = "
                     "(SELECT id FROM metric_names WHERE name = 'layer40.metric_2000')")
    conn.close()
    capsys.readouterr()
    assert main(["export", "wide", "--db", str(db)]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # not even the header
    assert out.err.count("\n") == 1 and out.err.startswith("mdb: error: run 'wide' in ")
    assert "the value of layer40.metric_2000 at step 1 is 'oops', not a number" in out.err
