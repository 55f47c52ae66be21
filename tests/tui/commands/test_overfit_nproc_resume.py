"""A job of ``mdb overfit --nproc N`` (DDP, ``--fsdp``, ``--tp``) keeps no checkpoints: ``mdb
runs`` offers no ``--resume`` for it and says which kind of job it was, and ``mdb overfit
--resume NAME`` refuses it in one ``mdb: error:`` line, exit 2, with the store unchanged (its
per-rank history stays)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hooks.store.store import RunStore
from hooks.train.overfit import OverfitOptions, default_overfit_text
from tests.conftest import REPO, terminal_signals, wait_for
from tui.cli import main

KINDS = {"ddp": "DDP", "fsdp": "FSDP2", "tp": "tensor parallel"}


def _snapshot(db: Path) -> dict[str, list]:
    """Every row of every table of the database file, read with sqlite3 itself."""
    conn = sqlite3.connect(db)
    try:
        tables = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return {t: sorted(map(repr, conn.execute(f"SELECT * FROM {t}").fetchall()))
                for t in tables}
    finally:
        conn.close()


def _interrupted_job(db: Path, name: str, parallel: str | None, steps: int = 7) -> None:
    """The rows an interrupted ``mdb overfit --nproc 2`` job leaves: a run of kind ``overfit``
    with ``world_size`` 2, its config (the options, ``nproc``, ``gather_every``, ``parallel``;
    ``None``: a job from before ``--fsdp``/``--tp``, which only had ``nproc``), rank 0's steps,
    both ranks' rows and per-rank steps, no checkpoint."""
    text, source = default_overfit_text()
    config = {**OverfitOptions(text=text, text_source=source, steps=400).to_dict(), "nproc": 2,
              "gather_every": 10}
    if parallel is not None:
        config["parallel"] = parallel
    with RunStore(db, create=True) as store:
        w = store.create_run(name, config, total_steps=400, kind="overfit", world_size=2)
        now = time.time()
        w.log_steps([({"step": s, "wall": now, "values": {"ce": 5.0 / s, "aux": 0.01}}, None,
                      None) for s in range(1, steps + 1)])
        for rank in (0, 1):
            w.log_rank_steps(rank, [{"step": s, "wall": now,
                                     "values": {"ce": 5.0 / s + rank, "aux": 0.01}}
                                    for s in range(1, steps + 1)])
        w.set_ranks([{"rank": r, "pid": 1000 + r, "state": "interrupted", "last_step": steps}
                     for r in (0, 1)])
        w.finish("interrupted", reason="SIGINT")


def _check_refused(db: Path, name: str, capsys) -> None:
    before = _snapshot(db)
    rc = main(["overfit", "--resume", name, "--headless", "--steps", "3", "--db", str(db)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("mdb: error: cannot resume run"), err
    assert "--nproc" in err[0] and "--resume applies to single-process runs only" in err[0]
    assert _snapshot(db) == before  # nothing changed, the per-rank history included
    assert not (db.parent / f"{db.stem}-checkpoints").exists()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "tp", None])
