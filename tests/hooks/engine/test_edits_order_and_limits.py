"""Edits, from a review: several edits of one module run in the order given; ``pos=`` patches
positions only where there are positions, of a source of the same shape; a source the model
refuses is one line; a spec survives its round trip; an ``Edit`` built by hand is checked like
a spec; an edited step's ops are not replayed without its edits."""

from __future__ import annotations

import pytest
import torch

import hooks
from hooks.engine.edits import Edit, parse_edit
from tests.models import batch_for, tiny


def _layer_output(model, batch, edits=None, sources=None, name="model.layers.1"):
    """The output (B, T, D) of module ``name`` (its last call) under ``edits``, read by a hook
    of the test's own (registered after the capture's and the edits' hooks)."""
    seen = {}
    module = model.get_submodule(name)

    def keep(m, a, out) -> None:
        seen["x"] = (out[0] if isinstance(out, tuple) else out).detach().clone()  # the last

    h = module.register_forward_hook(keep)
    try:
        with hooks.capture(model, edits=edits, sources=sources):
            model(**batch)
    finally:
        h.remove()
    return seen["x"]


def test_two_edits_of_one_module_run_in_the_order_given():
    model = tiny()
    batch = batch_for(model, t=8)
    other = torch.randint(0, model.config.vocab_size, (2, 8),
                          generator=torch.Generator().manual_seed(5))
    src = _layer_output(model, {"input_ids": other})
    plain = _layer_output(model, batch)
    # scale by 2 first, then position 0 taken from the source: position 0 is the source's
    got = _layer_output(model, batch, ["scale model.layers.1 by=2",
                                       "patch model.layers.1 from=s pos=0"], {"s": other})
    torch.testing.assert_close(got[:, 0], src[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(got[:, 1:], 2 * plain[:, 1:], rtol=1e-6, atol=1e-6)
    # the other order: the patched position is doubled too
    got = _layer_output(model, batch, ["patch model.layers.1 from=s pos=0",
                                       "scale model.layers.1 by=2"], {"s": other})
    torch.testing.assert_close(got[:, 0], 2 * src[:, 0], rtol=1e-6, atol=1e-6)


def test_pos_on_an_output_without_positions_or_of_another_length_is_not_patched():
    model = tiny()
    batch = batch_for(model, t=8)
    # the router's logits are (B·T, E): dimension 1 is the experts, not the positions
    with hooks.capture(model, edits=["patch model.layers.0.mlp.gate from=s pos=3"],
                       sources={"s": batch["input_ids"].flip(1)}) as trace:
        model(**batch)
    (applied,) = trace.edits
    assert applied.changed == 0 and "pos=" in applied.note
    # a source of 5 positions against 8: not patched, whatever pos says
    with hooks.capture(model, edits=["patch model.layers.0 from=s pos=-1"],
                       sources={"s": batch["input_ids"][:, :5]}) as trace:
        model(**batch)
    (applied,) = trace.edits
    assert applied.changed == 0 and "source" in applied.note


def test_a_source_the_model_refuses_is_one_line():
    model = tiny()
    batch = batch_for(model, t=4)
    bad = torch.full((2, 4), model.config.vocab_size + 10)
    with pytest.raises(ValueError, match=r"^patch source 's': the model raised IndexError") as e:
        with hooks.capture(model, edits=["patch model.layers.0 from=s"], sources={"s": bad}):
            model(**batch)
    assert "\n" not in str(e.value)
    assert not model._forward_hooks and not model.model.layers[0]._forward_hooks


def test_specs_round_trip_and_hand_built_edits_are_checked():
    e = parse_edit("scale model.layers.0 by=0.123456789")
    assert e.by == 0.123456789 and parse_edit(e.spec) == e
    assert parse_edit("scale model.layers.0 by=2").spec == "scale model.layers.0 by=2"
    with pytest.raises(ValueError, match="drop needs expert="):
        parse_edit(Edit("drop", "model.layers.0.mlp"))
    with pytest.raises(ValueError, match="head must be >= 0"):
        parse_edit(Edit("zero", "model.layers.0.self_attn", head=-1))


def test_an_edited_step_does_not_replay_its_ops_without_the_edits():
    model = tiny()
    batch = batch_for(model, t=8)
    with hooks.capture(model, edits=["zero model.layers.0.self_attn head=1"]) as trace:
        model(**batch)
    with pytest.raises(LookupError, match="the step was edited"):
        trace.ops("model.layers.0.self_attn")
