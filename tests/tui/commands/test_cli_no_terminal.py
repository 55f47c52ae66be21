"""The Textual commands refuse to start without a terminal: one line, exit 2 (they used to
draw into the pipe and wait for keys forever)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.parametrize(
    "argv, says",
    [
        (["step", "--preset", "tiny", "--seq-len", "8"], "mdb step needs a terminal"),
        (
            ["doctor", "--tui", "--preset", "tiny", "--only", "8"],
            "mdb doctor --tui needs a terminal",
        ),
    ],
)
def test_no_terminal_is_one_line_and_exit_2(argv, says):
    out = subprocess.run(
        [sys.executable, "-m", "tui.cli", *argv],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mdb: error: {says}"), out.stderr
    assert out.stdout == ""
