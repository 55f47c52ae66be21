"""A watched step of a compiled model applies exactly the update an unwatched one would
(issue 32, item 13): the step runs compiled, the capture is an eager replay on the side that
leaves parameters, gradients, buffers and the RNG as the compiled step left them, and says by
how much eager and compiled differ."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hooks


class Graphs:
    """A torch.compile backend that runs dynamo's graph as traced and counts compilations."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, gm, example_inputs):
        self.count += 1
        return gm.forward


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.norm(self.embed(x)))))


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


def scale_output(module, args, out):
    """A hook registered after the model was compiled: eager runs it, the graph ignores it
    (pytorch #117265), so eager and compiled compute other losses."""
    return out * 3.0


def train(compiled: str | None, watched: bool, tmp_path, *, late_hook=False, steps=10):
    torch.manual_seed(0)
    model = Net().train()
    graphs = Graphs()
    if compiled == "wrapper":
        run_model = torch.compile(model, backend=graphs)
    elif compiled == "in_place":
        model.compile(backend=graphs)
        run_model = model
    elif compiled == "submodule":
        model.embed = torch.compile(model.embed, backend=graphs)
        run_model = model
    else:
        run_model = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(steps)
    run = hooks.run("cmp", db=tmp_path / f"{compiled}-{watched}-{late_hook}.sqlite")
    if watched:
        run.watch(run_model, every=1, optimizer=opt)
    torch.manual_seed(123)  # dropout masks
    try:
        for i, (x, y) in enumerate(data):
            loss = nn.functional.cross_entropy(run_model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.log(loss=loss)
            if i == 0 and late_hook:
                model.head.register_forward_hook(scale_output)
    finally:
        run.finish()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, graphs.count, run


@pytest.mark.parametrize("compiled", [None, "wrapper", "in_place", "submodule"])
def test_watched_steps_apply_the_same_updates(tmp_path, compiled):
    plain, n_plain, _ = train(compiled, False, tmp_path, steps=6)
    watched, n_watched, _ = train(compiled, True, tmp_path, steps=6)
    assert plain.keys() == watched.keys()
    for k in plain:
        assert torch.equal(plain[k], watched[k]), k
    if compiled != "in_place":  # the capture made dynamo compile nothing more
        # (Module.compile() traces the NaN sentinel's root hooks that run.watch attaches to
        # every step: a graph break, two graphs, the same values)
        assert n_watched == n_plain


def test_watched_steps_apply_the_compiled_update_where_eager_differs(tmp_path):
    plain, n_plain, _ = train("wrapper", False, tmp_path, late_hook=True)
    watched, n_watched, _ = train("wrapper", True, tmp_path, late_hook=True)
    for k in plain:
        assert torch.equal(plain[k], watched[k]), k
    assert n_watched == n_plain == 1
    # the hook does reach eager code: the uncompiled model trains to other parameters
    eager, _, _ = train(None, False, tmp_path, late_hook=True)
    assert not torch.equal(eager["head.weight"], plain["head.weight"])


def test_capture_of_a_compiled_step_leaves_its_gradients_and_says_how_far_eager_is():
    """hooks.capture on a compiled model outside run.watch: .grad and the buffers are the
    compiled step's, and where eager computes something else the note says by how much."""
    x = batches(1)[0][0]
    model = Net().train()
    compiled = torch.compile(model, backend=Graphs())
    compiled(x).sum().backward()  # compiled before the hook: the graph ignores it
    model.head.register_forward_hook(scale_output)

    def step(capture: bool):
        compiled.zero_grad(set_to_none=True)
        bn = model.norm.running_mean.clone()
        torch.manual_seed(5)
        if capture:
            with hooks.capture(compiled) as tr:
                out = compiled(x)
                out.sum().backward()
        else:
            tr, out = None, compiled(x)
            out.sum().backward()
        model.norm.running_mean.copy_(bn)  # the next call starts from the same statistics
        return tr, out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    _, out_plain, grads_plain = step(False)
    tr, out, grads = step(True)
    assert torch.equal(out, out_plain)
    for n, g in grads.items():
        assert torch.equal(g, grads_plain[n]), n
        assert tr.params[n].grad_norm == pytest.approx(float(g.double().norm()), rel=1e-6)
    assert [r.module for r in tr.forward] == ["", "embed", "norm", "drop", "head"]
    # eager runs the hook: its output is 3x the compiled one, |Δ| = 2 max |out|
    note = next(n.message for n in tr.notes if n.kind == "compiled_differs")
    assert f"outputs max |Δ| {2 * float(out_plain.abs().max()):.3g} (2 of max |x|" in note
    assert "beyond float rounding in outputs, gradients" in note
    assert tr.forward[-1].outputs[0].stats.max == pytest.approx(
        3 * float(out_plain.max()), rel=1e-5)


@pytest.mark.slow
def test_inductor_watched_steps_apply_the_same_updates(tmp_path):
    """The same with inductor's kernels (a C++ compiler on the machine; ~1 min to compile)."""
    import shutil

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("inductor needs a C++ compiler")

    def loop(watched):
        torch.manual_seed(0)
        model = Net().train()
        compiled = torch.compile(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = hooks.run("ind", db=tmp_path / f"{watched}.sqlite")
        if watched:
            run.watch(compiled, every=2, optimizer=opt)
        torch.manual_seed(123)
        try:
            for x, y in batches(4):
                loss = nn.functional.cross_entropy(compiled(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                run.log(loss=loss)
        finally:
            run.finish()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    plain, watched = loop(False), loop(True)
    for k in plain:
        assert torch.equal(plain[k], watched[k]), k
