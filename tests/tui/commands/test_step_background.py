"""``mdb step`` builds minillm and captures its step in a thread while Textual is imported
(:class:`tui.commands.step.BackgroundStep`): the same weights and the same trace as building and
capturing in order on this thread (the reference), the build's errors raised where they are
waited for, and Python's garbage collector on again once ``mdb step`` returns."""

from __future__ import annotations

import gc

import pytest
import torch

from tui import cli
from tui.commands.step import BackgroundStep, build_from_args, capture
from tui.errors import MdbError


def _args(*words: str):
    return cli.build_parser("step").parse_args(["step", *words])


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # set_threads(args) sets 1 (mdb step's default)


def test_background_step_builds_and_captures_as_in_order(one_thread):
    args = _args("--preset", "tiny", "--seq-len", "16", "--seed", "3")
    background = BackgroundStep(args)
    workload, trace = background.workload(), background.trace()
    ref_workload = build_from_args(args)  # reseeded with --seed: the same draws, in order
    ref = capture(ref_workload)
    theirs = dict(ref_workload.model.named_parameters())
    for name, p in workload.model.named_parameters():
        assert torch.equal(p, theirs[name]), name
    assert torch.equal(workload.batch.args[0], ref_workload.batch.args[0])
    assert trace.meta["loss"] == pytest.approx(ref.meta["loss"], rel=1e-6)
    assert [(r.module, r.call_index) for r in trace.forward] == \
        [(r.module, r.call_index) for r in ref.forward]
    for mine, other in zip(trace.forward, ref.forward, strict=True):
        for a, b in zip(mine.outputs, other.outputs, strict=True):
            if a.stats is not None:
                assert a.stats.l2 == pytest.approx(b.stats.l2, rel=1e-5, abs=1e-12)
    assert [g.module for g in trace.backward] == [g.module for g in ref.backward]


def test_background_step_raises_the_build_error_where_waited_for(one_thread):
    background = BackgroundStep(_args("--preset", "tiny", "--seq-len", "129"))
    with pytest.raises(MdbError, match="longer than the model allows"):
        background.workload()
    with pytest.raises(MdbError, match="longer than the model allows"):
        background.trace()


def test_garbage_collector_on_again_after_bad_input(capsys, one_thread):
    assert gc.isenabled()
    assert cli.main(["step", "--preset", "tiny", "--seq-len", "129"]) == 2
    assert "longer than the model allows" in capsys.readouterr().err
    assert gc.isenabled()


_BLOCKED_BUILD = """
import threading, sys
import tui.commands.workload as workload
def build_workload(args):
    print("building", flush=True)
    threading.Event().wait()  # a build that never ends (a thread stuck on an import lock)
workload.build_workload = build_workload
from tui import cli
sys.exit(cli.main(["step", "--preset", "tiny"]))
"""


@pytest.mark.slow
def test_ctrl_c_while_the_model_is_built_in_the_background_exits_130_at_once(tmp_path):
    """Before: the interrupted main thread waited for the build thread, which could wait on
    an import lock the interrupted import left (a hang), or the process exited with torch
    running in the daemon thread (abort)."""
    import signal
    import subprocess
    import sys

    from tests.processes import mdb_env
    from tests.terminal import terminal_signals

    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED_BUILD], cwd=tmp_path,
                            env=mdb_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=terminal_signals)
    try:
        # from here the build runs in the background, for ever: the SIGINT comes while it does
        assert proc.stdout.readline().strip() == "building"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "mdb: interrupted"
