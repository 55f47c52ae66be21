"""A stored capture or a trace file from elsewhere is untrusted data (issue #32, items 9 and
11): damaged or malformed, it is one ``mdb: error:`` line and exit 2 in ``mdb summary --run``,
``mdb step --run``, ``mdb diff RUN@STEP`` and with a trace file, never a traceback."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from pathlib import Path

import pytest

from tests.processes import main_rc, one_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

BIG = "9" * 5000  # past Python's 4,300-digit limit of int(str)


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Path:
    """A run database with run ``r1``: a tiny minillm, 4 steps, captures at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("captures")
    db = tmp / "mdb.sqlite"
    assert main_rc(["overfit", "--headless", "--preset", "tiny", "--steps", "4", "--every",
                    "2", "--sample-every", "0", "--run", "r1", "--db", str(db)]) == 0
    return tmp


@pytest.fixture
def db(captured, tmp_path) -> Path:
    shutil.copytree(captured, tmp_path / "runs")
    return tmp_path / "runs" / "mdb.sqlite"


def _cut_blob(db: Path) -> None:
    conn = sqlite3.connect(db)
    (blob,) = conn.execute("SELECT tensors FROM internals WHERE step = 2").fetchone()
    conn.execute("UPDATE internals SET tensors = ? WHERE step = 2", (blob[: len(blob) // 2],))
    conn.commit()
    conn.close()


def _edit_json(edit):
    def tamper(db: Path) -> None:
        conn = sqlite3.connect(db)
        (text,) = conn.execute("SELECT data FROM internals WHERE step = 2").fetchone()
        conn.execute("UPDATE internals SET data = ? WHERE step = 2", (edit(text),))
        conn.commit()
        conn.close()
    return tamper


def _big_int(text: str) -> str:
    out = re.sub(r'"kept_bytes": ?0', f'"kept_bytes": {BIG}', text, count=1)
    assert out != text
    return out


def _module_name_a_number(text: str) -> str:
    data = json.loads(text)
    data["forward"][1]["module"] = 7
    return json.dumps(data)


TAMPERS = [
    pytest.param(_cut_blob, "not a valid safetensors blob", id="cut-blob"),
    pytest.param(_edit_json(lambda t: t[:100]), "does not parse as JSON", id="cut-json"),
    pytest.param(_edit_json(lambda t: "[1, 2]"), "not a JSON object", id="json-list"),
    pytest.param(_edit_json(_big_int), "does not parse as JSON (Exceeds the limit",
                 id="5000-digits"),
    pytest.param(_edit_json(_module_name_a_number), "forward[1].module is 7", id="wrong-type"),
]
COMMANDS = [
    pytest.param(["summary", "--run", "r1@2"], "--run r1@2: ", id="summary"),
    pytest.param(["step", "--run", "r1@2"], "--run r1@2: ", id="step"),
    pytest.param(["diff", "r1@2", "r1@4", "--table"], "r1@2: ", id="diff"),
]


@pytest.mark.parametrize("argv, head", COMMANDS)
@pytest.mark.parametrize("tamper, said", TAMPERS)
def test_a_damaged_stored_capture_is_one_line(db, capsys, argv, head, tamper, said):
    tamper(db)
    assert main_rc([*argv, "--db", str(db)]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"mdb: error: {head}") and said in line, line
    # the other capture still reads
    assert main_rc(["summary", "--run", "r1@4", "--db", str(db)]) == 0


# -- trace files ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trace") / "t"
    assert main_rc(["capture", "--preset", "tiny", "--out", str(out)]) == 0
    return out


def _trace_with(trace_dir: Path, tmp_path: Path, edit) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(trace_dir, bad)
    path = bad / "trace.json"
    path.write_text(edit(path.read_text()))
    return bad


def _set(*keys_value):
    *keys, value = keys_value

    def edit(text: str) -> str:
        data = json.loads(text)
        node = data
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
        return json.dumps(data)
    return edit


@pytest.mark.parametrize("edit, said", [
    pytest.param(_big_int, "is not valid JSON: Exceeds the limit (4300 digits)",
                 id="5000-digits"),
    pytest.param(_set("modules", 0, "name", -1), "modules[0].name is -1, not of the type str",
                 id="name-a-number"),
    pytest.param(_set("modules", 1, "depth", 10**30), "larger than a trace holds",
                 id="depth-10e30"),
    pytest.param(_set("modules", 1, "depth", 10**6), "deeper than 4096 modules", id="deep"),
    pytest.param(_set("forward", 0, "inputs", 0, "shape", [2, -64]), "a shape with a negative",
                 id="negative-shape"),
    pytest.param(_set("forward", 0, "time_ms", float("nan")), "where a capture writes a "
                 "finite number", id="nan-time"),
    pytest.param(_set("forward", 2, "parent", 99999), "forward[2].parent is 99999",
                 id="parent-out-of-range"),
    pytest.param(_set("backward", "x"), "malformed trace: AttributeError", id="records-text"),
    pytest.param(_set("routing", 0, "top_k", 3), "chooses 2 experts per token, top_k is 3",
                 id="routing-shape"),
])
@pytest.mark.parametrize("argv", [["summary", "--trace", "{bad}"],
                                  ["diff", "{bad}", "{good}", "--table"],
                                  ["diff", "{bad}", "{good}", "--json"]],
                         ids=["summary", "diff-table", "diff-json"])
def test_a_malformed_trace_file_is_one_line(trace_dir, tmp_path, capsys, edit, said, argv):
    bad = _trace_with(trace_dir, tmp_path, edit)
    argv = [a.format(bad=bad, good=trace_dir) for a in argv]
    assert main_rc(argv) == 2
    line = one_error_line(capsys)
    assert line.startswith("mdb: error: ") and said in line, line


def test_a_nan_aux_loss_is_written_as_nan_by_diff_json(trace_dir, tmp_path, capsys):
    bad = _trace_with(trace_dir, tmp_path, _set("routing", 0, "aux_loss", float("nan")))
    assert main_rc(["diff", str(bad), str(trace_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)  # strict JSON: no bare NaN
    assert "nan" in json.dumps(doc["routing"])
