"""Keys typed in one burst act in order in every mdb app, not only the step view: ``mdb diff``'s
app (and ``--dtype``'s, a subclass), ``mdb diff --edit``'s, the live screens' (``mdb watch``,
``mdb overfit``) and ``mdb compare``'s. Each burst opens a view and types keys meant for it or
for the screen below once it is closed: without :class:`tui.keys.KeysInOrder` a key typed right
after a change of view is looked up on the wrong screen (or is lost).

A burst is posted to the app all at once (``burst`` of ``tests/tui/test_key_burst.py``), as a
terminal delivers keys typed faster than the app handles them. The expected ends follow from the
keys' documented meanings (the screens' ``Binding`` objects) and the data the test wrote, never
from the code under test."""

from __future__ import annotations

import pytest
import torch
from textual.widgets import DataTable

import hooks
from hooks.store.store import RunStore
from tests.tui.test_key_burst import burst, settle

SIZE = (80, 24)


@pytest.fixture(scope="module")
def pair():
    """Two captures of one tiny minillm, layer 1's MLP weights scaled between them."""
    from minillm import MiniLLM, load_preset

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        cfg = load_preset("tiny").replace(num_local_experts=1, num_experts_per_tok=1)
        model = MiniLLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 16),
                            generator=torch.Generator().manual_seed(0))
        traces = []
        for scale in (1.0, 1.5):
            with torch.no_grad():
                for p in model.model.layers[1].mlp.parameters():
                    p.mul_(scale)
            model.zero_grad(set_to_none=True)
            with hooks.capture(model) as tr:
                model(ids, labels=ids).loss.backward()
            traces.append(tr)
    finally:
        torch.set_num_threads(threads)
    return traces[0], traces[1], traces[0].diff(traces[1])


def _diff_app(pair):
    from tui.app import make_diff_app

    a, b, diff = pair
    return make_diff_app(a, b, diff, "A", "B")


def _edit_diff_app(pair):
    from tui.commands.diff_edit import _app
    from tui.screens.edit_diff import EditDiffScreen

    a, b, diff = pair
    return _app(EditDiffScreen(a, b, diff, ["scale model.layers.1.mlp by=1.5"], embedded=False))


@pytest.mark.parametrize("make", [_diff_app, _edit_diff_app], ids=["diff", "diff-edit"])
async def test_diff_apps_keys_after_opening_and_leaving_a_b_act_in_order(pair, make):
    """``j Enter n s j`` in ``mdb diff``'s and ``mdb diff --edit``'s apps: row 2 opened beside
    B, the next changed row (3), back to the list, then one row down: the list's cursor on
    row 4 (index 3)."""
    from tui.screens.diff import DiffScreen

    assert len(pair[2].ranked()) >= 4  # layer 1's MLP and everything after it changed
    app = make(pair)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: isinstance(app.screen, DiffScreen), "the diff view")
        screen = app.screen
        table = screen.query_one("#diff-table", DataTable)
        assert table.cursor_row == 0
        burst(app, "j", "enter", "n", "s", "j")
        await settle(pilot, lambda: app.screen is screen and table.cursor_row == 3,
                     "the diff view with its cursor on row 4")
        assert len(app.screen_stack) == 2 and app.is_running  # Textual's default, the view


async def test_precision_diff_app_is_a_diff_app_keeping_keys_in_order():
    """``mdb diff --dtype``'s app: ``Enter s j``: the call opened beside fp32, back, one down."""
    from hooks.whatif.precision import precision_diff
    from tests.hooks.whatif.test_precision import NormNet, _batch
    from tui.commands.diff_dtype import make_precision_app
    from tui.screens.precision_diff import PrecisionDiffScreen

    pd = precision_diff(NormNet(), _batch(), "float16")
    app = make_precision_app(pd)
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot, lambda: isinstance(app.screen, PrecisionDiffScreen), "the view")
        screen = app.screen
        table = screen.query_one("#diff-table", DataTable)
        start = table.cursor_row
        assert table.row_count > start + 1
        burst(app, "enter", "s", "j")
        await settle(pilot, lambda: app.screen is screen and table.cursor_row == start + 1,
                     "the precision view one row further")


def _finished_run(path, steps: int = 30):
    """A finished run of ``steps`` logged steps (loss 5/s) in a new database at ``path``."""
    with RunStore(path, create=True) as store:
        writer = store.create_run("done", {"lr": 1e-3}, total_steps=steps, kind="api")
        for s in range(1, steps + 1):
            writer.log_step({"step": s, "wall": 1000.0 + s, "loss": 5.0 / s})
        writer.finish("finished")


async def test_live_app_answer_right_after_the_question_then_a_view_key(tmp_path):
    """``mdb watch``'s LiveApp on a run being written: ``x n l``: stop? (a question), no (keep
    training: its letter, read by the question's own key handler), then ``l`` puts the loss on
    the other scale. No stop request reaches the database."""
    from hooks.store.control import pending
    from tui.live_app import make_watch_app
    from tui.screens.live import LiveScreen

    db = tmp_path / "r.sqlite"
    with RunStore(db, create=True) as store:
        writer = store.create_run("live", {"lr": 1e-3}, total_steps=100, kind="api")
        for s in range(1, 11):
            writer.log_step({"step": s, "wall": 1000.0 + s, "loss": 5.0 / s})
        app = make_watch_app(store, store.run("live"), poll_interval=0.05)
        live = app.live
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot, lambda: app.screen is live and live.series.step == 10,
                         "the live screen with the 10 steps")
            log_scale = live._log_scale
            burst(app, "x", "n", "l")
            await settle(pilot, lambda: app.screen is live and live._log_scale != log_scale,
                         "the live screen on the other loss scale")
            assert app.is_running and isinstance(app.screen, LiveScreen)
            assert live.state == "running"
        assert pending(db, store.run("live").id) == []
        writer.finish("finished")


async def test_compare_app_runs_chosen_in_a_burst_are_applied(tmp_path):
    """``mdb compare``: ``a down down space Enter``: the picker opened, its third row (run
    ``three``, the one not shown) chosen, the choice applied: three runs on the screen."""
    from tui.screens.compare import CompareApp, CompareScreen

    db = tmp_path / "r.sqlite"
    with RunStore(db, create=True) as store:
        for name, steps in (("one", 20), ("two", 25), ("three", 10)):
            writer = store.create_run(name, {"lr": 1e-3}, total_steps=steps, kind="api")
            for s in range(1, steps + 1):
                writer.log_step({"step": s, "wall": 1000.0 + s, "loss": 5.0 / s})
            writer.finish("finished")
    screen = CompareScreen(db, ["one", "two"], poll_interval=0.05)
    app = CompareApp(screen)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda: screen.polls >= 1 and len(screen.runs) == 3, "three runs")
        burst(app, "a", "down", "down", "space", "enter")
        await settle(pilot, lambda: [v.name for v in screen.views] == ["one", "two", "three"],
                     "run three added")
        assert app.is_running and app.screen is screen
