"""Outside text never drives the terminal: an ESC, BEL, C1 CSI or newline in a module name
(an ``nn.ModuleDict`` key), a run name (written into the database by other code) or a metric
name reaches the screen, the piped tables and the error line as a visible escape (``\\x1b``,
``\\n``: :func:`hooks.text.printable`), never as the raw byte; a newline in a metric name does
not split a table row. Each piped command's bytes are read as they are written; the step view's
text is read from its rendered screen (what the driver would draw, without its own styling)."""

from __future__ import annotations

import sqlite3
import time

import pytest
import torch
from torch import nn

import hooks
from hooks.store.store import RunStore
from tests.conftest import wait_until
from tui import cli
from tui.app import make_step_app

#: Two ModuleDict keys: an OSC that retitles the window (BEL-terminated), a CSI that clears it.
KEYS = ("a\x1b]0;pwned\x07", "b\x1b[2J")
SHOWN_KEYS = ("a\\x1b]0;pwned\\x07", "b\\x1b[2J")
RUN = "bad\x1b]0;pwned\x07run\x9b2J"
SHOWN_RUN = "bad\\x1b]0;pwned\\x07run\\x9b2J"
METRIC = "acc\x1b]0;pwned\x07\nsplit"
SHOWN_METRIC = "acc\\x1b]0;pwned\\x07\\nsplit"
RAW = ("\x1b", "\x07", "\x9b")


class Keyed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.d = nn.ModuleDict({KEYS[0]: nn.Linear(16, 16), KEYS[1]: nn.Linear(16, 50)})

    def forward(self, ids):
        return self.d[KEYS[1]](self.d[KEYS[0]](self.emb(ids)))


def make_model():
    """``--model`` entry point (mdb seeds torch before calling it)."""
    return Keyed(), torch.randint(0, 50, (2, 8))


MODEL = f"{__file__}:make_model"


def _screen_text(app) -> str:
    """The text of every cell of the screen as drawn (the screenshot's text runs in order)."""
    import html
    import re

    svg = app.export_screenshot()
    return "".join(html.unescape(t) for t in re.findall(r"<text [^>]*>([^<]*)</text>", svg))


def _clean(text: str) -> None:
    for byte in RAW:
        assert byte not in text, (byte, text)


