"""One step run again with edits: the "what if" that ``mdb diff --edit`` and the step view's
``e`` show (A = the step as is, B = the step edited, on the same model, weights and batch).

:func:`run_step` captures one forward and backward pass with or without edits;
:func:`rerun_edited` re-runs a captured step (its :class:`hooks.trace.ops.Replay`: the model, the
root call's arguments and the random state at its start) with edits. Both leave the model's
``.grad`` as they found them and the caller's random stream untouched, so that A and B differ
by the edits only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

#: The source name of the step view's ``patch``: the batch with its rows rolled by one.
ROLLED = "rolled"


def rolled(batch: Any) -> Any:
    """The batch with every tensor whose first dimension is B (B ≥ 2) rolled by one row along
    it: each row's source is the next row (a "clean prompt" from the same batch).

    Args:
        batch: anything :meth:`hooks.Batch.of` takes.

    Returns:
        hooks.Batch: the rolled batch.

    Raises:
        ValueError: the batch has no tensor with at least 2 rows.
    """
    from hooks.batch import Batch

    b = Batch.of(batch)
    ids = b.ids()
    rows = ids.shape[0] if ids is not None and ids.dim() >= 1 else None
    if rows is None:
        first = next((v for v in (*b.args, *b.kwargs.values()) if isinstance(v, torch.Tensor)
                      and v.dim() >= 1), None)
        rows = None if first is None else first.shape[0]
    if not rows or rows < 2:
        raise ValueError("patch from=rolled needs a batch of at least 2 rows (each row takes "
                         "its source from the next)")

    def roll(v):
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == rows:
            return torch.roll(v, 1, dims=0)
        return v

    return b.replace(args=tuple(roll(v) for v in b.args),
                     kwargs={k: roll(v) for k, v in b.kwargs.items()})


def _loss_meta(output: Any, choice: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"loss_source": choice.source, "loss_fallback": choice.fallback}
    for name in ("loss", "ce_loss", "aux_loss"):
        value = choice.loss if name == "loss" else getattr(output, name, None)
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            value = float(value.detach())
            meta[name] = value if math.isfinite(value) else str(value)
    return meta


def run_step(model: nn.Module, batch: Any, *, loss_fn: Any = None,
             edits: Sequence[Any] | None = None, sources: Mapping[str, Any] | None = None,
             attention: bool = False, meta: Mapping[str, Any] | None = None,
             rng_state: torch.Tensor | None = None, training: bool | None = None):
    """Capture one forward and backward pass of ``model`` on ``batch``, with ``edits``.

    The model's ``.grad`` are set aside during the step and put back after it (the step's
    own gradients are recorded in the trace, not accumulated); the random state is
    ``rng_state`` when given, and the caller's random stream is left as it was.

    Args:
        model: the model.
        batch: anything :meth:`hooks.Batch.of` takes.
        loss_fn: ``loss_fn(output, batch)``, else the loss by :func:`hooks.select_loss`.
        edits: edit specs or :class:`hooks.engine.edits.Edit` objects (None: the step as is).
        sources: batches by name for ``patch ... from=NAME``.
        attention: record attention probabilities.
        meta: values for ``trace.meta`` (the loss values are added: ``loss``, ``ce_loss``,
            ``aux_loss``, ``loss_source``).
        rng_state: ``torch.get_rng_state()`` to run with (dropout draws the same masks).
        training: the model's train flag for the step (restored after), None to leave it.

    Returns:
        hooks.Trace: the trace, ``trace.edits`` saying what each edit did.

    Raises:
        ValueError: a bad edit (before anything runs; one line).
        hooks.BatchError: no loss can be found in the output.
    """
    from hooks.batch import Batch, select_loss
    from hooks.engine.capture import capture

    b = Batch.of(batch)
    cap = capture(model, edits=edits, sources=sources, attention=attention,
                        meta=dict(meta or {}))
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    flags = [(m, m.training) for m in model.modules()] if training is not None else []
    for p in params:
        p.grad = None
    try:
        if training is not None:
            model.train(training)
        with torch.random.fork_rng(devices=[]):
            if rng_state is not None:
                torch.set_rng_state(rng_state)
            with cap as trace:
                output = b.call(model)
                choice = select_loss(output, loss_fn, b)
                choice.loss.backward()
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
        for m, f in flags:
            m.training = f
    trace.meta.update(_loss_meta(output, choice))
    if edits:
        note_unread_positions(trace, model, b, loss_fn)
    return trace


def loss_reads(model: nn.Module, batch: Any, loss_fn: Any = None) -> list[int] | None:
    """The positions (0…T-1) whose logits the step's loss reads, where that can be told from the
    batch: with labels equal to the input ids (HF, shifted inside the model: position p predicts
    the label at p + 1, so the last position is never read; also labels ignored on some positions
    of a causal LM, a ``*ForCausalLM`` / ``*LMHeadModel``) or next-token targets (nanoGPT:
    position p predicts the target at p), the positions whose target is counted (not the ignore
    value). None with a ``loss_fn`` of the user's, an encoder-decoder, or other targets.
    """
    from hooks.batch import Batch, TargetLayout, is_encoder_decoder

    if loss_fn is not None or is_encoder_decoder(model):
        return None
    b = Batch.of(batch)
    layout = b.target_layout(model)
    tgt, _slot = b.targets_tensor(model)
    causal = type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    if layout.kind == "masked" and causal:
        layout = TargetLayout("aligned", layout.ignore, layout.where)  # HF shifts inside
    if layout.kind not in ("aligned", "shifted") or not isinstance(tgt, torch.Tensor):
        return None
    counted = (tgt != layout.ignore) if layout.ignore is not None else torch.ones_like(
        tgt, dtype=torch.bool)
    if layout.kind == "aligned":
        return [p for p in range(tgt.shape[1] - 1) if bool(counted[:, p + 1].any())]
    return [p for p in range(tgt.shape[1]) if bool(counted[:, p].any())]


def note_unread_positions(trace, model: nn.Module, batch: Any, loss_fn: Any = None) -> None:
    """Say, on each ``patch … pos=P`` of ``trace.edits`` that changed its calls, when every
    position P lies after the last position the loss reads (:func:`loss_reads`): a causal
    language model's later positions cannot reach earlier logits, so the edit cannot change the
    loss (``pos=-1`` never can with HF's shifted loss). The note goes on the
    :class:`hooks.trace.applied_edit.AppliedEdit` (its :meth:`describe` says it) and in
    ``trace.notes``.
    """
    from hooks.batch import Batch
    from hooks.engine.edits import parse_edit, parse_positions
    from hooks.trace.records import Note

    reads = loss_reads(model, batch, loss_fn)
    ids = Batch.of(batch).ids(model)
    if reads is None or ids is None or ids.dim() != 2:
        return
    t, last = int(ids.shape[1]), max(reads, default=-1)
    for rec in trace.edits:
        e = parse_edit(rec.spec)
        if e.op != "patch" or e.pos is None or not rec.applied or rec.note:
            continue
        pos = parse_positions(e.pos)
        idx = list(range(t))[pos] if isinstance(pos, slice) else [p % t for p in pos]
        if idx and min(idx) > last:
            rec.note = (f"{rec.changed} of {rec.calls} call(s) changed, but pos={e.pos} lies "
                        f"after the last position the loss reads ({last}): a causal model's "
                        "later positions cannot reach it, so the loss cannot change")
            trace.notes.append(Note("edit", f"{rec.spec}: {rec.note}", module=rec.hooked))


def rerun_edited(trace, edits: Sequence[Any], *, sources: Mapping[str, Any] | None = None,
                 loss_fn: Any = None):
    """Run the step ``trace`` recorded again, with ``edits`` (B of "A as is, B edited").

    Uses ``trace.replay`` (the model and the root call's arguments, the random state at the
    step's start, and the step's batch and loss function when the capture kept them:
    ``tui.commands.capturing.capture_step`` does); a ``patch ... from=rolled`` takes its
    source from the batch's rows rolled by one (:func:`rolled`) unless ``sources`` names
    another.

    Args:
        trace: a :class:`hooks.Trace` captured in this process (not loaded from disk).
        edits: edit specs or :class:`hooks.engine.edits.Edit` objects.
        sources: batches by name for ``patch``.
        loss_fn: the loss function the step used (default: the replay's).

    Returns:
        hooks.Trace: the edited step, with ``meta`` copied from ``trace`` and its own loss.

    Raises:
        ValueError: the trace holds no replay (loaded from disk), the step's loss came from a
            ``loss_fn`` that is not given, or a bad edit (one line, nothing run).
    """
    from hooks.batch import Batch
    from hooks.engine.edits import parse_edit

    replay = getattr(trace, "replay", None)
    if replay is None:
        raise ValueError("this trace was loaded from disk: it holds no model to re-run; "
                         "capture the step here, or use mdb diff --edit")
    loss_fn = loss_fn if loss_fn is not None else getattr(replay, "loss_fn", None)
    if loss_fn is None and str(trace.meta.get("loss_source", "")).startswith("loss_fn"):
        raise ValueError("the step's loss came from a loss_fn the trace does not hold; use "
                         "mdb diff --edit with your --model factory")
    batch = getattr(replay, "batch", None) or Batch(replay.args, replay.kwargs)
    srcs = dict(sources or {})
    parsed = [parse_edit(e) for e in edits]
    if any(e.needs_source and e.source == ROLLED for e in parsed) and ROLLED not in srcs:
        srcs[ROLLED] = rolled(batch)
    meta = {k: v for k, v in (trace.meta or {}).items()
            if k not in ("loss", "ce_loss", "aux_loss", "aux_losses")}
    meta["edits"] = [e.spec for e in parsed]
    return run_step(replay.model, batch, loss_fn=loss_fn, edits=parsed, sources=srcs,
                    meta=meta, rng_state=replay.rng_cpu, training=replay.training)


def loss_of(trace) -> float | None:
    """The trace's loss (``meta['loss']``) as a float, None when absent or not finite text."""
    v = (trace.meta or {}).get("loss")
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


__all__ = ["ROLLED", "loss_of", "loss_reads", "note_unread_positions", "rerun_edited", "rolled",
           "run_step"]
