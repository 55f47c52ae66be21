"""Opening a run database: connections, locks held by other processes, damaged files.

What :class:`hooks.store.store.RunStore` builds on:

* :func:`open_database` opens a database file in autocommit mode with the store's pragmas,
  read-write where it may, read-only (``mode=ro``, ``immutable=1``, or a private copy) where it
  may not (see :mod:`hooks.store.store`'s docstring); it never creates one unless asked.
* **Locks.** Every connection waits up to :func:`lock_wait` seconds (``$MDB_LOCK_WAIT``, else
  the store's default, 10 s) for a lock that another process holds: an open write
  transaction (``BEGIN EXCLUSIVE``), or a connection in ``locking_mode=EXCLUSIVE`` that keeps
  every other one out. Past that bound an operation raises :class:`DatabaseLockedError`, one
  line naming the process that holds the lock when the system says (Linux: ``/proc/locks``)
  and how long mdb waited — never "not an mdb run database".
* **Damage.** :func:`find_damage` runs ``PRAGMA quick_check`` (every page and record read, the
  indexes not compared with their tables); a store refuses to write to a database it
  reports damaged (:class:`DamagedDatabaseError`).

This module uses only the standard library; it never imports torch, textual or rich.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

__all__ = [
    "DEFAULT_DB_ENV",
    "LOCK_WAIT_ENV",
    "DamagedDatabaseError",
    "DatabaseLockedError",
    "RunStoreError",
    "Transaction",
    "damaged_error",
    "decode_text",
    "find_damage",
    "is_malformed",
    "not_a_store",
    "open_copy",
    "is_locked",
    "lock_holders",
    "lock_wait",
    "locked_error",
    "open_database",
    "set_wal",
]

#: Environment variable overriding the default database path.
DEFAULT_DB_ENV = "MDB_DB"
#: Environment variable: seconds to wait for a lock another process holds.
LOCK_WAIT_ENV = "MDB_LOCK_WAIT"
#: The longest wait ``$MDB_LOCK_WAIT`` may ask for (one day).
MAX_LOCK_WAIT = 86_400.0


class RunStoreError(Exception):
    """The database is missing, unreadable, not an mdb run store, or was used wrongly.

    The message is one line meant for the user (the CLI prints it as ``mdb: error: ...``).
    """


class DatabaseLockedError(RunStoreError, sqlite3.OperationalError):
    """Another process held a lock on the database for longer than :func:`lock_wait`.

    Also an :class:`sqlite3.OperationalError`, so that code which handles a failed write
    (``except sqlite3.Error``) handles this one. The message is one line: ``the run database is
    locked by another process (pid N); mdb waited 10 s for PATH (...)``.

    Attributes:
        pids: The processes that held a write lock on the file or its ``-shm`` when mdb gave
            up (empty when the system does not say).
        waited: Seconds mdb waited.
    """

    def __init__(self, message: str, pids: list[int] | None = None, waited: float = 0.0) -> None:
        super().__init__(message)  # (message,): it pickles, as an exception must
        self.pids = list(pids or [])
        self.waited = waited


class DamagedDatabaseError(RunStoreError):
    """The database file is damaged (``PRAGMA quick_check`` reports a problem, or SQLite said
    ``database disk image is malformed``): mdb reads what it can and writes nothing."""


# ---------------------------------------------------------------------------------------------
# Locks
# ---------------------------------------------------------------------------------------------


def lock_wait(default: float) -> float:
    """Seconds a connection waits for a lock held by another process: ``$MDB_LOCK_WAIT``
    when it is set to a number of seconds (0 to :data:`MAX_LOCK_WAIT`), else ``default``.

    Raises:
        RunStoreError: ``$MDB_LOCK_WAIT`` is set to something else.
    """
    text = os.environ.get(LOCK_WAIT_ENV, "").strip()
    if not text:
        return float(default)
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= MAX_LOCK_WAIT:  # also NaN
        raise RunStoreError(f"{LOCK_WAIT_ENV}={text[:40]!r}: expected the seconds to wait for "
                            f"a locked run database, 0 to {MAX_LOCK_WAIT:.0f}")
    return value


def is_locked(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite's ``SQLITE_BUSY``: a lock another connection holds."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF == sqlite3.SQLITE_BUSY:
        return True
    return "database is locked" in str(exc)


def _file_id(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def lock_holders(path: str | os.PathLike[str]) -> list[int]:
    """The other processes holding a write lock on the database file or its ``-shm`` file.

    Read from ``/proc/locks`` (Linux); SQLite takes POSIX advisory locks: a writer holds a
    write lock on a byte of the ``-shm`` file (WAL mode) or on the lock bytes of the
    database file (rollback journal, or ``locking_mode=EXCLUSIVE``); readers hold read locks.

    Returns:
        Their pids, in increasing order, without this process; empty where the system does
        not say (no ``/proc/locks``) or no other process holds one.
    """
    path = Path(path)
    ids = {i for i in (_file_id(path), _file_id(Path(f"{path}-shm"))) if i is not None}
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    pids = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8 or fields[1] == "->" or fields[1] not in ("POSIX", "FLOCK"):
            continue
        mode, pid, where = fields[3], fields[4], fields[5].split(":")
        if mode != "WRITE" or len(where) != 3 or not pid.isdigit():
            continue
        try:
            fid = (int(where[0], 16), int(where[1], 16), int(where[2]))
        except ValueError:
            continue
        if fid in ids and int(pid) != os.getpid():
            pids.add(int(pid))
    return sorted(pids)


def locked_error(path: Path, waited: float, bound: float | None = None) -> DatabaseLockedError:
    """The one-line error for a database another process kept locked while mdb waited
    ``waited`` seconds (see :class:`DatabaseLockedError`). ``bound``: the lock wait mdb
    applied; the line states it when mdb waited at least that long (a loaded machine wakes
    late: the bound is what the user can change, the overshoot is noise), else ``waited``."""
    pids = lock_holders(path)
    who = ""
    if pids:
        who = f" (pid {pids[0]})" if len(pids) == 1 else f" (pids {', '.join(map(str, pids))})"
    said = waited if bound is None else min(waited, bound)
    shown = f"{said:.0f}" if said >= 9.5 else f"{said:.1f}"
    return DatabaseLockedError(
        f"the run database is locked by another process{who}; mdb waited {shown} s for "
        f"{path} (set {LOCK_WAIT_ENV}=SECONDS to wait longer)", pids, waited)


class Transaction:
    """``with Transaction(conn, path):`` one transaction on an autocommit connection:
    ``BEGIN IMMEDIATE`` for writes (the write lock is taken up front, so the lock wait applies
    at ``BEGIN`` rather than failing at ``COMMIT``), ``BEGIN`` for a consistent read of
    several statements. Committed when the block ends normally, rolled back otherwise.

    Raises:
        DatabaseLockedError: Another process held the write lock for longer than the lock
            wait.
    """

    def __init__(self, conn: sqlite3.Connection, path: Path, immediate: bool = True) -> None:
        self.conn = conn
        self.path = path
        self.immediate = immediate

    def __enter__(self) -> sqlite3.Connection:
        t0 = time.monotonic()
        try:
            self.conn.execute("BEGIN IMMEDIATE" if self.immediate else "BEGIN")
        except sqlite3.OperationalError as exc:
            if is_locked(exc):
                bound = self.conn.execute("PRAGMA busy_timeout").fetchone()[0] / 1000
                raise locked_error(self.path, time.monotonic() - t0, bound) from exc
            raise
        return self.conn

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.conn.execute("COMMIT")
        else:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass


def set_wal(conn: sqlite3.Connection, path: Path, wait: float) -> str:
    """``PRAGMA journal_mode = WAL`` on a new database; the mode it is in after.

    Switching a file to WAL takes an exclusive lock that SQLite does not wait for (its busy
    timeout does not apply): while other processes open the same new file it answers
    ``database is locked`` at once. It is tried again, up to ``wait`` seconds.

    Raises:
        DatabaseLockedError: Still locked after ``wait`` seconds.
    """
    t0 = time.monotonic()
    pause = 0.001
    while True:
        try:
            return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            waited = time.monotonic() - t0
            if not is_locked(exc):
                raise
            if waited >= wait:
                raise locked_error(path, waited, wait) from exc
        time.sleep(min(pause, max(0.0, wait - waited)))
        pause = min(pause * 2, 0.05)


# ---------------------------------------------------------------------------------------------
# Damage
# ---------------------------------------------------------------------------------------------


def is_malformed(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite's ``SQLITE_CORRUPT`` (``database disk image is
    malformed``)."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF == sqlite3.SQLITE_CORRUPT:
        return True
    return "malformed" in str(exc)


def find_damage(conn: sqlite3.Connection) -> str | None:
    """How the database is damaged, from ``PRAGMA quick_check``: ``None`` for a sound one,
    else its first problems on one line (``Page 10: btreeInitPage() returns error code 11``).

    Raises:
        DatabaseLockedError: Only as a read would (a ``locking_mode=EXCLUSIVE`` holder).
    """
    try:
        rows = [str(r[0]) for r in conn.execute("PRAGMA quick_check(3)").fetchall()]
    except sqlite3.DatabaseError as exc:
        if is_locked(exc):
            raise
        return str(exc)
    rows = [r for r in rows if r and not r.startswith("***")]
    if rows == ["ok"]:
        return None
    return "; ".join(" ".join(r.split()) for r in rows)[:300] or "quick_check gave no answer"


#: A database file larger than this is checked by :func:`find_damage_quickly` with
#: ``quick_check`` of its small tables only (a full one costs about a second per 100 MB).
FULL_CHECK_BYTES = 32 << 20
#: The tables that grow with a run's steps: :func:`find_damage_quickly` walks their pages.
STEP_TABLES = ("scalars", "metrics", "blocks", "internals", "samples", "rank_steps",
               "rank_scalars", "rank_internals", "checks")


def find_damage_quickly(conn: sqlite3.Connection, size: int) -> str | None:
    """:func:`find_damage` for a listing that must not cost a second: the whole file when it
    is at most :data:`FULL_CHECK_BYTES` (``size``, in bytes), else ``PRAGMA quick_check`` of
    each table but those of :data:`STEP_TABLES`, whose b-tree pages are walked instead
    (``SELECT count(*)``: a page whose header is damaged is found; a damaged cell inside a
    sound page is not, as the full check would find it).

    Raises:
        DatabaseLockedError: Only as a read would.
    """
    if size <= FULL_CHECK_BYTES:
        return find_damage(conn)
    try:
        tables = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
        for name in tables:
            quoted = '"' + name.replace('"', '""') + '"'
            if name in STEP_TABLES:
                conn.execute(f"SELECT count(*) FROM {quoted}").fetchone()
                continue
            rows = [str(r[0]) for r in conn.execute(f"PRAGMA quick_check({quoted})")]
            rows = [r for r in rows if r and not r.startswith("***")]
            if rows != ["ok"]:
                return "; ".join(" ".join(r.split()) for r in rows)[:300] or "no answer"
    except sqlite3.DatabaseError as exc:
        if is_locked(exc):
            raise
        return str(exc)
    return None


def damaged_error(path: Path, problem: str) -> DamagedDatabaseError:
    """The one-line refusal to write to a damaged database (see :func:`find_damage`)."""
    return DamagedDatabaseError(
        f"{path} is damaged (PRAGMA quick_check: {problem}): mdb reads what it can and will not "
        f"write to it; `sqlite3 {path} .recover | sqlite3 recovered.sqlite` copies out what it "
        "still holds")


# ---------------------------------------------------------------------------------------------
# Opening
# ---------------------------------------------------------------------------------------------


def decode_text(data: bytes) -> str:
    """A TEXT value as ``str``: UTF-8, each byte that is not valid UTF-8 read as U+FFFD.

    A database written elsewhere may hold any bytes in a TEXT column (``CAST(X'FF' AS
    TEXT)``); SQLite's default decoding raises ``OperationalError`` for them in every read of
    the row. Replaced rather than kept as surrogates, the text can always be encoded again
    (printed, written as JSON, bound to a query), and a run name so read fails the name check.
    """
    return data.decode("utf-8", errors="replace")


def _uri_path(path: Path) -> str:
    # Percent-encode the characters that are special in an SQLite URI.
    s = str(path.resolve())
    return s.replace("%", "%25").replace("?", "%3f").replace("#", "%23")


def _sqlite_connect(uri: str, path: Path, wait: float) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(
            uri,
            uri=True,
            timeout=wait,
            isolation_level=None,
            check_same_thread=False,
        )
    except sqlite3.Error as exc:
        raise RunStoreError(f"cannot open the run database {path}: {exc}") from exc
    conn.row_factory = sqlite3.Row
    conn.text_factory = decode_text
    return conn


def _configure(conn: sqlite3.Connection, path: Path, *, read_only: bool, wait: float) -> None:
    """The store's pragmas, and a first read that opens the file for real (and its -wal/-shm
    in WAL mode): a file that is not a database, or cannot be opened, fails here
    (``sqlite3.DatabaseError``); one that another process keeps locked raises
    :class:`DatabaseLockedError`. The connection is closed on failure."""
    t0 = time.monotonic()
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(wait * 1000)}")
        conn.execute("PRAGMA foreign_keys = ON")
        if not read_only:
            # WAL + NORMAL: a commit appends to the WAL without fsync (fsync at checkpoints).
            conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as exc:
        conn.close()
        if is_locked(exc):
            raise locked_error(path, time.monotonic() - t0, wait) from exc
        raise


def _cannot_open(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says the file (or its -wal/-shm) could not be opened or written, rather
    than that it is not a database."""
    text = str(exc).lower()
    return any(
        s in text
        for s in ("unable to open", "readonly", "read-only", "disk i/o error", "locking protocol")
    )


