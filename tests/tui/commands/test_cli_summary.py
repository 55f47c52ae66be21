"""``mdb summary`` (torchinfo-style table) and ``mdb capture`` (trace to disk), checked against
the model itself: ``named_modules()``, ``parameters()``, and a plain forward/backward run."""

from __future__ import annotations

import math
import re

import pytest
import torch

from hooks import Trace
from minillm import MiniLLM, load_preset
from tests.terminal import spawn_in_pty
from tui import cli
from tui.commands.step import load_trace
from tui.widgets.fmt import sci

ANSI = re.compile(r"\x1b\[")


def _reference(seq_len: int = 16):
    """The tiny model and batch mdb builds for --preset tiny (same seed), run without hooks."""
    from tui.commands.inputs import batch_from_text, default_text_path, read_text, tokenizer_for

    torch.manual_seed(0)
    cfg = load_preset("tiny")
    text = read_text(default_text_path())
    ids = batch_from_text(text, tokenizer_for(text, cfg.vocab_size), 2, seq_len)
    model = MiniLLM(cfg)
    out = model(ids, labels=ids)
    out.loss.backward()
    return model, ids, out


@pytest.fixture(autouse=True)
def _no_columns(monkeypatch):
    """Piped output is full width unless $COLUMNS says otherwise: start without it."""
    monkeypatch.delenv("COLUMNS", raising=False)


def test_summary_table_piped(capsys):
    assert cli.main(["summary", "--preset", "tiny", "--seq-len", "16"]) == 0
    text = capsys.readouterr().out
    assert not ANSI.search(text)  # piped: plain text
    lines = text.splitlines()
    model, ids, out = _reference()
    total = sum(p.numel() for p in model.parameters())
    root = next(line for line in lines if "(root)" in line)
    assert f"{total:,}" in root and "100.0%" in root
    grad_total = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))
    assert sci(grad_total) in root
    # every module appears once, in named_modules() order, with its class
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == len(list(model.named_modules()))
    for row, (name, module) in zip(rows, model.named_modules(), strict=True):
        leaf = name.rsplit(".", 1)[-1] if name else "(root)"
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[0] == leaf and cells[1] == type(module).__name__
    lm_head = next(r for r in rows if r.strip("│").split("│")[0].strip() == "lm_head")
    assert str(tuple(out.logits.shape)) in lm_head
    loss, ce = out.loss.item(), out.ce_loss.item()
    assert f"loss = out.loss = {loss:.4g} (ce {ce:.4g} + aux" in text


