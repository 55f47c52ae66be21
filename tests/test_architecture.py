"""The core packages stay free of the UI: importing them loads no textual, rich or tui."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("package", ["minillm", "hooks"])
def test_core_does_not_import_ui(package):
    code = (
        "import sys, pkgutil, importlib\n"
        f"import {package}\n"
        f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('textual', 'rich', 'tui'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{package} pulled in: {out.stdout.strip()}"


def test_cli_help_is_fast_and_imports_no_torch():
    code = (
        "import sys, contextlib, io\n"
        "from tui.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_import_contracts_hold():
    """The layers of pyproject.toml's [tool.importlinter]: minillm and hooks free of the UI,
    the packages by concern on the layers below them, the facade ``hooks`` on top of all
    (hooks.recorder imported by it, the trainer, the integrations and the UI), minillm imported by
    hooks.train alone, no cycles between sibling modules."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = (
        "import sys\n"
        "from importlinter.cli import lint_imports\n"
        f"sys.exit(lint_imports(config_filename={str(root / 'pyproject.toml')!r}, "
        "no_cache=True, no_logo=True))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
