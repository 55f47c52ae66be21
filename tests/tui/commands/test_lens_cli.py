"""``mdb lens``: the printed table against the model run here without mdb (its own logits give
the last layer's column), and bad input as one line with exit code 2."""

from __future__ import annotations

import pytest
import torch

from minillm import MiniLLM, load_preset
from tui import cli


@pytest.fixture(autouse=True)
def _no_columns(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)


def _reference(seq_len: int):
    """The tiny model, batch and tokenizer mdb builds for --preset tiny (same seed)."""
    from tui.commands.inputs import batch_from_text, default_text_path, read_text, tokenizer_for

    torch.manual_seed(0)
    cfg = load_preset("tiny")
    text = read_text(default_text_path())
    tok = tokenizer_for(text, cfg.vocab_size)
    ids = batch_from_text(text, tok, 1, seq_len)
    model = MiniLLM(cfg)
    with torch.no_grad():
        logits = model(ids).logits
    return ids, logits, tok


def _rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("│")] for line in out.splitlines() if "│" in line]


def test_mdb_lens_prints_positions_by_layers_and_the_last_layer_is_the_models_own(capsys):
    ids, logits, tok = _reference(12)
    code = cli.main(["lens", "--preset", "tiny", "--seq-len", "12", "--batch-size", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "model.norm → lm_head" in out
    header = next(line for line in out.splitlines() if "layers.0" in line)
    assert "layers.1" in header and "input" in header and "next" in header
    rows = _rows(out)
    assert len(rows) == 12
    probs = torch.softmax(logits[0].double(), -1)
    for p, cells in enumerate(rows):
        assert cells[0] == str(p)
        assert cells[1] == tok.token_strings([int(ids[0, p])])[0]
        want = int(probs[p].argmax())
        text, prob = cells[-1].rsplit(" ", 1)
        assert text == tok.token_strings([want])[0]
        assert float(prob) == pytest.approx(float(probs[p, want]), abs=6e-4)


def test_mdb_lens_at_one_position_lists_the_top_k_of_every_layer(capsys):
    _, logits, tok = _reference(12)
    code = cli.main(["lens", "--preset", "tiny", "--seq-len", "12", "--batch-size", "1",
                     "--pos", "4", "--k", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "top 3 at position 4" in out
    rows = _rows(out)
    assert [r[0] for r in rows] == ["layers.0", "layers.1"]
    want = torch.softmax(logits[0, 4].double(), -1).topk(3).indices.tolist()
    assert [c.rsplit(" ", 1)[0] for c in rows[1][1:]] == tok.token_strings(want)


@pytest.mark.parametrize("argv, message", [
    (["--pos", "12"], "--pos 12: the batch has 12 positions (0..11)"),
    (["--row", "1"], "--row 1: the batch has 1 sequences (0..0)"),
    (["--k", "0"], "argument --k: must be a positive integer"),
    (["--model", "samples/user_models.py:small_cnn"], "logit lens: "),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    base = [] if "--model" in argv else ["--preset", "tiny", "--seq-len", "12",
                                         "--batch-size", "1"]
    try:
        code = cli.main(["lens", *base, *argv])
    except SystemExit as exc:  # argparse's own one line
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and message in err
