"""Shared pytest fixtures and helpers."""

from __future__ import annotations

import signal
import time
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "samples"

#: A minimal MoE config for training tests that must run thousands of steps quickly.
TINY_TOML = """\
vocab_size = 256
hidden_size = 16
intermediate_size = 32
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
num_local_experts = 2
num_experts_per_tok = 1
max_position_embeddings = 128
"""


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (restored after). Small models are overhead-bound and
    train fastest on one thread, above all on a shared 2-core machine. Test files that want it
    say ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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


@pytest.fixture
def terminal_sigint():
    """This process's SIGINT as Python sets it up in a terminal (``KeyboardInterrupt``) for the
    test, whatever it inherited (ignored under ``nohup … &``); restored after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def pytest_configure(config):
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


async def wait_until(pilot, cond, timeout: float = 60.0) -> None:
    """Let a Textual Pilot run until ``cond()`` is true; AssertionError after ``timeout`` s."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out")
        await pilot.pause(0.05)


def wait_for(cond, timeout: float = 120.0, what: str = "condition"):
    """Poll ``cond()`` until it returns something true (returned) or ``timeout`` seconds pass
    (``AssertionError`` naming ``what``): a known point to wait for instead of a sleep."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
