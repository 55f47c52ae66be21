"""A run database or checkpoint from elsewhere is untrusted input (issue #32, items 1 and 2):
a name or a path read back from it never leads mdb out of ``<db>-checkpoints/<run>/``, and a
resume never imports a model file that the user did not name again or that changed since the
run was made. Each refusal is one ``mdb: error:`` line, exit 2, nothing touched."""

from __future__ import annotations

import json
import shutil
import sqlite3
import textwrap
from pathlib import Path

import pytest
import tomllib

from hooks.store.store import RunStore, RunStoreError
from hooks.train.overfit import resume_session
from tests.conftest import TINY_TOML
from tests.processes import one_error_line
from tui.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    """``runs/mdb.sqlite`` with run ``r``: a tiny minillm stopped after step 4 with its
    checkpoint in ``runs/mdb-checkpoints/r/step-00000004``."""
    from hooks.train.overfit import OverfitOptions, OverfitSession
    from minillm import MiniLLMConfig

    tmp = tmp_path_factory.mktemp("untrusted")
    opts = OverfitOptions(text="人工智能正在改变世界。" * 2,
                          model_config=MiniLLMConfig(**tomllib.loads(TINY_TOML)).to_dict(),
                          steps=10, every=0, sample_every=0)
    with RunStore(tmp / "mdb.sqlite", create=True) as store:
        session = OverfitSession.create(store, "r", opts)
        session.run(on_step=lambda rep: rep.step == 4 and session.control.stop("SIGTERM"))
    return tmp


@pytest.fixture
def db(stopped_run, tmp_path) -> Path:
    dst = tmp_path / "runs"
    shutil.copytree(stopped_run, dst)
    return dst / "mdb.sqlite"


def _sql(db: Path, sql: str, *params) -> None:
    conn = sqlite3.connect(db)
    conn.execute(sql, params)
    conn.commit()
    conn.close()


def _row(db: Path) -> tuple:
    conn = sqlite3.connect(db)
    out = conn.execute("SELECT name, status, attempt, last_step, checkpoint_step, "
                       "checkpoint_path FROM runs").fetchone()
    conn.close()
    return out


def _victim(db: Path) -> Path:
    """A folder beside the store holding ``step-*`` folders of someone else's, with a file."""
    victim = db.parent / "victim"
    (victim / "step-00000001").mkdir(parents=True)
    (victim / "step-00000001" / "keep.txt").write_text("not mdb's")
    return victim


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_run_renamed_out_of_the_store_is_refused_and_nothing_outside_is_touched(db, capsys):
    victim = _victim(db)
    _sql(db, "UPDATE runs SET name = '../victim'")  # runs/mdb-checkpoints/../victim
    before = _row(db)
    assert main(["overfit", "--headless", "--resume", "../victim", "--steps", "6", "--db",
                 str(db)]) == 2
    assert "invalid run name '../victim'" in one_error_line(capsys)
    # the name read back from the database, not typed: refused the same way
    with RunStore(db) as store, pytest.raises(RunStoreError, match="invalid run name"):
        resume_session(store, "../victim", steps=6)
    assert _tree(victim) == ["step-00000001", "step-00000001/keep.txt"]
    assert _row(db) == before


def test_a_checkpoint_path_outside_the_runs_folder_is_refused(db, capsys):
    victim = _victim(db)
    shutil.copytree(db.parent / "mdb-checkpoints" / "r" / "step-00000004",
                    victim / "step-00000004")
    _sql(db, "UPDATE runs SET checkpoint_path = 'victim/step-00000004'")
    before, files = _row(db), _tree(victim)
    assert main(["overfit", "--headless", "--resume", "r", "--steps", "6", "--db",
                 str(db)]) == 2
    line = one_error_line(capsys)
    assert "run 'r' records its checkpoint at 'victim/step-00000004', which is not inside" in line
    assert _tree(victim) == files and _row(db) == before


