"""``mdb compare``: the screen follows runs while they are written (Pilot), tells runs apart by
marker, shows minillm numbers and "—" with a reason for others, its keys add and remove runs;
the printed table; bad input in one line."""

from __future__ import annotations

import json
import threading

import pytest

from hooks.store.store import RunStore
from minillm import MiniLLM, MiniLLMConfig, load_preset
from tests.conftest import wait_until
from tui.cli import main
from tui.screens.compare import CompareApp, CompareScreen, RunPicker
from tui.screens.compare_data import RUN_STYLES, compare_rows, short_labels


def _minillm_run(store, name, steps, *, kv=2, total=None, ce0=3.0):
    cfg = load_preset("tiny", num_key_value_heads=kv)
    writer = store.create_run(name, {"workload": "minillm", "steps": total or steps,
                                     "resolved_model_config": cfg.to_dict(), "lr": 3e-3},
                              total_steps=total or steps)
    for s in range(1, steps + 1):
        writer.log_step({"step": s, "wall": 1000.0 + s / 10, "ce": ce0 / s, "aux": 0.01,
                         "total": ce0 / s + 0.01, "grad_norm": 1.0})
    return writer, cfg


def _api_run(store, name, steps):
    writer = store.create_run(name, {"lr": 1e-3, "block": 32}, total_steps=steps, kind="api")
    for s in range(1, steps + 1):
        writer.log_step({"step": s, "wall": 1000.0 + s, "loss": 5.0 / s})
    writer.finish("finished")


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "mdb.sqlite"
    with RunStore(path, create=True) as store:
        w, _ = _minillm_run(store, "abl-attention=mha", 40, kv=4)
        w.finish("finished")
        _api_run(store, "own-loop", 25)
    return path


async def test_compare_follows_a_run_being_written(db):
    """Three runs, one still being written by another thread while the screen is open."""
    ready, go, done = threading.Event(), threading.Event(), threading.Event()
    written = []

    def writer_thread():
        with RunStore(db) as store:
            writer, _ = _minillm_run(store, "abl-attention=gqa", 5, kv=2, total=60)
            written.append(5)
            ready.set()
            go.wait(30)
            for s in range(6, 31):
                writer.log_step({"step": s, "wall": 2000.0 + s, "ce": 2.0 / s, "aux": 0.01,
                                 "total": 2.0 / s + 0.01, "grad_norm": 0.5})
                written.append(s)
            done.wait(30)
            # as mdb ablate does: held-out CE added to the last step once it was read
            writer.log_step({"step": 30, "ce@16": 2.5})
            writer.finish("finished")

    t = threading.Thread(target=writer_thread, daemon=True)
    t.start()
    assert ready.wait(30)
    names = ["abl-attention=mha", "abl-attention=gqa", "own-loop"]
    screen = CompareScreen(db, names, poll_interval=0.05)
    app = CompareApp(screen)
    try:
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: screen.polls >= 1 and screen.views[1].series.step == 5)
            gqa = screen.views[1]
            assert gqa.info.writer_state() == "running"
            go.set()  # the writer adds 25 steps while the screen is open
            await wait_until(pilot, lambda: gqa.series.step == 30, timeout=30)
            await wait_until(pilot, lambda: "30/60" in _table_text(screen), timeout=60)
            chart = app.screen.query_one("#cmp-chart")
            # the chart's redraw slot: drawn with every run's points up to their last step
            await wait_until(pilot, lambda: [s.xs[-1] if s.xs else None for s in chart.series]
                             == [v.series.step for v in screen.views], timeout=60)
            done.set()
            await wait_until(pilot, lambda: "finished" in _cells(screen, "status")[1], timeout=60)
            await wait_until(pilot, lambda: "2.5000" in _table_text(screen), timeout=60)
            assert _cells(screen, "held-out ce@16") == ["—", "2.5000", "—"]
            assert gqa.series.step == 30 and len(gqa.series.metric("ce")) == 30  # no new point
            # the table: a column per run, minillm numbers from the config, "—" and why else
            rows = {r.label: r.cells for r in compare_rows(screen.views)}
            cfg_mha = load_preset("tiny", num_key_value_heads=4)
            cfg_gqa = load_preset("tiny", num_key_value_heads=2)
            assert rows["params"] == [f"{MiniLLM(cfg_mha).num_parameters():,}",
                                      f"{MiniLLM(cfg_gqa).num_parameters():,}", "—"]
            assert rows["num_key_value_heads"][:2] == ["4", "2"]
            assert rows["KV bytes/token fp32"][:2] == ["512", "256"]  # 2·L·Hkv·Dh·4 bytes, ∝ Hkv
            # the run's loss, as mdb runs and mdb watch say: minillm's total (ce + aux), the
            # ce beside it
            assert rows["last loss"] == ["0.0850", "0.0767", "0.2000"]
            assert rows["best loss"] == ["0.0850", "0.0767", "0.2000"]
            assert rows["loss metric"] == ["total", "total", "loss"]
            assert rows["last ce"] == ["0.0750", "0.0667", "—"]
            note = str(app.screen.query_one("#cmp-note").render())
            assert "own-loop: — a hooks.run loop" in note
            # every run's marker is on the chart and in its legend: apart without colour
            text = "\n".join("".join(t for t, _ in row) for row in chart._rows)
            for i in range(3):
                assert text.count(RUN_STYLES[i][1]) >= 2, RUN_STYLES[i][1]
            assert text.splitlines()[0].startswith("ce (log)") is False  # two metrics: "loss"
            assert "loss (log)" in text.splitlines()[0]
            await pilot.press("l")
            await wait_until(pilot, lambda: "loss (linear)" in "".join(
                t for t, _ in chart._rows[0]), timeout=60)
    finally:
        go.set()
        done.set()
        t.join(10)


