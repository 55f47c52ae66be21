"""Issue 19's inputs that crashed, hung or misled the CLI: each is one ``mdb: error:`` line on
stderr and a non-zero exit, before anything is created. ``--threads`` beyond the machine's
CPUs (10,000 segfaulted), a rope_scaling factor of NaN or 1e308, file names too long for the
file system, a ``--db`` that is a symbolic-link loop, a factory's model on the meta device, a
trace.json that is ``/dev/zero`` or a FIFO, a factory that writes to file descriptor 1 under
``doctor --json``, a factory that exits, a NaN in a headless run, ``diff --limit -5`` and
error lines that repeated a 10 MB value.

What could hang or kill the test process (a FIFO, ``/dev/zero``, ``os._exit``, a segfault)
runs ``mdb`` in a subprocess with a timeout."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_TOML
from tests.processes import REPO, error_line
from tests.processes import main_rc as _main
from tests.processes import run_mdb as _mdb
from tests.terminal import terminal_signals
from tui import cli
from tui.errors import MAX_QUOTED, clip

CPUS = os.cpu_count() or 1
#: A file name longer than any file system's 255-byte limit on one name.
LONG = "a" * 300

TINY = TINY_TOML  # the tiny MoE config of the training tests


def _one_line(capsys) -> str:
    """The only line on stderr, an ``mdb: error:`` line (nothing on stdout)."""
    out, err = capsys.readouterr()
    assert out == ""
    return error_line(err)


def _error_line(proc: subprocess.CompletedProcess) -> str:
    return error_line(proc.stderr)


@pytest.fixture
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    """A real trace of the tiny preset, written by ``mdb capture``."""
    out = tmp_path_factory.mktemp("traces") / "good.mdbtrace"
    with contextlib.redirect_stdout(io.StringIO()):  # not into the first test's capsys
        assert cli.main(["capture", "--out", str(out), "--preset", "tiny", "--seq-len", "8",
                         "--batch-size", "1"]) == 0
    return out


# ------------------------------------------------------------------ 5: --threads


@pytest.mark.parametrize("command", ["summary", "capture", "doctor", "overfit", "step"])
def test_more_threads_than_cpus_is_refused_before_anything_is_created(command, tmp_path,
                                                                      capsys):
    out, db = tmp_path / "t.mdbtrace", tmp_path / "runs.sqlite"
    argv = [command, "--preset", "tiny", "--seq-len", "8", "--threads", str(CPUS + 1)]
    if command == "capture":
        argv += ["--out", str(out)]
    if command == "overfit":
        argv += ["--headless", "--steps", "1", "--db", str(db)]
    assert _main(argv) == 2
    assert _one_line(capsys) == (f"mdb: error: --threads {CPUS + 1}: more than this machine's "
                                 f"{CPUS} CPUs; give at most {CPUS}")
    assert not out.exists() and not db.exists()  # overfit made no run to leave "gone"


def test_threads_10000_is_one_line_not_a_segfault(tmp_path):
    proc = _mdb(["summary", "--preset", "tiny", "--seq-len", "8", "--threads", "10000"],
                tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _error_line(proc).startswith("mdb: error: --threads 10000: more than this machine")
    assert proc.stdout == ""


def test_as_many_threads_as_cpus_are_accepted(capsys):
    assert _main(["summary", "--preset", "tiny", "--seq-len", "8", "--batch-size", "1",
                  "--threads", str(CPUS)]) == 0
    assert "parameters:" in capsys.readouterr().out


def test_negative_threads_are_refused_by_the_parser(capsys):
    assert _main(["summary", "--preset", "tiny", "--threads", "-1"]) == 2
    assert "argument --threads: must be 0 or a positive integer" in capsys.readouterr().err


# ------------------------------------------------------------------ 6: rope_scaling factor


@pytest.mark.parametrize("kind", ["linear", "dynamic"])
@pytest.mark.parametrize("factor, says", [
    ("nan", "rope_scaling.factor must be a finite number >= 1, got nan"),
    ("inf", "rope_scaling.factor must be a finite number >= 1, got inf"),
    ("1e308", "rope_scaling.factor (1e+308) must be at most max_position_embeddings (128): "
              "the original context it stretches, max_position_embeddings / factor, keeps at "
              "least one position"),
])
def test_a_rope_factor_of_nan_or_1e308_is_one_line(kind, factor, says, tiny, capsys):
    tiny.write_text(TINY + f'[rope_scaling]\nrope_type = "{kind}"\nfactor = {factor}\n')
    assert _main(["summary", "--config", str(tiny), "--seq-len", "8"]) == 2
    assert _one_line(capsys) == f"mdb: error: --config {tiny}: {says}"


def test_rope_factor_bounds_and_original_length():
    from minillm import MiniLLM, MiniLLMConfig

    base = dict(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, num_local_experts=0, max_position_embeddings=16)
    # the largest factor leaves an original context of one position and computes
    cfg = MiniLLMConfig(**base, rope_scaling={"rope_type": "dynamic", "factor": 16})
    assert cfg.original_max_position_embeddings == 1
    ids = torch.randint(0, 32, (1, 16))
    assert torch.isfinite(MiniLLM(cfg)(ids).logits).all()
    for bad, says in [
        ({"factor": 16.5}, "must be at most max_position_embeddings (16)"),
        ({"factor": True}, "must be a finite number >= 1, got True"),
        ({"factor": 2, "original_max_position_embeddings": 0},
         "original_max_position_embeddings must be a positive integer, got 0"),
    ]:
        with pytest.raises(ValueError) as info:
            MiniLLMConfig(**base, rope_scaling={"rope_type": "linear", **bad})
        assert says in str(info.value)
    # head_dim 2: dynamic NTK's exponent head_dim / (head_dim - 2) divides by zero
    with pytest.raises(ValueError) as info:
        MiniLLMConfig(**{**base, "num_attention_heads": 8, "num_key_value_heads": 1},
                      rope_scaling={"rope_type": "dynamic", "factor": 2})
    assert "head_dim" in str(info.value) and "at least 4" in str(info.value)


# ------------------------------------------------------------------ 7, 8: unusable paths


@pytest.mark.parametrize("argv", [
    ["runs", "--db", "{long}.sqlite"],
    ["overfit", "--headless", "--steps", "1", "--db", "{long}.sqlite"],
    ["summary", "--config", "{long}.toml"],
    ["summary", "--text", "{long}.txt"],
    ["summary", "--trace", "{long}"],
    ["capture", "--out", "{long}", "--preset", "tiny"],
    ["diff", "{long}", "{long}"],
])
def test_a_file_name_too_long_is_one_line(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [a.format(long=LONG) for a in argv]
    assert _main(argv) == 2
    line = _one_line(capsys)
    assert "file name too long (30" in line and "about 255 per part" in line
    assert len(line) < 2 * MAX_QUOTED + 200  # the name is cut, not repeated whole
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", [
    ["runs", "--db", "{loop}"],
    ["overfit", "--headless", "--steps", "1", "--preset", "tiny", "--db", "{loop}"],
    ["watch", "--db", "{loop}"],
    ["export", "r", "--db", "{loop}"],
    ["summary", "--run", "r", "--db", "{loop}"],
    ["diff", "{loop}", "{loop}"],
])
def test_a_db_that_is_a_symlink_loop_is_one_line(argv, tmp_path, capsys):
    loop = tmp_path / "loop.sqlite"
    (tmp_path / "other").symlink_to(loop)
    loop.symlink_to(tmp_path / "other")
    assert _main([a.format(loop=loop) for a in argv]) == 2
    line = _one_line(capsys)
    assert line.endswith(f"{loop}: a loop of symbolic links (a link that leads back to itself); "
                         "give a real file")
    assert sorted(os.listdir(tmp_path)) == ["loop.sqlite", "other"]


# ------------------------------------------------------------------ 9: meta device

META_FACTORY = '''
import torch


def build():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
    return model, torch.randint(0, 50, (2, 8))
'''


@pytest.mark.parametrize("command", ["summary", "doctor", "capture"])
def test_a_model_on_the_meta_device_says_how_to_materialise_it(command, tmp_path, capsys):
    factory = tmp_path / "meta_model.py"
    factory.write_text(META_FACTORY)
    out = tmp_path / "t.mdbtrace"
    argv = [command, "--model", f"{factory}:build"] + (["--out", str(out)]
                                                      if command == "capture" else [])
    assert _main(argv) == 2
    assert _one_line(capsys) == (
        f"mdb: error: --model {factory}:build: build() returned a model with no data: 0.weight "
        "(and 2 more) is on the meta device; materialise it before returning it: "
        "model.to_empty(device='cpu'), then initialise its weights (e.g. model.apply(init_fn)) "
        "or load them (model.load_state_dict(...))")
    assert not out.exists()


def test_hooks_capture_refuses_a_meta_model_on_entry():
    import hooks

    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError) as info, hooks.capture(model):
        pass
    assert str(info.value) == ("the model has no data: weight is on the meta device; "
                               "materialise it first: model.to_empty(device='cpu'), then "
                               "initialise or load its weights")
    model.to_empty(device="cpu")  # materialised, it is captured
    torch.nn.init.normal_(model.weight)
    with hooks.capture(model) as trace:
        model(torch.ones(1, 4)).sum().backward()
    assert [r.module for r in trace.forward] == [""]


# ------------------------------------------------------------------ 10, 11: trace files


def _broken_trace(trace_dir: Path, tmp_path: Path, what: str, kind: str) -> Path:
    """A copy of ``trace_dir`` whose ``what`` file is ``/dev/zero``, a FIFO or a sparse
    600 MB file."""
    bad = tmp_path / f"{kind}.mdbtrace"
    bad.mkdir()
    for f in trace_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    target = bad / what
    target.unlink()
    if kind == "devzero":
        target.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        with open(target, "wb") as f:
            f.truncate(600 << 20)
    return bad


@pytest.mark.parametrize("what, kind", [
    ("trace.json", "devzero"),
    ("trace.json", "fifo"),
    ("tensors.safetensors", "fifo"),
])
@pytest.mark.parametrize("command", ["summary", "diff"])
def test_a_trace_file_that_never_ends_is_refused_at_once(command, what, kind, trace_dir,
                                                         tmp_path):
    bad = _broken_trace(trace_dir, tmp_path, what, kind)
    argv = (["summary", "--trace", str(bad)] if command == "summary"
            else ["diff", str(trace_dir), str(bad)])
    proc = _mdb(argv, tmp_path, timeout=30)  # before: blocked forever, or MemoryError in 20 s
    assert proc.returncode == 2, proc.stderr[-2000:]
    where = "--trace " if command == "summary" else ""
    assert _error_line(proc) == (
        f"mdb: error: {where}{bad}: {bad / what} is not a regular file (a FIFO, socket or "
        "device); a trace is a directory of files written by mdb capture")
    assert proc.stdout == ""


def test_a_trace_json_beyond_the_cap_is_refused_unread(trace_dir, tmp_path, capsys):
    from hooks.trace.trace import MAX_JSON_BYTES

    bad = _broken_trace(trace_dir, tmp_path, "trace.json", "sparse")
    assert _main(["summary", "--trace", str(bad)]) == 2
    assert _one_line(capsys) == (
        f"mdb: error: --trace {bad}: {bad / 'trace.json'} has {600 << 20:,} bytes, more than "
        f"a trace holds (at most {MAX_JSON_BYTES:,})")


def test_a_good_trace_still_loads(trace_dir, capsys):
    assert _main(["diff", str(trace_dir), str(trace_dir / "trace.json"), "--table"]) == 0
    assert "no differences" in capsys.readouterr().out


# ------------------------------------------------------------------ 12: doctor --json, fd 1

FD1_FACTORY = '''
import os

import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.head = torch.nn.Linear(16, 50)

    def forward(self, ids):
        os.write(1, b"forward wrote to fd 1\\n")
        return self.head(self.emb(ids))


def build():
    os.write(1, b"factory wrote to fd 1\\n")
    print("factory printed")
    return Net(), torch.randint(0, 50, (2, 8))
'''


def test_doctor_json_is_pure_json_when_user_code_writes_to_fd_1(tmp_path):
    factory = tmp_path / "fd1_model.py"
    factory.write_text(FD1_FACTORY)
    proc = _mdb(["doctor", "--json", "--model", f"{factory}:build"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)  # the whole of stdout is one JSON document
    assert doc["model"].startswith("Net from fd1_model.py:build")
    from hooks.doctor.model import CHECKS

    assert doc["summary"]["checks"] == len(doc["results"]) == len(CHECKS)
    assert "factory wrote to fd 1" in proc.stderr and "factory printed" in proc.stderr
    assert "forward wrote to fd 1" in proc.stderr


# ------------------------------------------------------------------ 13: a factory that exits

EXIT_FACTORY = '''
import os
import sys

import torch


def sys_exit():
    sys.exit(7)  # MARK: sys


def os_exit():
    os._exit(9)  # MARK: os


def exits_quietly():
    sys.exit()


def forks():
    pid = os.fork()
    if pid == 0:
        os._exit(3)  # the child exits as asked
    _, status = os.waitpid(pid, 0)
    print("child exit code", os.waitstatus_to_exitcode(status), file=sys.stderr)
    return torch.nn.Linear(4, 4), torch.randn(2, 4)
'''


@pytest.fixture
def exit_factory(tmp_path) -> Path:
    path = tmp_path / "exits.py"
    path.write_text(EXIT_FACTORY)
    return path


def _mark(path: Path, mark: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if mark in line)


@pytest.mark.parametrize("func, call", [("sys_exit", "sys.exit(7)"),
                                        ("exits_quietly", "sys.exit()")])
def test_a_factory_that_calls_sys_exit_is_said(func, call, exit_factory, capsys):
    assert _main(["summary", "--model", f"{exit_factory}:{func}"]) == 1
    line = _one_line(capsys)
    assert line.startswith(f"mdb: error: --model {exit_factory}:{func}: {func}() called {call}")
    assert line.endswith("instead of returning (model, batch)")
    if func == "sys_exit":
        assert f" at exits.py:{_mark(exit_factory, 'MARK: sys')} " in line


def test_a_factory_that_calls_os_exit_is_said(exit_factory):
    proc = _mdb(["summary", "--model", f"{exit_factory}:os_exit"], exit_factory.parent)
    assert proc.returncode == 1, proc.stderr[-2000:]  # before: 9, and not a word
    assert _error_line(proc) == (
        f"mdb: error: --model {exit_factory}:os_exit: os_exit() called os._exit(9) at "
        f"exits.py:{_mark(exit_factory, 'MARK: os')} instead of returning (model, batch)")


def test_os_exit_in_a_forked_child_still_exits_the_child(exit_factory, capfd):
    assert _main(["summary", "--model", f"{exit_factory}:forks"]) == 0
    out, err = capfd.readouterr()
    assert "child exit code 3" in err and "parameters: 20" in out


def test_a_module_that_exits_on_import_is_said(tmp_path, capsys):
    module = tmp_path / "exits_on_import.py"
    module.write_text("import sys\nsys.exit('no GPU here')\n")
    assert _main(["summary", "--model", f"{module}:build"]) == 1
    assert _one_line(capsys) == (
        f"mdb: error: --model {module}:build: importing {module} called sys.exit('no GPU "
        "here') at exits_on_import.py:2 instead of defining build")


# ------------------------------------------------------------------ 14: NaN, headless


def test_a_nan_in_a_headless_run_is_an_error_line_on_stderr(tiny, tmp_path, capsys):
    db = tmp_path / "runs.sqlite"
    assert _main(["overfit", "--headless", "--config", str(tiny), "--steps", "10", "--db",
                  str(db), "--run", "n", "--debug-nan-at", "4", "--sample-every", "0"]) == 1
    out, err = capsys.readouterr()
    errors = [x for x in err.splitlines() if x.startswith("mdb: error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "mdb: error: run n failed: non-finite loss at step 4"), err
    assert "failed" not in out


# ------------------------------------------------------------------ 16: smaller items


def test_diff_limit_must_not_be_negative(trace_dir, capsys):
    assert _main(["diff", str(trace_dir), str(trace_dir), "--limit", "-5"]) == 2
    assert capsys.readouterr().err == (
        "mdb diff: error: argument --limit: must be 0 or a positive integer up to "
        "2,147,483,647, got -5 (see mdb diff -h)\n")


def test_a_10_mb_config_value_gives_a_short_line(tiny, capsys):
    tiny.write_text(TINY + 'hidden_act = "' + "x" * 10_000_000 + '"\n')
    assert _main(["summary", "--config", str(tiny)]) == 2
    line = _one_line(capsys)
    assert line == (f"mdb: error: --config {tiny}: hidden_act must be 'silu' (SwiGLU), got "
                    f"'{'x' * MAX_QUOTED}…[10,000,000 characters]'")


def test_a_long_bad_option_value_is_cut_by_the_parser_too(capsys):
    assert _main(["summary", "--seq-len", "9" * 5000 + "x"]) == 2
    err = capsys.readouterr().err
    assert err == (f"mdb summary: error: argument --seq-len: '{'9' * MAX_QUOTED}…[5,001 "
                   "characters]' is not an integer (see mdb summary -h)\n")


def test_clip_cuts_quoted_values_and_long_words_only():
    short = "hidden_act must be 'silu' (SwiGLU), got 'gelu'; the model's vocab_size is 256"
    assert clip(short) == short
    assert clip(short + " " + "y" * 150) == short + " " + "y" * 150  # nothing over the limit
    assert clip("got " + repr("a b " * 1000) + " end") == (
        f"got '{('a b ' * 1000)[:MAX_QUOTED]}…[4,000 characters]' end")
    assert clip("--db /" + "d/" * 300 + ": no such file") == (
        f"--db {('/' + 'd/' * 300)[:MAX_QUOTED]}…[601 characters]: no such file")
    spaced = clip("values " + "1, " * 5000)  # neither quoted nor one word: the middle goes
    assert len(spaced) < 2100 and "characters cut]" in spaced


# ------------------------------------------------------------------ 16: SIGINT while starting

#: Put first on PYTHONPATH: when the import of module $MDB_TEST_AT starts, note whether SIGINT
#: is blocked and send SIGINT to the process, as a Ctrl-C arriving during mdb's start would.
SIGINT_AT_IMPORT = '''
import os
import signal
import sys


class SigintAtImport:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["MDB_TEST_AT"]:
            sys.meta_path.remove(self)
            blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
            with open(os.environ["MDB_TEST_MARK"], "w") as f:
                f.write("blocked" if blocked else "deliverable")
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, SigintAtImport())
'''


@pytest.mark.skipif(not hasattr(__import__("signal"), "pthread_sigmask"), reason="POSIX only")
@pytest.mark.parametrize("module", ["torch", "tui.commands.step"])
def test_a_sigint_while_mdb_starts_is_an_interruption_not_a_traceback(module, tmp_path):
    """``torch``: mdb imports it for every command but the store commands (``mdb diff`` here);
    ``tui.commands.step``: the parser is being built (a SIGINT there was a KeyboardInterrupt
    traceback)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SIGINT_AT_IMPORT)
    mark = tmp_path / "mark"
    env = dict(os.environ, PYTHONPATH=f"{hook}{os.pathsep}{REPO}", MDB_TEST_MARK=str(mark),
               MDB_TEST_AT=module)
    proc = subprocess.run([sys.executable, "-m", "tui.cli", "diff", "a.mdbtrace",
                           "b.mdbtrace"], cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                          preexec_fn=terminal_signals)  # SIGINT as in a terminal, not nohup's
    # torch: blocked, the SIGINT cannot land inside numpy's or torch's C initialisation (it did:
    # ImportError: cannot load module more than once per process, or a hang)
    assert mark.read_text() == ("blocked" if module == "torch" else "deliverable")
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "mdb: interrupted\n", "")
