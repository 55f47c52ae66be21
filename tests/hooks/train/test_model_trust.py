"""``mdb overfit --resume`` of a ``--model`` run imports the stored model only when this user
signed it (an HMAC with this user's key over the reference and the hash of every file importing
it runs): a database from elsewhere, naming a file with that file's real hash, never runs code."""

from __future__ import annotations

import hashlib
import hmac
import importlib.util
import json
import os
import sqlite3
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from tests.processes import one_error_line
from tui.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

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

ZEN = "Beautiful is better than ugly"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _config(db: Path) -> dict:
    conn = sqlite3.connect(db)
    cfg = json.loads(conn.execute("SELECT config FROM runs").fetchone()[0])
    conn.close()
    return cfg


def _set_config(db: Path, **changes) -> None:
    cfg = {**_config(db), **changes}
    conn = sqlite3.connect(db)
    conn.execute("UPDATE runs SET config = ?", (json.dumps(cfg),))
    conn.commit()
    conn.close()


def _resume(db: Path, steps: int, *extra: str) -> int:
    return main(["overfit", "--headless", "--resume", "m", "--steps", str(steps), "--db",
                 str(db), *extra])


@pytest.fixture
def model_run(tmp_path, capsys, monkeypatch) -> tuple[Path, Path]:
    """Run ``m`` of ``mdb overfit --model factory.py:build``, 4 of 12 steps: (db, factory)."""
    monkeypatch.chdir(tmp_path)
    factory = tmp_path / "factory.py"
    factory.write_text(textwrap.dedent(_FACTORY.format(tag="a")))
    db = tmp_path / "runs" / "mdb.sqlite"
    assert main(["overfit", "--headless", "--model", f"{factory}:build", "--steps", "4",
                 "--db", str(db), "--run", "m", "--every", "0"]) == 0
    (tmp_path / "imported-a").unlink()
    capsys.readouterr()
    return db, factory


def test_a_run_made_here_is_signed_with_the_users_key_and_resumes(model_run, capsys):
    db, factory = model_run
    key_file = Path(os.environ["MDB_KEY_FILE"])
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_bytes()
    assert len(key) == 32
    cfg = _config(db)
    files = [[str(factory.resolve()), _sha(factory)]]
    assert cfg["model_files"] == files and cfg["model_sha256"] == _sha(factory)
    message = json.dumps([f"{factory.resolve()}:build", files], sort_keys=True).encode()
    assert cfg["model_mac"] == hmac.new(key, b"mdb model reference v1\n" + message,
                                        hashlib.sha256).hexdigest()
    assert _resume(db, 6) == 0
    assert "run m finished: step 6/6" in capsys.readouterr().out
    assert (factory.parent / "imported-a").exists()


def _forge(db: Path, spec: str, sha: str) -> None:
    """What the reviewer's database does: name another file, with that file's real hash."""
    _set_config(db, model_path=spec, model=spec, model_sha256=sha)


def test_a_stdlib_module_named_with_its_real_hash_is_not_imported(model_run, capsys):
    db, _ = model_run
    sys.modules.pop("this", None)
    origin = Path(importlib.util.find_spec("this").origin)
    _forge(db, "this:s", _sha(origin))
    assert _resume(db, 6) == 2
    out, err = capsys.readouterr()
    assert ZEN not in out and ZEN not in err and "this" not in sys.modules
    line = err.strip()
    assert line.count("\n") == 0 and line.startswith("mdb: error: cannot resume 'm'")
    assert "its signature is not this user's" in line and "--resume m --model this:s" in line


