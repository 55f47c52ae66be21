"""torch.compile: a compiled model's captured step runs eagerly and records every module.

The models are compiled with a counting backend on top of dynamo's ``eager`` backend: dynamo
traces and guards exactly as with inductor, without needing a C++ compiler on the machine, and
the backend counts the graphs dynamo hands it (every compilation, recompilations included).
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import hooks


class Graphs:
    """A torch.compile backend that runs the graph as traced and counts compilations."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, gm, example_inputs):
        self.count += 1
        return gm.forward


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.block(self.embed(x)) + x.sum(-1, keepdim=True))


NAMES = ["", "embed", "block", "block.0", "block.1", "block.2", "head"]
X = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))


def capture_step(target, run, **kw):
    run.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hooks.capture(target, **kw) as tr:
            run(X).sum().backward()
    return tr, [str(w.message) for w in caught]


def plain_trace():
    model = Net()
    tr, _ = capture_step(model, model)
    return tr


def assert_like_plain(tr, plain):
    assert [r.module for r in tr.forward] == NAMES
    assert [g.key for g in tr.backward] == [g.key for g in plain.backward]
    for a, b in zip(plain.forward, tr.forward, strict=True):
        assert a.outputs[0].stats.mean == pytest.approx(b.outputs[0].stats.mean, abs=1e-6)
    for name, p in plain.params.items():
        assert tr.params[name].grad_norm == pytest.approx(p.grad_norm, rel=1e-5)


def compiled_note(tr, replay: bool = True) -> str:
    """The capture's note on a compiled model: the step ran compiled and an eager replay on
    the side was recorded (issue 32: a captured step applies the compiled update), or, for the
    original module captured while its wrapper runs, the step itself ran eagerly."""
    notes = [n.message for n in tr.notes if n.kind == "compiled"]
    assert len(notes) == 1, tr.notes
    assert "force_eager" in notes[0]
    if replay:
        assert "the step ran compiled" in notes[0] and "eager replay" in notes[0]
        assert "within float rounding" in notes[0]
    else:
        assert "ran eagerly" in notes[0] and "not the compiled graph's" in notes[0]
    return notes[0]


def stance() -> str:
    return sys.modules["torch._dynamo.eval_frame"]._stance.stance


def test_compiled_wrapper_fresh_and_already_run_records_every_module():
    plain = plain_trace()
    graphs = Graphs()
    compiled = torch.compile(Net(), backend=graphs)
    # fresh: nothing compiled yet; the step compiles as it would without the capture, and
    # dynamo traces none of the capture's hooks (nothing recompiles after)
    tr, caught = capture_step(compiled, compiled)
    assert graphs.count == 1
    assert_like_plain(tr, plain)
    assert tr.model_type == "Net" and "_orig_mod" in compiled_note(tr)
    assert not [w for w in caught if "recompil" in w.lower()], caught
    assert stance() == "default"
    # already run compiled: its cached graph would skip the hooks (1 record of 7 before)
    compiled(X).sum().backward()
    assert graphs.count == 1
    tr, caught = capture_step(compiled, compiled)
    assert_like_plain(tr, plain)
    compiled_note(tr)
    # the capture left nothing for dynamo to recompile
    compiled(X).sum().backward()
    assert graphs.count == 1 and stance() == "default"
    assert not caught
    # the original module captured while its compiled wrapper is what runs
    tr, _ = capture_step(compiled._orig_mod, compiled)
    assert_like_plain(tr, plain)
    assert "inside its torch.compile wrapper" in compiled_note(tr, replay=False)
    compiled(X).sum().backward()
    assert graphs.count == 1


def test_module_compiled_in_place_records_every_module():
    plain = plain_trace()
    graphs = Graphs()
    model = Net()
    model.compile(backend=graphs)
    model(X).sum().backward()
    assert graphs.count == 1
    tr, caught = capture_step(model, model)
    assert_like_plain(tr, plain)
    assert "<root> torch.compile'd" in compiled_note(tr)
    model(X).sum().backward()
    assert graphs.count == 1 and not caught


def test_compiled_submodule_and_the_stance_restored_after_an_error():
    graphs = Graphs()
    model = Net()
    model.block = torch.compile(model.block, backend=graphs)
    model(X)
    assert graphs.count == 1
    with pytest.raises(RuntimeError, match="boom"), hooks.capture(model) as tr:
        model(X)
        assert stance() == "default"  # the step runs compiled; only the replay ran eagerly
        assert graphs.count == 1
        raise RuntimeError("boom")
    assert stance() == "default"
    assert [r.module for r in tr.forward] == [
        "", "embed", "block", "block._orig_mod", "block._orig_mod.0", "block._orig_mod.1",
        "block._orig_mod.2", "head",
    ]
    assert "block torch.compile'd" in compiled_note(tr)


def test_minillm_compiled_capture_has_every_module():
    from minillm import MiniLLM, load_preset

    def tiny():
        torch.manual_seed(0)
        return MiniLLM(load_preset("tiny")).train()

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model = tiny()
    with hooks.capture(model) as plain:
        model(ids, labels=ids).loss.backward()
    graphs = Graphs()
    compiled = torch.compile(tiny(), backend=graphs)
    compiled(ids, labels=ids).loss.backward()
    n = graphs.count
    compiled.zero_grad(set_to_none=True)
    with hooks.capture(compiled) as tr:
        compiled(ids, labels=ids).loss.backward()
    compiled(ids, labels=ids).loss.backward()
    assert graphs.count == n  # nothing traced or recompiled for the capture
    compiled_note(tr)
    assert [r.key for r in tr.forward] == [r.key for r in plain.forward]
    assert len(tr.routing) == len(plain.routing) == 2
    for a, b in zip(plain.routing, tr.routing, strict=True):
        assert torch.equal(a.top_k_ids, b.top_k_ids)
    for name, p in plain.params.items():
        assert tr.params[name].grad_norm == pytest.approx(p.grad_norm, rel=1e-5)


def test_capturing_an_uncompiled_model_does_not_import_dynamo():
    """Start-up time: torch._dynamo costs seconds to import; only a compiled model needs it."""
    code = (
        "import sys, torch, hooks\n"
        "from minillm import MiniLLM, load_preset\n"
        "m = MiniLLM(load_preset('tiny'))\n"
        "ids = torch.zeros(1, 4, dtype=torch.long)\n"
        "with hooks.capture(m):\n"
        "    m(ids, labels=ids).loss.backward()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_captures_stopped_out_of_order_leave_the_stance_as_it_was():
    compiled = torch.compile(Net(), backend=Graphs())
    assert stance() == "default"
    a, b = hooks.capture(compiled), hooks.capture(Net())
    a.start()
    b.start()
    assert stance() == "force_eager"
    a.stop()
    assert stance() == "force_eager"  # b still records: its hooks must fire
    b.stop()
    assert stance() == "default"
