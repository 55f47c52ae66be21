"""Outside text never drives the terminal, in the views on top of the step view and the commands
that print a run's end: a module name holding an OSC (``nn.ModuleDict`` key
``m\\x1b]0;pwned\\x07``, the whole MoE model under it) and token texts holding a CSI or a C1
CSI byte (``\\x9b``) reach the router, attention, ops (``i``), edit form (``e``) and what-if,
lens (``L``) screens, ``mdb diff --dtype`` and ``mdb lens`` piped, and a failed run's error
line as visible escapes (:func:`hooks.text.printable`), never as raw bytes. Screens are read
from their rendered text (the screenshot's text runs, as the driver would draw them)."""

from __future__ import annotations

import html
import re

import pytest
import torch
from torch import nn

import hooks
from tests.conftest import wait_until
from tui import cli
from tui.app import make_step_app

KEY = "m\x1b]0;pwned\x07"
SHOWN_KEY = "m\\x1b]0;pwned\\x07"
#: Token texts: even positions start with the one-byte CSI, odd ones end with a CSI clear.
TOKENS = [f"t{i}\x1b[2J" if i % 2 else f"\x9bq{i}" for i in range(8)]
SHOWN_TOKENS = [f"t{i}\\x1b[2J" if i % 2 else f"\\x9bq{i}" for i in range(8)]
RAW = ("\x1b", "\x07", "\x9b")
SIZE = (220, 50)


class Wrapped(nn.Module):
    """minillm's tiny MoE under a ModuleDict key with an OSC in it."""

    def __init__(self) -> None:
        super().__init__()
        from minillm import MiniLLM, load_preset

        self.d = nn.ModuleDict({KEY: MiniLLM(load_preset("tiny"))})

    def forward(self, ids):
        return self.d[KEY](ids)

    def get_output_embeddings(self):
        """minillm's LM head (the logit lens reads it)."""
        return self.d[KEY].lm_head


def make_model():
    """``--model`` entry point: the model and one sequence of 8 tokens labelled ``TOKENS``."""
    ids = torch.randint(0, 256, (1, 8))
    return Wrapped(), hooks.Batch((ids,), token_text=TOKENS)


MODEL = f"{__file__}:make_model"


def _screen_text(app) -> str:
    svg = app.export_screenshot()
    text = "".join(html.unescape(t) for t in re.findall(r"<text [^>]*>([^<]*)</text>", svg))
    return text.replace("\xa0", " ")


def _clean(text: str) -> None:
    for byte in RAW:
        assert byte not in text, (byte, text)


@pytest.fixture(scope="module")
def trace():
    from tui.commands.capturing import capture_step
    from tui.commands.workload import load_user_workload

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        return capture_step(load_user_workload(MODEL))
    finally:
        torch.set_num_threads(threads)


def test_the_model_is_what_the_views_are_shown(trace):
    """The fixture: routing and attention recorded under the key, the tokens labelled."""
    assert [r.module for r in trace.routing] == [f"d.{KEY}.model.layers.{i}.mlp" for i in (0, 1)]
    assert [r.module for r in trace.attention] == [
        f"d.{KEY}.model.layers.{i}.self_attn" for i in (0, 1)]
    assert trace.meta["tokens"] == TOKENS


@pytest.mark.asyncio
async def test_router_view_shows_the_module_and_the_tokens_escaped(trace):
    from tui.screens.router import RouterScreen

    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("r")
        await wait_until(pilot, lambda: isinstance(app.screen, RouterScreen))
        await pilot.pause()
        shot = _screen_text(app)
        _clean(shot)
        assert f"router · layer 0 (1/2) · d.{SHOWN_KEY}.model.layers.0.mlp · E=4 top-2" in shot
        # each token's text (its first 6 characters), escaped: the CSI byte as \x9b, ESC as \x1b
        table = app.screen.query_one("#tokens")
        assert [str(table.get_row_at(i)[1]) for i in range(8)] == SHOWN_TOKENS
        await pilot.press("s")