@pytest.fixture(autouse=True)
def _no_columns(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture
def db(tmp_path):
    """A run store with a run whose name (set in SQLite), metric name and failure reason hold
    control characters."""
    path = tmp_path / "mdb.sqlite"
    with RunStore(path, create=True) as store:
        w = store.create_run("badrun", {"lr": 0.1}, total_steps=10, kind="api")
        w.log_steps([({"step": s, "wall": time.time(),
                       "values": {"loss": 2.0 / s, METRIC: 0.5}}, None, None)
                     for s in range(1, 6)])
        w.finish("failed", reason="boom\x1b[2J\nsecond line")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE runs SET name = ? WHERE name = 'badrun'", (RUN,))
    return str(path)


def test_summary_of_a_model_shows_the_module_names_escaped(capsys):
    assert cli.main(["summary", "--model", MODEL]) == 0
    out = capsys.readouterr().out
    _clean(out)
    rows = [line for line in out.splitlines() if "Linear" in line]
    assert len(rows) == 2 and SHOWN_KEYS[0] in rows[0] and SHOWN_KEYS[1] in rows[1]


def test_piped_diff_table_shows_the_calls_escaped(capsys, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for seed, path in (("0", a), ("1", b)):
        assert cli.main(["capture", "--model", MODEL, "--seed", seed, "--out", str(path)]) == 0
    capsys.readouterr()
    assert cli.main(["diff", str(a), str(b), "--table"]) == 0
    out = capsys.readouterr().out
    _clean(out)
    calls = [line for line in out.splitlines() if line.startswith(("fwd", "bwd"))]
    assert any(f"d.{SHOWN_KEYS[0]}#0" in line for line in calls)
    assert any(f"d.{SHOWN_KEYS[1]}#0" in line for line in calls)


def test_runs_lists_the_run_and_metric_escaped_one_row_each(capsys, db):
    assert cli.main(["runs", "--db", db]) == 0
    out = capsys.readouterr().out
    _clean(out)
    lines = out.splitlines()
    row = next(line for line in lines if line.startswith(SHOWN_RUN))
    assert row.endswith(f"loss, {SHOWN_METRIC}")  # the newline did not split the row
    assert "└ failed (boom\\x1b[2J\\nsecond line)" in out
    assert len(lines) == 4  # "runs in", the header, the run, its reason


def test_export_header_is_one_line_with_the_metric_escaped(capsys, db):
    assert cli.main(["export", RUN, "--db", db]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"step,loss,{SHOWN_METRIC}"
    assert lines[1:] == [f"{s},{2.0 / s!r},0.5" for s in range(1, 6)]


def test_an_error_line_that_repeats_run_names_is_one_escaped_line(capsys, db):
    assert cli.main(["export", "nope", "--db", db]) == 2
    err = capsys.readouterr().err
    _clean(err)
    assert err.count("\n") == 1 and err.startswith("mdb: error: no run named 'nope'")
    assert SHOWN_RUN in err


def test_compare_table_and_doctor_run_show_the_run_escaped(capsys, db, tmp_path):
    with RunStore(db) as store:
        w = store.create_run("good", {}, total_steps=5, kind="api")
        w.log_steps([({"step": 1, "wall": time.time(), "values": {"loss": 1.0}}, None, None)])
        w.finish("finished")
    assert cli.main(["compare", RUN, "good", "--db", db, "--table"]) == 0
    out = capsys.readouterr().out
    _clean(out)
    assert SHOWN_RUN in out and "failed (boom\\x1b[2J\\nsecond line)" in out
    assert cli.main(["doctor", "--run", RUN, "--db", db]) == 0
    out = capsys.readouterr().out
    _clean(out)
    assert out.startswith(f"run {SHOWN_RUN}: no finding")


@pytest.mark.asyncio
async def test_step_view_tree_details_status_gradients_and_search_show_names_escaped():
    torch.manual_seed(0)
    model, ids = make_model()
    with hooks.capture(model) as trace:
        model(ids).float().pow(2).mean().backward()
    app = make_step_app(trace)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        seen = []
        # the call of d[KEYS[0]] (3rd forward call: the root's comes first), the backward
        # pass, then the gradients view and the search box
        for key in ("n", "n", "b", "g", "s", "slash"):
            await pilot.press(key)
            await pilot.pause()
            shot = _screen_text(app).replace("\xa0", " ")
            _clean(shot)
            seen.append(shot)
        step_shot, grads_shot, search_shot = seen[1], seen[3], seen[5]
        assert f"forward · call 3/4 · d.{SHOWN_KEYS[0]}" in step_shot  # status line
        assert f"d.{SHOWN_KEYS[0]}  Linear #0" in step_shot  # the details' title
        assert SHOWN_KEYS[1] in step_shot  # the tree's label of the other key
        assert "backward · grad " in seen[2] and SHOWN_KEYS[1] in seen[2]
        assert f"{SHOWN_KEYS[0]}.weight" in grads_shot
        assert f"d.{SHOWN_KEYS[1]}" in search_shot
        await pilot.press("escape")
        await wait_until(pilot, lambda: type(app.screen).__name__ == "StepScreen")


def test_lens_k60_piped_at_80_columns_prints_every_token_within_the_width(capsys, monkeypatch):
    """``mdb lens --pos N --k 60`` at 80 columns: several tables of the ranks that fit, not one
    squeezed to its borders; the last layer's 60 probabilities are the model's own top 60."""
    from rich.cells import cell_len

    from minillm import MiniLLM, load_preset
    from tui.commands.inputs import batch_from_text, default_text_path, read_text, tokenizer_for

    monkeypatch.setenv("COLUMNS", "80")
    code = cli.main(["lens", "--preset", "tiny", "--seq-len", "12", "--batch-size", "1",
                     "--pos", "4", "--k", "60"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert max(cell_len(line) for line in lines) <= 80
    heads = [c.strip() for line in lines if line.startswith("layer ") for c in
             line.split("┃")[1:]]
    assert heads == [f"#{i}" for i in range(1, 61)]
    last = [c.strip() for line in lines if line.startswith("layers.1 ")
            for c in line.split("│")[1:]]
    torch.manual_seed(0)
    cfg = load_preset("tiny")
    text = read_text(default_text_path())
    ids = batch_from_text(text, tokenizer_for(text, cfg.vocab_size), 1, 12)
    with torch.no_grad():
        logits = MiniLLM(cfg)(ids).logits
    want = torch.softmax(logits[0, 4].double(), -1).topk(60).values.tolist()
    assert len(last) == 60
    assert [float(c.rsplit(" ", 1)[1]) for c in last] == pytest.approx(want, abs=6e-4)


@pytest.mark.asyncio
async def test_watch_screen_shows_the_run_and_metric_escaped_one_row_each(db):
    from tests.conftest import drawn
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    store, run = open_run(db, RUN)
    app = make_watch_app(store, run)
    try:
        async with app.run_test(size=(160, 40)) as pilot:
            await wait_until(pilot, lambda: app.live.polls >= 1)
            await drawn(pilot, app.live)
            shot = _screen_text(app).replace("\xa0", " ")
            _clean(shot)
            assert f"mdb watch · run {SHOWN_RUN} · " in shot
            assert "boom\\x1b[2J\\nsecond line" in shot  # how it ended, one line
            table = str(app.screen.query_one("#live-table").render()).splitlines()
            rows = [line for line in table if line.lstrip("▸ ").startswith("acc")]
            assert len(rows) == 1 and rows[0].split()[0].lstrip("▸").startswith("acc\\x1b]0")
            assert rows[0].split()[-3:] == ["0.5", "0.5", "0.5"]  # last, min, max on its row
            await pilot.press("q")
    finally:
        store.close()
