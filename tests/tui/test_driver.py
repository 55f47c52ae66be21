"""Where mdb's screens draw (tui/driver.py): with stderr redirected to a file (``mdb step
2>FILE``) the screen appears on the terminal, and FILE gets only what was written to stderr,
including what the user's forward writes there while the screen is open."""

from __future__ import annotations

import ast
import os
import shlex

import pytest

from tests.processes import mdb_argv
from tests.terminal import REPO, spawn_in_pty

LOUD_MODEL = '''\
import sys
import warnings

import torch
from torch import nn


class Loud(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.out = nn.Linear(16, 32)

    def forward(self, ids):
        print("marker-1 written to stderr by the forward", file=sys.stderr)
        warnings.warn("marker-2 warned by the forward")
        return self.out(self.emb(ids))


def build():
    torch.manual_seed(0)
    return Loud(), torch.randint(0, 32, (2, 8))
'''


@pytest.mark.slow
def test_mdb_step_with_stderr_in_a_file_draws_on_the_terminal(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    (tmp_path / "loud_model.py").write_text(LOUD_MODEL, encoding="utf-8")
    err = tmp_path / "err.txt"
    argv = [*mdb_argv(), "step", "--model", f"{tmp_path / 'loud_model.py'}:build"]
    # as a shell runs `mdb step ... 2>err.txt`: stdin and stdout the terminal, stderr the file
    child = spawn_in_pty(["/bin/sh", "-c", f"exec {shlex.join(argv)} 2>{shlex.quote(str(err))}"])
    try:
        child.expect("forward · call 1/3", timeout=120)  # the step view, on the terminal
        child.send("q")
        child.expect(pexpect.EOF, timeout=60)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
    text = err.read_text(encoding="utf-8", errors="replace")
    assert "\x1b" not in text  # nothing of the screen
    # what the forward wrote while the screen was open (the loading screen) is kept
    assert "marker-1 written to stderr by the forward\n" in text
    assert "UserWarning: marker-2 warned by the forward" in text


def _app_classes() -> list[tuple[str, ast.ClassDef]]:
    """Every class in tui/ whose bases name Textual's ``App`` (``App`` or ``App[...]``)."""
    found = []
    for path in sorted((REPO / "tui").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = base.value if isinstance(base, ast.Subscript) else base
                if isinstance(name, ast.Name) and name.id == "App":
                    found.append((str(path.relative_to(REPO)), node))
    return found


def test_every_mdb_app_draws_through_the_terminal_driver():
    classes = _app_classes()
    # MdbApp, DiffApp, LiveApp, CompareApp, EditDiffApp at least (the others derive from them)
    assert len(classes) >= 5
    missing = [f"{path}: {node.name}" for path, node in classes
               if not any(isinstance(b, ast.Name) and b.id == "TerminalOutput"
                          for b in node.bases)]
    assert not missing


def test_the_driver_draws_on_stdout_when_stderr_is_a_file(tmp_path, monkeypatch):
    from textual.drivers.linux_driver import LinuxDriver

    from tui.app import DiffApp, MdbApp
    from tui.driver import TerminalDriver, drawing_stream
    from tui.live_app import LiveApp
    from tui.screens.compare import CompareApp

    for cls in (MdbApp, DiffApp, LiveApp, CompareApp):
        assert cls.get_driver_class(object.__new__(cls)) is TerminalDriver
    assert issubclass(TerminalDriver, LinuxDriver)
    main, sub = os.openpty()
    try:
        with open(os.dup(sub), "w") as tty, open(tmp_path / "err.txt", "w") as file:
            monkeypatch.setattr("sys.__stdout__", tty)
            monkeypatch.setattr("sys.__stderr__", file)
            assert drawing_stream() is tty
            monkeypatch.setattr("sys.__stderr__", tty)
            monkeypatch.setattr("sys.__stdout__", file)
            assert drawing_stream() is tty  # Textual's own choice: stderr, a terminal
            monkeypatch.setattr("sys.__stderr__", None)  # 2>&-
            monkeypatch.setattr("sys.__stdout__", tty)
            assert drawing_stream() is tty
    finally:
        os.close(main)
        os.close(sub)


def test_textual_driver_env_still_wins(monkeypatch):
    from textual import constants

    from tui.app import MdbApp
    from tui.driver import TerminalDriver

    monkeypatch.setattr(constants, "DRIVER", "textual.drivers.headless_driver:HeadlessDriver")
    assert MdbApp.get_driver_class(object.__new__(MdbApp)) is not TerminalDriver