@pytest.mark.asyncio
async def test_attention_view_shows_the_module_and_the_token_labels_escaped(trace):
    from tui.screens.attention import AttentionScreen

    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("a")
        await wait_until(pilot, lambda: isinstance(app.screen, AttentionScreen))
        await pilot.pause()
        shot = _screen_text(app)
        _clean(shot)
        assert f"sequence 1/1 · d.{SHOWN_KEY}.model.layers.0.self_attn" in shot
        assert "keys " + " ".join(SHOWN_TOKENS) in shot  # the keys, one label each
        grid = str(app.screen.query_one("#grid").render())
        rows = [line for line in grid.splitlines() if "│" in line]
        assert [line.split("│")[0][4:].rstrip() for line in rows] == \
            [t[:6] for t in SHOWN_TOKENS]  # each query row's label, cut to 6


@pytest.mark.asyncio
async def test_step_into_shows_the_ops_module_escaped(trace):
    from tui.screens.ops import OpsScreen

    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        app.screen.jump(f"d.{KEY}.model.layers.0.self_attn")
        await pilot.press("i")
        await wait_until(pilot, lambda: isinstance(app.screen, OpsScreen)
                         and app.screen.optrace is not None)
        await pilot.pause()
        ops = app.screen.optrace.ops
        shot = _screen_text(app)
        _clean(shot)
        assert (f"step into d.{SHOWN_KEY}.model.layers.0.self_attn (MiniLLMAttention) · call 0 · "
                f"{len(ops)} ops") in shot
        assert f"{ops[0].op} · in d.{SHOWN_KEY}.model.layers.0.self_attn" in shot  # the details
        await pilot.press("u")


@pytest.mark.asyncio
async def test_edit_form_and_what_if_view_show_the_module_escaped_and_the_edit_runs(trace):
    from tui.screens.edit_diff import EditDiffScreen
    from tui.screens.edit_form import EditFormScreen

    attn = f"d.{KEY}.model.layers.0.self_attn"
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        app.screen.jump(attn)
        await pilot.press("e")
        await wait_until(pilot, lambda: isinstance(app.screen, EditFormScreen))
        await pilot.pause()
        shot = _screen_text(app)
        _clean(shot)
        assert f"what if · edit d.{SHOWN_KEY}.model.layers.0.self_attn" in shot
        assert f"zero d.{SHOWN_KEY}.model.layers.0.self_attn head=0" in shot  # a choice
        first = app.screen.options[0]
        assert first == f"zero {attn}"
        await pilot.press("enter")  # the first choice, copied to the input as shown
        await pilot.pause()
        _clean(_screen_text(app))
        await pilot.press("enter")  # runs it: the shown name is read back as the module's
        await wait_until(pilot, lambda: isinstance(app.screen, EditDiffScreen), 120)
        await pilot.pause()
        screen = app.screen
        assert [e.module for e in screen.b.edits] == [attn]
        shot = _screen_text(app)
        _clean(shot)
        assert screen.edits == [first]
        assert f"what if · zero d.{SHOWN_KEY}.model.layers.0.self_attn" in shot
        await pilot.press("escape")


@pytest.mark.asyncio
async def test_lens_screen_shows_the_head_and_tokens_escaped(trace):
    from tui.screens.lens import LensScreen

    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("L")
        await wait_until(pilot, lambda: isinstance(app.screen, LensScreen)
                         and app.screen.lens is not None)
        await pilot.pause()
        shot = _screen_text(app)
        _clean(shot)
        lens = app.screen.lens
        assert lens.norm == f"d.{KEY}.model.norm" and lens.head == f"d.{KEY}.lm_head"
        assert f"logit lens · d.{SHOWN_KEY}.model.norm → d.{SHOWN_KEY}.lm_head" in shot
        grid = app.screen.query_one("#lens-grid")
        labels = [str(c.label) for c in grid.columns.values()][1:]
        # each position's input token, its first 3 characters of the escaped text
        assert labels == [f"{t} {s[:2]}…" for t, s in enumerate(SHOWN_TOKENS)]
        await pilot.press("enter")  # the first position's top k
        await pilot.pause()
        _clean(_screen_text(app))
        detail = str(app.screen.query_one("#lens-detail").render())
        assert detail.startswith(f"d.{SHOWN_KEY}.model.layers.0 · position 0")


