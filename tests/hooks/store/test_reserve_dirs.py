"""The disk reserve of a run removes the folders it created, ``mdb-checkpoints/`` included,
when they are empty on release: a run that wrote no checkpoint (an ``mdb overfit --nproc``
job) leaves no empty folder; a folder holding another run's files stays."""

from __future__ import annotations

from hooks.store.reserve import DiskReserve
from hooks.store.store import checkpoint_dir


def test_release_removes_the_empty_folders_it_made(tmp_path):
    path = checkpoint_dir(tmp_path / "m.sqlite", "r") / ".mdb-reserve"
    reserve = DiskReserve(path, nbytes=4096)
    assert reserve.make()
    assert path.stat().st_size == 4096
    assert reserve.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_release_keeps_a_folder_that_holds_another_runs_files(tmp_path):
    db = tmp_path / "m.sqlite"
    other = checkpoint_dir(db, "other")
    other.mkdir(parents=True)
    (other / "checkpoint.json").write_text("{}")
    reserve = DiskReserve(checkpoint_dir(db, "r") / ".mdb-reserve", nbytes=4096)
    assert reserve.make() and reserve.release()
    assert sorted(p.name for p in (tmp_path / "m-checkpoints").iterdir()) == ["other"]
