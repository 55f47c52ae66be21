"""``import hooks`` stays cheap (issue 25): no torch until a name that needs it is used, every
public name still there, ``hooks.capture`` the function even once its module is imported."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import hooks
assert "torch" not in sys.modules, "import hooks imported torch"
run, Run = hooks.run, hooks.Run
assert "torch" not in sys.modules, "hooks.run imported torch"
assert callable(run) and Run.__name__ == "Run"
import hooks.engine.capture
assert callable(hooks.capture) and hooks.capture.__name__ == "capture"
import torch
for name in hooks.__all__:
    assert getattr(hooks, name) is not None, name
from hooks.engine.capture import Capture
assert hooks.Capture is Capture
assert sorted(set(hooks.__all__) - set(dir(hooks))) == []
ns = {}
exec("from hooks import *", ns)
assert set(hooks.__all__) <= set(ns), set(hooks.__all__) - set(ns)
print("ok", len(hooks.__all__))
"""


def test_import_hooks_loads_no_torch_and_keeps_every_name():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok ")


def test_hooks_names_are_the_modules_own():
    import hooks
    from hooks.batch import Batch
    from hooks.recorder.run import run
    from hooks.tensors.stats import summarize_tensor
    from hooks.trace.trace import Trace

    assert hooks.Batch is Batch and hooks.Trace is Trace and hooks.run is run
    assert hooks.summarize_tensor is summarize_tensor
