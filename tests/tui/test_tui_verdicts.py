"""What the router, gradients and step views conclude, at 80×24, on models whose routing and
gradients are known: a router forced onto two experts, a padded batch, gradients of known size
(one module reached by one row of 128), all-NaN gradients. Expected values come from the
models (their router's logits, minillm's own aux loss, analytic gradients), never from the
widgets under test."""

from __future__ import annotations

import math

import pytest
import torch
from rich.cells import cell_len
from textual.widgets import DataTable, Static

import hooks
from hooks.doctor.model import run_checks
from minillm import MiniLLM, load_preset
from minillm.moe import load_balancing_loss
from tests.hooks.doctor.test_verdicts import D, N, Routed
from tui.app import make_step_app
from tui.commands.capturing import capture_step
from tui.commands.workload import Workload
from tui.widgets import fmt
from tui.widgets.call_details import CallDetails

SIZE = (80, 24)


def _text(screen, wid: str) -> str:
    return " ".join(str(screen.query_one(wid, Static).render()).split())


def _capture(model, batch, **kw):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = model.config.to_dict() if isinstance(model, MiniLLM) else None
    try:
        return capture_step(Workload(model=model, batch=hooks.Batch.of(batch), config=config),
                            **kw)
    finally:
        torch.set_num_threads(threads)


def _forced_router_model():
    """tiny minillm whose routers prefer experts 0 and 1 for every token (logits 4, 3, 0, -4):
    E=4, top-2, so 0 and 1 take every token (E/k = 2× their share) and 2 and 3 none."""
    torch.manual_seed(0)
    model = MiniLLM(load_preset("tiny"))
    bias = torch.tensor([4.0, 3.0, 0.0, -4.0])
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, a, out: out * 0 + bias)
    ids = torch.randint(0, 256, (2, 16))
    return model, ids


async def test_router_flags_the_experts_the_router_was_forced_onto():
    model, ids = _forced_router_model()
    trace = _capture(model, {"input_ids": ids, "labels": ids}, attention=False)
    n = ids.numel()
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("r")
        screen = app.screen
        experts = screen.query_one("#experts", DataTable)
        rows = [experts.get_row(str(e)) for e in range(4)]
        assert [r[1] for r in rows] == [str(n), str(n), "0", "0"]  # tokens that chose it
        assert [r[2] for r in rows] == ["50.0%", "50.0%", "0.0%", "0.0%"]  # of the N·k picks
        flags = [str(r[5]) for r in rows]
        assert flags == [fmt.FLAG_TEXT["hot"]] * 2 + [fmt.FLAG_TEXT["dead"]] * 2
        summary = _text(screen, "#router-summary")
        assert (f"▲ expert 0: 50.0% of the picks (2.0× 1/E), chosen by {n} of {n} tokens "
                "(100.0%)") in summary
        assert "✗ no tokens: expert 2, 3" in summary
        assert "no expert dominates" not in summary
    # the doctor's routing check applies the same rule to the same routing
    r = {x.key: x for x in run_checks(model, ids, only="routing")}["routing"]
    assert r.status == "fail"
    assert all(layer["dead"] == [2, 3] and layer["hot"] == [0, 1]
               for layer in r.data["layers"].values())


async def test_router_of_a_padded_batch_says_pads_are_counted_and_gives_the_models_own():
    torch.manual_seed(0)
    model = MiniLLM(load_preset("tiny"))
    ids = torch.randint(0, 256, (2, 32))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[0, :12] = 0
    trace = _capture(model, {"input_ids": ids, "labels": ids, "attention_mask": mask},
                     attention=False)
    # the references: minillm's load-balancing loss over every token and over real ones
    logits = []
    handle = model.model.layers[0].mlp.gate.register_forward_hook(
        lambda m, a, out: logits.append(out.detach()))
    with torch.no_grad():
        out = model(ids, labels=ids, attention_mask=mask)
    handle.remove()
    every = float(load_balancing_loss(logits[0], 4, 2))
    real = float(load_balancing_loss(logits[0][mask.reshape(-1).bool()], 4, 2))
    assert abs(every - real) > 1e-4  # the pads make a difference here
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("r")
        summary = _text(app.screen, "#router-summary")
        assert "padded batch: 12 of 64 tokens are pads (attention_mask)" in summary
        assert f"layer aux loss {every:.4f}" in summary
        assert f"the model's own for this layer: {real:.4f}" in summary
        assert f"model's aux_loss {fmt.sci(float(out.aux_loss))};" in summary
        assert "pads left out there" in summary and "total aux_loss" not in summary


async def test_router_of_an_unpadded_batch_states_the_sum():
    torch.manual_seed(0)
    model = MiniLLM(load_preset("tiny"))
    ids = torch.randint(0, 256, (2, 16))
    trace = _capture(model, {"input_ids": ids, "labels": ids}, attention=False)
    with torch.no_grad():
        out = model(ids, labels=ids)
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("r")
        summary = _text(app.screen, "#router-summary")
        layer_sum = float(out.aux_losses.sum())
        assert f"total aux_loss {fmt.sci(float(out.aux_loss))} = 0.01 × Σ {layer_sum:.3f}" \
            in summary
        assert "padded" not in summary and "the model's own" not in summary


def _routed_trace(s: float, s_c: float):
    model = Routed(s=s, s_c=s_c)
    with hooks.capture(model) as trace:
        model(torch.ones(N, D)).backward()
    trace.meta["description"] = "Routed"
    return trace


