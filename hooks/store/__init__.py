"""``hooks.store``: the SQLite run store — one writer, any number of readers; no torch.

* :mod:`hooks.store.store` — :class:`RunStore`; its file format in :mod:`hooks.store.schema`,
  its rows in :mod:`hooks.store.rows`, its writer thread in :mod:`hooks.store.writer`, opening
  and locks in :mod:`hooks.store.sqlite_open`, liveness of the writer in
  :mod:`hooks.store.liveness`, the names listed in :mod:`hooks.store.listing`;
* what the writer keeps so that readers never scan a long run in :mod:`hooks.store.summary`;
  a run as one table (``mdb export``) in :mod:`hooks.store.table`; loss spikes found as steps
  are written in :mod:`hooks.store.spikes`; steps/s in :mod:`hooks.store.rates`; the ranks'
  medians and stragglers in :mod:`hooks.store.rank_stats`;
* :mod:`hooks.store.control` — stop, pause, resume through the store; :mod:`hooks.store.reserve`
  — disk kept free; :mod:`hooks.store.values` — the values ``hooks.run`` stores, checked.

This ``__init__`` imports nothing: ``mdb runs`` and the other store commands load only what
they read, never torch. Never imports textual, rich or tui.
"""
