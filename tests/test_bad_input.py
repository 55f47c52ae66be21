"""Bad input is one line and a non-zero exit, never a traceback, and nothing is left behind:
a model that raises, sizes that cannot be allocated, texts that never end, bad config values,
numbers out of range, a trace nested too deep, a forward that never returns."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.processes import main_rc as _main
from tests.processes import mdb_argv
from tests.processes import one_error_line as _one_line
from tests.terminal import spawn_in_pty

BAD_MODEL = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x).transpose(0, 1)
        return y.view(-1)  # MARK: not contiguous


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x)


class BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("the backward of my op is broken")  # MARK: backward


class NetB(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return BadBackward.apply(self.fc(x))


def forward_raises():
    return Net(), torch.randn(4, 8)


def backward_raises():
    return NetB(), torch.randn(2, 4)


def factory_raises():
    raise ValueError("no such checkpoint")  # MARK: factory


class Later(nn.Module):
    """Trains for four steps, then its forward raises."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.calls = 0

    def forward(self, ids, targets):
        self.calls += 1
        if self.calls > 4:
            raise RuntimeError("broke at call 5")  # MARK: later
        logits = self.head(self.emb(ids))
        return logits, nn.functional.cross_entropy(logits.view(-1, 16), targets.view(-1))


def raises_later():
    ids = torch.randint(0, 16, (2, 8))
    return Later(), {"ids": ids, "targets": ids}
