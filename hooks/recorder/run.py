"""``hooks.run``: record your own training loop in the run store, to follow it with ``mdb watch``.

::

    import hooks

    with hooks.run("exp1", db="runs/mdb.sqlite", config={"lr": 3e-3}) as run:
        run.watch(model, every=50)      # the internals of every 50th step, in the run store
        for x, y in loader:
            loss = model(x, y)[1]; loss.backward(); opt.step(); opt.zero_grad()
            run.log(loss=loss, lr=lr)   # any scalar names; the step counts itself

Then, from any terminal: ``mdb runs``, ``mdb watch exp1`` (``c`` opens the latest stored
capture), ``mdb step --run exp1@50``, ``mdb export exp1 > exp1.csv``.

What it does, and what it costs the loop:

* :meth:`Run.log` converts the values to floats (``.item()`` of a tensor, which waits for the
  device like ``loss.item()`` does), checks them for NaN/Inf and appends them to a bounded
  queue; a background thread writes the queue to SQLite and commits every
  :attr:`Run.FLUSH_INTERVAL` seconds (0.1 s), so a watcher sees a step within half a second.
  When the queue is full (the disk is slower than the loop) ``log`` waits for it.
* :meth:`Run.watch` attaches :func:`hooks.capture` only for the steps it records: after the
  ``log()`` of the step before a recorded one, removed again at the recorded step's ``log()``;
  the other steps run with only the NaN sentinel's two hooks on the root module (below). The
  capture covers everything the model runs
  between those two ``log()`` calls. The trace is serialised on the writer thread.
* With ``watch(optimizer=)`` a step whose loss or gradient norm spikes, or turns non-finite,
  is replayed under the capture before the update and stored with its batch and story
  (:mod:`hooks.recorder.spike_watch`; the training is unchanged bit for bit).
* The first logged value that is NaN or ±Inf records ``{"step", "metric", "module",
  "direction", "detail"}`` in the run row (:attr:`hooks.store.store.RunInfo.nonfinite`). With
  ``watch``, where it started (:mod:`hooks.nonfinite.origin`) is found while the weights are still
  the ones the failing forward used: the root module's output is checked on every step and,
  with ``watch(optimizer=opt)``, the gradients before the optimizer applies them; a weight
  that holds NaN is named, else the first non-finite output of a replay of that forward under
  the capture, else the first non-finite gradient. When that moment was missed (no
  ``optimizer=`` and a loss that stayed finite), the next step is captured to locate it if the
  weights are still finite, and otherwise the finding says the module cannot be told.
* SIGINT, SIGTERM and SIGHUP mark the run ``interrupted``: the handlers this module installs
  note the signal and call the handler that was there before (Python's ``KeyboardInterrupt``
  for SIGINT, your own handler if you installed one first); where that was the default action
  (terminate), the run is saved first and the process then terminates by the same signal. A
  signal that was ignored (``SIG_IGN``, e.g. SIGHUP under ``nohup``) stays ignored. The
  handlers are in place before the run is created: a signal that comes while it is being
  opened (a ``torchrun`` job stopped while its ranks start) acts once it is open, so the run
  never stays ``running``. The previous handlers are restored when the run finishes.
  (Handlers can only be installed from the main thread; a run started in another thread
  leaves signals alone.)
* An exception that leaves the ``with`` block marks the run ``failed`` with the exception's last
  line, and propagates. A run left open when the interpreter exits is finished then (or marked
  ``failed`` by an uncaught exception).
* If the writer thread cannot write (disk full, database locked for longer than the busy
  timeout) it says so once on stderr and marks the run ``failed`` with the reason; the loop goes
  on unrecorded, and every step committed before stays in the database.
* **Inside a ``torchrun`` job** (``torch.distributed`` initialised, two ranks or more) call
  ``hooks.run(...)`` on every rank: the job is one run. Rank 0 creates it and alone writes the
  store; every rank's steps, captures, step and compute times and checksums reach it through
  the job's process group every ``gather_every`` steps and at the end, tagged with the rank
  (see :mod:`hooks.dist.distributed`). The run-level series are rank 0's own ``log()`` calls;
  the other ranks' are in the store's rank tables (``mdb watch`` shows them). Without an
  initialised process group nothing of this runs.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hooks.recorder.job_end import job_end, say_world_size
from hooks.recorder.run_process import RunProcess
from hooks.recorder.run_writer import RunWriterThread, last_line
from hooks.store.control import ControlPoller, RunControls
from hooks.store.numbers import loss_metric
from hooks.store.reserve import DiskReserve
from hooks.store.store import (
    RunExistsError,
    RunStore,
    RunWriter,
    checkpoint_dir,
    default_db_path,
    validate_run_name,
)
from hooks.store.values import (
    checked_counts,
    checked_every,
    checked_metric_name,
    checked_step,
    config_checked,
    expert_load_table,
    to_float,
)

__all__ = ["Run", "run"]

#: Distributed runs started by this process (names their keys in the job's store).
_DIST_RUNS = [0]


def run(
    name: str | None = None,
    *,
    db: str | os.PathLike[str] | None = None,
    config: Mapping[str, Any] | None = None,
    total_steps: int | None = None,
    gather_every: int = 50,
) -> Run:
    """Start recording a training run in the run store; see :class:`Run`.

    Args:
        name: Run name (1-100 characters from ``A-Z a-z 0-9 . _ -``). ``None``:
            ``run-YYYYMMDD-HHMMSS``. A name already in the database gets a ``-2``, ``-3`` …
            suffix (said on stderr).
        db: The database file (created if missing). ``None`` or ``""``: ``$MDB_DB``, else
            ``./runs/mdb.sqlite`` (as ``--db ""`` in the CLI).
        config: Your run's configuration (hyper-parameters), stored as JSON (other values as
            ``str``); ``mdb runs --json`` does not print it, the database keeps it.
        total_steps: The number of steps you intend to run, if known (progress and ETA in
            ``mdb watch``; a run that reaches it counts as finished even after a signal).
        gather_every: In a ``torchrun`` job: every rank's steps reach rank 0 every this many
            steps (and at the end); ignored in a single process.

    Returns:
        The :class:`Run`, already recording (use it as a context manager, or call
        :meth:`Run.finish`).

    Raises:
        hooks.store.store.RunStoreError: Invalid name, or a database that cannot be written
            (one line): locked by another process past the lock wait
            (:class:`~hooks.store.sqlite_open.DatabaseLockedError`), or damaged
            (:class:`~hooks.store.sqlite_open.DamagedDatabaseError`). An invalid name creates
            no database.
        TypeError: ``config`` is not a mapping, or has keys JSON cannot store.
        ValueError: ``gather_every < 1``, or ``config`` cannot be stored as JSON (a value that
            contains itself): nothing is created either.
    """
    return Run(name, db=db, config=config, total_steps=total_steps, gather_every=gather_every)


def _job() -> Any:
    """The ``torchrun`` job this process is a rank of (:func:`hooks.dist.distributed.job`),
    ``None`` without one."""
    if "torch.distributed" not in sys.modules:  # a job's process group exists only if imported
        return None
    from hooks.dist import distributed

    return distributed.job()


class Run(RunControls, RunProcess, RunWriterThread):
    """One training run being recorded: :func:`run` returns it.

    Use it as a context manager (the run finishes when the block ends) or call :meth:`finish`.
    Call :meth:`log` and :meth:`watch` from the thread that trains. In a ``torchrun`` job call
    it on every rank (see the module docstring); on ranks other than 0, ``name`` and ``id``
    are those of rank 0's run once it is known (``None`` before).

    Attributes:
        name: The run's name in the database.
        db: The database file.
        id: The run's id in the database (:attr:`hooks.store.store.RunInfo.id`).
        step: The last step logged (0 before the first).
        status: ``"running"`` until finished, then the final status.
        reason: ``None``, or the final status's reason once finished (``"SIGTERM"``, an error
            line; in a ``torchrun`` job the rank that died or failed first).
        nonfinite: ``None``, or where a logged value first turned NaN/Inf (see
            :attr:`hooks.store.store.RunInfo.nonfinite`).
        error: ``None``, or the one line that said why recording stopped (the writer thread
            could not write).
        rank: This process's rank in a distributed job (0 for a single process).
        world_size: The job's number of ranks (1 for a single process).
    """

    #: Seconds between the writer thread's commits.
    FLUSH_INTERVAL = 0.1
    #: Seconds between heartbeats while nothing is logged.
    HEARTBEAT_INTERVAL = 1.0
    #: Logged steps waiting for the writer at most; :meth:`log` waits beyond that.
    MAX_PENDING = 10_000
    #: Captured traces waiting for the writer at most.
    MAX_PENDING_TRACES = 4
    #: Seconds :meth:`finish` waits for the writer to commit what is queued.
    FINISH_TIMEOUT = 60.0
    #: The training-loop doctor while watching with an optimizer
    #: (:class:`hooks.doctor.loop.watch.LoopWatch`), else ``None``.
    _doctor: Any = None
    #: The triggered capture of ``watch(..., optimizer=)``
    #: (:class:`hooks.recorder.spike_watch.SpikeWatch`), else ``None``.
    _spikes: Any = None
    #: The database was deleted (or the run resumed elsewhere): nothing more is written.
    _lost = False

    def __init__(
        self,
        name: str | None = None,
        *,
        db: str | os.PathLike[str] | None = None,
        config: Mapping[str, Any] | None = None,
        total_steps: int | None = None,
        gather_every: int = 50,
        kind: str = "api",
    ) -> None:
        # every argument checked before any database exists: a refusal creates none
        config = config_checked(config)
        if name is not None:
            validate_run_name(name)
        total_steps, gather_every = checked_counts(total_steps, gather_every)
        # None or "" (as --db "" in the CLI): the default database
        self.db = Path(db) if db is not None and os.fspath(db) != "" else default_db_path()
        self.total_steps = total_steps
        self.step = 0
        self.status = "running"
        self.reason: str | None = None
        self.nonfinite: dict[str, Any] | None = None
        self.error: str | None = None
        self.rank, self.world_size = 0, 1
        self._link: Any = None
        # rank 0 / one process: room for the final status once the disk is full
        self._reserve: DiskReserve | None = None
        self.name, self.id = None, None  # on ranks other than 0: rank 0's, once it says
        self._logged = False
        self._queue: collections.deque = collections.deque()
        self._traces_in = 0  # written by the caller's thread only
        self._traces_out = 0  # written by the writer thread only
        self._committed_step: int | None = None
        self._wake = threading.Event()
        self._stop = False
        self._dead = False
        self._final: tuple[str, str | None] | None = None
        self._closed = False
        self._finishing = False
        self._done = False
        self._signal: str | None = None
        # watch
        self._model: Any = None
        self._every = 0
        self._watched: str | None = None  # the first watch() call, "watch(...) at file:line"
        self._capture_options: dict[str, Any] = {}
        self._capture: Any = None
        self._step_trace: Any = None  # the trace of the current step, if it was captured
        self._locate_pending = False
        self._sentinel: Any = None  # hooks.nonfinite.origin.NonFiniteSentinel while watching
        # mdb stop / pause / resume (hooks.store.control), read by a poller thread
        self._stop_asked = False
        self._stop_seen = False  # the loop read should_stop once it was asked
        self._resumed = threading.Event()
        self._resumed.set()
        self._poller: Any = None
        self._nf_order: tuple[int, int] | None = None
        self._sample: tuple[int, str, str] | None = None
        self._thread: threading.Thread | None = None
        self._prev_handlers: dict[int, Any] = {}
        # the handlers go in before the run exists: a signal that comes while it is opened (a
        # job stopped while its ranks start) waits until it is open, then ends it interrupted
        self._opening = True
        self._install_signals()
        try:
            self._open(_job(), name, config, kind, gather_every)
        except BaseException:
            self._open_failed()
            raise
        self._opened()

    def _open(self, job: Any, name: str | None, config: dict[str, Any], kind: str,
              gather_every: int) -> None:
        """Create the run (rank 0, or a single process) and start what records it: the writer
        thread and the control poller there, the link to the other ranks in a job."""
        if job is None or job.rank == 0:
            self._create_run(name, config, kind, job, gather_every)
        say_world_size(job)
        if job is None or job.rank == 0:
            self._thread = threading.Thread(
                target=self._writer_main, name=f"mdb-run-writer-{self.id}", daemon=True
            )
            self._thread.start()
            self._poller = ControlPoller(self.db, self.id, self._on_request,
                                         since=time.time(),
                                         acknowledged=lambda: self._stop_seen).start()
            self._track_fork()
        if job is not None:
            self.rank, self.world_size = job.rank, job.world_size
            link = self._link or self._make_link(job, gather_every)
            if job.rank == 0:
                link.publish_run({"name": self.name, "id": self.id, "db": str(self.db)})
            link.start()
        self._prev_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._atexit)

    def _create_run(self, name: str | None, config: dict[str, Any], kind: str, job: Any,
                    gather_every: int) -> None:
        """Create the run in the store (rank 0, or a single process), set its disk reserve
        aside and say where it is recorded; a failure is told to the other ranks of a job,
        then raised."""
        try:
            with RunStore(self.db, create=True) as store:
                writer = self._create(store, name, config, kind,
                                      job.world_size if job is not None else None)
        except Exception as exc:
            if job is not None:  # the other ranks learn it rather than wait
                with contextlib.suppress(Exception):
                    self._make_link(job, gather_every).publish_run({"error": str(exc)})
            raise
        self.name, self.id = writer.name, writer.run_id
        if name is not None and name != self.name:
            print(f"mdb: a run named {name!r} exists in {self.db}: recording this one "
                  f"as {self.name!r}", file=sys.stderr)
        db_opt = "" if self.db == default_db_path() else f" --db {self.db}"
        ranks = f" ({job.world_size} ranks)" if job is not None else ""
        print(f"mdb: recording run {self.name}{ranks} in {self.db} (follow it: mdb watch "
              f"{self.name}{db_opt})", file=sys.stderr)
        self._reserve = DiskReserve(checkpoint_dir(self.db, self.name) / ".mdb-reserve")
        self._reserve.make()

    def _make_link(self, job: Any, every: int) -> Any:
        from hooks.dist import distributed

        _DIST_RUNS[0] += 1
        self._link = distributed.RankLink(
            job, str(_DIST_RUNS[0]), every=every,
            emit=self._emit if job.rank == 0 else None,
            serialise=self._serialise, say=self._say,
        )
        return self._link

    def _emit(self, kind: str, *args: Any) -> None:
        """Rank 0's link thread hands over what to write (see ``RankLink``)."""
        if self._thread is not None:
            self._enqueue((kind, *args))
            self._wake.set()

    def _learn_name(self) -> None:
        info = self._link.run_info if self._link is not None else None
        if self.id is None and info and "id" in info:
            self.name, self.id = info.get("name"), info.get("id")

    def _create(self, store: RunStore, name: str | None, config: dict[str, Any],
                kind: str = "api", world_size: int | None = None) -> RunWriter:
        base = name if name is not None else time.strftime("run-%Y%m%d-%H%M%S")
        validate_run_name(base)
        for i in range(1, 1000):
            candidate = base if i == 1 else f"{base[:95]}-{i}"
            try:
                return store.create_run(candidate, config, total_steps=self.total_steps,
                                        kind=kind, world_size=world_size)
            except RunExistsError:
                continue
        raise RunExistsError(f"runs {base!r}, {base}-2 … {base}-999 all exist in {self.db}")

    def __repr__(self) -> str:
        return f"Run(name={self.name!r}, db={str(self.db)!r}, step={self.step}, " \
               f"status={self.status!r})"

    # -- context manager -------------------------------------------------------------------------
    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._finishing = True
        if exc_type is None:
            if self._signal is not None and not self._reached_total():
                self.finish("interrupted", reason=self._signal)
            else:
                self.finish("finished")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.finish("interrupted", reason=self._signal or "KeyboardInterrupt")
        elif issubclass(exc_type, SystemExit):
            code = getattr(exc, "code", None)
            if self._signal is not None:
                self.finish("interrupted", reason=self._signal)
            elif code in (None, 0):
                self.finish("finished")
            else:
                self.finish("failed", reason=f"SystemExit: {code}")
        else:
            self.finish("failed", reason=last_line(exc))
        return False

    def _reached_total(self) -> bool:
        return self.total_steps is not None and self.step >= self.total_steps

    # -- logging ---------------------------------------------------------------------------------
    def log(self, *, step: int | None = None, expert_load: Any = None, **scalars: Any) -> None:
        """Record scalars of a training step: ``run.log(loss=loss, lr=lr, val_loss=v)``.

        Args:
            step: The step these values belong to. ``None``: the step after the last one logged
                (1 for the first). The same step as the last one adds to it (e.g. a validation
                loss computed after the training step was logged); an earlier step is refused.
            expert_load: Per MoE layer, per expert, the share of the step's routed slots each
                expert received, (L_moe, E), rows summing to 1 (a 2-D tensor or nested lists;
                :func:`hooks.train.trainer.expert_load` computes it from router logits): the
                MoE panel of ``mdb watch``, per rank in a ``torchrun`` job. A number here is
                a scalar named ``expert_load``.
            **scalars: Any names; each value a Python number, a one-element tensor (0-dim,
                e.g. a loss) or a numpy scalar. NaN and ±Inf are recorded as such.

        Raises:
            TypeError: A value that is not a number, or a ``step`` that is not an integer.
            ValueError: A tensor with more than one element or on the meta device, a step
                before the last one, or a metric name that is empty or holds a lone surrogate
                (UTF-8 cannot encode it).
            RuntimeError: The run is finished.
        """
        load = None
        if expert_load is not None:
            load = expert_load_table(expert_load)
            if load is None:
                scalars["expert_load"] = expert_load
        if self._closed:
            raise RuntimeError(f"{self._title} is finished: log() after finish()")
        step = self._next_step(step)
        values: dict[str, float] = {}
        bad = None
        for key, value in scalars.items():
            x = to_float(checked_metric_name(key), value)
            values[key] = x
            if bad is None and not math.isfinite(x):
                bad = key
        new = not self._logged or step != self.step
        trace = None
        found = self._sentinel.take() if self._sentinel is not None else None
        if new:
            self._step_trace = None
            if self._capture is not None:
                trace = self._end_capture(step, values)
            if self._spikes is not None:
                trace = self._spike_trace(step, values, trace)
            self._step_trace = trace
            if self._doctor is not None and (self._doctor.armed or self._doctor.findings):
                self._doctor_findings(close=False)  # also what it saw after the last window
        self._logged = True
        self.step = step
        wall = time.time()
        if self._link is not None:
            self._link.row(step, wall, values, new=new, expert_load=load,
                           trace=trace if self.rank != 0 else None)
            if self.id is None:
                self._learn_name()
        sample = None
        if self._sample is not None and self._sample[0] == step:
            sample, self._sample = self._sample[1:], None
        self._enqueue(("step", step, wall, values, trace, load, sample))
        if self.nonfinite is None and (bad is not None or found is not None):
            self._nf_order = (step, list(values).index(bad) if bad is not None else len(values))
            self._found_nonfinite(step, bad or found[0], found)
        elif self._locate_pending and trace is not None:
            self._locate(trace)
        if not self._resumed.is_set():
            self._wait_while_paused()
        if (
            self._model is not None
            and self._capture is None
            and not self._dead
            and not self._closed
            and (self._locate_pending or (step + 1) % self._every == 0)
        ):
            self._start_capture(step + 1)

    def _next_step(self, step: Any) -> int:
        """The step a ``log(step=...)`` call is for (see :meth:`log`)."""
        if step is None:
            return self.step + 1 if self._logged else 1
        step = checked_step(step)  # an integer (not a bool) in 0 … 2**63 - 1
        if self._logged and step < self.step:
            raise ValueError(
                f"run.log(step={step}): step {step} is before the last step logged "
                f"({self.step}); steps must not go back"
            )
        return step

    def log_sample(self, step: int, prompt: str, text: str) -> None:
        """Record the model's greedy continuation ``text`` of ``prompt``, written with step
        ``step``: call it before that step's first ``log()``; ``mdb watch`` shows the latest.
        Used by mdb's own runs (``mdb overfit``)."""
        self._sample = (int(step), str(prompt), str(text))

    def _enqueue(self, item: tuple) -> None:
        if self._dead or self._thread is None:
            # recording stopped (or another rank: rank 0 writes; or a forked child, which
            # says so once): nothing accumulates
            self._dropped_in_child()
            return
        q = self._queue
        traced = item[0] == "step" and item[4] is not None
        if len(q) >= self.MAX_PENDING or (
            traced and self._traces_in - self._traces_out >= self.MAX_PENDING_TRACES
        ):
            self._wake.set()
            while not self._dead and self._thread.is_alive() and (
                len(q) >= self.MAX_PENDING
                or (traced and self._traces_in - self._traces_out >= self.MAX_PENDING_TRACES)
            ):
                time.sleep(0.001)
            if self._dead or not self._thread.is_alive():
                return
        if traced:
            self._traces_in += 1
        q.append(item)

    # -- non-finite values -------------------------------------------------------------------------
    def _found_nonfinite(self, step: int, metric: str, found: Any = None) -> None:
        """Record the first non-finite value: where it started, from what the sentinel saw
        while the weights were still the forward's (``found``), else this step's capture, else
        the next step's capture, if the weights are still finite now."""
        from hooks.nonfinite.origin import parameter_origin, trace_origin

        self.nonfinite = {"step": step, "metric": metric, "module": None, "direction": None}
        origin = found[1] if found is not None else None
        if origin is None and self._step_trace is not None:
            stayed = "the model's output" if found is not None and found[0] == "gradient" \
                else None
            origin = trace_origin(self._step_trace, stayed_finite=stayed)
        if origin is not None:
            self._set_origin(origin)
        elif self._step_trace is not None:
            self.nonfinite["detail"] = (f"no module output or gradient in the capture of step "
                                        f"{step} was non-finite (a loss computed outside the "
                                        "model?)")
        elif self._model is not None and parameter_origin(self._model) is not None:
            self.nonfinite["detail"] = (
                f"step {step} was not captured, and the weights already hold NaN/Inf (an "
                "optimizer step applied it), so the first module cannot be told; "
                "run.watch(model, optimizer=opt) finds it before the update")
        elif self._model is not None:
            self._locate_pending = True  # capture the next step to find the module
        self._publish_nonfinite()

    def _set_origin(self, origin: Any) -> None:
        nf = self.nonfinite
        nf.update(module=origin.module, direction=origin.direction, detail=origin.detail)
        if origin.note:
            nf["note"] = origin.note
        held_by = getattr(origin, "rank", None)
        if held_by is not None and held_by != self.rank and self._nf_order is not None:
            # another rank's shard holds the NaN: that rank's own finding of the same step
            # (its sentinel reads its shard) comes first on rank 0; this one stays if it
            # never arrives
            self._nf_order = (self._nf_order[0], self._nf_order[1] + 1)

    def _locate(self, trace: Any) -> None:
        from hooks.nonfinite.origin import trace_origin

        self._locate_pending = False
        if self.nonfinite is None:
            return
        origin = None
        with contextlib.suppress(Exception):  # a trace that cannot answer locates nothing
            origin = trace_origin(trace)
        if origin is not None:
            self._set_origin(origin)
            self.nonfinite["detail"] = (f"{origin.detail} (at step {trace.step}, the next "
                                        "step, captured to locate it)")
        self._publish_nonfinite()

    def _publish_nonfinite(self) -> None:
        nf = dict(self.nonfinite or {})
        if self._link is not None:  # rank 0 keeps the first of all ranks
            self._link.set_nonfinite(nf, self._nf_order or (nf.get("step", 0), 0))
        else:
            self._enqueue(("nonfinite", nf))

    # -- watch -------------------------------------------------------------------------------------
    def watch(self, model: Any, every: int = 50, *, optimizer: Any = None,
              scheduler: Any = None, **capture_options: Any) -> None:
        """Record the internals of every ``every``-th step of ``model`` in the run store.

        Steps ``every``, ``2·every``, … are run under :func:`hooks.capture` (statistics of
        every module call's inputs and outputs, their gradients, parameter gradients, MoE
        routing); the hooks are attached after the ``log()`` of the step before and removed at
        the recorded step's ``log()``, so the other steps run with none but the sentinel's two
        on the root module (below). ``mdb watch`` opens the
        latest stored capture with ``c``; ``mdb step --run NAME@STEP`` opens any.

        Every step, watched or not, the root module's output is checked for NaN/Inf (and, with
        ``optimizer``, the gradients before the optimizer applies them): the first non-finite
        value is located at once, while the weights are still the ones that forward used
        (:class:`hooks.nonfinite.origin.NonFiniteSentinel`: a weight that holds NaN, else the first
        non-finite output of a replay of that forward under :func:`hooks.capture`), and
        recorded with the step it was logged at (:attr:`nonfinite`).

        Args:
            model: The ``torch.nn.Module`` being trained.
            every: Record every ``every``-th step (1 = every step).
            optimizer: The loop's ``torch.optim.Optimizer``: a NaN in the gradients is then
                located before it reaches the weights, also when the loss stayed finite (a
                kernel that returns finite values for NaN inputs). With it the training-loop
                doctor checks the loop (:mod:`hooks.doctor.loop.watch`, docs/loop-doctor.md):
                its findings are the run's ``findings``.
            scheduler: The loop's LR scheduler (its optimizer is watched if ``optimizer``
                is not given): the doctor also checks how often it steps.
            **capture_options: Passed to :func:`hooks.capture` (``include``, ``exclude``,
                ``attention=True`` …).

        Raises:
            TypeError: ``model`` is not an ``nn.Module``, ``optimizer`` not a
                ``torch.optim.Optimizer``, ``scheduler`` not an LR scheduler, a keyword
                neither ``watch`` nor :func:`hooks.capture` takes, or ``every``,
                ``attention_bytes`` or ``keep_bytes`` is not an integer (a float, a bool; at
                once, before anything is attached).
            ValueError: ``every`` not in 1 … 2**63 - 1, a negative ``attention_bytes`` or
                ``keep_bytes``; ``scheduler`` drives another optimizer.
            RuntimeError: ``watch`` was called before on this run (the message names that
                call): a run watches one model, once.
        """
        from torch import nn

        from hooks.doctor.loop.watch import LoopWatch, check_watch_arguments, ddp_reduce
        from hooks.nonfinite.origin import NonFiniteSentinel

        if not isinstance(model, nn.Module):
            raise TypeError(f"watch expects a torch.nn.Module, got {type(model).__name__}")
        optimizer = check_watch_arguments(optimizer, scheduler, capture_options)
        every = checked_every(every)
        if self._watched is not None:
            raise RuntimeError(f"{self._title}: {self._watched} came first; a run watches one "
                               "model, once: call run.watch once, before the training loop")
        caller = traceback.extract_stack(limit=2)[0]
        self._watched = (f"watch({type(model).__name__}, every={every}) at "
                         f"{os.path.basename(caller.filename)}:{caller.lineno}")
        self._model, self._every = model, every
        # the optimizer's state is counted in each capture's trace.memory
        self._capture_options = {**capture_options, "optimizer": optimizer}
        nxt = self.step + 1 if self._logged else 1
        ddp = False
        if self._link is not None:
            self._link.watch(model, every=every)  # cross-rank checks at captured steps too
            self._link.arm_first(nxt)
            inner = getattr(model, "module", None)
            if isinstance(inner, nn.Module) and type(model).__name__ == "DistributedDataParallel":
                self._model = inner  # captured under the user's own module names
                ddp = self.world_size > 1
        self._sentinel = NonFiniteSentinel(self._model, lambda: self._capture is not None,
                                           optimizer)  # the first and only watch: none before
        sentinel = self._sentinel
        if optimizer is not None and self.world_size == 1 and not self._sharded(self._model):
            from hooks.recorder.spike_watch import SpikeWatch

            self._spikes = SpikeWatch(
                self._model, optimizer, next_step=lambda: self.step + 1 if self._logged else 1,
                busy=lambda: sentinel.replaying, active_capture=lambda: self._capture,
                capture_options=self._capture_options, say=self._say)
        if optimizer is not None and self._sharded(self._model):
            if self.rank == 0:
                self._say(f"{self._title}: the loop doctor is off for a sharded (FSDP2/tensor-"
                          "parallel) model: its replays and gradient norms would run the "
                          "shards' collectives out of the loop's order")
        elif optimizer is not None:  # the loop doctor, on every rank (each rank's loop)
            spikes = self._spikes
            self._doctor = LoopWatch(self._model, optimizer, scheduler,
                                     capture=lambda: self._capture,
                                     busy=lambda: sentinel.replaying or (
                                         spikes is not None and spikes.replaying),
                                     reduce=ddp_reduce if ddp else None)
            self._doctor.once(nxt)
            self._doctor_findings(close=False)
        if not self._closed and nxt % every == 0:
            self._start_capture(nxt)

    @property
    def loop_doctor(self) -> Any:
        """The loop doctor (:class:`hooks.doctor.loop.watch.LoopWatch`) that ``watch(...,
        optimizer=)`` attached (on every rank of a torchrun job), or ``None``: an integration
        that drives the step itself (Lightning's ``optimizer.step(closure)``) tells it when the
        step comes."""
        return self._doctor

    @property
    def spike_watch(self) -> Any:
        """The triggered capture of ``watch(..., optimizer=)``
        (:class:`hooks.recorder.spike_watch.SpikeWatch`), or ``None``."""
        return self._spikes

    @staticmethod
    def _sharded(model: Any) -> bool:
        """Whether ``model`` holds DTensor parameters (FSDP2, tensor parallel): the loop
        doctor's replays and gradient norms would be collectives that only rank 0 issues."""
        from hooks.sharded.stats import sharded_parameters

        return bool(sharded_parameters(model))

    def _doctor_findings(self, *, close: bool) -> None:
        """Close the loop doctor's window (``close``: detach it for good) and hand its
        findings to the writer."""
        doctor = self._doctor
        if close:
            doctor.close()
        elif doctor.armed:
            doctor.disarm()  # an evaluation right after this log() is still seen
        found = doctor.take()
        if found and self._link is not None:  # tagged with this rank; rank 0 writes them
            found = self._link.loop_findings(found)
        if found:
            self._enqueue(("findings", found))

    def _start_capture(self, step: int) -> None:
        from hooks.engine.capture import capture

        if self._doctor is not None:
            self._doctor.arm(step)

        model = self._model
        meta = {
            "run": self.name,
            "step": step,
            "description": f"{self._title} · {type(model).__name__}",
        }
        if self.world_size > 1:  # shapes, routing and attention are this rank's batch
            meta["description"] += f" · rank {self.rank} of {self.world_size}"
            meta["rank"], meta["world_size"] = self.rank, self.world_size
        try:
            cap = capture(model, step=step, meta=meta, **self._capture_options)
            cap.start()
        except Exception as exc:
            self._say(f"{self._title}: watch stopped, the capture could not start: "
                      f"{last_line(exc)}")
            self._model = None
            self._capture = None
            return
        self._capture = cap

    def _end_capture(self, step: int, values: dict[str, float]) -> Any:
        cap, self._capture = self._capture, None
        try:
            trace = cap.stop()
        except Exception as exc:
            self._say(f"{self._title}: the capture of step {step} failed: {last_line(exc)}")
            return None
        if not trace.forward:
            return None  # nothing ran between the two log() calls: nothing to store
        return self._stamp(trace, step, values)

    def _stamp(self, trace: Any, step: int, values: dict[str, float]) -> Any:
        """Write the step and its logged values into a capture's ``meta``."""
        trace.step = step
        meta = trace.meta
        meta["step"] = step
        meta["logged"] = {k: (v if math.isfinite(v) else str(v)) for k, v in values.items()}
        key = loss_metric(values)
        if key is not None:
            v = values[key]
            meta["loss"] = v if math.isfinite(v) else str(v)
            meta["loss_source"] = f"run.log({key}=…)"
        return trace

    def _spike_trace(self, step: int, values: dict[str, float], trace: Any) -> Any:
        """The step's capture: the triggered one (:mod:`hooks.recorder.spike_watch`) when the
        step spiked, its story said on stderr; else ``trace``, kept for the story's medians."""
        spiked = self._spikes.take(step)
        if spiked is None:
            if trace is not None:
                self._spikes.remember(trace)
            return trace
        spiked.meta["run"] = self.name
        spiked.meta["description"] = f"{self._title} · {spiked.meta.get('description', '')}"
        db = "" if self.db == default_db_path() else f" --db {self.db}"
        self._say(f"{self._title}: {spiked.meta['spike']['line']} (captured before its update:"
                  f" mdb step --run {self.name}@{step}{db})")
        return self._stamp(spiked, step, values)

    # -- finishing ---------------------------------------------------------------------------------
    def finish(self, status: str = "finished", *, reason: str | None = None) -> None:
        """End the run: commit everything logged, set its final status, restore the signal
        handlers. Idempotent.

        Args:
            status: ``"finished"``, ``"interrupted"`` or ``"failed"``.
            reason: Shown by ``mdb runs`` and ``mdb watch`` (``"SIGTERM"``, an error line …).

        Raises:
            ValueError: Unknown status.
        """
        if status not in ("finished", "interrupted", "failed"):
            raise ValueError(f"status must be finished/interrupted/failed, not {status!r}")
        if self._closed:
            return
        # a loop that never read should_stop ran to its own end: it did not stop for mdb stop
        if status == "finished" and self._stop_seen and not self._reached_total():
            status, reason = "interrupted", reason or "stopped"
        self._finishing = True
        self._closed = True
        if self._poller is not None:
            self._poller.close()
        cap, self._capture = self._capture, None
        if cap is not None:  # attached for a step that was never logged: nothing to store
            with contextlib.suppress(Exception):
                cap.stop()
        self._model = None
        if self._sentinel is not None:
            self._sentinel.remove()
            self._sentinel = None
        if self._spikes is not None:
            self._spikes.remove()
            self._spikes = None
        if self._doctor is not None:
            self._doctor_findings(close=True)
            self._doctor = None
        if self._link is not None:
            ends = self._link.finish(status, reason, self.step)
            self._learn_name()
            if self.rank == 0:
                status, reason = job_end(status, reason, ends)
        self._final = (status, reason)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.FINISH_TIMEOUT)
            if self._thread.is_alive():
                self._say(f"{self._title}: the writer did not finish within "
                          f"{self.FINISH_TIMEOUT:.0f} s; the last steps may not be recorded")
        self.status, self.reason = self._final
        self._done = True
        self._restore_signals()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
        atexit.unregister(self._atexit)

    def _atexit(self) -> None:
        if not self._closed:
            if self._signal is not None and not self._reached_total():
                self.finish("interrupted", reason=self._signal)
            else:
                self.finish("finished")

    def _excepthook(self, exc_type, exc, tb) -> None:
        if not self._closed:
            self._finishing = True
            if issubclass(exc_type, KeyboardInterrupt):
                self.finish("interrupted", reason=self._signal or "KeyboardInterrupt")
            else:
                self.finish("failed", reason=last_line(exc))
        hook = self._prev_excepthook if self._prev_excepthook is not self._excepthook else None
        (hook or sys.__excepthook__)(exc_type, exc, tb)
