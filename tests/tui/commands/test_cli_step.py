"""``mdb step`` from the command line: bad input is one line and exit code 2 (in-process, the
app never starts), and the real program in a pseudo-terminal steps, opens the router view and
quits with exit code 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.processes import mdb_argv
from tests.processes import one_error_line as _one_error_line
from tests.terminal import spawn_in_pty
from tui import cli
from tui.app import MdbApp


@pytest.fixture
def no_app(monkeypatch):
    """Fail loudly if a bad-input case gets as far as starting the app."""

    def refuse(self, *args, **kwargs):
        raise AssertionError("the app started although the input was bad")

    monkeypatch.setattr(MdbApp, "run", refuse)


USER_BODIES = {
    "returns-module": "def build():\n    return nn.Linear(2, 2)\n",
    "returns-non-module": "def build():\n    return 3, torch.zeros(1)\n",
    "no-func": "x = 1\n",
}


def _user_model(tmp_path: Path, kind: str) -> str:
    """``path/to/usermodel.py:build`` for a user module of the given kind."""
    path = tmp_path / "usermodel.py"
    path.write_text("import torch\nfrom torch import nn\n\n" + USER_BODIES[kind],
                    encoding="utf-8")
    return f"{path}:build"


@pytest.mark.parametrize(
    "make_args, expect",
    [
        (lambda tmp: ["--text", str(tmp / "missing.txt")], "no such file"),
        (lambda tmp: ["--text", str(_write(tmp / "empty.txt", b"  \n"))], "empty"),
        (lambda tmp: ["--text", str(_write(tmp / "latin1.txt", "café".encode("latin-1")))],
         "not UTF-8"),
        (lambda tmp: ["--preset", "tiny", "--seq-len", "129"], "longer than the model allows"),
        (lambda tmp: ["--preset", "no-such-preset"], "no-such-preset"),
        (lambda tmp: ["--model", "no_such_module_xyz:build"], "cannot import"),
        (lambda tmp: ["--model", _user_model(tmp, "returns-module")],
         "must return (model, batch)"),
        (lambda tmp: ["--model", _user_model(tmp, "returns-non-module")], "torch.nn.Module"),
        (lambda tmp: ["--model", _user_model(tmp, "no-func")], "no function build"),
        (lambda tmp: ["--trace", str(tmp / "nothing.mdbtrace")], "no such file"),
        (lambda tmp: ["--trace", str(_write(tmp / "t" / "trace.json", b"{}").parent)],
         "not an mdb trace"),
    ],
    ids=["text-missing", "text-empty", "text-not-utf8", "seq-too-long", "unknown-preset",
         "model-import", "model-returns-module", "model-returns-non-module", "model-no-func",
         "trace-missing", "trace-not-a-trace"],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, no_app, make_args, expect):
    code = cli.main(["step", *make_args(tmp_path)])
    assert code == 2
    assert expect in _one_error_line(capsys)


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, term, no_color",
    [([], "xterm-256color", False), (["--preset", "tiny"], "xterm", True)],
    ids=["default-256", "tiny-16-nocolor"],
)
def test_real_mdb_step_in_a_pty(extra, term, no_color):
    pexpect = pytest.importorskip("pexpect")
    child = spawn_in_pty(mdb_argv() + ["step", *extra], TERM=term,
                         NO_COLOR="1" if no_color else "")
    try:
        child.expect("forward · call 1/")
        child.send("n")
        child.expect("forward · call 2/", timeout=30)
        child.send("N")
        child.expect("model.layers.0", timeout=30)
        child.send("r")
        child.expect("router · layer 0", timeout=30)
        child.send("q")
        child.expect(pexpect.EOF, timeout=60)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


@pytest.mark.slow
@pytest.mark.parametrize("closed", [0, 1])
def test_closed_stdin_or_stdout_is_one_line_and_exit_2(tmp_path, closed):
    """``mdb step <&-`` (or ``>&-``): Python starts with ``sys.stdin`` (``sys.stdout``) None;
    the terminal check once raised AttributeError on it (a traceback, then an abort while the
    model was still being built): one ``mdb: error:`` line and exit 2 instead."""
    import os
    import subprocess

    from tests.processes import mdb_env

    proc = subprocess.run(
        [*mdb_argv(), "step", "--preset", "tiny"], cwd=tmp_path, env=mdb_env(),
        stdout=subprocess.DEVNULL if closed == 0 else None, stderr=subprocess.PIPE,
        preexec_fn=lambda: os.close(closed), timeout=120, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "mdb: error: mdb step needs a terminal (without one, use `mdb summary` for a table, or "
        "`mdb capture --out FILE` to save a trace and open it later with `mdb step --trace "
        "FILE`)"]
