"""The packages of ``hooks`` (issue 33): none is named after a public name of ``hooks``
(the module of the function ``hooks.capture`` once hid it, and needed a module-class swap),
each says what it is, and the old flat paths are gone rather than kept as re-exports."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

import hooks


def test_no_module_or_package_of_hooks_is_named_after_a_public_name():
    names = {m.name for m in pkgutil.iter_modules(hooks.__path__)}
    assert {"engine", "recorder", "store", "trace"} <= names
    assert names.isdisjoint(hooks.__all__), sorted(names & set(hooks.__all__))
    assert not hasattr(hooks, "_Facade") and type(hooks) is type(pkgutil)


def test_every_package_says_what_it_is():
    for info in pkgutil.walk_packages(hooks.__path__, "hooks."):
        if info.ispkg:
            module = importlib.import_module(info.name)
            assert len((module.__doc__ or "").split()) >= 10, f"{info.name} says nothing"


def test_the_trace_package_exports_the_trace():
    import hooks.trace

    assert hooks.trace.Trace is hooks.Trace
    assert hooks.trace.TraceFormatError is hooks.TraceFormatError


@pytest.mark.parametrize("old", ["hooks.runs", "hooks.checks", "hooks.capture_params",
                                 "hooks.dtensor_stats", "hooks.edits_run"])
def test_the_old_paths_are_gone(old):
    """No module, package or re-export left at the old path (looked up in the folder of this
    ``hooks``: an editable install of another checkout could still map the name)."""
    where = Path(hooks.__path__[0], *old.split(".")[1:])
    assert not where.with_suffix(".py").exists() and not where.exists()
    assert old.split(".")[1] not in vars(hooks)
