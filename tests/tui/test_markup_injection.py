"""Outside text is never Rich/Textual markup: module names (``nn.ModuleDict`` keys), a run
name (set in SQLite), a metric name and a config key holding ``[/x]`` (a closing tag with no
opening one: ``MarkupError``), ``[bold]`` (a style tag that would vanish),
``[@click=quit]x[/]`` (a Textual action) and ``[link=http://e]y[/link]`` reach the step
view (tree, details, status line, find), the router and attention views, the compare and
watch screens and the piped ``mdb runs``/``summary``/``diff`` as typed: no crash, every
bracket shown, the app still running afterwards (no action ran). Screens are read from their
rendered text (the screenshot's text runs)."""

from __future__ import annotations

import html
import re
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

#: ModuleDict keys (no "." allowed in a key).
KEYS = ("[/x]", "[bold]", "[@click=quit]x[/]", "[link=http://e]y[/link]")
RUN = "r[/x][@click=app.quit]q[/]"
METRIC = "[/m]"
CONFIG_KEY = "k[/x][link=http://e]y[/link]"
SIZE = (220, 50)


class Keyed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.d = nn.ModuleDict({k: nn.Linear(16, 16 if i < 3 else 50) for i, k in enumerate(KEYS)})

    def forward(self, ids):
        x = self.emb(ids)
        for k in KEYS:
            x = self.d[k](x)
        return x


def make_model():
    """``--model`` entry point (mdb seeds torch before calling it)."""
    return Keyed(), torch.randint(0, 50, (2, 8))


MODEL = f"{__file__}:make_model"


class WrappedMoE(nn.Module):
    """minillm's tiny MoE under a ModuleDict key that is an action in markup."""

    def __init__(self) -> None:
        super().__init__()
        from minillm import MiniLLM, load_preset

        self.d = nn.ModuleDict({KEYS[2]: MiniLLM(load_preset("tiny"))})

    def forward(self, ids):
        return self.d[KEYS[2]](ids)

    def get_output_embeddings(self):
        """minillm's LM head (the logit lens reads it)."""
        return self.d[KEYS[2]].lm_head


def make_moe():
    ids = torch.randint(0, 256, (1, 8))
    return WrappedMoE(), hooks.Batch((ids,), token_text=[f"[/t{i}]" for i in range(8)])


def _screen_text(app) -> str:
    svg = app.export_screenshot()
    text = "".join(html.unescape(t) for t in re.findall(r"<text [^>]*>([^<]*)</text>", svg))
    return text.replace("\xa0", " ")


@pytest.fixture(autouse=True)
def _no_columns(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture
def db(tmp_path):
    """A store with a run named ``RUN`` (set in SQLite: no API check in the way), a metric
    named ``METRIC`` and a config key ``CONFIG_KEY``, and a second run whose config differs."""
    path = tmp_path / "mdb.sqlite"
    with RunStore(path, create=True) as store:
        for name, value in (("badrun", "[bold]v"), ("other", "w[/]")):
            w = store.create_run(name, {"lr": 0.1, CONFIG_KEY: value}, total_steps=10, kind="api")
            w.log_steps([({"step": s, "wall": time.time(),
                           "values": {"loss": 2.0 / s, METRIC: 0.5}}, None, None)
                         for s in range(1, 6)])
            w.finish("failed", reason="boom [/x] [@click=app.quit]q[/]")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE runs SET name = ? WHERE name = 'badrun'", (RUN,))
    return str(path)


@pytest.mark.asyncio
async def test_step_view_tree_details_status_and_find_show_bracketed_names_as_typed():
    from tui.screens.search import SearchScreen

    torch.manual_seed(0)
    model, ids = make_model()
    with hooks.capture(model) as trace:
        model(ids).float().pow(2).mean().backward()
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        shots = []
        for _ in KEYS:  # the call of each key in turn (the root's and the embedding's first)
            await pilot.press("n")
            await pilot.pause()
            shots.append(_screen_text(app))
        await pilot.press("n")
        await pilot.pause()
        shots.append(_screen_text(app))
        for i, key in enumerate(KEYS):
            shot = shots[i + 1]
            assert f"forward · call {i + 3}/6 · d.{key}" in shot, (key, shot)  # status line
            assert f"d.{key}  Linear #0" in shot  # the details' title
            assert all(k in shot for k in KEYS)  # the tree's labels
        await pilot.press("slash")
        await wait_until(pilot, lambda: isinstance(app.screen, SearchScreen))
        await pilot.press(*"click")
        await pilot.pause()
        assert f"d.{KEYS[2]}" in _screen_text(app)
        await pilot.press("enter")
        await wait_until(pilot, lambda: not isinstance(app.screen, SearchScreen))
        await pilot.press("s")  # the search box's "no module matches" line repeats the input
        await pilot.press("slash")
        await wait_until(pilot, lambda: isinstance(app.screen, SearchScreen))
        await pilot.press(*"[/x]z", "enter")
        await wait_until(pilot, lambda: "no module matches '[/x]z'" in _screen_text(app))
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, SearchScreen))
        assert app.is_running  # no [@click=app.quit] ran