def not_a_store(path: Path, exc: sqlite3.Error) -> RunStoreError:
    """What a first read that failed says about the file: damaged, or not a run database."""
    if is_malformed(exc):
        return DamagedDatabaseError(f"{path} is a damaged database ({exc}): mdb cannot read it;"
                                    f" `sqlite3 {path} .recover | sqlite3 recovered.sqlite` "
                                    "copies out what it still holds")
    return RunStoreError(f"{path} is not an mdb run database ({exc})")


def _is_writable(path: Path) -> bool:
    """Whether this process may change ``path`` and create its ``-wal``/``-shm`` beside it
    (``access(2)`` says no on a read-only mount, also to root)."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)


def _wal_has_content(path: Path) -> bool:
    wal = Path(str(path) + "-wal")
    try:
        return wal.stat().st_size > 0
    except OSError:
        return False


class Opened:
    """What :func:`open_database` found: the connection, whether it is read-only, a note for
    the user, and the private copy's directory (deleted on close)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        read_only: bool,
        note: str | None = None,
        copy_dir: str | None = None,
    ) -> None:
        self.conn = conn
        self.read_only = read_only
        self.note = note
        self.copy_dir = copy_dir


def _open_read_only(path: Path, reason: str, wait: float) -> Opened:
    """Open ``path`` without writing anything next to it (see the module docstring)."""
    try:
        conn = _sqlite_connect(f"file:{_uri_path(path)}?mode=ro", path, wait)
        _configure(conn, path, read_only=True, wait=wait)
        return Opened(conn, True, f"{path} is read-only ({reason}): reading it without writing")
    except DatabaseLockedError:
        raise
    except sqlite3.DatabaseError as exc:
        if not _cannot_open(exc):
            raise not_a_store(path, exc) from exc
    if not _wal_has_content(path):
        # No write-ahead log to read: the main file holds every committed transaction, and
        # immutable=1 reads it without the -shm file it cannot create.
        try:
            conn = _sqlite_connect(f"file:{_uri_path(path)}?mode=ro&immutable=1", path, wait)
            _configure(conn, path, read_only=True, wait=wait)
        except DatabaseLockedError:
            raise
        except sqlite3.DatabaseError as exc:
            raise not_a_store(path, exc) from exc
        return Opened(
            conn, True,
            f"{path} is read-only ({reason}): reading it as an unchanging file (a writer "
            "elsewhere would not be seen)",
        )  # fmt: skip
    return open_copy(
        path,
        f"{path} is read-only ({reason}) and has an unfinished write-ahead log: reading a "
        f"private copy made at {time.strftime('%H:%M:%S')}",
        wait,
    )


