"""Run stores and checkpoints changed outside mdb, rejected ``mdb overfit`` calls, and what a
user's own loop may log: one line, a non-zero exit, nothing written, the run's status untouched."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import tomllib

import hooks
from hooks.store.store import DamagedRunError, RunStore
from tests.conftest import TINY_TOML, drawn
from tests.processes import main_rc as _main
from tests.processes import one_error_line
from tui.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


_err_line = one_error_line


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory) -> Path:
    """A directory holding ``mdb.sqlite`` with run ``r``: 6 steps of a tiny minillm, stopped
    by SIGTERM with a checkpoint of step 6, and its checkpoints beside it."""
    from hooks.train.overfit import OverfitOptions, OverfitSession
    from minillm import MiniLLMConfig

    tmp = tmp_path_factory.mktemp("tamper")
    opts = OverfitOptions(text="人工智能正在改变世界。" * 2,
                          model_config=MiniLLMConfig(**tomllib.loads(TINY_TOML)).to_dict(),
                          steps=20, every=0, sample_every=0)
    with RunStore(tmp / "mdb.sqlite", create=True) as store:
        session = OverfitSession.create(store, "r", opts)
        session.run(on_step=lambda rep: rep.step == 6 and session.control.stop("SIGTERM"))
    return tmp


@pytest.fixture
def copy(interrupted_run, tmp_path) -> Path:
    """A private copy of :func:`interrupted_run`'s directory; its database path."""
    dst = tmp_path / "runs"
    shutil.copytree(interrupted_run, dst)
    return dst / "mdb.sqlite"


def _sql(db: Path, sql: str, *params) -> None:
    conn = sqlite3.connect(db)
    conn.execute(sql, params)
    conn.commit()
    conn.close()


def _row(db: Path) -> tuple:
    conn = sqlite3.connect(db)
    row = conn.execute("SELECT status, reason, attempt, last_step, checkpoint_step FROM runs")
    out = row.fetchone()
    conn.close()
    return out


def _checkpoint_json(db: Path) -> Path:
    (path,) = (db.parent / "mdb-checkpoints" / "r").glob("step-*/checkpoint.json")
    return path


# -- text in numeric columns, a config that is not JSON --------------------------------------

@pytest.mark.parametrize("column, value, said", [
    ("last_step", "abc", "runs.last_step holds 'abc', not an integer"),
    ("pid", "p", "runs.pid holds 'p', not an integer"),
    ("last_loss", "x", "runs.last_loss holds 'x', not a number"),
    ("started", "yesterday", "runs.started holds 'yesterday', not a number"),
    ("config", "not json", "runs.config holds 'not json', not a JSON object"),
    ("config", "[1, 2]", "runs.config holds '[1, 2]', not a JSON object"),
    ("nonfinite", "{bad", None),  # an unreadable finding is no finding, the row still reads
])
def test_mdb_runs_lists_a_damaged_run_says_which_field_and_exits_1(copy, capsys, column, value,
                                                                   said):
    _sql(copy, f"UPDATE runs SET {column} = ?", value)
    before = _row(copy)
    code = main(["runs", "--db", str(copy)])
    out = capsys.readouterr()
    if said is None:
        assert code == 0 and "interrupted" in out.out and not out.err
        return
    assert code == 1
    (line,) = out.err.splitlines()
    assert line == f"mdb: error: run 'r' cannot be read: {said}; the database was changed " \
                   "outside mdb"
    assert "damaged" in out.out and "Traceback" not in out.out + out.err
    assert main(["runs", "--json", "--db", str(copy)]) == 1
    rec = json.loads(capsys.readouterr().out)
    assert said in rec["damaged"]
    assert _row(copy) == before  # reading changes nothing


def test_every_column_tampered_at_once_is_one_line(copy, capsys):
    _sql(copy, "UPDATE runs SET last_step='abc', last_loss='x', total_steps='many', "
         "started='y', heartbeat='hb', pid='p', attempt='two', checkpoint_step='cs', "
         "fail_step='fs', paused='maybe'")
    assert main(["runs", "--db", str(copy)]) == 1
    assert "(and 9 more)" in _err_line(capsys)


