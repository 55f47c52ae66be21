"""``kill -TERM`` of an open mdb screen (tui/driver.py): the app closes as on ``q``, the terminal
is restored (main screen, cursor shown, mouse reporting off, echo on) and the process exits with
status 143 (128 + SIGTERM), in a real pseudo-terminal, as a user's ``kill`` in another window.
Also: SIGTERM while ``mdb step`` still captures, and the SIGTERM disposition put back exactly
once an app has closed."""

from __future__ import annotations

import os
import re
import signal
import sys
import termios
import time

import pytest

from tests.conftest import wait_for
from tests.processes import mdb_argv
from tests.terminal import REPO, spawn_in_pty

#: What Textual's LinuxDriver.stop_application_mode writes to give the terminal back: leave the
#: alternate screen, show the cursor, and turn off each mouse-reporting mode it turned on.
RESTORE = ("\x1b[?1049l", "\x1b[?25h", "\x1b[?1000l", "\x1b[?1003l", "\x1b[?1006l")

SLOW_MODEL = '''\
import pathlib
import time

import torch
from torch import nn


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.out = nn.Linear(16, 32)

    def forward(self, ids):
        pathlib.Path(__file__).with_name("forward-started").touch()
        time.sleep(120)  # still capturing when the test sends SIGTERM
        return self.out(self.emb(ids))


def build():
    torch.manual_seed(0)
    return Slow(), torch.randint(0, 32, (2, 8))
'''


def _terminate_and_wait(child, timeout: float = 10.0) -> tuple[str, float]:
    """SIGTERM to ``child``; returns (what it wrote after the last match, seconds to its end)."""
    pexpect = pytest.importorskip("pexpect")
    started = time.monotonic()
    os.kill(child.pid, signal.SIGTERM)
    child.expect(pexpect.EOF, timeout=timeout)
    return child.before, time.monotonic() - started


def _printed_after_the_screen(text: str) -> list[str]:
    """The lines of text written after the alternate screen was left, escape sequences
    removed."""
    rest = re.sub(r"\x1b\[[0-9;?<>=$]*[A-Za-z]", "", text.rsplit("\x1b[?1049l", 1)[1])
    return [line for line in rest.splitlines() if line.strip()]


def _echo_on(child) -> bool:
    """Whether the pseudo-terminal echoes and is in canonical mode again (Linux: the master's
    attributes are the terminal's)."""
    lflag = termios.tcgetattr(child.child_fd)[3]
    return bool(lflag & termios.ECHO) and bool(lflag & termios.ICANON)


@pytest.mark.slow
def test_sigterm_closes_mdb_step_and_restores_the_terminal():
    child = spawn_in_pty([*mdb_argv(), "step", "--preset", "tiny"], OMP_NUM_THREADS="1")
    try:
        child.expect("call 1/", timeout=120)  # the step view is on screen
        wait_for(lambda: not _echo_on(child), 60, "the app to hold the terminal")
        after, took = _terminate_and_wait(child)
        echo = _echo_on(child)
    finally:
        child.close()
    assert child.signalstatus is None, "killed by the signal: the terminal was left as it was"
    assert child.exitstatus == 128 + signal.SIGTERM
    assert took < 8.0
    for sequence in RESTORE:
        assert sequence in after, repr(sequence)
    assert echo
    assert len(_printed_after_the_screen(after)) <= 1, after


@pytest.mark.slow
def test_sigterm_while_mdb_step_captures_exits_without_waiting_for_the_forward(tmp_path):
    (tmp_path / "slow_model.py").write_text(SLOW_MODEL, encoding="utf-8")
    argv = [*mdb_argv(), "step", "--model", f"{tmp_path / 'slow_model.py'}:build"]
    child = spawn_in_pty(argv, OMP_NUM_THREADS="1")
    try:
        child.expect("capturing one forward", timeout=120)  # the loading screen
        wait_for(lambda: (tmp_path / "forward-started").exists(), 120, "the forward to start")
        after, took = _terminate_and_wait(child)  # the forward sleeps 120 s: no wait for it
        echo = _echo_on(child)
    finally:
        child.close()
    assert child.signalstatus is None
    assert child.exitstatus == 128 + signal.SIGTERM
    assert took < 8.0
    for sequence in RESTORE:
        assert sequence in after, repr(sequence)
    assert echo
    assert len(_printed_after_the_screen(after)) <= 1, after


DISPOSITION_SCRIPT = '''\
import os
import signal
import sys

from textual.app import App

from tui.driver import TerminalDriver, TerminalOutput

seen = []


def handler(signum, frame):
    seen.append(signum)


class Quick(TerminalOutput, App):
    def on_mount(self):
        self.set_timer(0.2, self.exit)


assert Quick().get_driver_class() is TerminalDriver
for before in (signal.SIG_DFL, handler, signal.SIG_IGN):
    signal.signal(signal.SIGTERM, before)
    Quick().run()
    after = signal.getsignal(signal.SIGTERM)
    print("RESULT:same" if after is before or after == before else f"RESULT:changed {after!r}")


class SelfTerm(TerminalOutput, App):
    def on_mount(self):
        self.set_timer(0.2, lambda: os.kill(os.getpid(), signal.SIGTERM))


# a command's own SIGTERM handler is called, and the command goes on after the app
signal.signal(signal.SIGTERM, handler)
seen.clear()
SelfTerm().run()
print("RESULT:handled" if seen == [signal.SIGTERM] else f"RESULT:unhandled {seen}")
sys.stdout.flush()
'''


def test_the_sigterm_disposition_is_put_back_when_the_app_closes(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    script = tmp_path / "disposition.py"
    script.write_text(DISPOSITION_SCRIPT, encoding="utf-8")
    child = spawn_in_pty([sys.executable, str(script)], cwd=REPO, timeout=60)
    try:
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
    results = re.findall(r"RESULT:(\w+)", child.before)
    assert results == ["same", "same", "same", "handled"], child.before
