"""A trace file or a stored capture from elsewhere is data (issue #32 review, items 3, 5, 6
and the missing tensors file): a dtype that is no torch dtype, an integer of hundreds or
thousands of digits, ``meta`` fields of the wrong type are one ``mdb: error:`` line and exit
2, never a traceback; what is shown is escaped."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from tests.processes import main_rc, one_error_line

pytestmark = pytest.mark.usefixtures("one_thread")

ESC = "\x1b]0;PWNED\x07\x1b[2J"


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trace") / "t"
    assert main_rc(["capture", "--preset", "tiny", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("captures")
    db = tmp / "mdb.sqlite"
    assert main_rc(["overfit", "--headless", "--preset", "tiny", "--steps", "2", "--every",
                    "2", "--sample-every", "0", "--run", "r1", "--db", str(db)]) == 0
    return tmp


def _trace_with(trace_dir: Path, tmp_path: Path, edit) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(trace_dir, bad)
    path = bad / "trace.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return bad


def _db_with(captured: Path, tmp_path: Path, edit) -> Path:
    shutil.copytree(captured, tmp_path / "runs")
    db = tmp_path / "runs" / "mdb.sqlite"
    conn = sqlite3.connect(db)
    (text,) = conn.execute("SELECT data FROM internals WHERE step = 2").fetchone()
    conn.execute("UPDATE internals SET data = ? WHERE step = 2",
                 (json.dumps(edit(json.loads(text))),))
    conn.commit()
    conn.close()
    return db


def _setter(*keys_value):
    *keys, value = keys_value

    def edit(data):
        node = data
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
        return data
    return edit


def _first_input_dtype(value):
    def edit(data):
        call = next(c for c in data["forward"] if c["inputs"])
        call["inputs"][0]["dtype"] = value
        return data
    return edit


EDITS = [
    pytest.param(_first_input_dtype(ESC), "not the name of a torch dtype", id="dtype-escape"),
    pytest.param(_first_input_dtype("float99"), "is 'float99', not the name of a torch dtype",
                 id="dtype-unknown"),
    pytest.param(_setter("modules", 1, "depth", 10**399), "an integer of 400 digits",
                 id="400-digits"),
    pytest.param(_setter("modules", 1, "depth", -(10**3999)), "an integer of 4000 digits",
                 id="4000-digits"),
]


@pytest.mark.parametrize("edit, said", EDITS)
def test_a_hostile_trace_file_is_one_line(trace_dir, tmp_path, capsys, edit, said):
    bad = _trace_with(trace_dir, tmp_path, edit)
    assert main_rc(["summary", "--trace", str(bad)]) == 2
    line = one_error_line(capsys)
    assert said in line and "\x1b" not in line, line


@pytest.mark.parametrize("edit, said", EDITS)
def test_a_hostile_stored_capture_is_one_line(captured, tmp_path, capsys, edit, said):
    db = _db_with(captured, tmp_path, edit)
    assert main_rc(["summary", "--run", "r1@2", "--db", str(db)]) == 2
    line = one_error_line(capsys)
    assert line.startswith("mdb: error: --run r1@2: ") and said in line, line


def test_io_table_escapes_a_dtype():
    from hooks.trace.records import CallRecord, TensorInfo
    from tui.widgets.call_details import io_table

    call = CallRecord.__new__(CallRecord)
    call.inputs = [TensorInfo("args[0]", [2, 3], "float\x1b[2J")]
    call.outputs = []
    assert io_table(call).plain == "in  args[0] 2×3   float\\x1b[2J"


def test_digits_counts_exactly():
    from hooks.trace.check import digits

    for n in (1, 2, 15, 16, 17, 308, 309, 400, 4000, 4300, 5000):
        assert digits(10 ** (n - 1)) == n and digits(10**n - 1) == n
        assert digits(-(10 ** (n - 1))) == n
    assert digits(0) == 1


META_EDITS = [
    pytest.param(_setter("meta", "description", 5),
                 "trace.meta['description'] is 5, not of the type str | None", id="description"),
    pytest.param(_setter("meta", "tokens", {"a": 1}),
                 "trace.meta['tokens'] is {'a': 1}, not of the type list[str] | None",
                 id="tokens-object"),
    pytest.param(_setter("meta", "tokens", ["a", 2]), "trace.meta['tokens'] is ['a', 2]",
                 id="token-number"),
    pytest.param(_setter("meta", "config", {"router_aux_loss_coef": "x"}),
                 "trace.meta['config']['router_aux_loss_coef'] is 'x', not of the type float",
                 id="coef-text"),
    pytest.param(_setter("meta", "config", [1, 2]),
                 "trace.meta['config'] is [1, 2], not of the type dict[str, Any] | None",
                 id="config-list"),
    pytest.param(_setter("meta", "input_shape", "1x8"), "trace.meta['input_shape'] is '1x8'",
                 id="input-shape-text"),
]


@pytest.mark.parametrize("argv", [["summary", "--trace"], ["step", "--trace"],
                                  ["diff", "--table", "{good}"]],
                         ids=["summary", "step", "diff"])
@pytest.mark.parametrize("edit, said", META_EDITS)
def test_a_trace_meta_of_the_wrong_type_is_one_line(trace_dir, tmp_path, capsys, edit, said,
                                                    argv):
    bad = _trace_with(trace_dir, tmp_path, edit)
    argv = [a.format(good=trace_dir) for a in argv]
    assert main_rc([*argv, str(bad)]) == 2
    line = one_error_line(capsys)
    assert line.startswith("mdb: error: ") and f"malformed trace: {said}" in line, line


@pytest.mark.parametrize("edit, said", META_EDITS[:3])
def test_a_stored_capture_meta_of_the_wrong_type_is_one_line(captured, tmp_path, capsys,
                                                             edit, said):
    db = _db_with(captured, tmp_path, edit)
    assert main_rc(["summary", "--run", "r1@2", "--db", str(db)]) == 2
    line = one_error_line(capsys)
    assert line.startswith("mdb: error: --run r1@2: ") and said in line, line


def test_a_loss_that_is_not_a_number_is_shown_as_text():
    """``meta["loss"]`` is the caller's to set (``hooks.capture(meta=...)``): the edit diff's
    loss line shows a list as text (it raised TypeError in ``f"{la:.6g}"``)."""
    from types import SimpleNamespace

    from tui.screens.edit_diff import loss_change_line

    a, b = SimpleNamespace(meta={"loss": [1.5]}), SimpleNamespace(meta={"loss": 2.0})
    assert loss_change_line(a, b) == "loss [1.5] → 2.0"
    a.meta["loss"] = "x\x1b[2J"
    assert loss_change_line(a, b) == "loss x\\x1b[2J → 2.0"
    assert loss_change_line(SimpleNamespace(meta={"loss": 5.5}), b) == "loss 5.5 → 2 (Δ -3.5)"


def test_a_trace_without_its_tensors_file_names_it(trace_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(trace_dir, bad)
    (bad / "tensors.safetensors").unlink()
    assert main_rc(["summary", "--trace", str(bad)]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"mdb: error: --trace {bad}: {bad / 'tensors.safetensors'} is "
                           "missing: ") and "KeyError" not in line, line
