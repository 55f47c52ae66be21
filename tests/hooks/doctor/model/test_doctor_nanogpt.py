"""``mdb doctor`` on a nanoGPT-shaped model (:mod:`tests.nanogpt_shaped`): last-position logits
without targets, its own cross-entropy against unshifted targets. No check ends in ERROR; the
label convention is measured (targets equal to the inputs train it to copy them); a small,
known look-ahead fails the causality check. Every expected value comes from the model's own
definition or from ``torch.nn.functional`` in the test, never from mdb."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hooks.doctor.model import CHECKS, run_checks
from tests import nanogpt_shaped as ng
from tui.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

FILE = Path(ng.__file__)
V = ng.GPTConfig.vocab_size


def by_key(results):
    return {r.key: r for r in results}


def _no_error_and_reasons(results):
    for r in results.values():
        assert r.status != "error", (r.key, r.evidence)
        if r.status in ("skip", "n/a"):
            assert len(r.evidence) > 20, (r.key, r.evidence)  # says why, in words


def test_the_model_is_shaped_like_nanogpt():
    """The premises, measured: one position without targets, all of them with, and a loss that
    scores position t against targets[:, t]."""
    model, (x, y) = ng.shifted()
    with torch.no_grad():
        short, none = model(x)
        logits, loss = model(x, y)
    assert short.shape == (4, 1, V) and none is None
    assert logits.shape == (4, 32, V)
    torch.testing.assert_close(short[:, 0], logits[:, -1])
    ref = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    assert float(loss) == pytest.approx(float(ref), rel=1e-6)


def test_next_token_targets_pass_every_check_with_real_numbers():
    model, batch = ng.shifted()
    res = by_key(run_checks(model, batch))
    _no_error_and_reasons(res)
    assert {k for k, r in res.items() if r.status in ("fail", "warn")} == set()
    assert res["init-loss"].status == "pass" and res["causality"].status == "pass"
    # init loss: the logits at every position against the next tokens, on random tokens. An
    # independent reference: the model's own logits on other random tokens of the same shape
    # score ln V + σ²/2 (σ: logits std); two samples of 4×32 tokens differ by a few 0.01 nats.
    d = res["init-loss"].data
    x = torch.randint(0, V, (4, 33), generator=torch.Generator().manual_seed(123))
    with torch.no_grad():
        logits, _ = model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
    ref = float(F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:-1].reshape(-1)))
    assert d["ln_v"] == pytest.approx(math.log(V), rel=1e-9)
    assert d["loss"] == pytest.approx(ref, abs=0.06)
    assert d["logits_std"] == pytest.approx(float(logits.std()), rel=0.1)
    assert d["tokens"] == 4 * 32
    # the label convention was measured, not assumed: the data loader shifts, the model does not
    assert d["labels"]["layout"] == "shifted" and d["labels"]["shift"] == 0
    assert d["labels"]["predicts_ahead"] == 1
    # causality: every position compared (the model was given targets to return them all)
    c = res["causality"].data
    assert c["seq_len"] == 32 and c["cut"] == 16 and c["leak"] == 0.0
    assert c["past_influence"] > 1e-3


def test_uniform_logits_score_exactly_ln_v():
    """A zero LM head (tied: a zero embedding too) gives uniform logits at every position:
    cross-entropy ln V whatever the tokens, which the check must report to float rounding."""
    model, batch = ng.shifted()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    r = by_key(run_checks(model, batch, only="init-loss"))["init-loss"]
    assert r.status == "pass"
    assert r.data["loss"] == pytest.approx(math.log(V), abs=1e-5)
    assert r.data["logits_std"] == 0.0
    assert r.data["labels"]["shift"] is None  # uniform logits cannot tell the conventions apart


def test_targets_equal_to_inputs_are_a_copy_task():
    model, (x, y) = ng.targets_equal_inputs()
    assert torch.equal(x, y)
    # ground truth, from the model's definition: its loss scores position t against y[:, t]
    with torch.no_grad():
        logits, loss = model(x, y)
    same = F.cross_entropy(logits.reshape(-1, V), x.reshape(-1))
    nxt = F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
    assert float(loss) == pytest.approx(float(same), rel=1e-6)
    assert abs(float(loss) - float(nxt)) > 0.1
    res = by_key(run_checks(model, (x, y)))
    _no_error_and_reasons(res)
    r = res["init-loss"]
    assert r.status == "fail"
    assert "trained to copy its input" in r.evidence and "does not shift" in r.evidence
    assert "next-token targets" in r.hint
    lab = r.data["labels"]
    assert lab["layout"] == "aligned" and lab["shift"] == 0 and lab["predicts_ahead"] == 0
    assert abs(lab["loss"] - lab["ce_same"]) <= lab["tolerance"] < abs(lab["loss"] - lab["ce_next"])
    assert res["causality"].status == "pass"  # the model is causal: only its labels are wrong
    assert {k for k, r in res.items() if r.failed} == {"init-loss"}


def test_shifted_targets_on_a_model_that_shifts_again_predict_two_ahead():
    model, batch = ng.shifted_twice()
    r = by_key(run_checks(model, batch, only="init-loss"))["init-loss"]
    assert r.status == "fail" and "two ahead" in r.evidence
    assert r.data["labels"]["shift"] == 1 and r.data["labels"]["predicts_ahead"] == 2
    # the same model with labels equal to the inputs is HF's convention: next-token training
    x, _ = batch
    ok = by_key(run_checks(model, (x, x.clone()), only="init-loss"))["init-loss"]
    assert ok.status == "pass" and ok.data["labels"]["predicts_ahead"] == 1


def test_inputs_alone_get_targets_from_mdb_to_see_every_position():
    model, x = ng.inputs_only()
    res = by_key(run_checks(model, x))
    _no_error_and_reasons(res)
    assert res["causality"].status == "pass" and res["causality"].data["seq_len"] == 32
    assert res["init-loss"].status == "pass"
    assert "labels" not in res["init-loss"].data  # no targets of the user's to judge


def test_a_model_that_cannot_return_every_position_skips_with_the_reason():
    model, x = ng.last_position_only()
    res = by_key(run_checks(model, x))
    _no_error_and_reasons(res)
    for key in ("init-loss", "causality"):
        assert res[key].status == "skip"
        assert "logits for 1 of 32 positions" in res[key].evidence
        assert "takes no targets" in res[key].evidence


# -- the causality tolerance ---------------------------------------------------------------------
LEAK = 1e-4


def test_a_small_known_look_ahead_fails_causality():
    """A leak of 1e-4 on logits of magnitude < 1: float rounding of a causal fp32 model is
    ~1e-7 there, so a check that lets 1e-4 through (a tolerance 100× the 64-ulp one, 7.6e-4)
    misses real look-ahead. The leak's size is exact by construction: changing token c moves
    the logits at c - 1 by ±LEAK at the old and new token."""
    model, batch = ng.leaking(LEAK)
    x, y = batch
    with torch.no_grad():
        base, _ = model(x, y)
        z = x.clone()
        z[:, 16:] = (z[:, 16:] + 1) % V
        moved, _ = model(z, y)
    assert float((moved[:, :16] - base[:, :16]).abs().max()) == pytest.approx(LEAK, rel=1e-3)
    assert float(base.abs().max()) < 1.0
    r = by_key(run_checks(model, batch, only="causality"))["causality"]
    assert r.status == "fail", r.evidence
    assert r.data["leak"] == pytest.approx(LEAK, rel=1e-3)
    assert r.data["first_leaking_position"] == r.data["cut"] - 1 == 15
    assert "must not see later tokens" in r.evidence


def test_the_same_model_without_the_leak_passes_causality():
    model, batch = ng.leaking(0.0)
    r = by_key(run_checks(model, batch, only="causality"))["causality"]
    assert r.status == "pass" and r.data["leak"] == 0.0


# -- on the command line -------------------------------------------------------------------------
def _table(capsys, factory: str, monkeypatch) -> tuple[int, list[str], str]:
    monkeypatch.delenv("COLUMNS", raising=False)
    rc = main(["doctor", "--model", f"{FILE}:{factory}", "--wide"])
    cap = capsys.readouterr()
    return rc, cap.out.splitlines(), cap.err


def test_cli_table_for_next_token_targets_has_no_error_and_exits_0(capsys, monkeypatch):
    rc, lines, err = _table(capsys, "shifted", monkeypatch)
    assert rc == 0, "\n".join(lines)
    assert lines[0].startswith("mdb doctor · GPT from ") and lines[1].startswith("kind: decoder")
    rows = [ln for ln in lines if ln.startswith("│")]
    assert len(rows) == len(CHECKS)  # one table, one row per check
    assert not any("ERROR" in ln or "FAIL" in ln for ln in rows)
    assert lines[-1].startswith(f"{len(CHECKS)} checks · ") and "error" not in lines[-1]
    assert err == ""


def test_cli_table_for_targets_equal_to_inputs_fails_check_1_and_exits_1(capsys, monkeypatch):
    rc, lines, err = _table(capsys, "targets_equal_inputs", monkeypatch)
    assert rc == 1
    rows = [ln for ln in lines if ln.startswith("│")]
    assert len(rows) == len(CHECKS) and not any("ERROR" in ln for ln in rows)
    assert "FAIL" in rows[0] and "copy its input" in rows[0]
    assert all("FAIL" not in ln for ln in rows[1:])
    assert err == ""
