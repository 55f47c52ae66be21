"""Lists of run names in error lines: a database with more runs than the line shows says how
many there are and ends the list with "…"."""

from __future__ import annotations

import hooks
from tui.cli import main


def _runs(db, n: int) -> list[str]:
    names = [f"r{i}" for i in range(1, n + 1)]
    for name in names:
        hooks.run(name, db=db).finish()
    return names


def test_a_missing_run_among_six_names_the_latest_five_and_says_there_are_more(tmp_path,
                                                                             capsys):
    db = tmp_path / "mdb.sqlite"
    _runs(db, 6)
    capsys.readouterr()
    assert main(["export", "nope", "--db", str(db)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"no run named 'nope' in {db} (the latest 5 of 6 runs: r2, r3, r4, "
                        "r5, r6, …)"), err
    assert main(["step", "--run", "nope@1", "--db", str(db)]) == 2
    assert "(the latest 5 of 6 runs: r2, r3, r4, r5, r6, …)" in capsys.readouterr().err


def test_a_missing_run_among_five_lists_them_all(tmp_path, capsys):
    db = tmp_path / "mdb.sqlite"
    _runs(db, 5)
    capsys.readouterr()
    assert main(["export", "nope", "--db", str(db)]) == 2
    assert capsys.readouterr().err.strip().endswith("(runs: r1, r2, r3, r4, r5)")
