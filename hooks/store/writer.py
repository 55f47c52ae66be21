"""Writing one run: :class:`RunWriter`, obtained from
:meth:`hooks.store.store.RunStore.create_run` or :meth:`~hooks.store.store.RunStore.resume_run`.

A batch of steps is written in one short transaction (their metrics rows and scalars, their
internals and samples if any, the loss spikes found in them, and the run row's ``last_step`` /
``last_loss`` / ``heartbeat``), so a reader sees a step completely or not at all.

The writer's liveness is recorded as ``pid``, ``host``, the process's identity (``writer``:
pid, host and start time, :mod:`hooks.store.liveness`) and a ``heartbeat`` timestamp refreshed
by a background thread (:meth:`RunWriter.start_heartbeat`), so a reader can tell a run that is
still being written from one whose writer died without saying so (``kill -9``, a power cut):
see :meth:`hooks.store.rows.RunInfo.writer_state`.

A writer writes only while the run and the file are still its own: every commit (steps,
checkpoint, heartbeat, final status) first checks that the database file at its path is the
one it opened (its device and inode: ``rm`` of the database, or another file put in its place,
raises :class:`DatabaseGoneError`), and writes the run row only if its ``pid`` and ``host``
are still this writer's (a resume from another process took the run over:
:class:`RunTakenOverError`). Either way nothing more is written, and the caller stops.

A distributed run's rank 0 also writes every rank's view (:meth:`RunWriter.set_ranks`,
:meth:`~RunWriter.log_rank_steps`, :meth:`~RunWriter.add_findings`,
:meth:`~RunWriter.add_checks`; the tables are in :mod:`hooks.store.schema`).

Part of the run store (:mod:`hooks.store.store`, which re-exports :class:`RunWriter`). This
module uses only the standard library (and :mod:`hooks.store.spikes`, which does too).
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hooks.store.liveness import this_process
from hooks.store.numbers import loss_metric
from hooks.store.rows import (
    DIRECTIONS,
    FINDING_KINDS,
    NONFINITE_KEYS,
    RANK_STATES,
    STATUSES,
    MetricRow,
    RunInfo,
    nonfinite_from_failure,
)
from hooks.store.schema import store_lock_wait
from hooks.store.spikes import Spike, SpikeDetector
from hooks.store.sqlite_open import RunStoreError, open_database
from hooks.store.summary import record_captures, record_scalars


class WriterLostError(RunStoreError):
    """This writer may no longer write its run: :class:`DatabaseGoneError` or
    :class:`RunTakenOverError`. Nothing was written; stop training into it."""


class DatabaseGoneError(WriterLostError):
    """The database file was deleted (or another file put at its path) while the run was being
    written: what would be written now goes to a file no one can open."""


class RunTakenOverError(WriterLostError):
    """Another process resumed the run (its row names that process's pid and host now)."""


def _file_id(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file at ``path``, ``None`` when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _metric_mapping(metrics: MetricRow | Mapping[str, Any]) -> tuple[int, Any, Any, dict]:
    """``(step, wall, expert_load, values)`` of a :class:`MetricRow` or a mapping of its field
    names; other keys of a mapping are scalars too (a ``None`` value: not logged)."""
    if isinstance(metrics, MetricRow):
        return metrics.step, metrics.wall, metrics.expert_load, metrics.values
    m = dict(metrics)
    step = int(m.pop("step"))
    wall = m.pop("wall", None)
    load = m.pop("expert_load", None)
    values: dict[str, Any] = {}
    for name, v in dict(m.pop("values", None) or {}).items():
        values[name] = v
    for name, v in m.items():
        if v is not None and name not in values:
            values[name] = v
    return step, wall, load, values


class RunWriter:
    """Writes one run: its steps, heartbeat, checkpoint record and final status.

    Obtain it from :meth:`hooks.store.store.RunStore.create_run` or
    :meth:`~hooks.store.store.RunStore.resume_run`. Use it from one thread (the training
    thread, or ``hooks.run``'s writer thread); the heartbeat thread started by
    :meth:`start_heartbeat` uses its own connection.

    As it writes the steps it watches the run's loss (:func:`loss_metric`) for spikes
    (:class:`hooks.store.spikes.SpikeDetector`, seeded from the steps already stored when the
    run was resumed) and records each episode in ``spikes`` in the same transaction.

    Attributes:
        spikes: The spikes this writer recorded, in step order, each in its latest state (its
            peak and last step move while the episode lasts).
    """

    # store: the hooks.store.store.RunStore that made it (not imported: that module imports this
    # one)
    def __init__(self, store: Any, run_id: int, name: str):
        self.store = store
        self.run_id = run_id
        self.name = name
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._closed = False
        self._ids: dict[str, int] | None = None
        self._detector: SpikeDetector | None = None
        self._detected_step: int | None = None  # the last step the detector was given
        self.spikes: list[Spike] = []
        # the file this writer writes, by absolute path (a loop may chdir) and identity
        self._path = os.path.abspath(store.path)
        self._file = _file_id(self._path)
        self._owner = self._claim()

    def _claim(self) -> tuple[Any, Any]:
        """Record this process as the run's writer (``runs.writer``) when the run row names
        it, and return the row's ``(pid, host)``: the owner every write checks for."""
        me = this_process()
        with self.store.transaction() as conn:
            cols = {r[1] for r in conn.execute("PRAGMA table_info(runs)")}
            if "writer" not in cols:  # a database of an older mdb: added, no version change
                conn.execute("ALTER TABLE runs ADD COLUMN writer TEXT")
            row = conn.execute("SELECT pid, host, writer FROM runs WHERE id = ?",
                               (self.run_id,)).fetchone()
            text = json.dumps(me)
            # written only when it changes (a second writer of this process, e.g. the one
            # that writes a final status on a full disk, writes nothing here)
            if row is not None and (row[0], row[1]) == (me["pid"], me["host"]) \
                    and row[2] != text:
                conn.execute("UPDATE runs SET writer = ? WHERE id = ?", (text, self.run_id))
        return (row[0], row[1]) if row is not None else (None, None)

    def check_file(self) -> None:
        """Raise :class:`DatabaseGoneError` when the file at the database's path is no longer
        the one this writer opened (deleted, or replaced). One ``stat``; called before every
        commit."""
        if self._file is None:
            return  # could not be told when the writer started
        now = _file_id(self._path)
        if now != self._file:
            what = "deleted" if now is None else "replaced by another file"
            raise DatabaseGoneError(
                f"the run database {self._path} was {what} while run {self.name} was being "
                "written: nothing more can be recorded")

    def _owned(self, conn: sqlite3.Connection, sql: str, params: tuple) -> None:
        """Run ``UPDATE runs SET ... WHERE id = ?`` (``sql``, its last parameter the run's
        id) only while the row still names this writer's pid and host.

        Raises:
            RunTakenOverError: Another process resumed the run (the transaction rolls back).
        """
        cur = conn.execute(sql + " AND pid IS ? AND host IS ?", (*params, *self._owner))
        if cur.rowcount:
            return
        row = conn.execute("SELECT pid, host FROM runs WHERE id = ?", (self.run_id,)).fetchone()
        who = (f"pid {row[0]} on {row[1]}" if row is not None
               else "nothing: the run is no longer in the database")
        raise RunTakenOverError(
            f"run {self.name} is now written by {who} (resumed while this process, pid "
            f"{self._owner[0]}, was not writing it): this process stops writing it")

    @property
    def info(self) -> RunInfo:
        """The run's current row."""
        return self.store.run(self.run_id)

    def log_step(
        self,
        metrics: MetricRow | Mapping[str, Any],
        *,
        internals: Mapping[str, Any] | None = None,
        sample: tuple[str, str] | None = None,
        tensors: bytes | None = None,
    ) -> None:
        """Write one step atomically: metrics row and scalars, optional internals and sample,
        run row.

        Args:
            metrics: A :class:`MetricRow` or a mapping with its field names (``step`` required;
                ``wall`` defaults to now; ``values`` and any other key are scalars by name; a
                ``None`` value is not logged, a NaN is).
            internals: JSON-serialisable captured statistics of this step.
            sample: ``(prompt, continuation)`` generated at this step.
            tensors: Opaque bytes stored with the internals (safetensors of the capture's
                tensors); ignored without ``internals``.
        """
        self.log_steps([(metrics, internals, sample, tensors)])

    def _metric_ids(self, conn: sqlite3.Connection) -> dict[str, int]:
        if self._ids is None:
            rows = conn.execute(
                "SELECT id, name FROM metric_names WHERE run_id = ?", (self.run_id,)
            )
            self._ids = {r[1]: r[0] for r in rows}
        return self._ids

    def log_steps(
        self,
        steps: Iterable[tuple[Any, ...]],
    ) -> None:
        """Write several steps in one transaction.

        A step logged again merges into the stored one: its scalars are added (a name logged
        twice keeps the later value) and ``wall`` is updated.

        Args:
            steps: Tuples ``(metrics, internals, sample[, tensors])`` as the arguments of
                :meth:`log_step`.
        """
        rows = []
        extras_i = []
        extras_s = []
        now = time.time()
        for item in steps:
            metrics, internals, sample = item[:3]
            tensors = item[3] if len(item) > 3 else None
            step, wall, load, values = _metric_mapping(metrics)
            rows.append((step, now if wall is None else float(wall),
                         json.dumps(load) if load is not None else None, values))
            if internals is not None:
                data = json.dumps(internals, default=_jsonable)
                blob = sqlite3.Binary(tensors) if tensors is not None else None
                extras_i.append((self.run_id, step, now, data, blob))
            if sample is not None:
                extras_s.append((self.run_id, step, sample[0], sample[1]))
        if not rows:
            return
        found: list[Spike] = []
        self.check_file()
        try:
            with self.store.transaction() as conn:
                self._write(conn, rows, extras_i, extras_s, now, found)
        except BaseException:
            self._ids = None  # names added in the rolled-back transaction are not stored
            self._detector = None  # nor its steps: seeded again from the database
            raise
        for spike in found:
            if self.spikes and self.spikes[-1].step == spike.step:
                self.spikes[-1] = spike
            else:
                self.spikes.append(spike)

    def _spike_detector(self, conn: sqlite3.Connection, key: str) -> SpikeDetector:
        """The detector of ``key``, seeded from what the database holds of it (a resume)."""
        det = self._detector
        if det is not None and det.metric == key:
            return det
        det = self._detector = SpikeDetector(key)
        self._detected_step = None
        mid = (self._ids or {}).get(key)
        if mid is not None:
            sql = ("SELECT step, value FROM scalars WHERE run_id = ? AND metric = ?"
                   " ORDER BY step {} LIMIT ?")
            first = conn.execute(sql.format("ASC"), (self.run_id, mid, det.min_history))
            last = conn.execute(sql.format("DESC"),
                                (self.run_id, mid, det.window)).fetchall()[::-1]
            det.seed([v for _s, v in first], [v for _s, v in last])
            if last:
                self._detected_step = last[-1][0]
        return det

    def _detect(self, conn: sqlite3.Connection, key: str | None, rows, found: list) -> None:
        if key is None:
            return
        det = self._spike_detector(conn, key)
        upserts = []
        for step, _w, _l, values in sorted(rows, key=lambda r: r[0]):
            if key not in values or (self._detected_step is not None
                                     and step <= self._detected_step):
                continue  # a step logged again (hooks.run adds to it) is seen once
            self._detected_step = step
            v = values[key]
            spike = det.observe(step, None if v is None else float(v))
            if spike is not None:
                found.append(spike)
                upserts.append((self.run_id, spike.step, spike.metric, spike.value,
                                spike.baseline, spike.peak_step, spike.last_step))
        if upserts:
            conn.executemany(
                "INSERT INTO spikes (run_id, step, metric, value, baseline, peak_step,"
                " last_step) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, step, metric)"
                " DO UPDATE SET value = excluded.value, peak_step = excluded.peak_step,"
                " last_step = excluded.last_step", upserts)

    def _metric_id(self, conn: sqlite3.Connection, ids: dict[str, int], name: str) -> int:
        mid = ids.get(name)
        if mid is None:
            mid = len(ids) + 1
            conn.execute(
                "INSERT INTO metric_names (run_id, id, name) VALUES (?, ?, ?)",
                (self.run_id, mid, str(name)),
            )
            ids[name] = mid
        return mid

    def _relogged(self, conn: sqlite3.Connection, rows) -> bool:
        """Whether some step of ``rows`` may be stored already (a step logged again, or
        written by another writer of the run): not when they all come after the run's last
        stored step, read in this transaction (an index lookup). Called before the rows are
        written."""
        (before,) = conn.execute("SELECT max(step) FROM metrics WHERE run_id = ?",
                                 (self.run_id,)).fetchone()
        return before is not None and min(r[0] for r in rows) <= before

    def _count_captures(self, conn: sqlite3.Connection, steps: list[int],
                        relogged: bool) -> None:
        """Count the captured steps of this batch in ``summary`` (before they are written:
        one stored already is not counted again)."""
        new = len(set(steps))
        if relogged:
            marks = ",".join("?" * len(set(steps)))
            (old,) = conn.execute(
                f"SELECT count(*) FROM internals WHERE run_id = ? AND step IN ({marks})",
                (self.run_id, *set(steps))).fetchone()
            new -= old
        record_captures(conn, self.run_id, steps, new)

    def _write(self, conn, rows, extras_i, extras_s, now, found) -> None:
        ids = self._metric_ids(conn)
        self._detect(conn, loss_metric([*ids, *(n for r in rows for n in r[3])]), rows, found)
        scalars = []
        for step, _wall, _load, values in rows:
            for name, v in values.items():
                mid = self._metric_id(conn, ids, name)
                scalars.append((self.run_id, step, mid, None if v is None else float(v)))
        relogged = self._relogged(conn, rows)  # before the rows are written
        conn.executemany(
            "INSERT INTO metrics (run_id, step, wall, expert_load) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (run_id, step) DO UPDATE SET wall = excluded.wall,"
            " expert_load = COALESCE(excluded.expert_load, expert_load)",
            [(self.run_id, s, w, load) for s, w, load, _ in rows],
        )
        conn.executemany(
            "INSERT OR REPLACE INTO scalars (run_id, step, metric, value) VALUES (?, ?, ?, ?)",
            scalars,
        )
        if scalars:
            record_scalars(conn, self.run_id, min(r[0] for r in rows), max(r[0] for r in rows),
                           relogged)
        if extras_i:
            self._count_captures(conn, [e[1] for e in extras_i], relogged)
            conn.executemany(
                "INSERT OR REPLACE INTO internals (run_id, step, captured, data, tensors)"
                " VALUES (?, ?, ?, ?, ?)",
                extras_i,
            )
        if extras_s:
            conn.executemany(
                "INSERT OR REPLACE INTO samples (run_id, step, prompt, text) VALUES (?, ?, ?, ?)",
                extras_s,
            )
        last_step = max(r[0] for r in rows)
        loss = None
        key = loss_metric(ids)  # the run's loss metric, from every name it logged so far
        for _step, _w, _l, values in rows:
            if key is not None and key in values:
                v = values[key]
                loss = (None if v is None else float(v),)
        if loss is None:
            self._owned(conn, "UPDATE runs SET last_step = MAX(last_step, ?), heartbeat = ?"
                        " WHERE id = ?", (last_step, now, self.run_id))
        else:
            self._owned(conn, "UPDATE runs SET last_step = MAX(last_step, ?), last_loss = ?,"
                        " heartbeat = ? WHERE id = ?", (last_step, loss[0], now, self.run_id))

    # -- distributed runs ------------------------------------------------------------------

    def set_world_size(self, world_size: int) -> None:
        """Record that this run is a distributed job of ``world_size`` ranks."""
        with self.store.transaction() as conn:
            conn.execute("UPDATE runs SET world_size = ? WHERE id = ?",
                         (int(world_size), self.run_id))

    def set_ranks(self, ranks: Iterable[Mapping[str, Any]]) -> None:
        """Insert or update rows of ``ranks``, in one transaction.

        Args:
            ranks: Mappings with ``rank`` and any of ``host``, ``pid``, ``local_rank``,
                ``state`` (:data:`RANK_STATES`), ``last_step``, ``heartbeat``, ``reason``; a
                key left out keeps the stored value (``last_step`` only grows).

        Raises:
            ValueError: An unknown state.
        """
        rows = []
        for r in ranks:
            state = r.get("state")
            if state is not None and state not in RANK_STATES:
                raise ValueError(f"unknown rank state {state!r}")
            rows.append((self.run_id, int(r["rank"]), r.get("host"), r.get("pid"),
                         r.get("local_rank"), state or "running", int(r.get("last_step") or 0),
                         r.get("heartbeat"), r.get("reason"), "reason" in r))
        if not rows:
            return
        with self.store.transaction() as conn:
            for (run_id, rank, host, pid, local, state, step, beat, reason, has_reason) in rows:
                conn.execute(
                    "INSERT INTO ranks (run_id, rank, host, pid, local_rank, state, last_step,"
                    " heartbeat, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (run_id, rank) DO UPDATE SET"
                    " host = COALESCE(excluded.host, host), pid = COALESCE(excluded.pid, pid),"
                    " local_rank = COALESCE(excluded.local_rank, local_rank),"
                    " state = excluded.state, last_step = MAX(last_step, excluded.last_step),"
                    " heartbeat = COALESCE(excluded.heartbeat, heartbeat),"
                    " reason = CASE WHEN ? THEN excluded.reason ELSE reason END",
                    (run_id, rank, host, pid, local, state, step, beat, reason, int(has_reason)),
                )

    def log_rank_steps(
        self,
        rank: int,
        rows: Iterable[Mapping[str, Any]],
        internals: Iterable[tuple[int, Mapping[str, Any], bytes | None]] = (),
    ) -> None:
        """Write steps of one rank of a distributed run in one transaction (a step written again
        merges, as in :meth:`log_steps`).

        Args:
            rank: The rank.
            rows: Mappings with the fields of :class:`RankRow` (``step`` and ``wall``
                required; ``values``: scalars by name, ``None`` or NaN = NaN).
            internals: ``(step, trace dict, safetensors bytes or None)`` of the rank's
                captures (for rank 0 use :meth:`log_steps`: its captures are the run's).
        """
        rank = int(rank)
        prepared = []
        for r in rows:
            load = r.get("expert_load")
            prepared.append((int(r["step"]), float(r["wall"]), r.get("step_time"),
                             r.get("compute_time"),
                             json.dumps(load) if load is not None else None,
                             dict(r.get("values") or {})))
        extras = [(self.run_id, int(step), rank, time.time(),
                   json.dumps(data, default=_jsonable),
                   sqlite3.Binary(blob) if blob is not None else None)
                  for step, data, blob in internals]
        if not prepared and not extras:
            return
        try:
            with self.store.transaction() as conn:
                ids = self._metric_ids(conn)
                conn.executemany(
                    "INSERT INTO rank_steps (run_id, step, rank, wall, step_time, compute_time,"
                    " expert_load) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, step, rank)"
                    " DO UPDATE SET wall = excluded.wall,"
                    " step_time = COALESCE(excluded.step_time, step_time),"
                    " compute_time = COALESCE(excluded.compute_time, compute_time),"
                    " expert_load = COALESCE(excluded.expert_load, expert_load)",
                    [(self.run_id, st, rank, w, t, c, load)
                     for st, w, t, c, load, _ in prepared],
                )
                scalars = []
                for st, _w, _t, _c, _l, values in prepared:
                    for name, v in values.items():
                        mid = self._metric_id(conn, ids, name)
                        x = None if v is None or (isinstance(v, float) and math.isnan(v)) \
                            else float(v)
                        scalars.append((self.run_id, st, rank, mid, x))
                conn.executemany(
                    "INSERT OR REPLACE INTO rank_scalars (run_id, step, rank, metric, value)"
                    " VALUES (?, ?, ?, ?, ?)", scalars,
                )
                if extras:
                    conn.executemany(
                        "INSERT OR REPLACE INTO rank_internals (run_id, step, rank, captured,"
                        " data, tensors) VALUES (?, ?, ?, ?, ?, ?)", extras,
                    )
                if prepared:
                    conn.execute(
                        "UPDATE ranks SET last_step = MAX(last_step, ?) WHERE run_id = ?"
                        " AND rank = ?", (max(p[0] for p in prepared), self.run_id, rank),
                    )
        except BaseException:
            self._ids = None
            raise

    def add_findings(self, findings: Iterable[Mapping[str, Any]]) -> None:
        """Append findings (:class:`Finding` fields but ``id`` and ``wall``, which are
        assigned), in one transaction.

        Raises:
            ValueError: An unknown kind, or no ``subject`` / ``line``.
        """
        rows = []
        for f in findings:
            if f.get("kind") not in FINDING_KINDS:
                raise ValueError(f"unknown finding kind {f.get('kind')!r}")
            if not f.get("subject") or not f.get("line"):
                raise ValueError("a finding needs a subject and a line")
            rows.append(f)
        if not rows:
            return
        now = time.time()
        with self.store.transaction() as conn:
            (last,) = conn.execute("SELECT COALESCE(MAX(id), 0) FROM findings WHERE run_id = ?",
                                   (self.run_id,)).fetchone()
            conn.executemany(
                "INSERT INTO findings (run_id, id, kind, step, rank, subject, line, detail, wall)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(self.run_id, last + i, f["kind"], f.get("step"), f.get("rank"),
                  str(f["subject"]), str(f["line"])[:1000],
                  json.dumps(f.get("detail") or {}, default=_jsonable), now)
                 for i, f in enumerate(rows, start=1)],
            )

    def add_checks(self, checks: Iterable[Mapping[str, Any]]) -> None:
        """Record cross-rank comparisons (see :meth:`hooks.store.store.RunStore.checks`), in one
        transaction."""
        rows = [(self.run_id, int(c["step"]), str(c["kind"]), int(c["ranks"]),
                 int(c["compared"]), int(c["differing"])) for c in checks]
        if not rows:
            return
        with self.store.transaction() as conn:
            conn.executemany(
                "INSERT OR REPLACE INTO checks (run_id, step, kind, ranks, compared, differing)"
                " VALUES (?, ?, ?, ?, ?, ?)", rows,
            )

    def heartbeat(self) -> None:
        """Refresh the run's heartbeat timestamp.

        Raises:
            WriterLostError: The database was deleted, or the run taken over.
        """
        self.check_file()
        with self.store.transaction() as conn:
            self._owned(conn, "UPDATE runs SET heartbeat = ? WHERE id = ?",
                        (time.time(), self.run_id))

    def set_paused(self, paused: bool) -> None:
        """Record whether training is paused (watchers show it)."""
        with self.store.transaction() as conn:
            self._owned(conn, "UPDATE runs SET paused = ?, heartbeat = ? WHERE id = ?",
                        (int(paused), time.time(), self.run_id))

    def set_checkpoint(self, step: int, path: str | os.PathLike[str]) -> None:
        """Record that a complete checkpoint of ``step`` now exists at ``path``.

        ``path`` is stored relative to the database's directory when it lies under it.

        Raises:
            WriterLostError: The database was deleted, or the run taken over: nothing is
                recorded (the checkpoint's files stay where they are).
        """
        self.check_file()
        p = Path(path).resolve()
        base = self.store.path.resolve().parent
        try:
            rel = str(p.relative_to(base))
        except ValueError:
            rel = str(p)
        with self.store.transaction() as conn:
            self._owned(conn, "UPDATE runs SET checkpoint_step = ?, checkpoint_path = ?,"
                        " heartbeat = ? WHERE id = ?", (int(step), rel, time.time(), self.run_id))

    def set_nonfinite(self, nonfinite: Mapping[str, Any] | None) -> None:
        """Record where a logged value first turned NaN/Inf (:attr:`RunInfo.nonfinite`).

        Args:
            nonfinite: ``{"step": int, "metric": str | None, "module": str | None,
                "direction": "forward" | "backward" | "parameter" | "gradient" | None}``, and
                optionally ``"detail"`` and ``"note"`` (strings, see
                :class:`hooks.nonfinite.origin.Origin`), or ``None`` to clear it.

        Raises:
            ValueError: No integer ``step``, or an unknown ``direction``.
        """
        text = None
        if nonfinite is not None:
            nf = {k: nonfinite.get(k) for k in NONFINITE_KEYS}
            if nonfinite.get("rank") is not None:
                nf["rank"] = int(nonfinite["rank"])
            if not isinstance(nf["step"], int):
                raise ValueError(f"nonfinite needs an integer step, got {nf['step']!r}")
            for key in ("detail", "note"):
                if nf[key] is None:
                    del nf[key]
            if nf["direction"] not in DIRECTIONS:
                raise ValueError(f"direction must be one of {DIRECTIONS}, not "
                                 f"{nf['direction']!r}")
            text = json.dumps(nf)
        with self.store.transaction() as conn:
            conn.execute("UPDATE runs SET nonfinite = ? WHERE id = ?", (text, self.run_id))

    def update_config(self, config: Mapping[str, Any]) -> None:
        """Replace the run's stored configuration."""
        with self.store.transaction() as conn:
            conn.execute(
                "UPDATE runs SET config = ? WHERE id = ?",
                (json.dumps(dict(config), sort_keys=True, default=str), self.run_id),
            )

    def finish(
        self,
        status: str,
        *,
        reason: str | None = None,
        fail_step: int | None = None,
        fail_module: str | None = None,
    ) -> None:
        """Set the final status and stop the heartbeat.

        A ``failed`` status whose reason is the trainer's ``non-finite loss ...`` or
        ``non-finite gradient ...`` also records :attr:`RunInfo.nonfinite` (unless one is
        recorded already).

        Args:
            status: ``finished``, ``interrupted`` or ``failed``.
            reason: Free text shown by readers (``"SIGTERM"``, ``"non-finite loss"`` ...).
            fail_step: For ``failed``: the step where a non-finite value appeared.
            fail_module: For ``failed``: the module whose output was first non-finite.

        Raises:
            ValueError: Unknown status.
            WriterLostError: The database was deleted, or the run taken over: the status
                is not written (the heartbeat is stopped all the same).
        """
        if status not in STATUSES or status == "running":
            raise ValueError(f"final status must be finished/interrupted/failed, not {status!r}")
        self.stop_heartbeat()
        self.check_file()
        now = time.time()
        nf = nonfinite_from_failure(status, reason, fail_step, fail_module)
        with self.store.transaction() as conn:
            self._owned(
                conn, "UPDATE runs SET status = ?, ended = ?, heartbeat = ?, reason = ?,"
                " fail_step = ?, fail_module = ?, paused = 0,"
                " nonfinite = COALESCE(nonfinite, ?) WHERE id = ?",
                (status, now, now, reason, fail_step, fail_module,
                 json.dumps(nf) if nf else None, self.run_id),
            )
        self._closed = True

    # -- heartbeat thread ------------------------------------------------------------------

    def start_heartbeat(self, interval: float = 1.0) -> None:
        """Refresh the heartbeat every ``interval`` seconds from a daemon thread.

        The thread opens its own connection; it keeps beating while the training thread is
        busy in a long step or paused. :meth:`finish` and :meth:`stop_heartbeat` stop it.
        """
        if self._hb_thread is not None:
            return
        self._hb_stop.clear()
        path = self.store.path
        run_id = self.run_id
        pid, host = self._owner

        def beat() -> None:
            try:
                conn = open_database(path, create=False, wait=store_lock_wait()).conn
            except (RunStoreError, sqlite3.Error):  # locked, or gone: the writer's own writes say
                return
            try:
                while not self._hb_stop.wait(interval):
                    try:
                        conn.execute("BEGIN IMMEDIATE")
                        conn.execute(  # never another writer's run (a resume took it over)
                            "UPDATE runs SET heartbeat = ? WHERE id = ? AND status = 'running'"
                            " AND pid IS ? AND host IS ?", (time.time(), run_id, pid, host),
                        )
                        conn.execute("COMMIT")
                    except sqlite3.Error:
                        try:
                            conn.execute("ROLLBACK")
                        except sqlite3.Error:
                            pass
            finally:
                conn.close()

        self._hb_thread = threading.Thread(target=beat, name=f"mdb-heartbeat-{run_id}", daemon=True)
        self._hb_thread.start()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat thread (idempotent)."""
        if self._hb_thread is None:
            return
        self._hb_stop.set()
        self._hb_thread.join(timeout=5)
        self._hb_thread = None


def _jsonable(obj: Any) -> Any:
    """``json.dumps`` fallback: tensors and numpy scalars/arrays to lists, the rest to str."""
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, Sequence) and not isinstance(obj, str):
        return list(obj)
    return str(obj)
