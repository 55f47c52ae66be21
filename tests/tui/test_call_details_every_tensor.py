"""The step view's details pane shows the statistics of every output and every input of a call
(a newcomer's test found 3 of the root call's outputs shown, the others' statistics not).

The root call of a tiny minillm returns 7 tensors (logits, the losses, the per-layer aux losses,
each layer's router logits). Its statistics are read back from the pane's text at 80×24 and
120×40 and compared with the model run again here, without hooks, on the same batch (torch's
own reductions), and with the trace's ``TensorInfo.stats`` as the table formats them.
"""

from __future__ import annotations

import pytest
import torch

import hooks
from minillm import MiniLLM, load_preset
from tui.app import make_step_app
from tui.commands.capturing import capture_step
from tui.commands.workload import Workload
from tui.widgets import fmt
from tui.widgets.call_details import CallDetails

#: rows of the table: label, torch's value of a float tensor ``x``
REFERENCE = {
    "mean": lambda x: x.mean(),
    "std": lambda x: x.std() if x.numel() > 1 else x.new_zeros(()),  # Bessel's, 0 for one
    "min": lambda x: x.min(),
    "max": lambda x: x.max(),
    "|x| max": lambda x: x.abs().max(),
    "l2": lambda x: x.norm(),
}
#: the same rows, as the TensorStats attributes the trace holds
ATTRS = {"mean": "mean", "std": "std", "min": "min", "max": "max", "|x| max": "abs_max",
         "l2": "l2"}


@pytest.fixture(scope="module")
def captured():
    """(trace, the root call's inputs by path, the model's outputs recomputed without hooks)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = MiniLLM(load_preset("tiny"))
        ids = torch.randint(0, 256, (2, 16))
        mask = torch.ones(2, 16, dtype=torch.long)  # no pad: an input of its own statistics
        batch = {"input_ids": ids, "labels": ids, "attention_mask": mask}
        trace = capture_step(Workload(model=model, batch=hooks.Batch.of(batch),
                                      config=model.config.to_dict()), attention=False)
        with torch.no_grad():
            out = model(ids, labels=ids, attention_mask=mask)
    finally:
        torch.set_num_threads(threads)
    return trace, {"kwargs.input_ids": ids, "kwargs.attention_mask": mask}, out


def _reference(out, path: str) -> torch.Tensor:
    """The tensor at ``path`` (``out.logits``, ``out.router_logits[1]``) of the model's output."""
    name = path.removeprefix("out.")
    if name.endswith("]"):
        name, index = name[:-1].split("[")
        return getattr(out, name)[int(index)].double()
    return getattr(out, name).double()


def _tables(text: str, title: str) -> list[dict[str, list[str]]]:
    """The columns of the statistics tables under section ``title``, in order: each a dict of
    row label to cell text (the 9-cell label column, then one column a tensor, all as wide),
    ``"stat"`` to its heading."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"── {title}"))
    columns: list[dict[str, list[str]]] = []
    i = start + 1
    while i < len(lines) and lines[i].startswith("stat "):
        n = len(lines[i].split()) - 1  # headings are paths: no spaces
        w = (len(lines[i]) - 9) // n  # every column of a table is as wide
        block = [{"stat": lines[i][9 + w * j:9 + w * (j + 1)].strip()} for j in range(n)]
        i += 1
        while i < len(lines) and lines[i][:9].strip() in (*REFERENCE, "zeros", "nan/inf"):
            label = lines[i][:9].strip()
            for j in range(n):
                block[j][label] = lines[i][9 + w * j:9 + w * (j + 1)].strip()
            i += 1
        columns += block
    return columns


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_every_output_and_input_of_the_root_call_has_its_statistics(captured, size):
    trace, given, out = captured
    app = make_step_app(trace)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        step = app.screen
        call = step.stepper.call
        assert call.module == "" and len(call.outputs) == 7  # more than 3: all of them
        details = step.query_one("#details", CallDetails)
        text = details.text.plain
        width = details.scrollable_content_region.width
        table_lines = [line for line in text.splitlines()
                       if line[:9].strip() in ("stat", *REFERENCE, "zeros", "nan/inf")]
        assert table_lines and max(len(line) for line in table_lines) <= width  # none wraps
        outputs = _tables(text, "statistics of the outputs")
        assert len(outputs) == len(call.outputs)
        for column, info in zip(outputs, call.outputs, strict=True):
            ref = _reference(out, info.path)
            assert list(ref.shape) == info.shape
            assert column["stat"] == info.path.removeprefix("out.")  # whole: it fits
            for label, stat in REFERENCE.items():
                assert column[label] == fmt.sci(getattr(info.stats, ATTRS[label]))
                assert float(column[label]) == pytest.approx(float(stat(ref)), rel=6e-3,
                                                             abs=1e-6)
            assert column["zeros"] == fmt.pct(float((ref == 0).double().mean()))
            assert column["nan/inf"] == "✓ 0/0"
        inputs = _tables(text, "statistics of the inputs")
        assert sorted(t.path for t in call.inputs) == sorted(given)
        assert len(inputs) == len(call.inputs)
        for column, info in zip(inputs, call.inputs, strict=True):
            assert column["stat"] == info.path.removeprefix("kwargs.")
            ref = given[info.path].double()
            for label, stat in REFERENCE.items():
                assert column[label] == fmt.sci(getattr(info.stats, ATTRS[label]))
                assert float(column[label]) == pytest.approx(float(stat(ref)), rel=6e-3)
        assert "more output" not in text
        # the pane scrolls to its last line: every table can be brought on screen
        details.scroll_end(animate=False)
        await pilot.pause()
        assert details.scroll_y == details.virtual_size.height - details.size.height > 0


@pytest.mark.parametrize("width", [40, 80, 200])
def test_headings_of_different_tensors_stay_different(width):
    """Cut to 11 cells, layer 0's and layer 10's cache tensors were both headed
    ``past_…0][0]``: the columns are now as wide as the longest heading (within the pane)."""
    from hooks.tensors.stats import summarize_tensor
    from tui.widgets.call_details import stats_tables

    paths = [f"past_key_values[{layer}][{kv}]" for layer in (0, 1, 10) for kv in (0, 1)]
    cols = [(p, summarize_tensor(torch.full((3,), float(i)))) for i, p in enumerate(paths)]
    lines = stats_tables(cols, width).plain.splitlines()
    headings = [h for line in lines if line.startswith("stat ") for h in line.split()[1:]]
    assert headings == paths
    assert max(len(line) for line in lines) <= width
    means = [c for line in lines if line.startswith("mean ") for c in line.split()[1:]]
    assert means == [fmt.sci(float(i)) for i in range(len(paths))]
