"""``mdb sweep``: the JSON and the printed table against the plain-torch reference of
``tests/hooks/whatif/test_sweep.py`` (one hooked run per cell), ``--attribution`` beside it with
the correlation, and bad input as one line with exit code 2."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.hooks.whatif.test_sweep import pair, ref_heads, ref_logit_diff, ref_loss, ref_positions
from tests.processes import main_rc

pytest.importorskip("transformers")

HERE = "tests.tui.commands.test_sweep_cli"


def corrupted():
    """``--model``: the tiny GPT-2 and its corrupted batch."""
    model, _, corrupt = pair("hf_gpt2")
    return model, corrupt


def clean():
    """``--source-batch``: the clean batch."""
    return pair("hf_gpt2")[1]


def short():
    """A clean batch of another length."""
    return {"input_ids": pair("hf_gpt2")[1]["input_ids"][:, :5]}


BASE = ["sweep", "--model", f"{HERE}:corrupted", "--source-batch", f"{HERE}:clean"]


def test_json_holds_the_sweep_and_the_attribution_beside_it(capsys):
    model, c, x = pair("hf_gpt2")
    ids = c["input_ids"]
    ref = ref_positions(model, c, x, lambda lg: ref_loss(lg, ids))
    assert main_rc([*BASE, "--json", "--attribution"]) == 0
    doc = json.loads(capsys.readouterr().out)
    exact = doc["exact"]
    assert exact["over"] == "layers×positions" and exact["metric"] == "loss"
    assert exact["rows"] == ["transformer.h.0", "transformer.h.1"]
    torch.testing.assert_close(torch.tensor(exact["values"], dtype=torch.float64), ref,
                               atol=1e-5, rtol=0)
    with torch.no_grad():
        assert exact["clean"] == pytest.approx(ref_loss(model(**c).logits, ids), abs=1e-5)
    est = doc["attribution"]
    assert est["method"] == "attribution" and est["shape"] == [2, 16]
    a, b = torch.tensor(est["values"]).flatten(), torch.tensor(exact["values"]).flatten()
    r = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    assert doc["correlation"] == pytest.approx(r, abs=1e-4)
    assert any("position 15" in n for n in exact["notes"])


def test_piped_heads_table_prints_each_value(capsys):
    model, c, x = pair("hf_gpt2")
    ref = ref_heads(model, c, x, lambda lg: ref_logit_diff(lg, 5, 7))
    assert main_rc([*BASE, "--over", "heads", "--metric", "logit_diff:5,7",
                    "--attribution"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("│")] for line in out.splitlines() if "│" in line]
    assert [r[0] for r in rows] == ["h.0", "h.1", "h.0", "h.1"]  # exact, then the estimate
    for layer, cells in enumerate(rows[:2]):
        assert [float(v) for v in cells[1:]] == pytest.approx(ref[layer].tolist(), abs=1e-4)
    line = next(x for x in out.splitlines() if x.startswith("correlation"))
    assert math.isfinite(float(line.rsplit(" ", 1)[1]))
    assert "\x1b[" not in out  # piped: no colour


@pytest.mark.parametrize("extra, says", [
    (["--over", "tokens"], "mdb: error: sweep: over='tokens': give one of layers×positions"),
    (["--metric", "acc"], "mdb: error: sweep: metric 'acc': give one of loss, logit_diff:A,B"),
    (["--metric", "logit_diff:1,9999"], "outside the vocabulary"),
])
def test_bad_over_or_metric_is_one_line(extra, says, capsys):
    assert main_rc([*BASE, *extra]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


def test_no_clean_batch_or_one_of_another_shape_is_one_line(capsys):
    assert main_rc(["sweep", "--model", f"{HERE}:corrupted"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mdb: error: sweep: give the clean batch") and err.count("\n") == 1
    assert main_rc(["sweep", "--model", f"{HERE}:corrupted", "--source-batch",
                    f"{HERE}:short"]) == 2
    err = capsys.readouterr().err
    assert "patching needs the same (B, T)" in err and err.count("\n") == 1


def test_in_a_terminal_each_cell_is_coloured_by_how_much_it_restores():
    from rich.console import Console

    import hooks
    from tui.commands.sweep import print_sweep

    s = hooks.Sweep("layers×positions", "loss", "patch", torch.tensor([[4.0, 2.0, 3.0]]),
                    ["model.layers.0"], clean=2.0, corrupt=4.0)
    console = Console(record=True, force_terminal=True, color_system="truecolor", width=80)
    print_sweep(console, s, ["0", "1", "2"], heat=True)
    out = console.export_text(styles=True)
    assert "\x1b[48;2;30;40;140m" in out  # 4.0: the corrupted end, nothing restored (blue)
    assert "\x1b[48;2;230;40;20m" in out  # 2.0: the clean end, all of it (red)
    assert "\x1b[48;2;130;100;80m" in out  # 3.0: half-way
    plain = Console(record=True, force_terminal=True, color_system="truecolor", width=80)
    print_sweep(plain, s, ["0", "1", "2"], heat=False)
    assert "48;2" not in plain.export_text(styles=True)
