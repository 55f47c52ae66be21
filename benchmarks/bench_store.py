"""The store commands on a run of 1,000,000 steps × 5 metrics (issue 25), each against its
reference, interleaved in one run, medians and ratios:

* ``mdb runs`` (process spawn to exit) vs ``python -c "import torch"`` — bound ≤ 0.3×;
* ``mdb export RUN > /dev/null`` (CSV) vs the ``sqlite3`` command line printing the same values
  (``-csv``, the same one-row-per-step pivot) — bound ≤ 3×; without the ``sqlite3`` program,
  Python's ``sqlite3`` module running that query and writing each row with ``",".join`` (the
  report says which);
* ``mdb watch RUN`` first full frame (spawn until the loss chart is painted with the run's
  history; headless Textual, the command's own code path: ``open_run`` and
  ``make_watch_app``) vs ``python -c "import torch"`` — bound ≤ 1×.

The store is written with the store's writer (``RunWriter.log_steps``, batches of 50,000 steps;
about 30 s), a spike at a random step; ``--db PATH`` reuses one written before.

Run: ``python benchmarks/bench_store.py [--repeats 5] [--db PATH]``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._timing import interleaved, report  # noqa: E402

STEPS = 1_000_000
NAMES = ("loss", "acc", "lr", "grad_norm", "tokens_per_s")
BOUNDS = {"runs": 0.3, "export": 3.0, "watch": 1.0}

_WATCH = r"""
import sys, time
from tui.commands.watch import open_run
from tui.live_app import make_watch_app
from tui.screens.live_chart import LineChart

store, run = open_run(sys.argv[1], sys.argv[2])
app = make_watch_app(store, run)

def check():
    s = app.live
    try:
        loss = s.query_one("#live-loss", LineChart)
    except Exception:
        return
    if s.polls and any(x.xs for x in loss.series) and loss._rows is not None:
        print(f"frame {time.time():.6f}", flush=True)
        app.exit()

app.call_later(lambda: app.set_interval(0.005, check))
app.run(headless=True, size=(120, 36))
store.close()
"""


def write_store(db: Path) -> None:
    """Run ``big``: :data:`STEPS` steps of :data:`NAMES`, a spike of 1e4 at a random step."""
    import random

    from hooks.store.store import RunStore

    spike = random.Random(0).randrange(STEPS)
    with RunStore(db, create=True) as store:
        w = store.create_run("big", {}, total_steps=STEPS, kind="api")
        for lo in range(1, STEPS + 1, 50_000):
            w.log_steps([({"step": s, "wall": 1.7e9 + s * 0.01, "values": {
                "loss": 1e4 if s == spike else 2 + math.sin(s * 1e-3),
                "acc": (s % 997) / 997, "lr": 1e-3, "grad_norm": math.cos(s) ** 2,
                "tokens_per_s": 1000.0 + s % 13}}, None, None)
                for s in range(lo, min(STEPS, lo + 49_999) + 1)])
        w.finish("finished")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(argv: list[str], stdout=subprocess.DEVNULL) -> None:
    subprocess.run(argv, check=True, stdout=stdout, stderr=subprocess.PIPE, env=_env(),
                   cwd=REPO)


def _pivot_sql(db: Path) -> str:
    import sqlite3

    conn = sqlite3.connect(db)
    ids = [r[0] for r in conn.execute(
        "SELECT id FROM metric_names WHERE run_id = 1 ORDER BY id")]
    conn.close()
    cols = ", ".join(f"max(CASE s.metric WHEN {i} THEN IFNULL(s.value, 'nan') END)"
                     for i in ids)
    return (f"SELECT m.step, {cols} FROM metrics AS m LEFT JOIN scalars AS s ON s.run_id ="
            " m.run_id AND s.step = m.step WHERE m.run_id = 1 GROUP BY m.step ORDER BY m.step")


def _python_dump(db: Path, sql: str) -> None:
    import sqlite3

    conn = sqlite3.connect(db)
    with open(os.devnull, "w") as out:
        cur = conn.execute(sql)
        while rows := cur.fetchmany(20_000):
            out.write("".join(",".join("" if v is None else str(v) for v in r) + "\n"
                              for r in rows))
    conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--db", type=Path, default=None,
                        help="a store written by this script before (else a new one)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mdb-bench-store-"))
    try:
        db = args.db
        if db is None or not db.exists():
            db = db or tmp / "m.sqlite"
            t0 = time.perf_counter()
            write_store(db)
            print(f"wrote {STEPS:,} steps × {len(NAMES)} metrics with RunWriter.log_steps in "
                  f"{time.perf_counter() - t0:.1f} s ({db.stat().st_size / 2**20:.0f} MiB)")
        mdb = [sys.executable, "-c", "import sys; from tui.cli import main; sys.exit(main())"]
        _run([*mdb, "runs", "--db", str(db)])  # a v3 store is migrated once, here
        torch = [sys.executable, "-c", "import torch"]
        sql = _pivot_sql(db)
        cli = shutil.which("sqlite3")
        if cli:
            ref_name, ref = "sqlite3 CLI -csv pivot", lambda: _run([cli, "-csv", str(db), sql])
        else:
            ref_name, ref = "python sqlite3 pivot dump", lambda: _python_dump(db, sql)
        frames: list[float] = []

        def watch() -> None:
            t_wall = time.time()
            out = subprocess.run([sys.executable, "-c", _WATCH, str(db), "big"], check=True,
                                 capture_output=True, text=True, env=_env(), cwd=REPO)
            (line,) = [x for x in out.stdout.splitlines() if x.startswith("frame ")]
            frames.append(float(line.split()[1]) - t_wall)

        print(f"{args.repeats} interleaved runs each, {os.cpu_count()} CPUs, load "
              f"{os.getloadavg()[0]:.1f}")
        ratios = {}
        print("\nmdb runs vs import torch")
        med = report(interleaved({"import torch": lambda: _run(torch),
                                  "mdb runs": lambda: _run([*mdb, "runs", "--db", str(db)])},
                                 args.repeats, warmup=1), "import torch")
        ratios["runs"] = med["mdb runs"] / med["import torch"]
        print(f"\nmdb export (csv) vs {ref_name}")
        med = report(interleaved({ref_name: ref, "mdb export": lambda: _run(
            [*mdb, "export", "big", "--db", str(db)])}, args.repeats, warmup=1), ref_name)
        ratios["export"] = med["mdb export"] / med[ref_name]
        print("\nmdb watch first full frame vs import torch")
        times = interleaved({"import torch": lambda: _run(torch), "mdb watch": watch},
                            args.repeats, warmup=1)
        times["mdb watch first frame"] = frames[-args.repeats:]  # spawn to painted chart
        del times["mdb watch"]
        med = report(times, "import torch")
        ratios["watch"] = med["mdb watch first frame"] / med["import torch"]
        print()
        for k, r in ratios.items():
            ok = "ok" if r <= BOUNDS[k] else "OVER"
            print(f"{k:>7}: {r:.3f}× (bound {BOUNDS[k]}×) {ok}")
        print(f"(medians; load now {os.getloadavg()[0]:.1f}; "
              f"watch frames {statistics.median(frames):.3f} s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
