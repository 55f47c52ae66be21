"""A run store shared by a screen and its polling worker thread.

A screen reads the run store from a thread worker (the UI stays responsive) and closes it when
it is unmounted, on the UI thread. Closing an SQLite connection while another thread is inside
a query is a use-after-free in the sqlite3 module (a segmentation fault, seen when a compare
screen closed during a poll). :class:`StoreHandle` serialises the two: the worker holds the
lock while it reads, ``close`` waits for that read to end, and a worker that starts after
``close`` gets ``None`` instead of reopening the database.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class StoreHandle:
    """Lazily opened :class:`hooks.store.store.RunStore` of ``path``, safe to close from another
    thread than the one reading it.

    Args:
        path: The run database.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._store: Any = None
        self._closed = False

    @contextlib.contextmanager
    def use(self) -> Iterator[Any]:
        """The open store (opened on first use), or ``None`` once :meth:`close` was called;
        :meth:`close` waits until the block ends.

        Raises:
            hooks.store.store.RunStoreError: The database cannot be opened (the next ``use``
                tries again).
        """
        from hooks.store.store import RunStore

        with self._lock:
            if self._closed:
                yield None
                return
            if self._store is None:
                self._store = RunStore(self.path)
            yield self._store

    def reset(self) -> None:
        """Forget the open store after a read failed (the next :meth:`use` reopens it)."""
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()

    def close(self) -> None:
        """Close the store once no read is in progress (idempotent); later reads get ``None``."""
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            store.close()
