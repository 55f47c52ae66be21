"""``hooks.runs``: training runs — what is recorded while a model trains, and how.

* :mod:`hooks.runs.store` — the SQLite run store (one writer, any number of readers): its
  file format in :mod:`hooks.runs.schema`, its rows in :mod:`hooks.runs.rows`, its writer in
  :mod:`hooks.runs.writer`, opening and locks in :mod:`hooks.runs.sqlite_open`; what the
  writer keeps so that readers never scan a long run (latest values, per-block aggregates,
  capture count) in :mod:`hooks.runs.summary`, a run as one table pivoted by SQLite (``mdb
  export``) in :mod:`hooks.runs.table`;
* :mod:`hooks.runs.numbers` — what each number every view shows means, computed once: the
  run's loss, steps/s and the ETA (:mod:`hooks.runs.rates`), the ranks' median times and
  stragglers (:mod:`hooks.runs.rank_stats`);
* :mod:`hooks.runs.spikes` — loss spikes, found by the store's writer as steps are written;
* :mod:`hooks.runs.run` — ``hooks.run``: record your own training loop (:class:`Run`);
* :mod:`hooks.runs.trainer` — a UI-free training loop with live controls (:class:`Trainer`);
* :mod:`hooks.runs.checkpoint` — checkpoints as safetensors + JSON;
* :mod:`hooks.runs.distributed` — a ``torchrun`` job recorded as one run
  (:class:`~hooks.runs.distributed.RankLink`): the job and its ranks in
  :mod:`hooks.runs.rank_job`, what travels in :mod:`hooks.runs.rank_payload`, the cross-rank
  checksums in :mod:`hooks.runs.rank_checksums`;
* :mod:`hooks.runs.overfit` — ``mdb overfit``: seed 000's "memorise one batch" run; its
  options in :mod:`hooks.runs.overfit_options`.

Built on the capture engine (:mod:`hooks.capture`); never imports textual, rich or tui.
"""
