"""``mdb diff A B``: traces (directories or RUN@STEP) compared call by call."""

from __future__ import annotations

import json

import pytest
import torch
from textual.widgets import DataTable

import hooks
from tests.conftest import wait_until
from tui.cli import main


def _tiny_trace(model, ids):
    with hooks.capture(model) as tr:
        model(ids, labels=ids).loss.backward()
    return tr


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two captures of one tiny minillm; between them layer 1's MLP weights change."""
    from minillm import MiniLLM, load_preset

    torch.manual_seed(0)
    cfg = load_preset("tiny").replace(num_local_experts=1, num_experts_per_tok=1)
    model = MiniLLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    a = _tiny_trace(model, ids)
    with torch.no_grad():
        for p in model.model.layers[1].mlp.parameters():
            p.mul_(1.5)
    model.zero_grad(set_to_none=True)
    b = _tiny_trace(model, ids)
    d = tmp_path_factory.mktemp("diff")
    a.save(d / "a.mdbtrace")
    b.save(d / "b.mdbtrace")
    return d / "a.mdbtrace", d / "b.mdbtrace", a, b


def test_a_trace_against_itself_has_no_differences(pair, capsys):
    a, _, _, _ = pair
    assert main(["diff", str(a), str(a)]) == 0
    assert "no differences" in capsys.readouterr().out


def test_changed_weights_change_exactly_the_modules_at_and_after_them(pair, capsys):
    a, b, ta, tb = pair
    assert main(["diff", str(a), str(b), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["no_differences"] is False
    changed = {r["module"] for r in doc["forward"] if float(r["relative"]) > 1e-6}
    # the reference: which forward outputs differ, straight from the two traces
    ref = set()
    for ra, rb in zip(ta.forward, tb.forward, strict=True):
        assert (ra.module, ra.call_index) == (rb.module, rb.call_index)
        sa, sb = ra.outputs[0].stats, rb.outputs[0].stats
        if abs(sa.mean - sb.mean) + abs(sa.std - sb.std) > 1e-6 * max(sa.abs_max, 1e-30):
            ref.add(ra.module)
    assert changed == ref
    assert "model.layers.1.mlp" in changed and "lm_head" in changed
    untouched = {"model.embed_tokens", "model.layers.0.self_attn", "model.layers.0.mlp",
                 "model.layers.1.self_attn"}
    assert not (changed & untouched)


def test_gqa_against_mha_lists_k_and_v_proj_as_changed_in_layout(tmp_path, capsys):
    from minillm import MiniLLM, load_preset

    traces = []
    for kv in (2, 4):
        torch.manual_seed(0)
        cfg = load_preset("tiny").replace(num_key_value_heads=kv)
        model = MiniLLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        path = tmp_path / f"kv{kv}.mdbtrace"
        _tiny_trace(model, ids).save(path)
        traces.append(path)
    assert main(["diff", *map(str, traces), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    layout = {r["module"] for r in doc["forward"]
              if r["shape_self"][1:] != r["shape_other"][1:]}
    assert layout == {f"model.layers.{i}.self_attn.{p}" for i in (0, 1)
                      for p in ("k_proj", "v_proj")}
    # and the printed table puts them first
    assert main(["diff", *map(str, traces), "--table", "--limit", "4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "│" in line]
    assert len(rows) == 4 and all("_proj#0" in r and r.rstrip().endswith("layout") for r in rows)


def test_bad_specs_are_one_line(tmp_path, capsys):
    assert main(["diff", str(tmp_path / "nope"), "x@3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such trace directory, and not RUN@STEP" in err
    (tmp_path / "empty").mkdir()
    assert main(["diff", str(tmp_path / "empty"), str(tmp_path / "empty")]) == 2
    assert "not a trace" in capsys.readouterr().err
    assert main(["diff", "run@1", "run@2", "--db", str(tmp_path / "no.sqlite")]) == 2
    assert capsys.readouterr().err.startswith("mdb: error: run@1:")


def test_run_at_step_reads_a_stored_capture(tmp_path, capsys):
    db = tmp_path / "runs.sqlite"
    assert main(["overfit", "--headless", "--preset", "tiny", "--steps", "4", "--every", "2",
                 "--sample-every", "0", "--run", "r1", "--db", str(db)]) == 0
    capsys.readouterr()
    assert main(["diff", "r1@2", "r1@4", "--db", str(db), "--table"]) == 0
    out = capsys.readouterr().out
    assert "A = r1@2" in out and "tensor(s) changed" in out
    assert main(["diff", "r1@2", "r1@3", "--db", str(db)]) == 2
    assert "r1@3: no stored capture at step 3 (captured steps: 2, 4)" in capsys.readouterr().err


async def test_the_diff_screen_opens_a_call_of_a_beside_b(pair):
    from tui.app import make_diff_app
    from tui.screens.diff import CallPairScreen, DiffScreen

    _, _, a, b = pair
    diff = a.diff(b)
    app = make_diff_app(a, b, diff, "A", "B")
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, DiffScreen))
        table = app.screen.query_one("#diff-table", DataTable)
        assert table.row_count == len(diff.ranked()) > 0
        await pilot.pause()
        assert "Enter" in str(app.screen.query_one("#hint").render())
        await pilot.press("enter")
        assert isinstance(app.screen, CallPairScreen)
        first = diff.ranked()[0]
        assert first.module in str(app.screen.query_one("#title").render())
        await pilot.press("n")
        assert app.screen.row == 1
        await pilot.press("s")
        assert isinstance(app.screen, DiffScreen)
        assert app.screen.query_one("#diff-table", DataTable).cursor_row == 1