def _cells(screen, label):
    return {r.label: r.cells for r in compare_rows(screen.views)}[label]


def _table_text(screen) -> str:
    table = screen.query_one("#cmp-table")
    return " ".join(str(c) for row in range(table.row_count) for c in table.get_row_at(row))


async def test_picker_adds_and_d_removes_runs_keeping_their_markers(db):
    with RunStore(db) as store:
        w, _ = _minillm_run(store, "abl-attention=mqa", 10, kv=1)
        w.finish("finished")
    screen = CompareScreen(db, ["abl-attention=mha", "own-loop"], poll_interval=0.05)
    app = CompareApp(screen)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: screen.polls >= 1 and len(screen.runs) == 3)
        marker_mha = screen.views[0].marker
        await pilot.press("a")
        await wait_until(pilot, lambda: isinstance(app.screen, RunPicker))
        picker = app.screen.query_one("#pick-list")
        picker.select("abl-attention=mqa")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(screen.views) == 3)
        await wait_until(pilot, lambda: screen.views[2].series.step == 10)
        assert [v.name for v in screen.views][2] == "abl-attention=mqa"
        assert len({v.marker for v in screen.views}) == 3
        # remove own-loop: select its column (the cursor starts on the first run) and press d
        await pilot.press("right")
        await pilot.press("d")
        await wait_until(pilot, lambda: len(screen.views) == 2)
        assert [v.name for v in screen.views] == ["abl-attention=mha", "abl-attention=mqa"]
        assert screen.views[0].marker == marker_mha  # kept while shown
        assert "removed own-loop" in str(app.screen.query_one("#hint").render())
        await pilot.press("q")


async def test_too_small_terminal_and_keys(db):
    screen = CompareScreen(db, ["abl-attention=mha", "own-loop"], poll_interval=0.05)
    app = CompareApp(screen)
    async with app.run_test(size=(70, 20)) as pilot:
        await wait_until(pilot, lambda: screen.has_class("-too-small"))
        await pilot.press("a")
        assert not isinstance(app.screen, RunPicker)
        footer = " ".join(str(k.render()) for k in app.screen.query("FooterKey"))
        assert "stop" not in footer  # x only under mdb ablate


def test_short_labels():
    assert short_labels(["abl-attention=mha", "abl-attention=gqa"]) == ["mha", "gqa"]
    assert short_labels(["abl-a=1+b=2", "abl-a=1+b=3"]) == ["b=2", "b=3"]
    assert short_labels(["run1", "run2"]) == ["run1", "run2"]  # no separator: kept
    assert short_labels(["x-a", "x-a"]) == ["x-a", "x-a"]