def test_a_run_directory_linked_out_of_the_store_is_refused(db, capsys):
    victim = _victim(db)
    run_dir = db.parent / "mdb-checkpoints" / "r"
    shutil.move(run_dir / "step-00000004", victim / "step-00000004")
    run_dir.rmdir()
    run_dir.symlink_to(victim, target_is_directory=True)
    before, files = _row(db), _tree(victim)
    assert main(["overfit", "--headless", "--resume", "r", "--steps", "6", "--db",
                 str(db)]) == 2
    assert "leads out of" in one_error_line(capsys)
    assert _tree(victim) == files and _row(db) == before


# -- --resume imports a model file only when it is unchanged or named again -----------------

_FACTORY = """
import pathlib
import torch
from torch import nn
import torch.nn.functional as F

pathlib.Path(__file__).with_name("imported-{tag}").write_text("ran")

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, idx, targets):
        logits = self.head(self.emb(idx))
        return logits, F.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))

def build():
    x = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    return Tiny(), (x[:, :-1], x[:, 1:])
"""


@pytest.fixture
def model_run(tmp_path, capsys) -> tuple[Path, Path]:
    """Run ``m`` of ``mdb overfit --model factory.py:build``, 4 of 12 steps: (db, factory)."""
    factory = tmp_path / "factory.py"
    factory.write_text(textwrap.dedent(_FACTORY.format(tag="a")))
    db = tmp_path / "runs" / "mdb.sqlite"
    assert main(["overfit", "--headless", "--model", f"{factory}:build", "--steps", "4",
                 "--db", str(db), "--run", "m", "--every", "0"]) == 0
    (tmp_path / "imported-a").unlink()
    capsys.readouterr()
    return db, factory


def _resume(db: Path, steps: int, *extra: str) -> int:
    return main(["overfit", "--headless", "--resume", "m", "--steps", str(steps), "--db",
                 str(db), *extra])


def test_resume_imports_the_same_model_file(model_run, capsys):
    db, factory = model_run
    import hashlib

    cfg = json.loads(sqlite3.connect(db).execute("SELECT config FROM runs").fetchone()[0])
    assert cfg["model_sha256"] == hashlib.sha256(factory.read_bytes()).hexdigest()
    assert _resume(db, 6) == 0
    assert "run m finished: step 6/6" in capsys.readouterr().out
    assert (factory.parent / "imported-a").exists()


def test_resume_refuses_a_changed_model_file_unless_named_again(model_run, capsys):
    db, factory = model_run
    factory.write_text(textwrap.dedent(_FACTORY.format(tag="b")))  # same model, other code
    before = _row(db)
    assert _resume(db, 6) == 2
    line = one_error_line(capsys)
    assert f"the model file of run 'm', {factory}:build, changed since the run was made" in line
    assert f"--resume m --model {factory}:build" in line
    assert not (factory.parent / "imported-b").exists()  # its code never ran
    assert _row(db) == before
    assert _resume(db, 6, "--model", f"{factory}:build") == 0
    assert (factory.parent / "imported-b").exists()
    # named again, its hash is stored: the next resume imports it without --model
    (factory.parent / "imported-b").unlink()
    assert _resume(db, 8) == 0 and (factory.parent / "imported-b").exists()


def test_resume_of_a_run_without_a_stored_hash_needs_model(model_run, capsys):
    db, factory = model_run
    conn = sqlite3.connect(db)
    cfg = json.loads(conn.execute("SELECT config FROM runs").fetchone()[0])
    del cfg["model_sha256"], cfg["model_mac"]  # a run made by an older mdb, or a forged one
    conn.execute("UPDATE runs SET config = ?", (json.dumps(cfg),))
    conn.commit()
    conn.close()
    assert _resume(db, 6) == 2
    assert "the database holds no signature of it by this user" in one_error_line(capsys)
    assert not (factory.parent / "imported-a").exists()
    assert _resume(db, 6, "--model", f"{factory}:build") == 0


def test_model_on_resume_of_a_minillm_run_is_one_line(db, capsys):
    before = _row(db)
    assert main(["overfit", "--headless", "--resume", "r", "--model", "x.py:build", "--db",
                 str(db)]) == 2
    assert "--model applies only to a run made with --model" in one_error_line(capsys)
    assert _row(db) == before
