"""One captured step of a workload (:func:`capture_step`), and the ops it steps into: the
first non-finite call's, the backward origin, and those of the modules ``--ops`` names."""

from __future__ import annotations

import contextlib
from typing import Any

from tui.commands.workload import Workload
from tui.errors import MdbError, ModelError


def capture_step(workload: Workload, *, attention: bool = True, keep_bytes: int = 0,
                 ops: list[str] | None = None, edits: list[str] | None = None,
                 sources: dict[str, Any] | None = None, optimizer: Any = None):
    """Run one forward and backward pass of ``workload`` under :func:`hooks.capture`.

    When the forward produced NaN/Inf, the ops of the first non-finite call are recorded
    (:meth:`hooks.Trace.ops`, a replay); when only the backward did, the forward op whose
    backward created them is located (:meth:`hooks.Trace.locate_backward_origin`). Both are
    saved with the trace.

    Args:
        workload: the model, batch and loss function.
        attention: record attention probabilities.
        keep_bytes: budget for full tensor copies.
        ops: ``fnmatch`` patterns of module names whose every call's ops are recorded too.
        edits: edit specs applied to the step (:mod:`hooks.engine.edits`; check them first with
            :func:`tui.commands.editing.edit_plan`), and ``sources`` their patch batches.
        optimizer: the optimizer whose state ``trace.memory`` counts (not stepped).

    Returns:
        The :class:`hooks.Trace`, with ``meta`` holding the description, token labels,
        config, input shape and the loss values (``loss``, ``ce_loss``, ``aux_loss``).
        A non-finite loss does not stop the capture: the trace shows where it started.

    Raises:
        MdbError: ``ops`` matches no recorded call; a bad edit.
    """
    import math

    import torch

    import hooks

    model = workload.model
    meta: dict[str, Any] = {
        "description": workload.description,
        "tokens": workload.token_strings,
        "config": workload.config_dict,
        "input_shape": list(workload.input_ids.shape) if workload.input_ids is not None else None,
    }
    from hooks.batch import BatchError, select_loss
    from hooks.errors import describe_error

    batch = workload.batch
    try:
        cap = hooks.capture(model, attention=attention, keep_bytes=keep_bytes, meta=meta,
                            edits=edits, sources=sources, optimizer=optimizer)
    except ValueError as exc:  # a bad edit: nothing ran
        raise MdbError(str(exc)) from None
    stack = contextlib.ExitStack()
    try:
        trace = stack.enter_context(cap)
    except ValueError as exc:  # a patch source the model refused (it runs on entry)
        raise ModelError(str(exc)) from None
    with stack:
        try:
            output = batch.call(model)
        except Exception as exc:  # the user's model: one line with the module and its line
            raise ModelError(describe_error(exc, model, "the forward pass")) from None
        try:
            choice = select_loss(output, workload.loss_fn, batch)
        except BatchError as exc:
            raise MdbError(str(exc)) from None
        except Exception as exc:  # the user's loss_fn raised
            raise ModelError(describe_error(exc, model, "loss_fn")) from None
        try:
            choice.loss.backward()
        except Exception as exc:
            raise ModelError(describe_error(exc, model, "the backward pass")) from None
    meta["loss_source"] = choice.source
    meta["loss_fallback"] = choice.fallback
    for name in ("loss", "ce_loss", "aux_loss"):
        value = choice.loss if name == "loss" else getattr(output, name, None)
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            value = float(value.detach())
            meta[name] = value if math.isfinite(value) else str(value)
    aux_losses = getattr(output, "aux_losses", None)
    if aux_losses is not None:
        meta["aux_losses"] = [float(v) for v in aux_losses.detach()]
    trace.meta.update(meta)
    if trace.replay is not None:  # what re-runs the whole step (e in the step view)
        trace.replay.batch, trace.replay.loss_fn = batch, workload.loss_fn
    _step_into(trace, workload, ops or [])
    return trace


def _step_into(trace, workload: Workload, patterns: list[str]) -> None:
    """The ops :func:`capture_step` records: the first non-finite call's, the backward
    origin, and every call of the modules ``patterns`` match."""
    import fnmatch

    from hooks.batch import select_loss

    calls = [r for r in trace.forward
             if any(fnmatch.fnmatchcase(r.module, p) for p in patterns)]
    if patterns and not calls:
        raise MdbError(f"--ops {' '.join(patterns)}: no recorded module call matches")
    bad = trace.first_nonfinite("forward")
    if bad is not None:
        calls.append(trace.forward[bad.index])
    for rec in calls:
        try:
            trace.ops(rec.module, rec.call_index)
        except Exception as exc:  # the user's model raised on the replay: say so, go on
            trace.meta.setdefault("ops_errors", []).append(
                f"{rec.module} call {rec.call_index}: {type(exc).__name__}: {exc}")
    if bad is None and trace.first_nonfinite("backward") is not None:
        batch, loss_fn = workload.batch, workload.loss_fn
        try:
            trace.locate_backward_origin(lambda out: select_loss(out, loss_fn, batch).loss)
        except Exception as exc:
            trace.meta["backward_origin_error"] = f"{type(exc).__name__}: {exc}"
