"""The test scaffold for terminals: signal dispositions of a foreground command, and ``mdb``
run in a pseudo-terminal (pexpect) as a user runs it in tmux or over SSH."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: The signals that stop a command, with the dispositions a user's shell gives a command it runs
#: in the foreground. ``nohup … &`` (and some CI runners) ignore SIGINT and SIGHUP, and an
#: ignored signal stays ignored in every child, across exec.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def terminal_signals() -> None:
    """``preexec_fn`` of a child process that a test sends signals to: the stop signals at their
    defaults, as in a terminal, whatever this process inherited. A Python child then raises
    ``KeyboardInterrupt`` on SIGINT (Python installs that handler only for a SIGINT that was not
    ignored when it started)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def spawn_in_pty(argv: list[str], cwd: Path | str | None = None, *, rows: int = 24,
                 cols: int = 80, timeout: float = 180, **env: str):
    """``argv`` in a pseudo-terminal of ``rows`` × ``cols`` with ``TERM=xterm`` (``env``
    overrides, e.g. ``TERM="xterm-256color"``; a value of ``""`` removes the variable), the
    repository importable and a terminal's signal dispositions: a ``pexpect.spawn`` reading
    text. Skips the test where pexpect is missing."""
    pexpect = pytest.importorskip("pexpect")
    environ = dict(os.environ, TERM="xterm", PYTHONPATH=str(REPO))
    for key, value in env.items():
        if value == "":
            environ.pop(key, None)
        else:
            environ[key] = value
    return pexpect.spawn(argv[0], argv[1:], env=environ, cwd=str(cwd or REPO),
                         dimensions=(rows, cols), encoding="utf-8", timeout=timeout,
                         preexec_fn=terminal_signals)
