"""Room to end a run when the disk fills.

When SQLite answers ``database or disk is full`` the writer has committed every step it could,
but marking the run as ended is one more write, and there is no room for it. A
:class:`DiskReserve` sets a few hundred KiB aside beside the database while a run is written
and gives them back at that moment, so the final ``UPDATE runs SET status = 'failed'`` fits
and the run does not stay ``running`` for ever.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

#: Bytes set aside beside the database while a run is written.
RESERVE_BYTES = 256 * 1024


class DiskReserve:
    """A file of :data:`RESERVE_BYTES` real bytes (a sparse file reserves nothing).

    Best effort: where the file cannot be written (no room already, read-only directory)
    nothing is reserved and :meth:`release` answers False.

    Args:
        path: The file to write; its directory is created. The directories created for it
            (``mdb-checkpoints/`` too, when it was made for this file) are removed again on
            :meth:`release` when they are empty: a run that wrote no checkpoint (a job of
            ``mdb overfit --nproc``) leaves no empty folder behind.
    """

    def __init__(self, path: str | Path, nbytes: int = RESERVE_BYTES) -> None:
        self.path = Path(path)
        self.nbytes = int(nbytes)
        self._held = False
        self._made_dirs: list[Path] = []  # deepest first

    @property
    def held(self) -> bool:
        """Whether the bytes are set aside now."""
        return self._held

    def make(self) -> bool:
        """Write the file (idempotent); whether the bytes are now set aside."""
        if self._held:
            return True
        parent = self.path.parent
        try:
            if not parent.exists():
                missing = [parent]
                while not missing[-1].parent.exists():
                    missing.append(missing[-1].parent)
                parent.mkdir(parents=True, exist_ok=True)
                self._made_dirs = missing
            if not self.path.exists() or self.path.stat().st_size < self.nbytes:
                with open(self.path, "wb") as f:
                    f.write(b"\0" * self.nbytes)
            self._held = True
        except OSError:
            with contextlib.suppress(OSError):
                self.path.unlink()
            self._held = False
        return self._held

    def release(self) -> bool:
        """Give the bytes back (idempotent); whether there were any to give."""
        if not self._held:
            return False
        self._held = False
        try:
            self.path.unlink()
        except OSError:
            return False
        finally:
            for made in self._made_dirs:
                try:
                    made.rmdir()  # only when empty (another run's folder stays)
                except OSError:
                    break
        return True


def finish_run(writer, reserve: DiskReserve | None, status: str, **fields) -> None:
    """``writer.finish(status, **fields)``; when SQLite refuses that write (``database or disk
    is full``, or ``attempt to write a readonly database`` once the shared-memory file could not
    grow), the open transaction is rolled back, ``reserve`` is given back and the write is
    retried once on a connection of its own (the failed one may stay unusable).

    Raises:
        sqlite3.Error: The write failed and there was no reserve to give back, or the retry
            failed too.
    """
    from hooks.store.store import RunStore, RunWriter

    try:
        writer.finish(status, **fields)
    except sqlite3.Error:
        rollback_if_open(writer.store.connection)
        if reserve is None or not reserve.release():
            raise
        with RunStore(writer.store.path) as fresh:
            RunWriter(fresh, writer.run_id, writer.name).finish(status, **fields)


def rollback_if_open(conn: sqlite3.Connection) -> None:
    """Roll back a transaction that a failed write (``SQLITE_FULL``) may have left open."""
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
