"""``mdb summary`` (torchinfo-style table) and ``mdb capture`` (trace to disk), checked against
the model itself: ``named_modules()``, ``parameters()``, and a plain forward/backward run."""

from __future__ import annotations

import math
import re

import pytest
import torch

from hooks import Trace
from minillm import MiniLLM, load_preset
from tui import cli
from tui.commands.step import load_trace
from tui.widgets.fmt import sci

ANSI = re.compile(r"\x1b\[")


def _reference(seq_len: int = 16):
    """The tiny model and batch mdb builds for --preset tiny (same seed), run without hooks."""
    from tui.commands._common import batch_from_text, default_text_path, read_text, tokenizer_for

    torch.manual_seed(0)
    cfg = load_preset("tiny")
    text = read_text(default_text_path())
    ids = batch_from_text(text, tokenizer_for(text, cfg.vocab_size), 2, seq_len)
    model = MiniLLM(cfg)
    out = model(ids, labels=ids)
    out.loss.backward()
    return model, ids, out


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
