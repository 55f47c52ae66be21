"""Step into (``hooks.trace.ops``) records statistics for at most ``hooks.trace.ops.MAX_OP_TENSORS``
tensors per op side (fewer when ``hooks.tensors.walk.MAX_TENSORS`` is smaller) and none deeper than
``hooks.tensors.walk.MAX_DEPTH``; what it left out is said in the op's notes (how many, the first
left out), as a module call's are. Also: ``hooks.tensors.walk.LeftOut`` counts a nested output with
many left-out containers right (its recorded ids are kept incrementally)."""

from __future__ import annotations

import re

import torch
from torch import nn

import hooks
import hooks.tensors.walk
import hooks.trace.ops
from hooks.tensors.walk import LeftOut, find_tensors
from hooks.trace.ops import OpRecord, OpRecorder, OpTrace

OVER = re.compile(
    r"^(inputs|outputs): (\d+) tensor\(s\) recorded, (\d+) not recorded "
    r"\(the first left out: (\S+)\): an op records at most (\d+) tensors per side \((\S+);"
)
DEEP = re.compile(
    r"^(inputs|outputs): (\d+) tensor\(s\) not recorded \(the first left out: (\S+)\): "
    r"they are nested deeper than (\d+) containers"
)


def _record(fn):
    """The ops ``fn()`` runs, recorded by an armed :class:`OpRecorder`, and its result."""
    rec = OpRecorder()
    rec.armed = True
    with rec:
        out = fn()
    rec.armed = False
    return rec.finish(), out


def _op(ops, name: str) -> OpRecord:
    (op,) = [o for o in ops if o.op.rsplit(".", 1)[-1] == name]
    return op


def _assert_stats(info, t: torch.Tensor) -> None:
    ref = t.detach().double()
    st = info.stats
    assert info.shape == list(t.shape)
    assert st.numel == t.numel()
    scale = 1 + ref.abs().max().item()  # float32 rounding grows with the values' magnitude
    assert abs(st.mean - ref.mean().item()) <= 1e-5 * scale
    assert abs(st.std - ref.std().item()) <= 1e-5 * scale
    assert abs(st.min - ref.min().item()) <= 1e-6 * scale
    assert abs(st.max - ref.max().item()) <= 1e-6 * scale


def test_unbind_into_more_pieces_than_the_cap_says_how_many_and_the_first():
    torch.manual_seed(0)
    x = torch.randn(20, 6) * torch.arange(1, 21).unsqueeze(1)  # pieces of different scales
    pieces = [x[i] for i in range(x.shape[0])]  # torch's own pieces, taken outside the recorder
    cap = min(hooks.trace.ops.MAX_OP_TENSORS, hooks.tensors.walk.MAX_TENSORS)
    assert len(pieces) > cap
    ops, out = _record(lambda: torch.unbind(x))
    op = _op(ops, "unbind")
    assert [t.path for t in op.outputs] == [f"out[{i}]" for i in range(cap)]
    for info, piece in zip(op.outputs, pieces, strict=False):
        _assert_stats(info, piece)
    assert [t.path for t in op.inputs] == ["args[0]"]
    _assert_stats(op.inputs[0], x)
    (note,) = op.notes  # the input side holds one tensor: nothing left out there
    m = OVER.match(note)
    assert m is not None, note
    assert m.group(1) == "outputs"
    assert (int(m.group(2)), int(m.group(3))) == (cap, len(pieces) - cap)
    assert m.group(4) == f"out[{cap}]"
    assert (int(m.group(5)), m.group(6)) == (cap, "hooks.trace.ops.MAX_OP_TENSORS")
    assert len(out) == len(pieces)


def test_a_lower_walk_cap_binds_and_is_named(monkeypatch):
    monkeypatch.setattr(hooks.tensors.walk, "MAX_TENSORS", 3)
    torch.manual_seed(1)
    x = torch.randn(20, 5)
    chunks = [x[i:i + 2] for i in range(0, 20, 2)]  # what split(x, 2) returns, by slicing
    ops, _ = _record(lambda: torch.split(x, 2))
    op = _op(ops, "split")
    assert len(op.outputs) == 3
    for info, chunk in zip(op.outputs, chunks, strict=False):
        _assert_stats(info, chunk)
    (note,) = op.notes
    m = OVER.match(note)
    assert m is not None, note
    assert (m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)) == (
        "outputs", 3, len(chunks) - 3, "out[3]")
    assert (int(m.group(5)), m.group(6)) == (3, "hooks.tensors.walk.MAX_TENSORS")


