"""``MdbCallback``: record a ``transformers.Trainer`` training as one mdb run.

::

    from hooks.integrations.transformers import MdbCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[MdbCallback("exp1", db="runs/mdb.sqlite", every=50)])
    trainer.train()        # then: mdb watch exp1, mdb doctor --run exp1

At ``on_train_begin`` it starts ``hooks.run(name, db=..., config=<the TrainingArguments'
plain values>, total_steps=max_steps)`` and watches the model with the Trainer's own
optimizer and LR scheduler (``run.watch(model, every, optimizer=, scheduler=)``: captures of
every ``every``-th optimizer step, and the training-loop doctor's findings). Each optimizer
step is one step of the run (``state.global_step``), logged at ``on_step_end``; what the
Trainer logs (``loss``, ``learning_rate``, ``grad_norm``, ``eval_loss`` …) is added to that
step at ``on_log``. The run finishes at ``on_train_end`` (an exception that ends training
marks it failed, as ``hooks.run`` does).

``transformers`` is not a dependency of mdb: it is imported when ``MdbCallback`` is first
used (``ImportError`` in one line when missing).
"""

from __future__ import annotations

from typing import Any

from hooks.integrations._common import lazy_callback

__all__ = ["MdbCallback"]  # noqa: F822 (made on first use: __getattr__)


def _require() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError("hooks.integrations.transformers needs transformers (and "
                          "accelerate for its Trainer): pip install transformers "
                          "accelerate") from None
    return transformers


def _make() -> type:
    from hooks.integrations._common import CallbackOptions, numeric

    transformers = _require()

    class MdbCallback(transformers.TrainerCallback):
        """A ``TrainerCallback`` that makes the training one mdb run (see the module).

        Args:
            name: The run's name (``None``: ``run-YYYYMMDD-HHMMSS``).
            db: The run database (``None``: ``$MDB_DB``, else ``./runs/mdb.sqlite``).
            every: Capture every ``every``-th optimizer step and run the loop doctor at
                those steps (``0``: metrics only).
            config: Extra configuration stored with the run.
            **capture_options: Passed to ``run.watch``.

        Attributes:
            run: The :class:`hooks.recorder.run.Run` once training began (``None`` before).

        Raises:
            TypeError, ValueError: A bad option (at once, one line).
        """

        def __init__(self, name: str | None = None, *, db: Any = None, every: int = 50,
                     config: Any = None, **capture_options: Any) -> None:
            self.options = CallbackOptions(name, db, every, config, capture_options)
            self.run: Any = None

        def on_train_begin(self, args, state, control, model=None, optimizer=None,
                           lr_scheduler=None, **kwargs):
            if self.run is not None and self.run.status == "running":
                self.run.finish()
            self.run = self.options.start(model, optimizer, lr_scheduler,
                                          trainer_config=args.to_dict(),
                                          total_steps=state.max_steps)

        def on_step_end(self, args, state, control, **kwargs):
            if self.run is not None and self.run.status == "running":
                self.run.log(step=state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            run = self.run
            if run is None or run.status != "running" or not logs:
                return
            values = numeric({k: v for k, v in logs.items() if k != "epoch"})
            if values:
                run.log(step=max(state.global_step, run.step), **values)

        def on_train_end(self, args, state, control, **kwargs):
            if self.run is not None:
                self.run.finish()

    return MdbCallback


__getattr__ = lazy_callback(globals(), _make)
