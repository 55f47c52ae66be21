"""``mdb doctor`` finds a model's attention where the step view does: a softmax attention in a
module whose class and children are named like nothing mdb knows (``Mixer`` with ``wqkv``)
is measured by the GQA check, not reported as "no attention module found".

The models are factories for
``--model tests/hooks/doctor/model/test_doctor_attention_found.py:FUNCTION``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hooks.doctor.model import run_checks
from tests.conftest import REPO
from tui.cli import main
from tui.commands.capturing import capture_step
from tui.commands.workload import load_user_workload

V, T = 64, 12
SPEC = "tests/hooks/doctor/model/test_doctor_attention_found.py"


class Mixer(nn.Module):
    """Causal grouped-query softmax attention: one fused q|k|v projection (``wqkv``, H=4
    query heads, 2 key/value heads), KV heads expanded with ``repeat_interleave`` (or with
    ``repeat``, a known mistake, when ``tiled``)."""

    def __init__(self, d: int = 32, n_heads: int = 4, n_kv_heads: int = 2, tiled=False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d // n_heads
        self.wqkv = nn.Linear(d, (n_heads + 2 * n_kv_heads) * self.head_dim)
        self.proj = nn.Linear(d, d)
        self.tiled = tiled

    def forward(self, x):
        b, t, _ = x.shape
        h, g, dh = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([h * dh, g * dh, g * dh], dim=-1)
        q = q.view(b, t, h, dh).transpose(1, 2)
        k = k.view(b, t, g, dh).transpose(1, 2)
        v = v.view(b, t, g, dh).transpose(1, 2)
        if self.tiled:
            k, v = k.repeat(1, h // g, 1, 1), v.repeat(1, h // g, 1, 1)
        else:
            k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(dh)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, h * dh))


class Layer(nn.Module):
    def __init__(self, d: int = 32, tiled=False):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mix = Mixer(d, tiled=tiled)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.mix(self.norm1(x))
        return x + self.ff(self.norm2(x))


class Net(nn.Module):
    def __init__(self, d: int = 32, tiled=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(T, d)
        self.layers = nn.ModuleList([Layer(d, tiled) for _ in range(2)])
        self.head = nn.Linear(d, V)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1),
                                                            targets.flatten())
        return logits, loss


def _batch():
    x = torch.randint(0, V, (2, T + 1), generator=torch.Generator().manual_seed(0))
    return x[:, :-1], x[:, 1:]


def build():
    torch.manual_seed(0)
    return Net(), _batch()


def build_tiled():
    torch.manual_seed(0)
    return Net(tiled=True), _batch()


def test_the_doctor_measures_the_attention_the_step_view_records():
    trace = capture_step(load_user_workload(f"{REPO / SPEC}:build"))
    recorded = sorted({a.module for a in trace.attention})
    assert recorded == ["layers.0.mix", "layers.1.mix"]  # what the attention view shows
    model, batch = build()
    (res,) = run_checks(model, batch, only="gqa")
    assert res.status == "pass", res.evidence
    assert "no attention module" not in res.evidence
    assert res.evidence.startswith("2 attention layer(s): perturbing K (k part of wqkv)")
    assert "h // 2 == g (H=4, Hkv=2)" in res.evidence


def test_the_doctor_catches_tiled_kv_heads_in_such_a_module():
    model, batch = build_tiled()
    (res,) = run_checks(model, batch, only="gqa")
    assert res.status == "fail" and res.module == "layers.0.mix"
    assert "`repeat` (tiling) used where `repeat_interleave` belongs" in res.evidence


def test_mdb_doctor_cli_names_the_attention_it_measured(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code = main(["doctor", "--model", f"{SPEC}:build", "--only", "gqa", "--wide"])
    out = capsys.readouterr().out
    assert code == 0, out
    row = next(line for line in out.splitlines() if "GQA head grouping" in line)
    assert "PASS" in row and "h // 2 == g" in row and "no attention module" not in out


def test_a_model_with_no_attention_at_all_is_still_not_applicable():
    model = nn.Sequential(nn.Embedding(V, 16), nn.Linear(16, V))
    (res,) = run_checks(model, torch.randint(0, V, (2, T)), only="gqa")
    assert res.status == "n/a" and res.evidence == "no attention module found"