def test_inputs_past_the_cap_count_each_distinct_tensor_once():
    torch.manual_seed(2)
    distinct = [torch.randn(2, 3) + i for i in range(11)]
    listed = distinct + distinct[:9]  # t0..t10 then t0..t8 again: 20 entries, 11 tensors
    cap = min(hooks.trace.ops.MAX_OP_TENSORS, hooks.tensors.walk.MAX_TENSORS)
    ops, out = _record(lambda: torch.cat(listed, dim=0))
    op = _op(ops, "cat")
    # independent count: distinct tensors in walk order, the first `cap` recorded
    order, ids = [], set()
    for i, t in enumerate(listed):
        if id(t) not in ids:
            ids.add(id(t))
            order.append((f"args[0][{i}]", t))
    assert [t.path for t in op.inputs] == [p for p, _ in order[:cap]]
    for info, (_, t) in zip(op.inputs, order, strict=False):
        _assert_stats(info, t)
    _assert_stats(op.outputs[0], torch.cat(listed, dim=0))
    assert torch.equal(out, torch.cat(listed, dim=0))
    (note,) = op.notes
    m = OVER.match(note)
    assert m is not None, note
    assert (m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)) == (
        "inputs", cap, len(order) - cap, order[cap][0])
    assert len(order) - cap == 3


def test_inputs_deeper_than_the_depth_cap_are_said(monkeypatch):
    # args (depth 0) holds the list (depth 1)
    monkeypatch.setattr(hooks.tensors.walk, "MAX_DEPTH", 1)
    a, b = torch.randn(3), torch.randn(4)
    ops, _ = _record(lambda: torch.cat([a, b]))
    op = _op(ops, "cat")
    assert op.inputs == []
    _assert_stats(op.outputs[0], torch.cat([a, b]))
    (note,) = op.notes
    m = DEEP.match(note)
    assert m is not None, note
    assert (m.group(1), int(m.group(2)), m.group(3), int(m.group(4))) == (
        "inputs", 2, "args[0][0]", 1)
    assert "hooks.tensors.walk.MAX_DEPTH" in note


def test_an_op_within_the_caps_has_no_notes():
    x = torch.randn(6, 4)
    ops, _ = _record(lambda: torch.unbind(x[:3]))
    op = _op(ops, "unbind")
    assert len(op.outputs) == 3 and op.notes == []
    assert "notes" not in op.to_dict()


class Splitter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 12)

    def forward(self, x):
        h = self.lin(x)
        return torch.stack(h.unbind(-1), 0).sum(0)


def test_step_into_a_model_carries_the_note_through_save_and_load(tmp_path):
    torch.manual_seed(3)
    model = Splitter()
    x = torch.randn(2, 4)
    with hooks.capture(model) as trace:
        model(x)
    ot = trace.ops("", 0)
    assert ot.diverged == ""
    op = _op(ot.ops, "unbind")
    cap = min(hooks.trace.ops.MAX_OP_TENSORS, hooks.tensors.walk.MAX_TENSORS)
    with torch.no_grad():
        h = model.lin(x)
    for i, info in enumerate(op.outputs):
        assert info.path == f"out[{i}]"
        _assert_stats(info, h[..., i])
    (note,) = op.notes
    m = OVER.match(note)
    assert (int(m.group(2)), int(m.group(3)), m.group(4)) == (cap, 12 - cap, f"out[{cap}]")
    stack = _op(ot.ops, "stack")  # 12 inputs in one list
    (snote,) = stack.notes
    sm = OVER.match(snote)
    assert (sm.group(1), int(sm.group(2)), int(sm.group(3)), sm.group(4)) == (
        "inputs", cap, 12 - cap, f"args[0][{cap}]")
    trace.save(tmp_path / "t.mdbtrace")
    back = hooks.Trace.load(tmp_path / "t.mdbtrace")
    ot2 = back.ops("", 0)
    assert _op(ot2.ops, "unbind").notes == [note]
    assert _op(ot2.ops, "stack").notes == [snote]
    # a trace saved before ops had notes (no "notes" key) still loads, with none
    d = ot.to_dict()
    for o in d["ops"]:
        o.pop("notes", None)
    old = OpTrace.from_dict(d)
    assert [o.notes for o in old.ops] == [[] for _ in ot.ops]
    assert [o.index for o in old.ops] == [o.index for o in ot.ops]


