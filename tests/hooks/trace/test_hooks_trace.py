"""Trace persistence (JSON + safetensors, no pickle) and Trace.diff."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import hooks
from hooks.trace.trace import JSON_NAME, SCHEMA_VERSION, TENSORS_NAME
from minillm import MiniLLM, load_preset


def tiny_model(**overrides) -> MiniLLM:
    torch.manual_seed(0)
    return MiniLLM(load_preset("tiny", **overrides))


IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))


def run(model, **kw) -> hooks.Trace:
    with hooks.capture(model, **kw) as tr:
        model(IDS, labels=IDS).loss.backward()
    model.zero_grad(set_to_none=True)
    return tr


def test_save_load_round_trip_is_equal(tmp_path):
    model = tiny_model()
    tr = run(model, keep_bytes=1 << 16, attention=True, meta={"preset": "tiny", "loss": [1.5]})
    tr.notes.append(hooks.Note("probe", "example", "model.layers.0", 0))
    path = tr.save(tmp_path / "step0.mdbtrace")
    assert sorted(p.name for p in path.iterdir()) == [TENSORS_NAME, JSON_NAME]
    back = hooks.Trace.load(path)
    assert back.forward == tr.forward
    assert back.backward == tr.backward
    assert back.params == tr.params
    assert back.modules == tr.modules
    assert back.notes == tr.notes
    assert back.meta == {"preset": "tiny", "loss": [1.5]}
    assert (back.model_type, back.step, back.captured) == ("MiniLLM", None, True)
    assert back.tensors.keys() == tr.tensors.keys()
    for k, v in tr.tensors.items():
        assert torch.equal(back.tensors[k], v)
    assert len(back.routing) == len(tr.routing) == 2
    for a, b in zip(tr.routing, back.routing, strict=True):
        assert a.to_dict() == b.to_dict()
        for name in ("top_k_ids", "top_k_weights", "router_probs", "tokens_per_expert"):
            assert torch.equal(getattr(a, name), getattr(b, name))
    for a, b in zip(tr.attention, back.attention, strict=True):
        assert a.to_dict() == b.to_dict() and torch.equal(a.probs, b.probs)
    # loading by the JSON file path works too, and a reloaded trace diffs to zero
    assert hooks.Trace.load(path / JSON_NAME).diff(back).is_zero()


def test_file_is_plain_json_and_safetensors_no_pickle(tmp_path):
    tr = run(tiny_model())
    path = tr.save(tmp_path / "t")
    data = json.loads((path / JSON_NAME).read_text())  # strict JSON parses
    assert data["schema"] == SCHEMA_VERSION and data["kind"] == "mdb-trace"
    raw = (path / TENSORS_NAME).read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])  # safetensors: a JSON header + raw bytes
    assert "routing/0/top_k_ids" in header
    for f in path.iterdir():
        assert b"\x80\x04" not in f.read_bytes()[:2]  # no pickle protocol marker


def test_nonfinite_statistics_survive_strict_json(tmp_path):
    model = nn.Linear(3, 3)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with hooks.capture(model) as tr:
        model(torch.ones(1, 3))
    back = hooks.Trace.load(tr.save(tmp_path / "inf"))
    st = back.forward[0].outputs[0].stats
    assert st.inf_count == 1 and back.first_nonfinite().module == ""


def test_load_rejects_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        hooks.Trace.load(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / JSON_NAME).write_text("{not json")
    with pytest.raises(hooks.TraceFormatError):
        hooks.Trace.load(bad)
    (bad / JSON_NAME).write_text(json.dumps({"kind": "mdb-trace", "schema": 999}))
    with pytest.raises(hooks.TraceFormatError, match="schema 999"):
        hooks.Trace.load(bad)
    (bad / JSON_NAME).write_text(json.dumps({"kind": "something-else"}))
    with pytest.raises(hooks.TraceFormatError):
        hooks.Trace.load(bad)
    (bad / JSON_NAME).write_text(json.dumps({"kind": "mdb-trace", "schema": SCHEMA_VERSION}))
    with pytest.raises(hooks.TraceFormatError, match="malformed"):
        hooks.Trace.load(bad)


def test_diff_of_identical_traces_is_zero():
    model = tiny_model()
    a = run(model, keep_bytes=1 << 20)
    b = run(model, keep_bytes=1 << 20)
    d = a.diff(b)
    assert d.is_zero() and d.max_abs_delta() == 0.0
    assert len(d.forward) == sum(len(r.outputs) for r in a.forward)
    assert len(d.backward) == len(a.backward)
    assert all(x.max_abs_diff == 0.0 for x in d.forward if x.max_abs_diff is not None)
    assert not d.only_in_self and not d.only_in_other


def test_diff_after_an_update_reports_the_change():
    model = tiny_model()
    a = run(model, keep_bytes=1 << 22)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # tied: the embedding scales too
    b = run(model, keep_bytes=1 << 22)
    d = a.diff(b)
    assert not d.is_zero()
    emb = next(x for x in d.forward if x.module == "model.embed_tokens")
    sa, sb = (
        a.call("model.embed_tokens").outputs[0].stats,
        b.call("model.embed_tokens").outputs[0].stats,
    )
    assert emb.delta["l2"] == pytest.approx(sb.l2 - sa.l2)
    assert emb.delta["l2"] == pytest.approx(0.5 * sa.l2, rel=1e-5)
    ka = a.call("model.embed_tokens").outputs[0].kept
    kb = b.call("model.embed_tokens").outputs[0].kept
    ref = (b.tensors[kb] - a.tensors[ka]).abs().max().item()
    assert emb.max_abs_diff == pytest.approx(ref)
    w = d.params["model.embed_tokens.weight"]["weight_norm"]
    assert w == pytest.approx(0.5 * a.params["model.embed_tokens.weight"].weight_norm, rel=1e-5)
    assert d.top(1, "l2")[0].delta["l2"] != 0.0


def test_diff_gqa_vs_mha_reports_shape_change_and_missing_records():
    gqa = run(tiny_model())
    mha = run(tiny_model(num_key_value_heads=4))
    d = gqa.diff(mha)
    k = next(x for x in d.forward if x.module == "model.layers.0.self_attn.k_proj")
    assert (k.shape_self, k.shape_other) == ([2, 12, 16], [2, 12, 32])
    assert not d.is_zero()
    q = next(x for x in d.forward if x.module == "model.layers.0.self_attn.q_proj")
    assert q.shape_self == q.shape_other
    # routing is compared per layer
    assert ("model.layers.0.mlp", 0) in d.routing


def test_unsampled_step_trace_round_trips(tmp_path):
    model = nn.Linear(2, 2)
    with hooks.capture(model, step=3, every=2) as tr:
        model(torch.ones(1, 2))
    back = hooks.Trace.load(tr.save(tmp_path / "s3"))
    assert back.captured is False and back.step == 3 and back.forward == []


def test_corrupt_tensor_file_is_a_format_error(tmp_path):
    tr = run(tiny_model())
    path = tr.save(tmp_path / "c")
    (path / TENSORS_NAME).write_bytes(b"\x00\x01garbage")
    with pytest.raises(hooks.TraceFormatError, match="safetensors"):
        hooks.Trace.load(path)


def test_from_dict_checks_schema():
    with pytest.raises(hooks.TraceFormatError, match="schema"):
        hooks.Trace.from_dict({"kind": "mdb-trace", "schema": 0, "forward": []}, {})
