"""``mdb COMMAND ...`` builds that command's parser alone (issue 25: the start-up of ``mdb step``
imports no other command's module); ``mdb --help`` still lists every command."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO
from tui.cli import COMMANDS, build_parser

_PROBE = """
import sys
from tui.cli import main
try:
    code = main(["step", "--seq-len", "abc"])
except SystemExit as exc:  # argparse's error exit
    code = exc.code
loaded = sorted(m for m in sys.modules if m.startswith("tui.commands.") and m.count(".") == 2)
print(code, " ".join(loaded))
"""


def test_one_command_imports_only_its_module():
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    code, *loaded = out.stdout.split()
    assert code == "2"  # the bad --seq-len: one line, exit 2, as with the full parser
    assert "mdb step: error: argument --seq-len: 'abc' is not an integer" in out.stderr
    others = {f"tui.commands.{m}" for name, m in COMMANDS.items() if name != "step"}
    assert "tui.commands.step" in loaded and not others & set(loaded)


def test_full_parser_lists_every_command():
    import argparse

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == set(COMMANDS)
    (one,) = [a for a in build_parser("runs")._actions
              if isinstance(a, argparse._SubParsersAction)]
    assert set(one.choices) == {"runs"}
