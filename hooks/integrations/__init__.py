"""mdb inside the trainers people use: each makes the training one mdb run (``hooks.run``):
the logged metrics, the watched captures (``run.watch``) and the training-loop doctor's
findings, with the trainer's own optimizer and LR scheduler.

* :mod:`hooks.integrations.transformers` — ``MdbCallback``, a ``transformers.TrainerCallback``:
  ``Trainer(..., callbacks=[MdbCallback("exp1")])``.
* :mod:`hooks.integrations.lightning` — ``MdbCallback``, a ``lightning.pytorch.Callback``:
  ``lightning.Trainer(..., callbacks=[MdbCallback("exp1")])``.

Neither library is a dependency of mdb: each module imports its library only when
``MdbCallback`` is first used, and says in one line (an ``ImportError``) what to install when
it is missing. This package never imports textual, rich or tui itself (``lightning`` imports
``rich`` on its own; the import contracts are about mdb's own imports).
"""

from __future__ import annotations

__all__: list[str] = []
