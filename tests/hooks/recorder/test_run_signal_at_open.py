"""A signal that comes while ``hooks.run`` opens the run, at the precise moment the run's row is
committed and nothing that records it has started yet (the moment a ``torchrun`` job stopped
while its ranks start hits rank 0): the run still ends ``interrupted`` with the signal's name,
and the process then does what the signal asks (terminates by it, ``KeyboardInterrupt``, the
user's own handler). Real processes, real signals: the child sends the signal to itself from
inside ``RunStore.create_run``, right after the row is written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hooks.store.store import RunStore
from tests.conftest import REPO, terminal_signals

ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

_CHILD = """
import os, signal, sys
import hooks
from hooks.store.store import RunStore

name, mode, db = sys.argv[1], sys.argv[2], sys.argv[3]
sig = getattr(signal, name)
calls = []
def mine(signum, frame):
    calls.append(signum)
if mode.startswith("user-handler"):
    signal.signal(sig, mine)
created = RunStore.create_run
def create_run(self, *args, **kwargs):
    writer = created(self, *args, **kwargs)  # the row is committed: a reader sees the run
    os.kill(os.getpid(), sig)
    if mode.endswith("open-fails"):
        raise OSError("the store went away")
    return writer
RunStore.create_run = create_run
try:
    with hooks.run("sig", db=db, total_steps=5) as run:
        print("body ran", flush=True)
        run.log(loss=1.0)
except OSError as exc:
    print("open failed:", exc, flush=True)
print("mine called", len(calls), "restored", signal.getsignal(sig) is mine, flush=True)
"""


def _child(tmp_path: Path, sig: str, mode: str) -> tuple[int, str, str, Path]:
    db = tmp_path / "m.sqlite"
    proc = subprocess.run([sys.executable, "-c", _CHILD, sig, mode, str(db)], env=ENV,
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=terminal_signals)
    return proc.returncode, proc.stdout, proc.stderr, db


def _run(db: Path):
    with RunStore(db) as store:
        return store.run("sig")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_terminating_signal_while_the_run_opens_saves_it_then_terminates(tmp_path, sig):
    """Before the fix the process died of the signal's default action before the handlers
    were installed, and the run stayed ``running`` for good."""
    rc, out, err, db = _child(tmp_path, sig, "plain")
    assert rc == -getattr(signal, sig), (rc, out, err)  # terminated by the signal, as before
    info = _run(db)
    assert (info.status, info.reason, info.last_step) == ("interrupted", sig, 0), err
    assert "body ran" not in out  # the loop never started


def test_sigint_while_the_run_opens_marks_it_interrupted(tmp_path):
    """SIGINT raises ``KeyboardInterrupt`` (Python's handler), once the run is open."""
    rc, out, err, db = _child(tmp_path, "SIGINT", "plain")
    assert rc in (-signal.SIGINT, 1, 130) and "KeyboardInterrupt" in err, (rc, out, err)
    info = _run(db)
    assert (info.status, info.reason) == ("interrupted", "SIGINT"), err
    assert "body ran" not in out


def test_the_users_own_handler_gets_a_signal_that_came_while_the_run_opened(tmp_path):
    rc, out, err, db = _child(tmp_path, "SIGTERM", "user-handler")
    assert rc == 0, err
    assert "body ran" in out and "mine called 1 restored True" in out, out
    info = _run(db)
    assert (info.status, info.reason) == ("interrupted", "SIGTERM"), err


@pytest.mark.parametrize("mode", ["open-fails", "user-handler-open-fails"])
def test_a_signal_held_while_opening_goes_to_the_old_handler_when_opening_fails(tmp_path,
                                                                               mode):
    """Opening raised after the signal came: the handlers that were there before are back,
    and the signal is not lost (the default action terminates; the user's handler is called
    once and the error propagates)."""
    rc, out, err, _ = _child(tmp_path, "SIGTERM", mode)
    if mode == "open-fails":
        assert rc == -signal.SIGTERM, (rc, out, err)
        assert "open failed" not in out
    else:
        assert rc == 0, err
        assert "open failed: the store went away" in out, out
        assert "mine called 1 restored True" in out, out
