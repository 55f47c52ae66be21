"""``mdb ablate``: the variants (hooks.train.ablate), bad input (one line, exit 2, nothing left
behind), and real ablations run headless in worker processes: parameter columns against
``sum(p.numel())`` of each variant's model, held-out CE against an independent evaluation of
the stored checkpoint, the RoPE length study, Ctrl-C, and a worker that fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hooks.store.rows import pid_alive
from hooks.store.store import RunStore
from hooks.train.ablate import AblateError, expand_variants, parse_vary
from minillm import CharTokenizer, MiniLLM, MiniLLMConfig, load_preset
from tests.conftest import REPO, SAMPLES, TINY_TOML, terminal_signals, wait_for
from tui.cli import main

# -- variants -----------------------------------------------------------------------------------


def test_named_ablations_change_only_their_field():
    base = load_preset("default")  # 8 heads, 2 KV heads, 8 experts
    vs = expand_variants(base, [parse_vary("attention=mha,gqa,mqa")], seq_len=64)
    assert [v.name for v in vs] == ["abl-attention=mha", "abl-attention=gqa",
                                    "abl-attention=mqa"]
    assert [v.config.num_key_value_heads for v in vs] == [8, 2, 1]
    for v in vs:
        diff = {k for k, x in v.config.to_dict().items() if base.to_dict()[k] != x}
        assert diff <= {"num_key_value_heads"}
    # gqa from an MQA base: the smallest KV-head count between 1 and H
    test_c = load_preset("seed-test-c")  # 4 heads, 1 KV head
    (gqa,) = expand_variants(test_c, [parse_vary("attention=gqa")], seq_len=32)
    assert gqa.config.num_key_value_heads == 2
    pos = expand_variants(base, [parse_vary("positions=rope,learned")], seq_len=64)
    assert [v.config.position_embedding for v in pos] == ["rope", "learned"]
    ffn = expand_variants(base, [parse_vary("ffn=moe,dense")], seq_len=64)
    assert [v.config.num_local_experts for v in ffn] == [8, 0]
    assert ffn[1].config.intermediate_size == base.intermediate_size  # one FFN of width I


def test_combinations_and_raw_fields():
    base = load_preset("tiny")
    vs = expand_variants(base, [parse_vary("attention=mha,mqa"), parse_vary("ffn=moe,dense")],
                         seq_len=16, prefix="x-")
    assert [v.name for v in vs] == ["x-attention=mha+ffn=moe", "x-attention=mha+ffn=dense",
                                    "x-attention=mqa+ffn=moe", "x-attention=mqa+ffn=dense"]
    assert [(v.config.num_key_value_heads, v.config.num_local_experts) for v in vs] == [
        (4, 4), (4, 0), (1, 4), (1, 0)]
    raw = expand_variants(base, [parse_vary("num_key_value_heads=1,2,4")], seq_len=16)
    assert [v.config.num_key_value_heads for v in raw] == [1, 2, 4]
    tied = expand_variants(base, [parse_vary("tie_word_embeddings=true,false")], seq_len=16)
    assert [v.config.tie_word_embeddings for v in tied] == [True, False]


def test_rope_study_variants():
    base = load_preset("tiny")  # max_position_embeddings 128
    vs = expand_variants(base, [parse_vary("rope_scaling=none,linear,dynamic")], seq_len=64)
    assert [v.config.max_position_embeddings for v in vs] == [256, 256, 256]  # room for 4T
    assert vs[0].config.rope_scaling is None
    assert vs[1].config.rope_scaling == {"rope_type": "linear", "factor": 4.0,
                                         "original_max_position_embeddings": 64}
    assert vs[2].config.rope_scaling["rope_type"] == "dynamic"
    assert vs[2].config.original_max_position_embeddings == 64


@pytest.mark.parametrize("spec, message", [
    ("attention", "write FIELD=VALUE,VALUE"),
    ("attention=", "empty value"),
    ("attention=mha,,gqa", "empty value"),
    ("attention=mha,mha", "given twice"),
    ("attention=mla", "unknown value 'mla'; choose from mha, gqa, mqa"),
    ("widht=1,2", "not an ablation"),
    ("rope_scaling=yarn", "unknown value 'yarn'"),
])
def test_bad_vary(spec, message):
    with pytest.raises(AblateError, match=message):
        parse_vary(spec)


def test_bad_variants():
    base = load_preset("tiny")
    with pytest.raises(AblateError, match="given twice"):
        expand_variants(base, [parse_vary("ffn=moe"), parse_vary("ffn=dense")], seq_len=8)
    with pytest.raises(AblateError, match="num_key_value_heads=3: num_attention_heads"):
        expand_variants(base, [parse_vary("num_key_value_heads=1,3")], seq_len=8)
    with pytest.raises(AblateError, match="'two' is not int"):
        expand_variants(base, [parse_vary("num_key_value_heads=two")], seq_len=8)
    with pytest.raises(AblateError, match="rope_scaling needs position_embedding"):
        expand_variants(base, [parse_vary("positions=learned"),
                               parse_vary("rope_scaling=linear")], seq_len=8)
    two_heads = MiniLLMConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(AblateError, match="no KV-head count strictly between"):
        expand_variants(two_heads, [parse_vary("attention=gqa")], seq_len=8)
    with pytest.raises(AblateError, match="invalid run name"):
        expand_variants(base, [parse_vary("attention=mha")], seq_len=8, prefix="a b")


@pytest.mark.parametrize("extra, message", [
    (["--vary", "attention=mla"], "unknown value 'mla'"),
    (["--vary", "attention=mha", "--vary", "attention=gqa"], "given twice"),
    ([], "give at least one --vary"),
    (["--vary", "positions=learned", "--vary", "rope_scaling=linear"],
     "rope_scaling needs position_embedding"),
    (["--vary", "attention=mha", "--seq-len", "4000"], "not more than one window"),
    (["--vary", "rope_scaling=none", "--seq-len", "400"], "fewer than an evaluation window"),
    (["--vary", "attention=mha", "--held-out", "1.5"], "--held-out must be between 0 and 1"),
    (["--vary", "attention=mha", "--eval-lengths", "8,x"], "--eval-lengths"),
    (["--vary", "attention=mha", "--preset", "nope"], "unknown preset"),
    (["--vary", "attention=mha", "--text", "/no/such.txt"], "no such file"),
    (["--vary", "hidden_size=1000000000"], "variant hidden_size=1000000000: this model and "
                                           "batch need at least"),
])
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, extra, message):
    db = tmp_path / "runs" / "mdb.sqlite"
    code = main(["ablate", "--headless", "--db", str(db), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("mdb: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()  # no database, no checkpoint directory


def test_an_existing_run_name_is_refused(tmp_path, capsys):
    db = tmp_path / "mdb.sqlite"
    with RunStore(db, create=True) as store:
        store.create_run("abl-attention=gqa", {}).finish("finished")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["ablate", "--headless", "--db", str(db), "--vary", "attention=mha,gqa"]) == 2
    assert "run 'abl-attention=gqa' already exists" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    with RunStore(db) as store:
        assert [r.name for r in store.runs()] == ["abl-attention=gqa"]


# -- real ablations -------------------------------------------------------------------------------


#: TINY_TOML with 4 query heads and 2 KV heads, so that MHA, GQA and MQA all exist.
ABL_TOML = TINY_TOML.replace("num_attention_heads = 2", "num_attention_heads = 4").replace(
    "num_key_value_heads = 1", "num_key_value_heads = 2")


def _ablate(tmp_path, *args, steps=20, timeout=240, **popen):
    toml = tmp_path / "tiny.toml"
    toml.write_text(ABL_TOML)
    db = tmp_path / "mdb.sqlite"
    cmd = [sys.executable, "-m", "tui.cli", "ablate", "--headless", "--config", str(toml),
           "--db", str(db), "--steps", str(steps), "--seq-len", "16", "--batch-size", "4",
           "--heartbeat", "0.2", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    if popen:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=terminal_signals), db
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc, db


def _row(out: str, label: str) -> list[str]:
    line = next(ln for ln in out.splitlines() if ln.startswith(label + " ") or
                ln.startswith(label + "│"))
    return [c.strip() for c in line.split("│")[1:]]


def _model_of(run) -> MiniLLM:
    return MiniLLM(MiniLLMConfig.from_dict(run.config["resolved_model_config"]))


@pytest.mark.slow
def test_headless_attention_ablation_numbers_equal_the_models(tmp_path):
    proc, db = _ablate(tmp_path, "--vary", "attention=mha,gqa,mqa")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    out = proc.stdout
    with RunStore(db) as store:
        runs = {r.name: r for r in store.runs()}
        names = ["abl-attention=mha", "abl-attention=gqa", "abl-attention=mqa"]
        assert sorted(runs) == sorted(names)
        models = [_model_of(runs[n]) for n in names]
        assert [m.config.num_key_value_heads for m in models] == [4, 2, 1]
        params = [sum(p.numel() for p in m.parameters()) for m in models]
        attn = [sum(p.numel() for p in m.model.layers[0].self_attn.parameters())
                for m in models]
        assert _row(out, "params") == [f"{n:,}" for n in params]
        assert _row(out, "attn params/layer") == [f"{n:,}" for n in attn]
        # KV bytes from a real cache of each model
        kv = []
        for m in models:
            with torch.no_grad():
                past = m(torch.zeros(1, 3, dtype=torch.long), use_cache=True).past_key_values
            kv.append(sum(k.numel() * 4 + v.numel() * 4 for k, v in past) // 3)
        assert _row(out, "KV bytes/token fp32") == [f"{n:,}" for n in kv]
        assert _row(out, "status") == ["finished"] * 3
        assert _row(out, "step") == ["20/20"] * 3
        # same text, seed and steps; only the attention differs
        cfgs = [runs[n].config for n in names]
        for key in ("text", "seed", "steps", "seq_len", "lr", "held_out"):
            assert len({str(c[key]) for c in cfgs}) == 1, key
        # the held-out CE is what the stored weights give on the held-out windows
        run = runs["abl-attention=gqa"]
        model = _model_of(run).eval()
        ckpt = Path(db.parent / run.checkpoint_path)
        from safetensors.torch import load_file

        model.load_state_dict(load_file(ckpt / "model.safetensors"), strict=False)
        model.tie_weights()
        text = run.config["text"]
        ids = torch.tensor(CharTokenizer.from_text(text).encode(text))
        held = ids[len(ids) - round(len(ids) * 0.2):]
        windows = held[: (min(16, len(held) // 16)) * 16].view(-1, 16)
        with torch.no_grad():
            logits = model(windows).logits
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                             windows[:, 1:].reshape(-1)).item()
        logged = store.last_metrics(run.id).values["ce@16"]
        assert abs(logged - ce) < 1e-5
        assert _row(out, "held-out ce@16")[1] == f"{logged:.4f}"


@pytest.mark.slow
def test_rope_length_study_reports_ce_at_T_2T_4T(tmp_path):
    proc, db = _ablate(tmp_path, "--vary", "rope_scaling=none,linear,dynamic", "--jobs", "3")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    with RunStore(db) as store:
        vals = {}
        for r in store.runs():
            assert r.config["resolved_model_config"]["max_position_embeddings"] >= 64
            vals[r.name.split("=")[1]] = store.last_metrics(r.id).values
    for v in vals.values():
        assert {"ce@16", "ce@32", "ce@64"} <= set(v)
    # dynamic NTK trains exactly like plain RoPE (no scaling up to T): same weights, same CE
    # at T; past T it rotates differently
    assert vals["dynamic"]["ce@16"] == vals["none"]["ce@16"]
    assert vals["dynamic"]["ce"] == vals["none"]["ce"]
    assert vals["dynamic"]["ce@64"] != vals["none"]["ce@64"]
    for label in ("held-out ce@16", "held-out ce@32", "held-out ce@64"):
        assert len(_row(proc.stdout, label)) == 3


def _wait_runs(db: Path, names, min_step: int, timeout: float = 120) -> None:
    def reached() -> bool:
        try:
            with RunStore(db) as store:
                steps = {r.name: r.last_step for r in store.runs()}
        except Exception:
            return False
        return all(steps.get(n, 0) >= min_step for n in names)

    wait_for(reached, timeout, f"runs {', '.join(names)} to reach step {min_step}")


@pytest.mark.slow
def test_ctrl_c_stops_every_worker_cleanly(tmp_path):
    proc, db = _ablate(tmp_path, "--vary", "attention=mha,gqa,mqa", "--jobs", "2",
                       steps=100_000, popen=True)
    try:
        _wait_runs(db, ["abl-attention=mha", "abl-attention=gqa"], 3)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the foreground process
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "stopping (SIGINT)" in err and "Traceback" not in err + out
    with RunStore(db) as store:
        runs = {r.name: r for r in store.runs()}
    assert set(runs) == {"abl-attention=mha", "abl-attention=gqa"}  # mqa never started
    for r in runs.values():
        assert r.status == "interrupted" and r.reason == "SIGINT"
        assert r.checkpoint_step == r.last_step  # checkpointed where it stopped
    assert _row(out, "status") == ["interrupted (SIGINT)"] * 2 + ["not started (SIGINT)"]


@pytest.mark.slow
def test_failing_and_killed_workers_are_reported_with_their_reason(tmp_path):
    # --lr 1e30: the first update makes the weights enormous and the loss non-finite
    proc, db = _ablate(tmp_path, "--vary", "attention=mha,mqa", "--lr", "1e30", steps=50)
    assert proc.returncode == 1, proc.stderr
    status = _row(proc.stdout, "status")
    assert all(s.startswith("failed") for s in status), status
    with RunStore(db) as store:
        assert all("non-finite" in (r.reason or "") for r in store.runs())
    # a worker killed outright (kill -9) cannot say anything: the table says how it ended
    (tmp_path / "k").mkdir()
    proc, db = _ablate(tmp_path / "k", "--vary", "attention=mha,mqa", steps=100_000,
                       popen=True)
    try:
        _wait_runs(db, ["abl-attention=mha", "abl-attention=mqa"], 2)
        with RunStore(db) as store:
            victim = store.run("abl-attention=mqa").pid
        os.kill(victim, signal.SIGKILL)
        # mdb ablate reaps its worker when it sees it ended: then the pid is gone
        wait_for(lambda: not pid_alive(victim), 120, "mdb ablate to see its worker killed")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _row(out, "status") == ["interrupted (SIGINT)", "worker killed by SIGKILL"], out


def test_samples_text_is_long_enough_for_the_defaults():
    text = (SAMPLES / "alice.txt").read_text(encoding="utf-8")
    assert len(text) * 0.2 >= 4 * 32  # the RoPE study's 4T at the default T = 32