def test_a_damaged_metric_row_is_one_line_in_export_and_ends_a_watch(copy, capsys):
    _sql(copy, "UPDATE scalars SET value = 'abc' WHERE step = 3 AND metric = 1")
    with RunStore(copy) as store:
        with pytest.raises(DamagedRunError, match="the value of ce at step 3 is 'abc'"):
            store.metrics(store.run("r").id)
    assert main(["export", "r", "--db", str(copy)]) != 0
    assert "the value of ce at step 3 is 'abc'" in _err_line(capsys)


@pytest.mark.parametrize("sql, said", [
    ("UPDATE metrics SET expert_load = '[[\"x\"]]' WHERE step = 2",
     "metrics.expert_load of step 2 holds"),
    ("UPDATE metrics SET expert_load = '{' WHERE step = 2", "metrics.expert_load of step 2"),
    ("UPDATE metrics SET wall = 'noon' WHERE step = 4", "metrics.wall of step 4"),
])
async def test_watch_of_a_damaged_metric_row_exits_2_with_one_line(copy, sql, said):
    from tests.conftest import wait_until
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    _sql(copy, sql)
    store, run = open_run(str(copy), "r")
    app = make_watch_app(store, run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.fatal is not None)
    store.close()
    assert app.return_code == 2 and said in app.live.fatal
    assert "\n" not in app.live.fatal


# -- resume refuses tampered configs and checkpoints, and leaves the run as it was ---------

def _config(db: Path) -> dict:
    conn = sqlite3.connect(db)
    (text,) = conn.execute("SELECT config FROM runs").fetchone()
    conn.close()
    return json.loads(text)


def _set_config(db: Path, **changes) -> None:
    cfg = _config(db)
    cfg.update(changes)
    _sql(db, "UPDATE runs SET config = ?", json.dumps(cfg))


def _edit_checkpoint(db: Path, edit) -> None:
    path = _checkpoint_json(db)
    meta = json.loads(path.read_text())
    path.write_text(json.dumps(edit(meta)))


def _group(key, value):
    def edit(meta):
        meta["optimizer"]["param_groups"][0][key] = value
        return meta
    return edit


def _set(key, value):
    def edit(meta):
        meta[key] = value
        return meta
    return edit


@pytest.mark.parametrize("tamper, said", [
    (lambda db: _sql(db, "UPDATE runs SET config = 'not json'"),
     "runs.config holds 'not json', not a JSON object"),
    (lambda db: _sql(db, "UPDATE runs SET config = 'null'"), "not a JSON object"),
    (lambda db: _set_config(db, lr="fast"), "the run's stored config has lr = 'fast', not a "
                                            "number"),
    (lambda db: _set_config(db, steps="many"), "steps = 'many', not an integer"),
    (lambda db: _set_config(db, text=5), "text = 5, not text"),
    (lambda db: _set_config(db, seed=2**70), "--seed must be an integer in [0, 2**63)"),
    (lambda db: _set_config(db, model_config={"hidden_size": "big"}),
     "its stored config does not rebuild the run: TypeError"),
    (lambda db: _edit_checkpoint(db, _set("torch_rng_state", "00")),
     "is damaged: its RNG state is '00', not the 5056 bytes"),
    (lambda db: _edit_checkpoint(db, lambda meta: [1, 2]), "is not an mdb checkpoint"),
    (lambda db: _edit_checkpoint(db, _group("lr", "fast")),
     "parameter group 0 has lr = 'fast', where the optimizer takes float"),
    (lambda db: _edit_checkpoint(db, _group("betas", "x")), "parameter group 0 has betas"),
    (lambda db: _edit_checkpoint(db, _group("betas", {"__tuple__": 5})), "betas"),
    (lambda db: _edit_checkpoint(db, _set("step", "6")), "its step is '6', not a step number"),
    (lambda db: _edit_checkpoint(db, _set("extra", 5)), "'extra' is not a JSON object"),
    (lambda db: _edit_checkpoint(db, _set("optimizer", None)), "has no optimizer state"),
    (lambda db: _checkpoint_json(db).write_text("{"), "unreadable checkpoint"),
])
def test_resume_of_a_tampered_run_is_one_line_and_the_run_is_untouched(copy, capsys, tamper,
                                                                       said):
    tamper(copy)
    before = _row(copy)
    assert before[:2] == ("interrupted", "SIGTERM")
    code = main(["overfit", "--headless", "--resume", "r", "--db", str(copy)])
    line = _err_line(capsys)
    assert code == 2 and said in line, line
    assert _row(copy) == before  # status, reason, attempt, steps and checkpoint unchanged


