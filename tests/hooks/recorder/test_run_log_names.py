"""``run.log`` refuses at the call a metric name the database cannot hold (issue #32 review,
item 7): a lone surrogate was accepted, then the background writer died on it
(UnicodeEncodeError) and every step not yet written was lost. A control character is kept
(views show it escaped). A loss on the meta device is said to be there. Rows are read back
with plain ``sqlite3``."""

from __future__ import annotations

import sqlite3

import pytest
import torch

import hooks


def _steps(db) -> list[tuple]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT s.step, n.name, s.value FROM scalars AS s JOIN metric_names"
                            " AS n ON n.run_id = s.run_id AND n.id = s.metric ORDER BY s.step,"
                            " n.name").fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize("name, said", [
    ("bad\ud800", r"run\.log\('bad\\ud800'=\.\.\.\): the metric name holds a lone surrogate "
                  r"\('\\ud800' at 3\)"),
    ("x\udfff", r"the metric name holds a lone surrogate \('\\udfff' at 1\)"),
], ids=["surrogate", "low-surrogate"])
def test_a_name_the_database_cannot_hold_is_refused_and_nothing_is_lost(tmp_path, name, said):
    db = tmp_path / "mdb.sqlite"
    with hooks.run("n", db=db) as run:
        run.log(loss=1.0)
        with pytest.raises(ValueError, match=said):
            run.log(**{"loss": 2.0, name: 1.0})
        run.log(loss=3.0)
    assert _steps(db) == [(1, "loss", 1.0), (2, "loss", 3.0)]


def test_a_control_character_in_a_name_is_kept(tmp_path):
    db = tmp_path / "mdb.sqlite"
    with hooks.run("c", db=db) as run:
        run.log(**{"a\x1b[2J": 0.5})
    assert _steps(db) == [(1, "a\x1b[2J", 0.5)]


def test_a_loss_on_the_meta_device_is_said_to_be_there(tmp_path):
    db = tmp_path / "mdb.sqlite"
    with hooks.run("m", db=db) as run:
        with pytest.raises(ValueError, match=r"run\.log\(loss=\.\.\.\): the tensor is on the "
                                             r"meta device"):
            run.log(loss=torch.empty((), device="meta"))
        run.log(loss=0.25)
    assert _steps(db) == [(1, "loss", 0.25)]