def test_summary_depth_limits_rows(capsys):
    assert cli.main(["summary", "--preset", "tiny", "--seq-len", "8", "--depth", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert [r.strip("│").split("│")[0].strip() for r in rows] == ["(root)", "model", "lm_head"]


def test_capture_writes_a_trace_step_can_open(tmp_path, capsys):
    out_dir = tmp_path / "tiny.mdbtrace"
    assert cli.main(["capture", "--out", str(out_dir), "--preset", "tiny", "--seq-len", "16"]) == 0
    assert capsys.readouterr().out.startswith(f"saved {out_dir}")
    trace = load_trace(str(out_dir))
    assert isinstance(trace, Trace)
    model, ids, out = _reference()
    # one forward record per module call: count the calls with our own hooks
    calls = []
    handles = [m.register_forward_pre_hook(lambda m, a, n=n: calls.append(n))
               for n, m in model.named_modules()]
    with torch.no_grad():
        model(ids, labels=ids)
    for h in handles:
        h.remove()
    assert [r.module for r in trace.forward] == calls
    assert list(trace.params) == [n for n, _ in model.named_parameters()]
    for name, p in model.named_parameters():
        want = torch.linalg.vector_norm(p.grad).item()
        assert trace.params[name].grad_norm == pytest.approx(want, rel=1e-4)
    assert len(trace.meta["tokens"]) == ids.numel()
    assert trace.meta["loss"] == pytest.approx(out.loss.item(), rel=1e-5)
    assert len(trace.attention) == load_preset("tiny").num_hidden_layers


# -- widths: the terminal's, $COLUMNS, full ---------------------------------------------------
@pytest.fixture(scope="module")
def saved_trace(tmp_path_factory):
    """A trace of the default preset (deep names: post_attention_layernorm at depth 4)."""
    import argparse

    from tui.commands.capturing import capture_step
    from tui.commands.options import add_model_arguments
    from tui.commands.workload import build_workload

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        workload = build_workload(parser.parse_args(["--seq-len", "16"]))
        trace = capture_step(workload, attention=False)
    finally:
        torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("summary") / "default.mdbtrace"
    trace.save(str(path))
    return str(path), trace


def _cells(line: str) -> list[str]:
    return line.split()


def _full_rows(text: str) -> dict[str, list[str]]:
    """Full-width rows by position: their cells between the box lines."""
    return [[c.strip() for c in line.strip("│").split("│")] for line in text.splitlines()
            if line.startswith("│")]


def test_columns_80_keeps_every_number_whole(saved_trace, capsys, monkeypatch):
    from rich.cells import cell_len

    path, trace = saved_trace
    assert cli.main(["summary", "--trace", path]) == 0
    full = _full_rows(capsys.readouterr().out)
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["summary", "--trace", path]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert all(cell_len(line) <= 80 for line in lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("module"))
    assert _cells(lines[header]) == ["module", "output", "params", "out", "mean", "out", "std",
                                     "param", "‖∇‖"]
    rows = lines[header + 2: header + 2 + len(full)]
    assert len(rows) == len(trace.modules) == len(full)
    for row, ref in zip(rows, full, strict=True):
        cells = _cells(row)
        # params, out mean, out std, param ‖∇‖: the full table's own strings, never cut
        assert cells[-4:] == [ref[3], ref[5], ref[6], ref[7]]
        assert "…" not in " ".join(cells[-4:])
        leaf = ref[0]
        name = cells[0]
        if "…" in name:  # a name cut in the middle keeps both ends
            start, end = name.split("…")
            assert leaf.startswith(start) and leaf.endswith(end)
        else:
            assert name == leaf
    assert "post_attention_layernorm" in "".join(r[0] for r in full)
    assert any("…" in _cells(r)[0] for r in rows)  # that one is cut at 80
    assert ("left out to fit 80 columns: class, % params, saved, bytes (--wide shows every "
            "column)") in " ".join(text.split())


def test_columns_120_shows_every_column_and_wide_ignores_columns(saved_trace, capsys,
                                                                 monkeypatch):
    path, _ = saved_trace
    monkeypatch.setenv("COLUMNS", "120")
    assert cli.main(["summary", "--trace", path]) == 0
    text = capsys.readouterr().out
    # every column but the memory accounting's last ones, which come first at 140
    assert "left out to fit 120 columns: saved (" in text
    assert "MiniLLMSparseMoeBlock" in text and "100.0%" in text
    monkeypatch.setenv("COLUMNS", "140")
    assert cli.main(["summary", "--trace", path]) == 0
    assert "left out" not in capsys.readouterr().out
    monkeypatch.setenv("COLUMNS", "60")
    assert cli.main(["summary", "--trace", path, "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "left out" not in wide and "post_attention_layernorm" in wide
    assert max(len(line) for line in wide.splitlines()) > 100


def test_in_a_terminal_the_table_fits_it(saved_trace):
    """A real pseudo-terminal of 80×24 (what tmux gives): the table fits 80 columns."""
    import sys

    pexpect = pytest.importorskip("pexpect")
    path, _ = saved_trace
    child = spawn_in_pty([sys.executable, "-m", "tui.cli", "summary", "--trace", path],
                         timeout=300, NO_COLOR="1", OMP_NUM_THREADS="1", COLUMNS="", LINES="")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", child.before)
    lines = [line.rstrip() for line in text.replace("\r", "").splitlines()]
    assert lines and max(len(line) for line in lines) <= 80
    assert any(line.startswith("module") and "param ‖∇‖" in line for line in lines)
    assert "left out to fit 80 columns" in text


@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit")
def test_summary_of_a_compiled_model_names_the_model(tmp_path, capsys):
    src = tmp_path / "compiled_model.py"
    src.write_text(
        "import torch\nfrom torch import nn\n\n"
        "def build():\n"
        "    m = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))\n"
        "    return torch.compile(m), torch.randint(0, 32, (2, 8))\n")
    assert cli.main(["summary", "--model", f"{src}:build"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("Sequential (torch.compile'd) from compiled_model.py:build")
    assert "OptimizedModule" not in first
