"""A call whose inputs or outputs hold more tensors than the capture's per-call cap (a KV cache
of many layers returned as (k, v) tuples, a module handed a list of pairs) records the first
``hooks.tensors.walk.MAX_TENSORS`` and says on the call how many it left out, where the first one is
and why; never that the containers past the cap are non-tensor parts."""

from __future__ import annotations

import re

import torch
from torch import nn

import hooks
import hooks.tensors.walk

NOTE = re.compile(
    r"^(inputs|outputs): (\d+) tensor\(s\) recorded, (\d+) not recorded "
    r"\(the first left out: (\S+)\): a call records at most (\d+) tensors per side"
)


class Cache(nn.Module):
    """Returns logits and a (k, v) pair per layer, as a nanoGPT-style model with a cache."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = layers
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        cache = [(h * (i + 1), h - i) for i in range(self.layers)]
        return {"logits": h.sum(-1), "past_key_values": cache}


class SumPairs(nn.Module):
    def forward(self, pairs, scale=None):
        return sum(a + b for a, b in pairs) * scale


class TakesPairs(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = layers
        self.sum = SumPairs()

    def forward(self, x):
        return self.sum([(x * i, x - i) for i in range(self.layers)], scale=x.mean())


def _cap_notes(rec) -> list[re.Match]:
    return [m for m in map(NOTE.match, rec.notes) if m]


def _assert_stats(info, t: torch.Tensor) -> None:
    ref = t.detach().double()
    st = info.stats
    assert info.shape == list(t.shape)
    assert st.numel == t.numel()
    assert abs(st.mean - ref.mean().item()) <= 1e-5 * (1 + abs(ref.mean().item()))
    assert abs(st.std - ref.std().item()) <= 1e-5 * (1 + ref.std().item())
    assert abs(st.min - ref.min().item()) <= 1e-6 * (1 + abs(ref.min().item()))
    assert abs(st.max - ref.max().item()) <= 1e-6 * (1 + abs(ref.max().item()))


def test_outputs_past_the_cap_are_counted_and_said_on_the_call():
    cap = hooks.tensors.walk.MAX_TENSORS
    layers = cap // 2 + 4
    torch.manual_seed(0)
    m = Cache(layers)
    x = torch.randn(3, 4)
    with hooks.capture(m) as tr:
        out = m(x)
    # the walk order, written out here: logits, then k, v of each layer
    paths = ["out.logits"] + [f"out.past_key_values[{i}][{j}]"
                              for i in range(layers) for j in range(2)]
    values = [out["logits"]] + [t for kv in out["past_key_values"] for t in kv]
    rec = tr.call("")
    assert [o.path for o in rec.outputs] == paths[:cap]
    for i in (0, 1, cap // 2, cap - 1):
        _assert_stats(rec.output(paths[i]), values[i])
    assert rec.output(paths[cap]) is None
    (note,) = _cap_notes(rec)
    assert note.group(1) == "outputs"
    assert int(note.group(2)) == cap
    assert int(note.group(3)) == len(paths) - cap == 2 * layers + 1 - cap
    assert note.group(4) == paths[cap]
    assert int(note.group(5)) == cap
    assert any("hooks.tensors.walk.MAX_TENSORS" in n for n in rec.notes)
    assert not any("non-tensor" in n for n in rec.notes)


def test_inputs_past_the_cap_are_counted_across_args_and_kwargs():
    cap = hooks.tensors.walk.MAX_TENSORS
    layers = cap // 2 + 3
    m = TakesPairs(layers)
    x = torch.randn(2, 5)
    with hooks.capture(m) as tr:
        m(x)
    pairs = [(x * i, x - i) for i in range(layers)]  # the same values the module built
    paths = [f"args[0][{i}][{j}]" for i in range(layers) for j in range(2)] + ["kwargs.scale"]
    values = [t for kv in pairs for t in kv] + [x.mean()]
    rec = tr.call("sum")
    assert [t.path for t in rec.inputs] == paths[:cap]
    for i in (1, cap // 3, cap - 1):
        _assert_stats(rec.inputs[i], values[i])
    (note,) = _cap_notes(rec)
    assert note.group(1) == "inputs"
    assert (int(note.group(2)), int(note.group(3))) == (cap, len(paths) - cap)
    assert note.group(4) == paths[cap] == f"args[0][{cap // 2}][0]"


def test_raising_the_cap_records_them_all_and_a_small_cap_cuts_mid_pair(monkeypatch):
    layers = 5
    m = Cache(layers)
    x = torch.randn(2, 4)
    monkeypatch.setattr(hooks.tensors.walk, "MAX_TENSORS", 2 * layers + 1)
    with hooks.capture(m) as tr:
        m(x)
    rec = tr.call("")
    assert len(rec.outputs) == 2 * layers + 1 and _cap_notes(rec) == []
    # logits, k0, v0, k1: v1 is the first out
    monkeypatch.setattr(hooks.tensors.walk, "MAX_TENSORS", 4)
    with hooks.capture(m) as tr:
        m(x)
    rec = tr.call("")
    assert len(rec.outputs) == 4
    (note,) = _cap_notes(rec)
    assert (int(note.group(2)), int(note.group(3))) == (4, 2 * layers + 1 - 4)
    assert note.group(4) == "out.past_key_values[1][1]"
    assert int(note.group(5)) == 4


class Deep(nn.Module):
    def forward(self, x):
        return x * 2, {"a": {"b": {"c": [[x + 1, x - 1]]}}}


def test_tensors_deeper_than_the_depth_cap_are_said_not_called_non_tensor():
    m = Deep()
    x = torch.randn(3)
    with hooks.capture(m) as tr:
        m(x)
    rec = tr.call("")
    assert [o.path for o in rec.outputs] == ["out[0]"]
    _assert_stats(rec.outputs[0], x * 2)
    # out[1].a.b.c is the 4th container level: the list inside it holds 2 tensors
    (note,) = [n for n in rec.notes if "deeper than" in n]
    assert note.startswith("outputs: 2 tensor(s) not recorded (the first left out: "
                           "out[1].a.b.c[0][0])")
    assert "hooks.tensors.walk.MAX_DEPTH" in note
    assert not any("non-tensor" in n for n in rec.notes)