class Overflows(nn.Module):
    """A linear layer under the key whose outputs (16 × 10 × 1000 = 160,000) are finite in fp32
    and overflow float16 (largest finite value 65,504)."""

    def __init__(self) -> None:
        super().__init__()
        self.d = nn.ModuleDict({KEY: nn.Linear(16, 4, bias=False)})
        nn.init.constant_(self.d[KEY].weight, 1000.0)

    def forward(self, x):
        return self.d[KEY](x)


def make_overflow():
    """``--model`` entry point: :class:`Overflows` and a batch of tens."""
    return Overflows(), torch.full((2, 16), 10.0)


def test_precision_diff_piped_shows_the_calls_escaped(capsys):
    assert cli.main(["diff", "--dtype", "float16", "--model", f"{__file__}:make_overflow"]) == 0
    out = capsys.readouterr().out
    _clean(out)
    lines = out.splitlines()
    bad = next(line for line in lines if line.startswith("first non-finite call: "))
    assert bad == (f"first non-finite call: d.{SHOWN_KEY}#0 (forward) (Linear) holds NaN/Inf "
                   "where fp32 is finite")


def test_lens_piped_shows_the_norm_and_head_escaped(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["lens", "--model", MODEL, "--pos", "1", "--k", "3"]) == 0
    out = capsys.readouterr().out
    _clean(out)
    assert (f"logit lens: each layer's output → d.{SHOWN_KEY}.model.norm → "
            f"d.{SHOWN_KEY}.lm_head") in out.splitlines()


#: What the model raises: an OSC that retitles the window, then a second line.
BOOM = "boom\x1b]0;x\x07\nsecond line"
SHOWN_BOOM = "boom\\x1b]0;x\\x07\\nsecond line"


class Raises(nn.Module):
    """A linear model whose forward raises :data:`BOOM` from its second call on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError(BOOM)
        return self.lin(x).pow(2).mean()


def make_raises():
    """``--model`` entry point: :class:`Raises` and a batch; its output is the loss."""
    return Raises(), torch.ones(2, 4)


def test_overfit_error_line_echoes_the_models_exception_escaped(capsys, tmp_path):
    code = cli.main(["overfit", "--headless", "--model", f"{__file__}:make_raises",
                     "--steps", "3", "--db", str(tmp_path / "mdb.sqlite")])
    err = capsys.readouterr().err
    assert code == 1
    _clean(err)
    errors = [line for line in err.splitlines() if line.startswith("mdb: error: ")]
    # the exception's message as describe_error gives it (its lines joined by a space)
    assert len(errors) == 1, err
    assert "failed at step 1: RuntimeError: boom\\x1b]0;x\\x07 second line — in <root>" \
        in errors[0]


def test_a_stopped_runs_line_shows_its_stored_name_and_reason_escaped(tmp_path):
    """``ended_line`` (mdb stop, mdb watch and the live mdb overfit print it) of a run whose
    name and failure reason, written into the database by other code, hold control
    characters."""
    import sqlite3
    import time

    from hooks.store.store import RunStore
    from tui.commands.stop import ended_line

    path = tmp_path / "mdb.sqlite"
    with RunStore(path, create=True) as store:
        w = store.create_run("r", {}, total_steps=4, kind="api")
        w.log_steps([({"step": 1, "wall": time.time(), "values": {"loss": 1.0}}, None, None)])
        w.finish("failed", reason="ok")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE runs SET name = ?, reason = ?", (f"r{KEY}", BOOM))
    with RunStore(path) as store:
        info = store.run(f"r{KEY}")
    line = ended_line(info, None)
    _clean(line)
    assert "\n" not in line
    assert line.startswith(f"run r{SHOWN_KEY} ") and SHOWN_BOOM in line


def test_error_line_is_one_printable_line_and_an_mdb_errors_message_is_kept():
    from tui.errors import MAX_QUOTED, MdbError, error_line

    assert error_line(f"run r{KEY} failed: {BOOM}") == \
        f"mdb: error: run r{SHOWN_KEY} failed: {SHOWN_BOOM}"
    assert error_line("disk full\r", "warning") == "mdb: warning: disk full\\r"
    exc = MdbError(f"no run named {'x' * 5000!r}")  # cut once, when raised
    assert str(exc) == f"no run named '{'x' * MAX_QUOTED}…[5,000 characters]'"
    assert error_line(exc) == f"mdb: error: {exc}"
