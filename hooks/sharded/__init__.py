"""``hooks.sharded``: sharded tensors (``DTensor``) measured as one tensor, and replicas
compared across ranks.

* :mod:`hooks.sharded.stats` — statistics of a DTensor from its local pieces;
* :mod:`hooks.sharded.replicas` — checksums of replicated positions;
* :mod:`hooks.sharded.checksums` — the checksums the ranks reported, compared.

Built on :mod:`hooks.trace` and :mod:`hooks.tensors`. This ``__init__`` imports nothing (the
run store reads :data:`hooks.sharded.checksums.NOT_COMPARED` without ``import torch``).
"""
