"""The trainer integrations import their library only when ``MdbCallback`` is first used, and
say in one line what to install when it is missing."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module,library,says", [
    ("hooks.integrations.transformers", "transformers", "pip install transformers accelerate"),
    ("hooks.integrations.lightning", "lightning", "pip install lightning"),
])
def test_a_missing_library_is_one_import_error_line(monkeypatch, module, library, says):
    mod = importlib.import_module(module)
    monkeypatch.setitem(sys.modules, library, None)  # as if not installed
    monkeypatch.setitem(sys.modules, f"{library}.pytorch", None)
    monkeypatch.delitem(vars(mod), "MdbCallback", raising=False)
    with pytest.raises(ImportError) as info:
        mod.MdbCallback  # noqa: B018
    assert says in str(info.value) and "\n" not in str(info.value)


def test_importing_the_integrations_loads_neither_library():
    code = ("import sys, hooks.integrations.transformers, hooks.integrations.lightning\n"
            "print(sorted(n for n in ('transformers', 'lightning', 'rich') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
