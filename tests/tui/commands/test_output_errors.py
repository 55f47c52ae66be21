"""Output that cannot be written (issue 32, item 10): a full disk (``/dev/full``) or a closed
stdout (``>&-``) is one line ``mdb: error: cannot write output: …`` and exit code 2, never a
traceback; a reader that closed its end of the pipe (``mdb runs --json | head -c 20``) ends
the command quietly, exit code 0 (:mod:`tui.output`).

Every command runs in a process of its own, its stdout a real file descriptor: ``/dev/full``,
the write end of a pipe whose read end is closed (before the first write, or after a few
bytes were read), or none at all."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import mdb_env
from tui.cli import main

FULL = "mdb: error: cannot write output: No space left on device\n"
CLOSED = "mdb: error: cannot write output: Bad file descriptor (standard output is closed)\n"

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    """Runs ``a`` … ``c`` of 3 steps and ``long``, of 6,000 steps (a CSV of ~150 kB: more than
    a pipe holds)."""
    from hooks.store.store import RunStore

    path = tmp_path_factory.mktemp("out") / "mdb.sqlite"
    with RunStore(path, create=True) as store:
        for name, steps in (("a", 3), ("b", 3), ("c", 3), ("long", 6000)):
            w = store.create_run(name, {}, total_steps=steps, kind="api")
            w.log_steps([({"step": s, "wall": 1.7e9 + s, "values": {
                "loss": 1 / s, "lr": 3e-4 * s, "grad_norm": s / 7}}, None, None)
                for s in range(1, steps + 1)])
            w.finish("finished")
    return path


def spawn(argv: list[str], stdout, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tui.cli", *argv], env=mdb_env(),
                            stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.PIPE,
                            text=True, **kw)


def to_dev_full(argv: list[str]) -> tuple[int, str]:
    with open("/dev/full", "w") as full:
        p = spawn(argv, full)
        _, err = p.communicate(timeout=120)
    return p.returncode, err


@pytest.mark.parametrize("argv", [["runs"], ["runs", "--json"], ["export", "long"],
                                  ["export", "a", "--format", "jsonl"]])
def test_a_full_disk_is_one_line_and_exit_2(db, argv):
    rc, err = to_dev_full([*argv, "--db", str(db)])
    assert (rc, err) == (2, FULL)


def test_doctor_json_into_a_full_disk_is_one_line(db):
    rc, err = to_dev_full(["doctor", "--json", "--only", "1", "--preset", "tiny"])
    assert rc == 2 and err.endswith(FULL) and "Traceback" not in err


def test_a_reader_gone_before_the_first_write_ends_quietly(db):
    for argv in (["runs", "--json"], ["runs"], ["export", "long"]):
        r, w = os.pipe()
        p = spawn([*argv, "--db", str(db)], w)
        os.close(w)
        os.close(r)  # before mdb writes anything: its first write is EPIPE
        _, err = p.communicate(timeout=60)
        assert (p.returncode, err) == (0, ""), argv


def test_a_reader_that_stops_after_20_bytes_ends_the_export_quietly(db):
    for fmt in ("csv", "jsonl"):
        p = spawn(["export", "long", "--format", fmt, "--db", str(db)], subprocess.PIPE)
        first = p.stdout.read(20)
        p.stdout.close()  # 150 kB more to come: more than the pipe holds
        err = p.stderr.read()
        p.wait(timeout=60)
        assert first == ("step,loss,lr,grad_nor" if fmt == "csv" else '{"step": 1, "loss": 1')[:20]
        assert (p.returncode, err) == (0, ""), fmt


def test_a_closed_stdout_is_one_line_and_exit_2(db):
    for argv in (["runs"], ["runs", "--json"], ["export", "a"]):
        p = spawn([*argv, "--db", str(db)], None, preexec_fn=lambda: os.close(1))
        _, err = p.communicate(timeout=60)
        assert (p.returncode, err) == (2, CLOSED), argv


def test_doctor_json_with_stdout_closed_by_the_shell(db):
    command = " ".join([sys.executable, "-m", "tui.cli", "doctor", "--json", "--only", "1",
                        "--preset", "tiny", ">&-"])
    p = subprocess.run(["bash", "-c", command], env=mdb_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.endswith(CLOSED) and "Traceback" not in p.stderr


class _Full:
    """A stdout whose every write fails as a full disk does."""

    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self):
        pass

    def isatty(self):
        return False


def test_in_process_a_write_error_is_one_line_and_stdout_is_put_back(db, monkeypatch, capsys):
    full = _Full()
    monkeypatch.setattr(sys, "stdout", full)
    assert main(["runs", "--json", "--db", str(db)]) == 2
    assert sys.stdout is full
    assert capsys.readouterr().err == FULL


def test_an_error_of_another_file_is_not_called_an_output_error(tmp_path, capsys):
    """``--db`` on a file that cannot be read is the store's own one-line error."""
    bad = tmp_path / "x.sqlite"
    bad.write_bytes(b"not a database" * 100)
    assert main(["runs", "--db", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write output" not in err


def test_bad_input_with_stderr_on_a_full_disk_still_exits_2(tmp_path):
    """The one line cannot be written either (``2>/dev/full``): the exit code still says bad
    input (it was 1, from the traceback of the failed print)."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "tui.cli", "runs", "--db",
                               str(tmp_path / "none.sqlite")], env=mdb_env(),
                              stdin=subprocess.DEVNULL, stdout=full, stderr=full, timeout=120)
    assert proc.returncode == 2