async def test_gradients_view_few_tokens_vanishing_and_not_called():
    trace = _routed_trace(1e-6, 1e-10)
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g")
        screen = app.screen
        table = screen.query_one("#grads", DataTable)
        flag = {k: str(table.get_row(k)[5]) for k in ("a.weight", "b.weight", "c.weight",
                                                        "d.weight")}
        # a: ‖g‖/‖w‖ = 1e-6·128; b: 1e-6 from 1 of 128 rows; c: 1e-10·128 from all; d: none
        assert flag == {"a.weight": "✓ ok", "b.weight": "◦ few tokens",
                        "c.weight": "▼ vanishing", "d.weight": "∅ not called"}
        summary = _text(screen, "#grad-summary")
        assert "▼ vanishing 1" in summary and "◦ few tokens 1" in summary
        assert "∅ not called 1" in summary
        # ‖g‖ = s·rows·√D per parameter: the total is their L2 norm
        ref = math.sqrt(D * ((1e-6 * N) ** 2 + 1e-6 ** 2 + (1e-10 * N) ** 2))
        assert screen.total.norm == pytest.approx(ref, rel=1e-5)
        assert f"total ‖g‖ {fmt.sci(ref)}" in _text(screen, "#title")
        await pilot.press("s")
        # the step view's parameter table on module b says the same
        app.screen.jump("b")
        await pilot.pause()
        details = str(app.screen.query_one("#details", CallDetails).text)
        assert "◦ few tokens" in details


async def test_gradients_view_of_nan_gradients_says_so():
    trace = _routed_trace(math.nan, math.nan)
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g")
        title = _text(app.screen, "#title")
        assert "total ‖g‖ nan (3 of 3 gradients NaN/Inf)" in title
        assert "no finite non-zero ‖g‖ to draw" in title and "log bars" not in title
        assert "✗ NaN/Inf 3" in _text(app.screen, "#grad-summary")


# -- the step view's tree and paths at 80 columns -------------------------------------------
async def test_tree_labels_fit_their_line_and_never_cut_a_shape():
    from tui.widgets.module_tree import ModuleTree

    torch.manual_seed(0)
    model = MiniLLM(load_preset("tiny"))
    ids = torch.randint(0, 256, (2, 64))
    trace = _capture(model, {"input_ids": ids, "labels": ids}, attention=False)
    shapes = {}
    for rec in trace.forward:
        shapes.setdefault(rec.module, fmt.dims(rec.outputs[0].shape) if rec.outputs else "")
    app = make_step_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        tree = app.screen.query_one("#tree", ModuleTree)
        width = tree.scrollable_content_region.width
        assert 20 <= width <= 30
        cut = 0
        for name, node in tree.nodes_by_name.items():
            label = node.label.plain.removeprefix("● ")
            depth = name.count(".") + 1 if name else 0
            room = width - 2 * depth - (2 if node.allow_expand else 0)
            assert cell_len(node.label.plain) <= room, (name, node.label.plain)
            leaf = name.rsplit(".", 1)[-1] if name else "MiniLLM"
            head, _, rest = label.partition(" ")
            if "…" in head:  # a name cut in the middle keeps both ends
                cut += 1
                start, end = head.split("…")
                assert leaf.startswith(start) and leaf.endswith(end)
            else:
                assert head == leaf
            parts = rest.split()
            if parts and "×" in parts[-1] and not parts[-1].startswith("×"):
                assert parts[-1] == shapes[name]  # a shape shown is the whole shape
        # post_attention_layernorm does not fit at depth 4: cut, not dropped
        assert cut >= 2
        node = tree.nodes_by_name["model.layers.0.post_attention_layernorm"]
        assert node.label.plain.startswith("post_")


def test_io_paths_are_cut_in_the_middle_and_shapes_never():
    from tui.widgets.call_details import io_table

    class T:
        def __init__(self, path, shape):
            self.path, self.shape, self.dtype = path, shape, "float32"

    class Call:
        inputs = [T("kwargs.past_key_values.layers[0].keys", [2, 4, 64, 16]),
                  T("kwargs.position_embeddings[0]", [2, 64, 16])]
        outputs = [T("out[0]", [2, 64, 256])]

    lines = io_table(Call(), width=40).plain.splitlines()
    assert all(cell_len(line) <= 40 for line in lines)
    assert "…" in lines[0] and lines[0].split()[1].endswith("keys")
    assert [line.split()[-2] for line in lines] == ["2×4×64×16", "2×64×16", "2×64×256"]


async def test_enter_on_the_hidden_tree_does_nothing_while_too_small():
    """The focused tree loses the focus while the terminal is too small (its own keys, Enter
    on a node, would jump invisibly) and gets it back at 80×24."""
    from tui.screens.step import StepScreen
    from tui.widgets.module_tree import ModuleTree

    trace = _routed_trace(1.0, 1.0)
    app = make_step_app(trace)
    async with app.run_test(size=(60, 20)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, StepScreen) and screen.has_class("-too-small")
        assert screen.focused is None
        await pilot.press("down", "down", "enter")
        await pilot.pause()
        assert screen.stepper.index == 0
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert isinstance(screen.focused, ModuleTree)
        await pilot.press("down", "enter")
        await pilot.pause()
        assert screen.stepper.call.module == "a"
