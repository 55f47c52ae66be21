"""``hooks.dist``: a ``torchrun`` job recorded as one run.

* :mod:`hooks.dist.distributed` — :class:`RankLink`, what each rank sends;
* :mod:`hooks.dist.rank_job` — the job and its ranks in the store;
* :mod:`hooks.dist.rank_payload` — what travels between ranks (the ranks' medians and
  stragglers are the store's: :mod:`hooks.store.rank_stats`).

This ``__init__`` imports nothing. Never imports textual, rich or tui.
"""