def open_copy(path: Path, note: str, wait: float) -> Opened:
    """Copy the database and its ``-wal`` into a private directory and open the copy (SQLite
    replays the log into it), read-write so that it can be migrated."""
    tmp = tempfile.mkdtemp(prefix="mdb-ro-")
    try:
        dest = Path(tmp) / path.name
        shutil.copyfile(path, dest)
        wal = Path(str(path) + "-wal")
        if wal.exists():
            shutil.copyfile(wal, Path(str(dest) + "-wal"))
        conn = _sqlite_connect(f"file:{_uri_path(dest)}?mode=rw", path, wait)
        _configure(conn, path, read_only=False, wait=wait)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunStoreError(
            f"{path} is read-only and cannot be copied to read it: {exc.strerror or exc}"
        ) from exc
    except DatabaseLockedError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except sqlite3.DatabaseError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise not_a_store(path, exc) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Opened(conn, True, note, copy_dir=tmp)


def _read_only_reason(path: Path) -> str:
    probe = path if path.exists() else path.parent
    try:
        if os.statvfs(probe).f_flag & os.ST_RDONLY:
            return "a read-only file system"
    except (OSError, AttributeError):
        pass
    if not os.access(path, os.W_OK):
        return "the file is not writable"
    return "its directory is not writable"


