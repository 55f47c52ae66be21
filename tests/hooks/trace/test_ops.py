"""Stepping into a module call (hooks.trace.ops, Trace.ops): every torch op, its source line, the op
that created NaN/Inf, replay divergence, the backward's origin."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import hooks

CASES = Path(__file__).resolve().parents[3] / "samples" / "user_gpt.py"


def _user_gpt():
    spec = importlib.util.spec_from_file_location("user_gpt_case", CASES)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _line_of(path: Path, text: str) -> int:
    """The (only) line of ``path`` containing ``text`` — read from the file, not from mdb."""
    lines = [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line]
    assert len(lines) == 1, (text, lines)
    return lines[0]


def _capture(model, *args, backward=True, **kwargs):
    with hooks.capture(model) as trace:
        out = model(*args, **kwargs)
        if backward:
            loss = out["loss"] if isinstance(out, dict) else out.float().mean()
            loss.backward()
    return trace


def test_nanogpt_nan_first_nonfinite_op_is_the_softmax_of_an_all_minus_inf_row():
    ug = _user_gpt()
    model, (idx, tgt) = ug.nanogpt_nan()
    trace = _capture(model, idx, tgt)
    bad = trace.first_nonfinite()
    assert bad.module == "h.1.attn"
    ot = trace.ops(bad.module, bad.call_index)
    assert ot.diverged == ""
    first = ot.first_nonfinite()
    assert first.op == "torch.nn.functional.softmax"
    assert first.file == str(CASES) and first.line == _line_of(CASES, "F.softmax(att, dim=-1)")
    out, scores = first.kept["out"], first.kept["args[0]"]
    b, h, i, _ = (int(v) for v in torch.isnan(out).nonzero()[0])
    assert torch.equal(scores[b, h, i], torch.full_like(scores[b, h, i], float("-inf")))
    assert "all -inf (32 of 32)" in first.offending_row()
    # the -inf was put there on purpose by masked_fill, which is recorded before the softmax
    assert ot.ops[first.index - 1].short_op == "Tensor.masked_fill"


class _DivByZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        scale = (x[:, :1] * 0).sum(-1, keepdim=True)
        return y / scale  # the division by zero


def test_a_division_by_zero_is_found_at_its_line():
    torch.manual_seed(0)
    model = _DivByZero()
    trace = _capture(model, torch.randn(3, 4), backward=False)
    ot = trace.ops("", 0)
    first = ot.first_nonfinite()
    src = Path(inspect.getsourcefile(_DivByZero))
    assert first.short_op == "Tensor.div"
    assert (first.file, first.line) == (str(src), _line_of(src, "# the division " + "by zero"))


class _Counter(TorchFunctionMode):
    """The test's own count: torch functions that returned a tensor (or a sequence holding
    one) while the mode was on."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) or (
                isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out)):
            self.n += 1
        return out


def test_op_count_equals_an_independent_function_mode_count():
    ug = _user_gpt()
    model, (idx, tgt) = ug.nanogpt_tuple()
    trace = _capture(model, idx, tgt, backward=False)
    attn = model.h[0].attn
    x = trace.replay  # re-run the block's input through the attention alone, counted
    seen = {}

    def grab(mod, args):
        seen.setdefault("x", args[0].detach().clone())

    h = attn.register_forward_pre_hook(grab)
    with torch.no_grad():
        model(*x.args, **x.kwargs)
    h.remove()
    with torch.no_grad(), _Counter() as counter:
        attn(seen["x"])
    ot = trace.ops("h.0.attn", 0)
    assert ot.diverged == ""
    assert len(ot.ops) == counter.n > 10


def test_stepping_into_a_linear_shows_the_linear_op_with_its_shapes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.ReLU())
    trace = _capture(model, torch.randn(2, 5))
    ot = trace.ops("0", 0)
    assert [o.op for o in ot.ops] == ["torch.nn.functional.linear"]
    op = ot.ops[0]
    assert [(t.path, t.shape) for t in op.inputs] == [
        ("args[0]", [2, 5]), ("args[1]", [3, 5]), ("args[2]", [3])]
    assert [(t.path, t.shape) for t in op.outputs] == [("out", [2, 3])]
    # the statistics are those of the call's own output
    assert op.outputs[0].stats.mean == pytest.approx(trace.call("0").outputs[0].stats.mean)
    # placed where the model called the Linear (nn.Sequential's loop), not in linear.py
    assert op.file.endswith("container.py") and "module(input)" in op.code