def test_compare_prints_the_table_without_a_terminal(db, capsys):
    assert main(["compare", "abl-attention=mha", "own-loop", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    params = next(line for line in out.splitlines() if line.startswith("params"))
    n = MiniLLM(load_preset("tiny", num_key_value_heads=4)).num_parameters()
    assert f"{n:,}" in params and "—" in params
    assert "own-loop: — a hooks.run loop" in out
    assert main(["compare", "abl-attention=mha", "own-loop", "--db", str(db), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["runs"][0]["arch"]["parameters"] == n
    assert doc["runs"][1]["arch"] is None and "hooks.run" in doc["runs"][1]["arch_why"]


@pytest.mark.parametrize("argv, message", [
    (["compare", "abl-attention=mha"], "give 2 to 8 runs"),
    (["compare", "own-loop", "own-loop"], "given twice"),
    (["compare", "own-loop", "nope"], "no run named 'nope'"),
    (["compare", *[f"r{i}" for i in range(9)]], "give 2 to 8 runs"),
])
def test_compare_bad_input_is_one_line(db, capsys, argv, message):
    assert main([*argv, "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mdb: error: ") and message in err and err.count("\n") == 1


def test_compare_missing_database(tmp_path, capsys):
    assert main(["compare", "a", "b", "--db", str(tmp_path / "none.sqlite")]) == 2
    assert "no run database" in capsys.readouterr().err
    assert not (tmp_path / "none.sqlite").exists()


def test_a_model_run_says_why_it_has_no_numbers(tmp_path):
    from tui.screens.compare_data import minillm_config_of

    class Info:
        kind = "overfit"
        config = {"workload": "model", "model": "tests/families.py:nanogpt",
                  "model_path": "/x/tests/families.py:nanogpt"}

    config, why = minillm_config_of(Info())
    assert config is None and why == "--model tests/families.py:nanogpt: not a minillm model"
    Info.config = {"workload": "minillm", "resolved_model_config": {"hidden_size": 30,
                                                                    "num_attention_heads": 4}}
    config, why = minillm_config_of(Info())
    assert config is None and "not valid" in why  # never a guess from a broken config
    Info.config = {"resolved_model_config": MiniLLMConfig().to_dict()}
    assert minillm_config_of(Info())[0] == MiniLLMConfig()


class FakeWorkers:
    """What mdb ablate hands the screen (tui.screens.compare.Controller)."""

    def __init__(self):
        self.stops = []
        self.alive = True  # workers finish their step after a stop
        self.states = {"abl-attention=mqa": "queued",
                       "abl-attention=gqa": "worker failed (exit 1): MemoryError"}

    def status(self, name):
        return self.states.get(name)

    def stop(self, reason):
        self.stops.append(reason)
        self.states["abl-attention=mqa"] = f"not started ({reason})"

    def running(self):
        return self.alive


async def test_ablation_controller_statuses_and_stop_keys(db):
    with RunStore(db) as store:  # a worker that died without marking its run
        _minillm_run(store, "abl-attention=gqa", 3, total=50)
    workers = FakeWorkers()
    names = ["abl-attention=mha", "abl-attention=gqa", "abl-attention=mqa"]
    screen = CompareScreen(db, names, controller=workers, poll_interval=0.05)
    app = CompareApp(screen)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: screen.polls >= 2)
        assert _cells(screen, "status") == ["finished", "worker failed (exit 1): MemoryError",
                                            "queued"]
        footer = " ".join(str(k.render()) for k in app.screen.query("FooterKey"))
        assert "stop all" in footer
        await pilot.press("ctrl+c")
        assert workers.stops == ["stopped from the screen"]
        await pilot.press("x")  # a second stop only says it is stopping
        assert workers.stops == ["stopped from the screen"]
        assert "already stopping" in str(app.screen.query_one("#hint").render())
        await wait_until(pilot, lambda: "not started" in _cells(screen, "status")[2])
        workers.alive = False  # the workers have ended: x is no longer offered
        await wait_until(pilot, lambda: "every worker has ended" in str(
            app.screen.query_one("#hint").render()))
        # the footer follows the bindings on Textual's next refresh, after the hint: wait for it
        await wait_until(pilot, lambda: "stop all" not in " ".join(
            str(k.render()) for k in app.screen.query("FooterKey")))
        await pilot.press("q")
    assert app.return_code == 0


async def test_picker_tells_chosen_runs_from_the_others_without_colour(db, monkeypatch):
    """Under NO_COLOR the picker's boxes still differ: ▐✓▌ for a run shown, ▐ ▌ for one not."""
    monkeypatch.setenv("NO_COLOR", "1")
    with RunStore(db) as store:
        w, _ = _minillm_run(store, "abl-attention=mqa", 10, kv=1)
        w.finish("finished")
    screen = CompareScreen(db, ["abl-attention=mha", "own-loop"], poll_interval=0.05)
    app = CompareApp(screen)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: screen.polls >= 1 and len(screen.runs) == 3)
        await pilot.press("a")
        await wait_until(pilot, lambda: isinstance(app.screen, RunPicker))
        picker = app.screen.query_one("#pick-list")

        def lines() -> dict[str, str]:
            rows = [picker.render_line(y).text for y in range(3)]
            return {row[4:].split()[0]: row[:3] for row in rows}

        assert lines() == {"abl-attention=mha": "▐✓▌", "own-loop": "▐✓▌",
                           "abl-attention=mqa": "▐ ▌"}
        await pilot.press("down", "down", "space")  # choose mqa, the third row
        await pilot.pause()
        assert lines()["abl-attention=mqa"] == "▐✓▌"
        await pilot.press("up", "space")  # and drop own-loop
        await pilot.pause()
        assert lines()["own-loop"] == "▐ ▌"
        await pilot.press("q")