@pytest.fixture(scope="module")
def moe_trace():
    from tui.commands.capturing import capture_step
    from tui.commands.workload import load_user_workload

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        return capture_step(load_user_workload(f"{__file__}:make_moe"))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.asyncio
async def test_router_and_attention_views_show_the_module_and_tokens_as_typed(moe_trace):
    from tui.screens.attention import AttentionScreen
    from tui.screens.router import RouterScreen

    app = make_step_app(moe_trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("r")
        await wait_until(pilot, lambda: isinstance(app.screen, RouterScreen))
        await pilot.pause()
        shot = _screen_text(app)
        assert f"router · layer 0 (1/2) · d.{KEYS[2]}.model.layers.0.mlp" in shot
        table = app.screen.query_one("#tokens")
        assert [str(table.get_row_at(i)[1]) for i in range(8)] == [f"[/t{i}]" for i in range(8)]
        await pilot.press("s")
        await wait_until(pilot, lambda: not isinstance(app.screen, RouterScreen))
        await pilot.press("a")
        await wait_until(pilot, lambda: isinstance(app.screen, AttentionScreen))
        await pilot.pause()
        shot = _screen_text(app)
        assert f"d.{KEYS[2]}.model.layers.0.self_attn" in shot
        assert "keys " + " ".join(f"[/t{i}]" for i in range(8)) in shot
        assert app.is_running


@pytest.mark.asyncio
async def test_compare_screen_shows_run_metric_and_config_key_as_typed(db):
    from tui.screens.compare import CompareApp, CompareScreen

    screen = CompareScreen(db, [RUN, "other"], poll_interval=0.05)
    app = CompareApp(screen)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: screen.polls >= 1
                         and all(v.series.step == 5 for v in screen.views))
        table = screen.query_one("#cmp-table")
        await wait_until(pilot, lambda: table.row_count and
                         str(table.get_row_at(0)[0]) == CONFIG_KEY)  # the key differs
        await wait_until(pilot, lambda: "failed (boom" in _screen_text(app))
        shot = _screen_text(app)
        assert RUN in shot  # the column's head
        assert CONFIG_KEY[:19] in shot  # the label column is 20 cells wide
        assert "[bold]v" in shot and "w[/]" in shot  # the config values
        assert "failed (boom [/x] [@click=app.quit]q[/])" in shot
        assert app.is_running


@pytest.mark.asyncio
async def test_watch_screen_shows_the_run_metric_and_reason_as_typed(db):
    from tests.conftest import drawn
    from tui.commands.watch import open_run
    from tui.live_app import make_watch_app

    store, run = open_run(db, RUN)
    app = make_watch_app(store, run)
    try:
        async with app.run_test(size=(160, 40)) as pilot:
            await wait_until(pilot, lambda: app.live.polls >= 1)
            await drawn(pilot, app.live)
            shot = _screen_text(app)
            assert f"mdb watch · run {RUN} · " in shot
            assert "boom [/x] [@click=app.quit]q[/]" in shot
            table = str(app.screen.query_one("#live-table").render())
            assert METRIC in table
            assert app.is_running
            await pilot.press("q")
    finally:
        store.close()


def test_runs_summary_and_diff_piped_print_names_as_typed(capsys, db, tmp_path):
    assert cli.main(["runs", "--db", db]) == 0
    out = capsys.readouterr().out
    assert RUN in out and METRIC in out and "boom [/x] [@click=app.quit]q[/]" in out
    assert cli.main(["summary", "--model", MODEL]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "Linear" in line]
    assert [k in row for k, row in zip(KEYS, rows, strict=True)] == [True] * 4
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for seed, path in (("0", a), ("1", b)):
        assert cli.main(["capture", "--model", MODEL, "--seed", seed, "--out", str(path)]) == 0
    capsys.readouterr()
    assert cli.main(["diff", str(a), str(b), "--table"]) == 0
    out = capsys.readouterr().out
    for key in KEYS:
        assert f"d.{key}#0" in out, key


def test_compare_table_piped_heads_its_columns_with_the_runs_as_typed(capsys, db):
    """The column heads were read as markup: ``[/x]`` in a run's name raised MarkupError."""
    assert cli.main(["compare", RUN, "other", "--db", db, "--table"]) == 0
    out = capsys.readouterr().out
    assert RUN in out and CONFIG_KEY in out and "[bold]v" in out

