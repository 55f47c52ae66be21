"""The line ``mdb overfit`` prints when a run ends, and its exit status (headless and live)."""

from __future__ import annotations

from typing import Any

#: Exit status of a run that failed (a non-finite value) or whose checkpoint could not be written.
EXIT_FAILED = 1


def fmt_loss(x: float | None) -> str:
    """A loss as printed in the progress and end lines (``nan`` when missing)."""
    return "nan" if x is None else f"{x:.4f}"


def end_of_run(
    session: Any, result: Any, last: Any, db: str | None
) -> tuple[str, bool, int]:
    """What to print when a run ends: ``(line, is_error, exit status)``.

    ``is_error`` lines go to stderr with the ``mdb: error:`` prefix: a failed run (a
    non-finite value, ``run n failed: non-finite loss at step 4 …``) and a run whose last
    checkpoint could not be written; the lines of a finished or interrupted run go to stdout.
    The line says "checkpoint" only about a checkpoint that exists: when the last one failed
    (disk full, read-only directory), it says so, and which step a resume would start from.

    Args:
        session: The :class:`hooks.train.overfit.RunSession` that ran.
        result: Its :class:`hooks.train.trainer.TrainResult`.
        last: The last step's :class:`hooks.store.store.MetricRow`, if any; its main loss (``ce``
            for minillm, ``loss`` for a ``--model``) is repeated in the line.
        db: The ``--db`` given on the command line (repeated in the resume hint), or ``None``.
    """
    from hooks.train.trainer import signal_exit_code
    from tui.screens.live_data import metric_values

    name = session.name
    loss = ""
    if last is not None and session.headline_metrics:
        main = session.headline_metrics[0]
        value = metric_values(last, session.metric_names).get(main)
        loss = f", {main} {fmt_loss(value)}" if value is not None else ""
    resume = f"mdb overfit --resume {name}" + (f" --db {db}" if db else "")
    saved = session.last_checkpoint_step
    if session.checkpoint_error and not session.checkpoint_current:
        where = (f"a resume starts again from step {saved}" if saved is not None
                 else "it cannot be resumed")
        return (f"run {name} {result.status} after step {result.last_step}{loss}, but its "
                f"{session.checkpoint_error}; {where}", True, EXIT_FAILED)
    if result.status == "finished":
        return (f"run {name} finished: step {result.last_step}/{session.trainer.total_steps}"
                f"{loss}; checkpoint in {session.checkpoint_path}", False, 0)
    if result.status == "failed":  # a non-finite value: an error, as the model raising is
        return f"run {name} failed: {result.reason}", True, EXIT_FAILED
    return (f"run {name} interrupted ({result.reason}) after step {result.last_step}{loss}; "
            f"checkpoint written; continue with: {resume}", False,
            signal_exit_code(result.reason) or 130)
