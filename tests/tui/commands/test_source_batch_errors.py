"""``--source-batch MODULE:FUNCTION`` that cannot be imported is named as ``--source-batch`` in
its one error line, not as ``--model`` (issue 32, item 12): the import is the one ``--model``
uses (``tui.commands.workload.import_factory_module``)."""

from __future__ import annotations

from tests.processes import main_rc

EDIT = ["diff", "--preset", "tiny", "--seq-len", "8", "--edit", "patch model.layers.0 from=x"]


def test_a_missing_source_batch_file_is_named_as_source_batch(tmp_path, capsys):
    missing = tmp_path / "nofile.py"
    assert main_rc([*EDIT, "--source-batch", f"{missing}:f"]) == 2
    assert capsys.readouterr().err == (f"mdb: error: --source-batch {missing}:f: no such file "
                                       f"{missing}\n")


def test_a_source_batch_module_that_raises_is_named_as_source_batch(tmp_path, capsys):
    bad = tmp_path / "badmod.py"
    bad.write_text('raise ValueError("boom")\n')
    assert main_rc([*EDIT, "--source-batch", f"{bad}:f"]) == 2
    assert capsys.readouterr().err == (f"mdb: error: --source-batch {bad}:f: cannot import "
                                       f"{bad}: ValueError: boom\n")


def test_model_keeps_its_own_name(tmp_path, capsys):
    bad = tmp_path / "badmod.py"
    bad.write_text('raise ValueError("boom")\n')
    assert main_rc(["summary", "--model", f"{bad}:f"]) == 2
    assert capsys.readouterr().err == (f"mdb: error: --model {bad}:f: cannot import {bad}: "
                                       "ValueError: boom\n")