'''


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "bad_models.py"
    path.write_text(BAD_MODEL)
    return path


def _line(path: Path, mark: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if mark in line)


@pytest.mark.parametrize("command", ["summary", "capture", "overfit", "doctor"])
def test_a_forward_that_raises_names_the_module_and_the_line(command, bad_models, tmp_path,
                                                             capsys):
    out = tmp_path / "t.mdbtrace"
    db = tmp_path / "runs.sqlite"
    argv = [command, "--model", f"{bad_models}:forward_raises"]
    if command == "capture":
        argv += ["--out", str(out)]
    if command == "overfit":
        argv += ["--headless", "--db", str(db)]
    assert _main(argv) == 1
    line = _one_line(capsys)
    assert "the forward pass: RuntimeError: view size is not compatible" in line
    assert "in block (Block)" in line
    assert f"at bad_models.py:{_line(bad_models, 'MARK: not contiguous')}" in line
    assert not out.exists() and not db.exists()


@pytest.mark.slow
def test_mdb_step_in_a_terminal_names_the_module_and_the_line(bad_models):
    """``mdb step`` needs a terminal: run it in a pty, as a user would."""
    pexpect = pytest.importorskip("pexpect")
    child = spawn_in_pty(mdb_argv() + ["step", "--model", f"{bad_models}:forward_raises"],
                         cwd=bad_models.parent)
    try:
        child.expect(pexpect.EOF)
    finally:
        child.close()
    out = child.before
    assert child.exitstatus == 1, out
    assert "Traceback" not in out
    assert "mdb: error: " in out and "in block (Block)" in out
    assert f"at bad_models.py:{_line(bad_models, 'MARK: not contiguous')}" in out


def test_a_model_that_raises_during_overfit_is_located_in_the_line_and_the_run(bad_models,
                                                                              tmp_path, capsys):
    from hooks.store.store import RunStore

    db = tmp_path / "runs.sqlite"
    argv = ["overfit", "--headless", "--model", f"{bad_models}:raises_later", "--steps", "20",
            "--db", str(db), "--run", "later"]
    assert _main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    line = next(x for x in err if x.startswith("mdb: error: "))
    where = f"at bad_models.py:{_line(bad_models, 'MARK: later')}"
    # call 1 was the probe: the fifth call is step 4
    assert "failed at step 4: RuntimeError: broke at call 5" in line and where in line
    with RunStore(db) as store:
        run = store.run("later")
    assert run.status == "failed" and where in run.reason and run.last_step == 3


def test_a_backward_that_raises_is_one_line_too(bad_models, capsys):
    assert _main(["summary", "--model", f"{bad_models}:backward_raises"]) == 1
    line = _one_line(capsys)
    assert "the backward pass: RuntimeError: the backward of my op is broken" in line
    assert f"bad_models.py:{_line(bad_models, 'MARK: backward')}" in line


def test_a_factory_that_raises_names_its_line(bad_models, capsys):
    assert _main(["summary", "--model", f"{bad_models}:factory_raises"]) == 1
    line = _one_line(capsys)
    assert "factory_raises() raised ValueError: no such checkpoint" in line
    assert f"bad_models.py:{_line(bad_models, 'MARK: factory')}" in line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "1000000000"], "need at least"),
        (["--batch-size", "100000"], "need at least"),
        (["--seq-len", "9999999999"], "positive integer up to"),
        (["--seed", "1180591620717411303424"], "argument --seed"),
    ],
    ids=["batch-1e9", "batch-1e5", "seq-2^33", "seed-2^70"],
)
def test_sizes_and_numbers_out_of_range_are_refused_before_allocating(argv, message, capsys):
    assert _main(["summary", "--preset", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "toml, message",
    [
        ("hidden_size = 1000000000\n", "need at least"),
        ("vocab_size = 100000000000\n", "need at least"),
        ("max_position_embeddings = 10000000000\n", "need at least"),
        ("num_hidden_layers = 1000000\n", "need at least"),
        ('initializer_range = "x"\n', "initializer_range must be a finite number"),
        ("initializer_range = -1\n", "initializer_range must be positive"),
        ('tie_word_embeddings = "no"\n', "tie_word_embeddings must be true or false"),
        ("router_aux_loss_coef = nan\n", "router_aux_loss_coef must be a finite number"),
    ],
)
def test_config_values(toml, message, tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    assert _main(["summary", "--config", str(path)]) == 2
    assert message in _one_line(capsys)


def test_the_memory_message_says_how_much(capsys, monkeypatch):
    from tui.commands import inputs

    monkeypatch.setattr(inputs, "available_memory", lambda: 10**9)  # 1 GB
    from minillm import load_preset

    cfg = load_preset("default")
    params, acts = inputs.step_memory(cfg, 2, 64)
    assert params >= 8 * cfg.parameter_count()
    assert _main(["summary", "--preset", "default", "--batch-size", "4096"]) == 2
    line = _one_line(capsys)
    assert "this machine has 1 GB available" in line


def test_a_config_that_is_a_directory(tmp_path, capsys):
    assert _main(["summary", "--config", str(tmp_path)]) == 2
    assert "not a file" in _one_line(capsys)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_text_that_is_not_a_regular_file(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        if not path.exists():
            continue
        assert _main(["summary", "--preset", "tiny", "--text", str(path)]) == 2
        assert "not a regular file" in _one_line(capsys)


def test_text_larger_than_the_cap_is_refused_before_reading(tmp_path, capsys):
    from tui.commands.inputs import MAX_TEXT_BYTES

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(MAX_TEXT_BYTES + 1)  # sparse: nothing is written
    assert _main(["summary", "--preset", "tiny", "--text", str(big)]) == 2
    assert "more text than a batch needs" in _one_line(capsys)


def test_a_trace_nested_too_deep(tmp_path, capsys):
    d = tmp_path / "deep.mdbtrace"
    d.mkdir()
    (d / "trace.json").write_text("[" * 200_000 + "]" * 200_000)
    for argv in (["summary", "--trace", str(d)], ["diff", str(d), str(d)]):
        assert _main(argv) == 2
        assert "nests too deeply" in _one_line(capsys)


def test_capture_out_empty_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _main(["capture", "--preset", "tiny", "--out", ""]) == 2
    assert "--out" in _one_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_overfit_steps_out_of_range_leaves_no_database(tmp_path, capsys):
    db = tmp_path / "runs.sqlite"
    assert _main(["overfit", "--headless", "--steps", str(2**63), "--db", str(db)]) == 2
    assert "--steps" in capsys.readouterr().err
    assert not db.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_run_database_that_is_not_a_regular_file(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for argv in (["runs", "--db", str(fifo)], ["watch", "r", "--db", str(fifo)],
                 ["export", "r", "--db", "/dev/zero"],
                 ["overfit", "--headless", "--steps", "2", "--db", str(fifo)]):
        assert _main(argv) == 2, argv
        assert "not a regular file" in _one_line(capsys)


def test_gather_every_without_nproc_is_refused(tmp_path, capsys):
    db = tmp_path / "runs.sqlite"
    assert _main(["overfit", "--headless", "--gather-every", "5", "--db", str(db)]) == 2
    assert "--gather-every applies only with --nproc" in _one_line(capsys)
    assert not db.exists()


async def test_keys_do_nothing_while_the_terminal_is_too_small():
    from tests.conftest import wait_until
    from tests.models import tiny_workload
    from tui.app import make_step_app
    from tui.commands.capturing import capture_step
    from tui.screens.step import StepScreen

    trace = capture_step(tiny_workload(), attention=False)
    app = make_step_app(trace)
    async with app.run_test(size=(60, 20)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, StepScreen))
        screen = app.screen
        assert screen.has_class("-too-small")
        await pilot.press("n", "n", "b", "r")
        assert app.screen is screen and screen.stepper.index == 0
        assert screen.stepper.direction == "forward"
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert not screen.has_class("-too-small")
        await pilot.press("n")
        assert screen.stepper.index == 1


SLEEPY = '''
import time
import torch
from torch import nn


class Sleepy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        time.sleep(600)
        return self.fc(x)


def build():
    return Sleepy(), torch.randn(1, 2)
'''


@pytest.mark.slow
def test_quitting_while_the_forward_sleeps_ends_the_process(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    (tmp_path / "sleepy.py").write_text(SLEEPY)
    child = spawn_in_pty(mdb_argv() + ["step", "--model", f"{tmp_path}/sleepy.py:build"],
                         cwd=tmp_path, timeout=120)
    try:
        child.expect("capturing one forward and backward pass")
        child.send("q")
        # the forward sleeps for 10 minutes: reaching EOF at all means mdb did not wait for it
        child.expect(pexpect.EOF, timeout=120)
    finally:
        child.close()
    assert "abandoned" in child.before and "Traceback" not in child.before
    assert child.exitstatus == 0


def test_parameter_count_from_the_config_alone_equals_the_model():
    from minillm import MiniLLM, load_preset

    for name in ("default", "mha", "mqa", "dense", "learned-pos", "tiny"):
        for tie in (True, False):
            cfg = load_preset(name).replace(tie_word_embeddings=tie)
            with torch.device("meta"):
                model = MiniLLM(cfg)
            assert cfg.parameter_count() == sum(p.numel() for p in model.parameters()), name