def test_a_planted_file_named_with_its_real_hash_is_not_imported(model_run, capsys):
    db, factory = model_run
    evil = factory.parent / "evil.py"
    marker = factory.parent / "PWNED_BY_IMPORT"
    evil.write_text(f"open({str(marker)!r}, 'w')\n" + textwrap.dedent(_FACTORY.format(tag="e")))
    files = [[str(evil), _sha(evil)]]
    # even with a list of files of the right shape, and the MAC of the real run kept
    _forge(db, f"{evil}:build", _sha(evil))
    _set_config(db, model_files=files)
    assert _resume(db, 6) == 2
    assert "its signature is not this user's" in one_error_line(capsys)
    assert not marker.exists() and not (factory.parent / "imported-e").exists()
    # without any signature: refused as well, with its own reason
    _set_config(db, model_mac="")
    assert _resume(db, 6) == 2
    assert "the database holds no signature of it by this user" in one_error_line(capsys)
    assert not marker.exists()


def test_a_package_whose_init_is_not_hashed_is_not_imported(model_run, capsys):
    db, factory = model_run
    pkg = factory.parent / "pkg_trust_a"
    pkg.mkdir()
    marker = factory.parent / "PWNED_INIT"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w')\n")
    (pkg / "model.py").write_text(textwrap.dedent(_FACTORY.format(tag="p")))
    _forge(db, "pkg_trust_a.model:build", _sha(pkg / "model.py"))
    try:
        assert _resume(db, 6) == 2
        assert "its signature is not this user's" in one_error_line(capsys)
        assert not marker.exists() and "pkg_trust_a" not in sys.modules
    finally:
        for name in ("pkg_trust_a", "pkg_trust_a.model"):
            sys.modules.pop(name, None)


def test_a_changed_package_init_of_a_module_run_is_refused_and_model_signs_it_again(
        tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pkg = tmp_path / "pkg_trust_b"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(textwrap.dedent(_FACTORY.format(tag="b")))
    db = tmp_path / "runs" / "mdb.sqlite"
    try:
        assert main(["overfit", "--headless", "--model", "pkg_trust_b.model:build", "--steps",
                     "4", "--db", str(db), "--run", "m", "--every", "0"]) == 0
        assert _config(db)["model_files"] == [
            [str((pkg / "__init__.py").resolve()), _sha(pkg / "__init__.py")],
            [str((pkg / "model.py").resolve()), _sha(pkg / "model.py")]]
        capsys.readouterr()
        for name in ("pkg_trust_b", "pkg_trust_b.model"):
            sys.modules.pop(name, None)
        marker = tmp_path / "init-ran"
        (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w')\n")
        assert _resume(db, 6) == 2
        line = one_error_line(capsys)
        assert "changed since the run was made" in line
        assert "--resume m --model pkg_trust_b.model:build" in line
        assert not marker.exists() and "pkg_trust_b" not in sys.modules
        assert _resume(db, 6, "--model", "pkg_trust_b.model:build") == 0
        assert marker.exists()
        assert _config(db)["model_files"][0] == [str((pkg / "__init__.py").resolve()),
                                                 _sha(pkg / "__init__.py")]
        marker.unlink()
        for name in ("pkg_trust_b", "pkg_trust_b.model"):
            sys.modules.pop(name, None)
        assert _resume(db, 8) == 0 and marker.exists()  # signed again: no --model needed
    finally:
        for name in ("pkg_trust_b", "pkg_trust_b.model"):
            sys.modules.pop(name, None)


def test_a_key_that_cannot_be_kept_is_one_line_and_no_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MDB_KEY_FILE", str(tmp_path / "not-a-folder" / "key"))
    (tmp_path / "not-a-folder").write_text("a file")
    factory = tmp_path / "factory.py"
    factory.write_text(textwrap.dedent(_FACTORY.format(tag="k")))
    db = tmp_path / "runs" / "mdb.sqlite"
    assert main(["overfit", "--headless", "--model", f"{factory}:build", "--steps", "2",
                 "--db", str(db), "--run", "m"]) == 2
    line = one_error_line(capsys)
    assert f"cannot keep mdb's key in {tmp_path / 'not-a-folder' / 'key'}" in line
    assert "MDB_KEY_FILE" in line
    assert not db.exists() and not (tmp_path / "imported-k").exists()