def test_a_finished_run_with_a_tampered_checkpoint_stays_finished(copy, capsys):
    from hooks.train.overfit import OverfitSession

    with RunStore(copy) as store:
        s = OverfitSession.resume(store, "r", steps=8)
        s.run()
    assert _row(copy)[0] == "finished"
    _edit_checkpoint(copy, _group("lr", "fast"))
    before = _row(copy)
    assert main(["overfit", "--headless", "--resume", "r", "--steps", "12", "--db",
                 str(copy)]) == 2
    assert "lr = 'fast'" in _err_line(capsys)
    assert _row(copy) == before and before[0] == "finished"


# -- a user's own loop with odd values --------------------------------------------------------

def test_hooks_run_with_odd_values_reads_back_everywhere(tmp_path, capsys):
    import math

    import torch

    db = tmp_path / "mdb.sqlite"
    config = {"nan": float("nan"), "obj": object(), "b": b"x", "d": {1: 2}}
    with hooks.run("odd", db=db, config=config, total_steps=10) as run:
        run.log(loss=1e308, acc=True, **{"weird name/é\nx": 3, "": 2, "a" * 300: 1})
        run.log(loss=float("inf"), lr=-0.0)
        run.log(loss=float("-inf"))
        run.log(step=10**6, loss=torch.tensor(2.0, dtype=torch.float64))
        with pytest.raises(ValueError, match="1329 bits does not fit a float64"):
            run.log(loss=10**400)
        with pytest.raises(ValueError, match="steps go up to 2\\*\\*63 - 1"):
            run.log(step=2**70, loss=1.0)
    with pytest.raises(ValueError, match="total_steps must be a positive integer"):
        hooks.run("neg", db=db, total_steps=-5)
    capsys.readouterr()
    with RunStore(db) as store:
        info = store.run("odd")
        assert info.status == "finished" and info.damaged is None and info.last_step == 10**6
        rows = store.metrics(info.id)
    assert [r.step for r in rows] == [1, 2, 3, 10**6]
    assert rows[0].values["loss"] == 1e308 and rows[0].values[""] == 2.0
    assert math.isinf(rows[1].values["loss"]) and rows[2].values["loss"] == -math.inf
    assert main(["runs", "--db", str(db)]) == 0
    table = capsys.readouterr().out
    assert "weird name/é\\nx" in table and '""' in table  # escaped, on one line
    assert main(["runs", "--json", "--db", str(db)]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["metrics"][:4] == ["loss", "acc", "weird name/é\nx", ""]
    assert main(["export", "odd", "--db", str(db)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("1000000,2.0")


async def test_watch_of_odd_names_and_values(tmp_path):
    from tests.conftest import wait_until
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    db = tmp_path / "mdb.sqlite"
    with hooks.run("odd", db=db) as run:
        for i in range(30):
            run.log(**{"val\nloss": 1.0 / (i + 1), "": float(i), "loss": 1e308 if i == 3
                       else 2.0 - i / 30})
    store, info = open_run(str(db), "odd")
    app = make_watch_app(store, info)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.series.rows == 30)
        await drawn(pilot, app.live)
        status = str(app.screen.query_one("#live-status").render())
        assert "\n" not in status and "val\\nloss" in status
        await pilot.press("m", "m", "m")
        await drawn(pilot, app.live)
        await pilot.press("q")
    store.close()


# -- rejected mdb overfit calls leave nothing behind -----------------------------------------

_NO_LOSS = '''
import torch
from torch import nn

def build():
    return nn.Linear(4, 4), torch.randn(2, 4)
'''

_RAISES = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        raise RuntimeError("my forward is broken")

def build():
    return Net(), torch.randn(2, 4)
'''


@pytest.fixture
def inputs(tmp_path) -> Path:
    d = tmp_path / "inputs"
    d.mkdir()
    (d / "big.toml").write_text("hidden_size = 1000000000\n")
    (d / "bad.toml").write_text("nonsense = = 1\n")
    (d / "badval.toml").write_text('initializer_range = "x"\n')
    (d / "empty.txt").write_text("")
    (d / "bin.txt").write_bytes(b"\xff\xfe")
    (d / "noloss.py").write_text(_NO_LOSS)
    (d / "raises.py").write_text(_RAISES)
    return d


@pytest.mark.parametrize("argv, said", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--config", "{d}/missing.toml"], "no such file"),
    (["--config", "{d}"], "not a file"),
    (["--config", "{d}/bad.toml"], "is not valid TOML"),
    (["--config", "{d}/badval.toml"], "initializer_range must be a finite number"),
    (["--config", "{d}/big.toml"], "need at least"),
    (["--preset", "tiny", "--batch-size", "100000000"], "need at least"),
    (["--text", "{d}/missing.txt"], "no such file"),
    (["--text", "{d}/empty.txt"], "the file is empty"),
    (["--text", "{d}/bin.txt"], "not UTF-8"),
    (["--text", "/dev/zero"], "not a regular file"),
    (["--text", "{d}"], "is a directory"),
    (["--seq-len", "1"], "--seq-len must be at least 2"),
    (["--model", "{d}/nope.py:build"], "no such file"),
    (["--model", "{d}/noloss.py:nofunc"], "has no function nofunc"),
    (["--model", "os:getcwd"], "must return (model, batch)"),
    (["--model", "{d}/noloss.py:build"], "returned no loss"),
    (["--model", "{d}/raises.py:build"], "my forward is broken"),
    (["--model", "{d}/noloss.py:build", "--text", "x"], "does not apply with --model"),
    (["--seed", "1180591620717411303424"], "argument --seed: must be an integer in [0, 2**63)"),
    (["--seed", "-1"], "argument --seed"),
    (["--steps", "0"], "argument --steps"),
    (["--lr", "nan"], "argument --lr"),
    (["--run", "bad name"], "--run: invalid run name 'bad name'"),
    (["--run", ""], "--run: invalid run name ''"),
    (["--every", "-1"], "argument --every"),
])
def test_a_rejected_overfit_creates_no_database(inputs, tmp_path, capsys, argv, said):
    db = tmp_path / "out" / "mdb.sqlite"
    argv = [a.replace("{d}", str(inputs)) for a in argv]
    code = _main(["overfit", "--headless", "--db", str(db), *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code in (1, 2) and len(err) == 1 and said in err[0], err
    assert "Traceback" not in err[0]
    assert not (tmp_path / "out").exists()  # no database, no checkpoint directory


def test_a_rejected_overfit_adds_nothing_to_an_existing_database(copy, inputs, capsys):
    assert main(["overfit", "--headless", "--db", str(copy), "--preset", "nope"]) == 2
    assert main(["overfit", "--headless", "--db", str(copy), "--run", "r"]) == 2  # exists
    assert "already exists" in capsys.readouterr().err
    with RunStore(copy) as store:
        assert [r.name for r in store.runs()] == ["r"]
    assert sorted(p.name for p in (copy.parent / "mdb-checkpoints").iterdir()) == ["r"]
