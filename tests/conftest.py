"""Shared pytest fixtures and helpers."""

from __future__ import annotations

import signal
import time
import warnings
from pathlib import Path

import pytest
import torch

from tests.terminal import STOP_SIGNALS, terminal_signals  # noqa: F401  (re-exported)

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "samples"

from tests.models import TINY_TOML  # noqa: E402,F401  (re-exported: many tests import it here)


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _model_key_file(tmp_path_factory, monkeypatch):
    """This test's own key for signing ``--model`` runs (``MDB_KEY_FILE``, inherited by the
    ``mdb`` processes it starts), never the user's ``~/.config/mdb/key``."""
    monkeypatch.setenv("MDB_KEY_FILE", str(tmp_path_factory.mktemp("mdbkey") / "key"))


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (restored after). Small models are overhead-bound and
    train fastest on one thread, above all on a shared 2-core machine. Test files that want it
    say ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def terminal_sigint():
    """This process's SIGINT as Python sets it up in a terminal (``KeyboardInterrupt``) for the
    test, whatever it inherited (ignored under ``nohup … &``); restored after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def pytest_configure(config):
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


#: Seconds between two looks at a condition (:func:`wait_until`, :func:`wait_for`).
POLL_S = 0.02


async def wait_until(pilot, cond, timeout: float = 60.0) -> None:
    """Let a Textual Pilot run until ``cond()`` is true; AssertionError after ``timeout`` s.
    Between two looks the app processes what is pending and runs for :data:`POLL_S` (not
    ``pilot.pause()`` alone: it waits for the process to be idle, up to 1 s a look while a
    trainer thread of the test's process computes)."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out")
        await pilot.pause(POLL_S)


async def drawn(pilot, screen, timeout: float = 60.0) -> None:
    """Wait until the live screen has drawn everything it was told to (no redraw pending):
    a known point after which what it shows is what it has, however loaded the machine."""
    await wait_until(pilot, lambda: not (screen._dirty_text or screen._dirty_charts)
                     and screen._redraw_timer is None, timeout)
    await pilot.pause()


def wait_for(cond, timeout: float = 120.0, what: str = "condition"):
    """Poll ``cond()`` until it returns something true (returned) or ``timeout`` seconds pass
    (``AssertionError`` naming ``what``): a known point to wait for instead of a sleep."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = cond()
        if value:
            return value
        time.sleep(POLL_S)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