def _walk_order(obj, path="out"):
    """(path, tensor) of every distinct tensor of a nest of tuples/lists/dicts, in depth-first
    order — written out here, independently of hooks.tensors.walk."""
    out, ids = [], set()

    def visit(o, p):
        if isinstance(o, torch.Tensor):
            if id(o) not in ids:
                ids.add(id(o))
                out.append((p, o))
        elif isinstance(o, (tuple, list)):
            for i, v in enumerate(o):
                visit(v, f"{p}[{i}]")
        elif isinstance(o, dict):
            for k, v in o.items():
                visit(v, f"{p}.{k}")

    visit(obj, path)
    return out


def _many_pairs(n: int):
    """``n`` (k, v) pairs after a logits tensor; every 7th pair repeats the first pair's k (a
    shared tensor: recorded once, never counted as left out), every 5th holds a dict."""
    torch.manual_seed(4)
    logits = torch.randn(3, 5)
    pairs = []
    for i in range(n):
        k = pairs[0][0] if i % 7 == 6 and pairs else torch.randn(2) + i
        v = {"v": torch.randn(2) - i} if i % 5 == 4 else torch.randn(2) - i
        pairs.append((k, v))
    return {"logits": logits, "past_key_values": pairs}


def test_left_out_counts_a_nest_with_many_left_out_containers():
    obj = _many_pairs(600)
    cap = hooks.tensors.walk.MAX_TENSORS
    order = _walk_order(obj)
    assert len(order) > cap + 500
    tensors, others = [], []
    cut = LeftOut()
    find_tensors(obj, "out", tensors, others, left_out=cut)
    assert [p for p, _ in tensors] == [p for p, _ in order[:cap]]
    assert all(t is r for (_, t), (_, r) in zip(tensors, order[:cap], strict=True))
    assert (cut.over, cut.first_over) == (len(order) - cap, order[cap][0])
    assert (cut.deep, cut.first_deep) == (0, None)
    assert others == []


def test_left_out_counts_deep_and_over_together_as_the_capture_says(monkeypatch):
    monkeypatch.setattr(hooks.tensors.walk, "MAX_TENSORS", 40)
    # out.past_key_values[i][1].v is depth 4
    monkeypatch.setattr(hooks.tensors.walk, "MAX_DEPTH", 3)
    obj = _many_pairs(300)
    order = _walk_order(obj)

    def depth(p):
        return p.count("[") + p.count(".")

    shallow = [(p, t) for p, t in order if depth(p) <= 3]
    deep = [(p, t) for p, t in order if depth(p) > 3]
    # the walk records the first 40 shallow tensors; deep ones met before the cap is reached
    # are "deep", after it "over" (the walk no longer enters containers)
    recorded = shallow[:40]
    last = recorded[-1][0]
    cut_at = [p for p, _ in order].index(last)
    deep_before = [p for p, _ in order[:cut_at] if depth(p) > 3]
    over = len(order) - len(recorded) - len(deep_before)

    class Model(nn.Module):
        def forward(self, x):
            return obj

    m = Model()
    with hooks.capture(m) as tr:
        m(torch.zeros(1))
    rec = tr.call("")
    assert [o.path for o in rec.outputs] == [p for p, _ in recorded]
    for i in (0, 17, 39):
        _assert_stats(rec.outputs[i], recorded[i][1])
    notes = " | ".join(rec.notes)
    assert (f"outputs: 40 tensor(s) recorded, {over} not recorded (the first left out: "
            f"{order[cut_at + 1][0]})") in notes
    assert (f"outputs: {len(deep_before)} tensor(s) not recorded (the first left out: "
            f"{deep_before[0]})") in notes
    assert len(deep) >= len(deep_before) > 0


class Pieces(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 10)

    def forward(self, x):
        return list(self.lin(x).unbind(-1))


def test_stepping_into_a_call_with_more_outputs_than_the_cap_replays_without_diverging(
        monkeypatch):
    monkeypatch.setattr(hooks.tensors.walk, "MAX_TENSORS", 4)
    torch.manual_seed(5)
    model = nn.Sequential(Pieces())
    x = torch.randn(2, 3)
    with hooks.capture(model) as trace:
        model(x)
    assert len(trace.call("0").outputs) == 4  # the capture recorded the first 4 of 10
    ot = trace.ops("0", 0)
    assert ot.diverged == ""  # the replay's outputs are walked with the same cap
    op = _op(ot.ops, "unbind")
    with torch.no_grad():
        h = model[0].lin(x)
    for i, info in enumerate(op.outputs):
        _assert_stats(info, h[..., i])
    (note,) = op.notes
    m = OVER.match(note)
    assert (int(m.group(2)), int(m.group(3)), m.group(4), m.group(6)) == (
        4, 10 - 4, "out[4]", "hooks.tensors.walk.MAX_TENSORS")
