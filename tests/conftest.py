"""Shared pytest fixtures and helpers."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "samples"


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
