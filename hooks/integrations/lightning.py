"""``MdbCallback``: record a ``lightning.Trainer`` training as one mdb run.

::

    from hooks.integrations.lightning import MdbCallback

    trainer = lightning.Trainer(max_steps=1000, callbacks=[MdbCallback("exp1", every=50)])
    trainer.fit(module, loader)        # then: mdb watch exp1, mdb doctor --run exp1

At ``on_train_start`` it starts ``hooks.run(name, db=..., total_steps=max_steps)`` and
watches the ``LightningModule`` with the Trainer's first optimizer and LR scheduler
(``run.watch(module, every, optimizer=, scheduler=)``). Each optimizer step is one step of the
run (``trainer.global_step``), logged at the ``on_train_batch_end`` that follows it with the
step's ``loss`` (``training_step``'s) and the numbers in ``trainer.callback_metrics``; a
validation's metrics are added to the step it ran after. The run finishes at
``on_train_end``, or as failed at ``on_exception``.

The training-loop doctor sees the module's own calls (``self(batch)`` in ``training_step``):
its gradient-accumulation check replays the micro-batches through ``forward``, which must
return the loss (``forward(...) -> loss`` or ``(logits, loss)``) for that check to run. Since
Lightning runs the last micro-batch's forward and backward inside ``optimizer.step(closure)``,
the checks of an optimizer step run at ``on_before_optimizer_step`` (after the closure).

``lightning`` is not a dependency of mdb: it is imported when ``MdbCallback`` is first used
(``ImportError`` in one line when missing). Importing ``lightning`` loads ``rich`` (its
progress bar); mdb's own modules still import neither.
"""

from __future__ import annotations

from typing import Any

from hooks.integrations._common import lazy_callback

__all__ = ["MdbCallback"]  # noqa: F822 (made on first use: __getattr__)


def _require() -> Any:
    try:
        import lightning.pytorch as pl
    except ImportError:
        raise ImportError("hooks.integrations.lightning needs lightning: pip install "
                          "lightning") from None
    return pl


def _make() -> type:
    from hooks.integrations._common import CallbackOptions, numeric

    pl = _require()

    class MdbCallback(pl.Callback):
        """A ``lightning.pytorch.Callback`` that makes the training one mdb run (see the
        module).

        Args:
            name: The run's name (``None``: ``run-YYYYMMDD-HHMMSS``).
            db: The run database (``None``: ``$MDB_DB``, else ``./runs/mdb.sqlite``).
            every: Capture every ``every``-th optimizer step and run the loop doctor at
                those steps (``0``: metrics only).
            config: Configuration stored with the run (the module's ``hparams`` otherwise).
            **capture_options: Passed to ``run.watch``.

        Attributes:
            run: The :class:`hooks.recorder.run.Run` once training began (``None`` before).

        Raises:
            TypeError, ValueError: A bad option (at once, one line).
        """

        def __init__(self, name: str | None = None, *, db: Any = None, every: int = 50,
                     config: Any = None, **capture_options: Any) -> None:
            super().__init__()
            self.options = CallbackOptions(name, db, every, config, capture_options)
            self.run: Any = None

        def on_train_start(self, trainer, pl_module) -> None:
            opts = trainer.optimizers
            optimizer = opts[0] if opts else None
            configs = getattr(trainer, "lr_scheduler_configs", None) or []
            scheduler = configs[0].scheduler if configs else None
            hparams = dict(getattr(pl_module, "hparams", {}) or {})
            total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
            self.run = self.options.start(pl_module, optimizer, scheduler,
                                          trainer_config=hparams, total_steps=total)
            _steps_from_closure(self.run)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            _before_update(self.run)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            run = self.run
            if run is None or run.status != "running":
                return
            step = trainer.global_step
            if step == 0 or step <= run.step:
                return  # a micro-batch of an optimizer step not yet taken
            values = numeric({k: v for k, v in trainer.callback_metrics.items()})
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            values.update(numeric({"loss": loss}) if loss is not None else {})
            run.log(step=step, **values)

        def on_validation_end(self, trainer, pl_module) -> None:
            run = self.run
            if run is None or run.status != "running" or trainer.sanity_checking:
                return
            values = numeric(dict(trainer.callback_metrics))
            if values and run.step:
                run.log(step=run.step, **values)

        def on_train_end(self, trainer, pl_module) -> None:
            if self.run is not None:
                self.run.finish()

        def on_exception(self, trainer, pl_module, exception) -> None:
            if self.run is not None and self.run.status == "running":
                line = f"{type(exception).__name__}: {exception}".splitlines()[0][:500]
                self.run.finish("interrupted" if isinstance(exception, KeyboardInterrupt)
                                else "failed", reason=line)

    return MdbCallback


def _steps_from_closure(run: Any) -> None:
    """Tell the run's loop doctor and spike watch that Lightning steps the optimizer through
    ``optimizer.step(closure)`` (see the module): they check in
    :func:`_before_update` instead of around ``optimizer.step``."""
    for watcher in (getattr(run, "loop_doctor", None), getattr(run, "spike_watch", None)):
        if watcher is not None:
            watcher.external_step = True


def _before_update(run: Any) -> None:
    """Lightning's ``on_before_optimizer_step``: the gradients are final, the update not yet
    applied — the spike watch's and the loop doctor's moment."""
    spikes = getattr(run, "spike_watch", None)
    if spikes is not None:
        spikes.before_update()
    doctor = getattr(run, "loop_doctor", None)
    if doctor is not None and doctor.armed:
        doctor.before_step()


__getattr__ = lazy_callback(globals(), _make)
