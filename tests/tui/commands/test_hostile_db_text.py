"""A run database from elsewhere may hold bytes that are not UTF-8 in any TEXT column (issue
#32, review item 2): every command reads it, the bad bytes shown as U+FFFD, never a
traceback (SQLite's default decoding raised ``OperationalError`` in each)."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from tests.conftest import drawn, wait_until
from tests.processes import main_rc, one_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

BAD = "CAST(X'6162FF80' AS TEXT)"  # "ab", then two bytes that are not UTF-8


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bad8")
    db = tmp / "mdb.sqlite"
    assert main_rc(["overfit", "--headless", "--preset", "tiny", "--steps", "4", "--every",
                    "2", "--sample-every", "0", "--run", "r1", "--db", str(db)]) == 0
    return tmp


def _bad_db(recorded: Path, tmp_path: Path, sql: str) -> Path:
    shutil.copytree(recorded, tmp_path / "runs")
    db = tmp_path / "runs" / "mdb.sqlite"
    conn = sqlite3.connect(db)
    conn.execute(sql)
    conn.commit()
    conn.close()
    return db


BAD_REASON = f"UPDATE runs SET reason = {BAD}, status = 'failed' WHERE name = 'r1'"
BAD_NAME = f"UPDATE runs SET name = {BAD}, status = 'failed' WHERE name = 'r1'"


@pytest.mark.parametrize("argv", [
    ["runs"], ["runs", "--json"], ["export", "r1"], ["doctor", "--run", "r1"],
    ["summary", "--run", "r1@2"],
], ids=lambda a: "-".join(a))
def test_a_reason_not_utf8_is_read(recorded, tmp_path, capsys, argv):
    db = _bad_db(recorded, tmp_path, BAD_REASON)
    assert main_rc([*argv, "--db", str(db)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out
    if argv == ["runs", "--json"]:
        doc = json.loads(captured.out.splitlines()[0])
        assert doc["reason"] == "ab\ufffd\ufffd" and doc["name"] == "r1"
    if argv == ["runs"]:
        assert "failed (ab\ufffd\ufffd)" in captured.out


def test_stop_names_the_reason_not_utf8(recorded, tmp_path, capsys):
    db = _bad_db(recorded, tmp_path, BAD_REASON)
    assert main_rc(["stop", "r1", "--db", str(db)]) == 2
    assert one_error_line(capsys) == (
        "mdb: error: run r1 is not running (failed (ab\ufffd\ufffd)): nothing to stop")


@pytest.mark.parametrize("argv", [
    ["export", "r1"], ["doctor", "--run", "r1"], ["summary", "--run", "r1@2"], ["stop", "r1"],
], ids=lambda a: "-".join(a))
def test_a_name_not_utf8_is_listed_not_matched(recorded, tmp_path, capsys, argv):
    db = _bad_db(recorded, tmp_path, BAD_NAME)
    assert main_rc([*argv, "--db", str(db)]) == 2
    line = one_error_line(capsys)
    assert "no run named 'r1'" in line and "(runs: ab\ufffd\ufffd)" in line, line


def test_runs_lists_a_name_not_utf8(recorded, tmp_path, capsys):
    db = _bad_db(recorded, tmp_path, BAD_NAME)
    assert main_rc(["runs", "--json", "--db", str(db)]) == 0
    doc = json.loads(capsys.readouterr().out.splitlines()[0])
    assert doc["name"] == "ab\ufffd\ufffd"


async def test_watch_replays_a_run_whose_reason_is_not_utf8(recorded, tmp_path):
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    db = _bad_db(recorded, tmp_path, BAD_REASON)
    store, run = open_run(str(db), "r1")
    app = make_watch_app(store, run)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.live.polls >= 1)
        await drawn(pilot, app.live)
        assert app.live.state == "failed"
        await pilot.press("q")
    store.close()


def test_doctor_run_shows_a_finding_kind_as_written(recorded, tmp_path, capsys):
    """A kind of Rich markup and an ESC (review item 4): shown escaped, as it is, not read as
    markup (``[bold]`` was dropped) nor written raw."""
    db = _bad_db(recorded, tmp_path, (
        "INSERT INTO findings (run_id, id, kind, step, subject, line, detail, wall) SELECT id,"
        " 1, '[bold]acc' || char(27) || '[2J', '[red]3', 'subj', 'line', NULL, 0 FROM runs"))
    assert main_rc(["doctor", "--run", "r1", "--db", str(db)]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "[bold]acc\\x1b[2J" in out and "[red]3" in out, out


def test_runs_cuts_a_long_name_in_the_middle_json_keeps_it(recorded, tmp_path, capsys):
    name = "head" + "x" * 4992 + "tail"
    db = _bad_db(recorded, tmp_path, f"UPDATE runs SET name = '{name}' WHERE name = 'r1'")
    assert main_rc(["runs", "--db", str(db)]) == 0  # piped: no width, the name still cut
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("head")]
    assert row.split()[0] == "head" + "x" * 26 + "…" + "x" * 25 + "tail", row
    assert main_rc(["runs", "--json", "--db", str(db)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["name"] == name