def test_runs_offers_no_resume_for_an_nproc_job_and_resume_refuses_it(tmp_path, capsys,
                                                                      parallel):
    db = tmp_path / "m.sqlite"
    _interrupted_job(db, "live1", parallel)
    assert main(["runs", "--db", str(db)]) == 0
    table = capsys.readouterr().out
    assert "--resume" not in table and "restart from step 0" not in table, table
    kind = KINDS[parallel or "ddp"]
    assert f"└ 2 ranks · {kind}\n" in table, table
    assert "no checkpoints (an --nproc job cannot be resumed)" in table, table
    assert main(["runs", "--db", str(db), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["parallel"] == kind and record["world_size"] == 2
    assert not any("--resume" in line for line in record["details"])
    _check_refused(db, "live1", capsys)


@pytest.mark.parametrize("mode", [["--detach"], []])
def test_resume_of_an_nproc_job_is_refused_before_a_trainer_starts(tmp_path, capsys, mode):
    """With --detach, or the live viewer: the same one line, not a trainer started only to
    exit 2 ("the trainer exited (2) before its run started: ...")."""
    db = tmp_path / "m.sqlite"
    _interrupted_job(db, "live1", "fsdp")
    before = _snapshot(db)
    rc = main(["overfit", "--resume", "live1", *mode, "--db", str(db)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("mdb: error: cannot resume run 'live1'"), err
    assert _snapshot(db) == before


def test_a_single_process_run_still_gets_its_restart_hint(tmp_path, capsys):
    """Only --nproc jobs lose the hint: a one-process overfit run with the same options and no
    checkpoint still says how to restart it, and its JSON has no ``parallel``."""
    db = tmp_path / "m.sqlite"
    with RunStore(db, create=True) as store:
        text, source = default_overfit_text()
        w = store.create_run("one", OverfitOptions(text=text, text_source=source).to_dict(),
                             total_steps=300, kind="overfit")
        w.finish("interrupted", reason="SIGINT")
    assert main(["runs", "--db", str(db), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["parallel"] is None
    assert record["details"][-1] == "restart from step 0: mdb overfit --resume one"


def test_a_torchrun_loop_of_ones_own_is_not_labelled_ddp(tmp_path, capsys):
    """A run that ``hooks.run`` recorded from a user's own 4-rank loop, whose config happens
    to hold an ``nproc`` key: the kind of its job is not known, so none is shown."""
    db = tmp_path / "m.sqlite"
    with RunStore(db, create=True) as store:
        w = store.create_run("own", {"nproc": 4, "strategy": "fsdp"}, total_steps=10,
                             kind="api", world_size=4)
        w.finish("finished")
    assert main(["runs", "--db", str(db), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["world_size"] == 4 and record["parallel"] is None
    assert main(["runs", "--db", str(db)]) == 0
    assert "DDP" not in capsys.readouterr().out


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                     else "")
    return env


@pytest.mark.slow
def test_a_real_interrupted_fsdp_job_cannot_be_resumed_and_keeps_its_rank_history(
        tmp_path, capsys):
    """``mdb overfit --nproc 2 --fsdp`` stopped with SIGINT after a few steps: ``mdb runs``
    says ``2 ranks · FSDP2`` without a ``--resume`` hint, ``--resume`` is refused with the
    store unchanged, and ``mdb export`` still has the job's steps."""
    db = tmp_path / "m.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tui.cli", "overfit", "--nproc", "2", "--fsdp", "--headless",
         "--steps", "400", "--every", "0", "--db", str(db), "--run", "live1"],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=terminal_signals)
    try:
        def stepped() -> bool:
            if not db.exists():
                return False
            try:
                with RunStore(db) as store:
                    return store.run("live1").last_step >= 3
            except Exception:  # noqa: BLE001 — not created yet, or busy
                return False

        wait_for(stepped, timeout=600, what="3 steps of the FSDP job")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 130, out[-2000:]
    with RunStore(db) as store:
        run = store.run("live1")
        assert (run.status, run.world_size) == ("interrupted", 2)
        steps = len(store.rank_steps(run.id))
    assert steps >= 3  # rank 0's steps at least (rank 1's arrive every --gather-every)
    assert not (tmp_path / "m-checkpoints").exists()
    assert main(["runs", "--db", str(db)]) == 0
    table = capsys.readouterr().out
    assert "--resume" not in table and "└ 2 ranks · FSDP2" in table, table
    _check_refused(db, "live1", capsys)
    assert main(["export", "live1", "--db", str(db)]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) > 1  # more than the header


WORDS = {"": "DDP", "--fsdp": "FSDP2", "--tp": "tensor-parallel"}


@pytest.mark.parametrize("flag", ["", "--fsdp", "--tp"])
@pytest.mark.parametrize("extra", [["--checkpoint-every", "5"], ["--model", "m:f"],
                                   ["--detach"]])
def test_nproc_refusals_name_the_kind_of_job(tmp_path, capsys, flag, extra):
    db = tmp_path / "m.sqlite"
    rc = main(["overfit", "--nproc", "2", *([flag] if flag else []), *extra, "--headless",
               "--db", str(db)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("mdb: error: "), err
    assert "does not apply with --nproc" in err[0] and f"the {WORDS[flag]} job" in err[0], err
    if flag:
        assert "DDP" not in err[0], err
    assert not db.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_quitting_the_live_screen_of_an_fsdp_job_says_fsdp2(tmp_path, capsys, monkeypatch):
    """q on the live screen of ``--nproc 2 --fsdp`` (the screen left at once here) stops the
    job with ``mdb: stopping the FSDP2 job…``; the run ends interrupted, exit 0, and leaves no
    ``m-checkpoints/`` folder."""
    import tui.commands.overfit_ddp as overfit_ddp
    import tui.live_app

    class _Screen:
        def run(self) -> None:
            pass

    monkeypatch.setattr(overfit_ddp, "has_screen", lambda: True)
    monkeypatch.setattr(tui.live_app, "make_watch_app", lambda store, info: _Screen())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    db = tmp_path / "m.sqlite"
    rc = main(["overfit", "--nproc", "2", "--fsdp", "--steps", "400", "--every", "0",
               "--db", str(db), "--run", "q1"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "mdb: stopping the FSDP2 job…" in err and "DDP" not in err, err
    with RunStore(db) as store:
        assert store.run("q1").status == "interrupted"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["m-logs"]


#: A ``sitecustomize`` for the job's rank 0 (torchrun sets ``RANK``): ``RunStore.create_run``
#: holds the rank right after the run's row is committed (before anything records it) until
#: the test says go.
_HOLD_RANK_0 = """
import os, time
from pathlib import Path

if os.environ.get("RANK") == "0" and "LOCAL_RANK" in os.environ:
    from hooks.store.store import RunStore

    _created = RunStore.create_run

    def create_run(self, *args, **kwargs):
        writer = _created(self, *args, **kwargs)
        hold = Path({hold!r})
        (hold / "created").touch()
        deadline = time.monotonic() + 300
        while not (hold / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return writer

    RunStore.create_run = create_run
"""


@pytest.mark.slow
def test_quitting_the_live_screen_while_rank_0_opens_the_run_ends_it_interrupted(
        tmp_path, capsys, monkeypatch):
    """The start-up race forced: the live screen is left while rank 0 has created the run
    but not yet started recording it, and rank 0 goes on only once the job was sent SIGTERM.
    Before the fix rank 0 died of the signal there, the run stayed ``running`` and the command
    exited 1 (``the FSDP2 job ended ... but the run was not closed``); now the run ends
    interrupted (SIGTERM), exit 0, and the job's log stays."""
    import tui.commands.overfit_ddp as overfit_ddp
    import tui.live_app

    hold, site = tmp_path / "hold", tmp_path / "site"
    hold.mkdir()
    site.mkdir()
    (site / "sitecustomize.py").write_text(_HOLD_RANK_0.format(hold=str(hold)), "utf-8")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    class _Screen:
        def run(self) -> None:  # q as soon as rank 0 is held inside the window
            wait_for(lambda: (hold / "created").exists(), timeout=600,
                     what="rank 0 created the run")

    sent: list[int] = []
    send = overfit_ddp._Job.send

    def send_then_go(job, signum: int) -> None:
        send(job, signum)
        sent.append(signum)
        (hold / "go").touch()  # the signal is on its way: rank 0 may go on

    monkeypatch.setattr(overfit_ddp, "has_screen", lambda: True)
    monkeypatch.setattr(tui.live_app, "make_watch_app", lambda store, info: _Screen())
    monkeypatch.setattr(overfit_ddp._Job, "send", send_then_go)
    db = tmp_path / "m.sqlite"
    rc = main(["overfit", "--nproc", "2", "--fsdp", "--steps", "400", "--every", "0",
               "--db", str(db), "--run", "q2"])
    out, err = capsys.readouterr()
    assert sent[:1] == [signal.SIGTERM], sent
    assert rc == 0, out + err
    assert "mdb: stopping the FSDP2 job…" in err and "DDP" not in err, err
    assert "run q2 interrupted (SIGTERM) after step 0" in out, out
    with RunStore(db) as store:
        run = store.run("q2")
        assert (run.status, run.reason, run.world_size) == ("interrupted", "SIGTERM", 2)
    log = (tmp_path / "m-logs" / "q2.log").read_text("utf-8")
    assert "mdb: recording run q2 (2 ranks)" in log, log
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["hold", "m-logs",
                                                                          "site"]