def test_dropout_replays_with_the_recorded_rng_and_a_changed_input_diverges():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).train()
    x = torch.randn(4, 8)
    trace = _capture(model, x)
    torch.rand(100)  # the global stream moves on; the replay uses the recorded state
    ot = trace.ops("1", 0)
    assert ot.diverged == ""
    assert [o.short_op for o in ot.ops] == ["dropout"]
    before = torch.get_rng_state()
    x.add_(1.0)  # the captured input changed since
    ot = trace.ops("1", 0, refresh=True)
    assert "mean" in ot.diverged and "replay" in ot.diverged
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is untouched


class _SqrtOfZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x) * (x > 100)  # every row is zero: a finite forward
        return torch.sqrt(y.pow(2).sum(-1))  # sqrt at 0: an infinite derivative


def test_backward_origin_names_the_forward_op_and_its_line():
    torch.manual_seed(0)
    model = _SqrtOfZero()
    x = torch.randn(3, 4)
    with hooks.capture(model) as trace:
        loss = model(x).sum()
        loss.backward()
    assert trace.first_nonfinite("forward") is None
    assert trace.first_nonfinite("backward") is not None
    grads = {n: p.grad for n, p in model.named_parameters()}
    copies = {n: p.grad.clone() for n, p in model.named_parameters()}
    origin = trace.locate_backward_origin(lambda out: out.sum())
    src = Path(inspect.getsourcefile(_SqrtOfZero))
    assert origin.node == "SqrtBackward0" and origin.op == "sqrt"
    assert (origin.file, origin.line) == (str(src), _line_of(src, "# sqrt " + "at 0"))
    assert origin.module == ""  # the root module's own forward
    for n, p in model.named_parameters():  # the user's gradients are left as they were
        assert p.grad is grads[n] and torch.equal(p.grad.isnan(), copies[n].isnan())


def test_ops_round_trip_through_save_and_a_loaded_trace_cannot_replay(tmp_path):
    model, (idx, tgt) = _user_gpt().nanogpt_nan()
    trace = _capture(model, idx, tgt)
    ot = trace.ops("h.1.attn", 0)
    trace.save(tmp_path / "t.mdbtrace")
    back = hooks.Trace.load(tmp_path / "t.mdbtrace")
    ot2 = back.ops("h.1.attn", 0)
    assert [o.to_dict() for o in ot2.ops] == [o.to_dict() for o in ot.ops]
    first = ot2.first_nonfinite()
    assert torch.equal(first.kept["args[0]"], ot.first_nonfinite().kept["args[0]"])
    with pytest.raises(LookupError, match="loaded from disk"):
        back.ops("h.0.attn", 0)
    with pytest.raises(KeyError):
        trace.ops("no.such.module", 0)


def test_capture_step_records_the_first_nonfinite_calls_ops(tmp_path, capsys):
    from tui.cli import main

    out = tmp_path / "nan.mdbtrace"
    assert main(["capture", "--model", f"{CASES}:nanogpt_nan", "--out", str(out),
                 "--ops", "h.0.mlp.0"]) == 0
    text = capsys.readouterr().out
    line = _line_of(CASES, "F.softmax(att, dim=-1)")
    assert f"ops of h.1.attn call 0: 22; first non-finite: softmax at user_gpt.py:{line}" in text
    assert "ops of h.0.mlp.0 call 0: 1" in text
    back = hooks.Trace.load(out)
    assert set(back.op_traces) == {("h.1.attn", 0), ("h.0.mlp.0", 0)}
    assert main(["capture", "--model", f"{CASES}:nanogpt_nan", "--out",
                 str(tmp_path / "x.mdbtrace"), "--ops", "nope"]) == 2
    assert not (tmp_path / "x.mdbtrace").exists()
    assert "no recorded module call matches" in capsys.readouterr().err


def test_functional_ops_inside_a_model_are_attributed_to_the_innermost_module():
    torch.manual_seed(0)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 3)

        def forward(self, x):
            return F.gelu(self.inner(x)) + 1

    trace = _capture(Outer(), torch.randn(2, 3), backward=False)
    ot = trace.ops("", 0)
    assert [(o.short_op, o.module) for o in ot.ops] == [
        ("linear", "inner"), ("gelu", ""), ("Tensor.add", "")]
