"""``mdb overfit --resume`` builds a stored minillm config only when it fits the checkpoint's
tensors (read from the safetensors header): a database asking for 100,000 layers is refused
in one line before any model is built."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import tomllib
import torch

import minillm
from hooks.store.store import RunStore
from tests.conftest import TINY_TOML
from tests.processes import one_error_line
from tui.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    from hooks.train.overfit import OverfitOptions, OverfitSession

    tmp = tmp_path_factory.mktemp("fits")
    opts = OverfitOptions(text="人工智能正在改变世界。" * 2,
                          model_config=minillm.MiniLLMConfig(**tomllib.loads(TINY_TOML)).to_dict(),
                          steps=10, every=0, sample_every=0)
    with RunStore(tmp / "mdb.sqlite", create=True) as store:
        session = OverfitSession.create(store, "r", opts)
        session.run(on_step=lambda rep: rep.step == 4 and session.control.stop("SIGTERM"))
    return tmp


@pytest.fixture
def db(stopped_run, tmp_path) -> Path:
    shutil.copytree(stopped_run, tmp_path / "runs")
    return tmp_path / "runs" / "mdb.sqlite"


def _doctor(db: Path, **model_config) -> None:
    conn = sqlite3.connect(db)
    cfg = json.loads(conn.execute("SELECT config FROM runs").fetchone()[0])
    cfg["model_config"].update(model_config)
    conn.execute("UPDATE runs SET config = ?", (json.dumps(cfg),))
    conn.commit()
    conn.close()


@pytest.fixture
def built_on(monkeypatch) -> list[str]:
    """The device of every MiniLLM built (``meta`` costs nothing)."""
    devices: list[str] = []
    real = minillm.MiniLLM

    def spy(config):
        devices.append(torch.get_default_device().type)
        return real(config)

    monkeypatch.setattr(minillm, "MiniLLM", spy)
    return devices


@pytest.mark.parametrize("change, said", [
    ({"num_hidden_layers": 100_000}, "num_hidden_layers = 100000, its checkpoint 1 layers"),
    ({"intermediate_size": 48},
     "its stored config does not build its checkpoint's model: "),
])
def test_a_config_that_does_not_fit_the_checkpoint_is_refused_before_a_model_is_built(
        db, capsys, built_on, change, said):
    assert minillm.MiniLLMConfig(**tomllib.loads(TINY_TOML)).num_hidden_layers == 1
    _doctor(db, **change)
    assert main(["overfit", "--headless", "--resume", "r", "--db", str(db)]) == 2
    assert said in one_error_line(capsys)
    assert "cpu" not in built_on


def test_the_stored_config_still_resumes(db, capsys, built_on):
    assert main(["overfit", "--headless", "--resume", "r", "--steps", "6", "--db",
                 str(db)]) == 0
    assert "run r finished: step 6/6" in capsys.readouterr().out
    assert built_on == ["meta", "cpu"]
