"""``tui.store_handle.StoreHandle``: closing waits for a read in progress (closing an SQLite
connection under a running query crashed the process), and no read reopens a closed store."""

from __future__ import annotations

import threading

from hooks.store.store import RunStore
from tui.store_handle import StoreHandle


def test_close_waits_for_the_read_in_progress_and_later_reads_get_none(tmp_path):
    db = tmp_path / "mdb.sqlite"
    RunStore(db, create=True).close()
    handle = StoreHandle(db)
    inside, release, closed = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def reader() -> None:
        with handle.use() as store:
            inside.set()
            release.wait(30)
            seen.append(store.runs())  # still open: close() is waiting

    t = threading.Thread(target=reader)
    t.start()
    assert inside.wait(30)
    closer = threading.Thread(target=lambda: (handle.close(), closed.set()))
    closer.start()
    assert not closed.wait(0.2)  # blocked by the read
    release.set()
    t.join(30)
    closer.join(30)
    assert closed.is_set() and seen == [[]]
    with handle.use() as store:
        assert store is None