def _open_to_create(path: Path, wait: float) -> Opened:
    if path.exists() and not _is_writable(path):
        raise RunStoreError(
            f"cannot record a run in {path}: it is read-only ({_read_only_reason(path)}); "
            f"`mdb runs` and `mdb watch` can still read it (pass another --db / set "
            f"{DEFAULT_DB_ENV} to record)"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunStoreError(
            f"cannot create the run database {path}: {exc.strerror or exc}"
        ) from exc
    conn = _sqlite_connect(f"file:{_uri_path(path)}?mode=rwc", path, wait)
    try:
        _configure(conn, path, read_only=False, wait=wait)
    except DatabaseLockedError:
        raise
    except sqlite3.DatabaseError as exc:
        if not _cannot_open(exc):
            raise not_a_store(path, exc) from exc
        why = str(exc)
        if not os.access(path.parent, os.W_OK):
            why = f"it is read-only ({_read_only_reason(path)})"
        raise RunStoreError(f"cannot create the run database {path}: {why}") from exc
    return Opened(conn, False)


def open_database(path: Path, *, create: bool, wait: float) -> Opened:
    """Open ``path`` in autocommit mode with the store's pragmas; never creates unless asked.
    Every wait for a lock another process holds lasts up to ``wait`` seconds.

    Raises:
        RunStoreError: A directory, not a regular file, missing (``create=False``), empty,
            unreadable, not an SQLite database, or read-only (``create=True``).
        DamagedDatabaseError: SQLite cannot read its schema (``malformed``).
        DatabaseLockedError: Another process kept it locked for longer than the lock wait.
    """
    if path.is_dir():
        raise RunStoreError(f"{path} is a directory, not a run database")
    if path.exists() and not path.is_file():  # a FIFO, /dev/zero: never opened (it may block)
        raise RunStoreError(f"{path} is not a run database: not a regular file")
    if create:
        return _open_to_create(path, wait)
    if not path.exists():
        raise RunStoreError(
            f"no run database at {path} (start a run with `mdb overfit` or `hooks.run`, or "
            f"pass --db / set {DEFAULT_DB_ENV})"
        )
    if not os.access(path, os.R_OK):
        raise RunStoreError(f"cannot read the run database {path}: permission denied")
    if path.stat().st_size == 0:
        raise RunStoreError(f"{path} is an empty database with no runs in it")
    if _is_writable(path):
        conn = _sqlite_connect(f"file:{_uri_path(path)}?mode=rw", path, wait)
        try:
            _configure(conn, path, read_only=False, wait=wait)
            return Opened(conn, False)
        except DatabaseLockedError:
            raise
        except sqlite3.DatabaseError as exc:
            if not _cannot_open(exc):
                raise not_a_store(path, exc) from exc
    return _open_read_only(path, _read_only_reason(path), wait)
