"""The test scaffold for running ``mdb`` as a user does: in-process (``cli.main``) and as a
child process (``python -m tui.cli``), and for reading its one-line errors.

Every test that starts ``mdb`` in a process of its own goes through :func:`mdb_argv`,
:func:`run_mdb` or :func:`spawn_mdb`, so that the interpreter, ``PYTHONPATH`` and the signal
dispositions (:func:`tests.terminal.terminal_signals`) are the same everywhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.terminal import terminal_signals

REPO = Path(__file__).resolve().parent.parent


def mdb_argv() -> list[str]:
    """The command a user types: the installed ``mdb`` script, else ``python -m tui.cli``."""
    exe = shutil.which("mdb")
    return [exe] if exe else [sys.executable, "-m", "tui.cli"]


def mdb_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository importable (and ``extra`` set)."""
    return dict(os.environ, PYTHONPATH=str(REPO), **extra)


def main_rc(argv: list[str]) -> int:
    """``mdb ARGV`` in-process; argparse's own refusals (``SystemExit``) give their code too."""
    from tui import cli

    try:
        return cli.main(argv)
    except SystemExit as exc:
        return int(exc.code)


def run_mdb(argv: list[str], cwd: Path | str | None = None, timeout: float = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``mdb ARGV`` in its own process, to the end (a hang fails the test at ``timeout``
    instead of blocking the suite); stdin is empty, stdout and stderr are captured as text."""
    return subprocess.run([sys.executable, "-m", "tui.cli", *argv], cwd=cwd,
                          env=env or mdb_env(), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


def spawn_mdb(argv: list[str], cwd: Path | str | None = None, log: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
    """``mdb ARGV`` started in the background with a terminal's signal dispositions (tests
    send it signals). Its stdout and stderr go to ``log`` (one file) when given, else to pipes
    read as text."""
    common = dict(cwd=cwd, env=env or mdb_env(), stdin=subprocess.DEVNULL,
                  preexec_fn=terminal_signals)
    command = [sys.executable, "-m", "tui.cli", *argv]
    if log is None:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, **common)
    with open(log, "w") as f:
        return subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, **common)


def error_line(err: str) -> str:
    """The only line of ``err``: an ``mdb: error:`` line and no traceback (AssertionError
    otherwise)."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("mdb: error: ") and "Traceback" not in err, err
    return lines[0]


def one_error_line(capsys) -> str:
    """The only line an in-process ``mdb`` wrote to stderr, an ``mdb: error:`` line."""
    return error_line(capsys.readouterr().err)


def spawn_logged(argv: list[str], cwd: Path, tag: str) -> tuple[subprocess.Popen, Path]:
    """``mdb ARGV`` in the background in ``cwd`` (``$MDB_DB`` unset, so ``--db`` or
    ``./runs`` decides), its output in ``cwd/TAG.log``: the process and the log's path."""
    env = mdb_env()
    env.pop("MDB_DB", None)
    log = Path(cwd) / f"{tag}.log"
    return spawn_mdb(argv, cwd=cwd, log=log, env=env), log


def run_row(db: Path, name: str):
    """The run ``name`` of the store ``db`` as a reader sees it now; None while the database
    or the run does not exist yet (or cannot be read at this instant)."""
    from hooks.store.store import RunStore

    if not db.exists():
        return None
    try:
        with RunStore(db) as store:
            return store.run(name)
    except Exception:
        return None
