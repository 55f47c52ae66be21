"""The run store's rows as Python values, and what can go wrong reading them.

* :class:`RunInfo` (a row of ``runs``: identity, configuration, writer status and liveness),
  :class:`MetricRow` (a step's named scalars), :class:`SampleRow`, :class:`RunUpdate` (what a
  watcher reads in one poll);
* the rows of a distributed run: :class:`RankInfo`, :class:`RankRow`, :class:`Finding`;
* the store's errors (:class:`RunNotFoundError`, :class:`RunExistsError`,
  :class:`DamagedRunError`, :class:`WriterBusyError`; their base
  :class:`~hooks.store.sqlite_open.RunStoreError`);
* run names (:func:`validate_run_name`), the loss metric (:func:`loss_metric`, defined in
  :mod:`hooks.store.numbers` with every number the views show), a writer's
  liveness (:meth:`RunInfo.writer_alive`; :func:`pid_alive` is
  :mod:`hooks.store.liveness`'s) and non-finite findings (:func:`nonfinite_sentence`).

A row changed outside mdb (text in a numeric column, a config that is not JSON) is read with
the unreadable fields left empty and :attr:`RunInfo.damaged` saying which; such a run is never
resumed. A metric row that cannot be read raises :class:`DamagedRunError`.

Part of the run store (:mod:`hooks.store.store`, which re-exports every public name). This
module uses only the standard library (and :mod:`hooks.store.spikes` and
:mod:`hooks.store.numbers`, which do too).
"""

from __future__ import annotations

import json
import math
import re
import socket
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from hooks.store.liveness import pid_alive, process_lives
from hooks.store.spikes import Spike
from hooks.store.sqlite_open import RunStoreError

#: A running run written from another host whose heartbeat is older than this many seconds
#: is reported "gone" (on this host the writer's process is asked, see
#: :meth:`RunInfo.writer_alive`).
DEFAULT_STALE_AFTER = 15.0
#: Run statuses as stored in ``runs.status``.
STATUSES = ("running", "finished", "interrupted", "failed")
#: The metrics ``mdb overfit`` logs every step, in the order it logs them; they are also
#: :class:`MetricRow` attributes.
FIXED_METRICS = (
    "ce",
    "aux",
    "total",
    "grad_norm",
    "lr",
    "step_time",
    "tokens_per_s",
    "steps_per_s",
)

_RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,99}")


class RunNotFoundError(RunStoreError):
    """No run with the requested name (or id) exists in the database."""


class RunExistsError(RunStoreError):
    """A new run was requested under a name that is already taken."""


class DamagedRunError(RunStoreError):
    """A row of a run holds what mdb never writes there (text in a numeric column, JSON that
    does not parse): the database was changed outside mdb. The message names the run, the
    column and the value."""


class WriterBusyError(RunStoreError):
    """A run cannot be resumed because its writer is still alive."""


def validate_run_name(name: str) -> str:
    """Return ``name`` if it is a valid run name, else raise :class:`RunStoreError`.

    A run name is 1-100 characters from ``A-Z a-z 0-9 . _ - = +`` starting with a letter or
    digit (it names a checkpoint directory, so no slashes or spaces; ``=`` and ``+`` let
    ``mdb ablate`` name a run after its variant, ``abl-attention=mha+ffn=dense``).
    """
    if not isinstance(name, str) or not _RUN_NAME_RE.fullmatch(name):
        shown = repr(name)
        if len(shown) > 120:  # a name of 10,000 characters is not repeated in full
            n = len(name) if isinstance(name, str) else len(shown)
            shown = f"{shown[:110]}… ({n:,} characters)"
        raise RunStoreError(
            f"invalid run name {shown}: use 1-100 characters from A-Z a-z 0-9 . _ - = + "
            "starting with a letter or digit"
        )
    return name


def _nan_to_none(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def nonfinite_from_failure(
    status: str, reason: str | None, fail_step: int | None, fail_module: str | None
) -> dict[str, Any] | None:
    """The :attr:`RunInfo.nonfinite` finding of a run that :class:`hooks.train.trainer.Trainer`
    stopped as failed: its reason starts ``non-finite loss`` (the loss, ``total``) or
    ``non-finite gradient`` (``grad_norm``) and names where it started, ``first in MODULE
    (DIRECTION)`` (:meth:`hooks.train.trainer.NonFiniteInfo.describe`)."""
    if status != "failed" or fail_step is None or not reason:
        return None
    metric = {"non-finite loss": "total", "non-finite gradient": "grad_norm"}.get(
        " ".join(reason.split()[:2]))
    if metric is None:
        return None
    m = re.search(r"first in .*? \((forward|backward|parameter|gradient)\)", reason)
    # a reason written before the origin named its direction: the locator of the time looked
    # forward for a non-finite loss and backward for a non-finite gradient
    legacy = "forward" if metric == "total" else "backward"
    return {"step": fail_step, "metric": metric, "module": fail_module,
            "direction": m.group(1) if m else legacy}


def nonfinite_sentence(nf: Mapping[str, Any]) -> str:
    """A non-finite finding (:attr:`RunInfo.nonfinite`) as one sentence, what, when and where:
    ``non-finite loss at step 131, first in blocks.1.mlp.0 (parameter): its weight holds 1 NaN
    of 4096 values``; ``non-finite loss at step 7 (module not located: …)``."""
    what = f"non-finite {nf.get('metric') or 'value'} at step {nf.get('step')}"
    if nf.get("rank") is not None:
        what += f" on rank {nf['rank']}"
    module, detail = nf.get("module"), nf.get("detail")
    if module is None:
        return f"{what} (module not located" + (f": {detail})" if detail else ")")
    text = f"{what}, first in {module or 'the root module'}"
    if nf.get("direction"):
        text += f" ({nf['direction']})"
    if detail:
        text += f": {detail}"
    return text + (f"; {nf['note']}" if nf.get("note") else "")


NONFINITE_KEYS = ("step", "metric", "module", "direction", "detail", "note")
#: Where a non-finite value started (:attr:`hooks.nonfinite.origin.Origin.direction`).
DIRECTIONS = (None, "forward", "backward", "parameter", "gradient")


def _nonfinite_from_json(text: str | None) -> dict[str, Any] | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(d, dict) or not isinstance(d.get("step"), int):
        return None
    out = {k: d.get(k) for k in NONFINITE_KEYS}
    for key in ("metric", "module", "detail", "note"):
        if not isinstance(out[key], (str, type(None))):
            out[key] = str(out[key])
        if isinstance(out[key], str) and len(out[key]) > 500:
            out[key] = out[key][:500] + "…"
    for key in ("detail", "note"):
        if out[key] is None:
            del out[key]
    if out["direction"] not in DIRECTIONS:
        out["direction"] = None
    if isinstance(d.get("rank"), int):  # a distributed run: the rank that logged it
        out["rank"] = d["rank"]
    return out


@dataclass(frozen=True)
class RunInfo:
    """One row of ``runs``: a run's identity, configuration and writer status.

    Attributes:
        id: Integer primary key, stable for the life of the database.
        name: Unique run name.
        kind: What wrote it: ``"overfit"`` (``mdb overfit``) or ``"api"`` (``hooks.run``).
        config: The run's configuration (model config and training options), as a dict.
        status: Stored status: ``running``, ``finished``, ``interrupted`` or ``failed``.
            ``running`` only says the writer has not said otherwise; see :meth:`writer_state`.
        pid: Process id of the (last) writer.
        host: Host name of the (last) writer.
        started: When the run was created (Unix seconds).
        ended: When the writer set a final status, else ``None``.
        heartbeat: Last sign of life of the writer (Unix seconds).
        total_steps: Number of steps the run was asked to do.
        last_step: Last step written (0 before the first).
        last_loss: The loss (see :func:`loss_metric`) of the last step that logged it (``None``
            before the first, or NaN).
        paused: Whether the writer is paused (live screen).
        reason: Why the run ended (``"finished"``, ``"SIGTERM"``, ``"non-finite loss"`` ...).
        fail_step: Step at which a non-finite value appeared (failed runs).
        fail_module: Qualified name of the module whose output was first non-finite, or
            ``None`` when it could not be located.
        checkpoint_step: Step of the last checkpoint, ``None`` if none was written.
        checkpoint_path: Directory of the last checkpoint, relative to the database's directory.
        attempt: 1 for a fresh run, incremented by every resume.
        nonfinite: ``None``, or where a logged value first turned NaN/Inf:
            ``{"step": int, "metric": str | None, "module": str | None,
            "direction": "forward" | "backward" | None}`` — the step, the metric, and the
            first module whose output (forward) or output gradient (backward) was non-finite
            in a capture of that step or the next (``None``: not located, e.g. no capture).
            ``module`` is ``""`` for the model's own (root) forward.
        damaged: ``None``, or one line naming the fields of the row that could not be read
            (text in a numeric column, a config that is not a JSON object...): they hold
            their empty value here (``None``, 0, ``{}``). A damaged run is listed, never
            resumed.
            ``module`` is ``""`` for the model's own (root) forward. In a distributed run it
            also has ``"rank"``: the rank that logged the first non-finite value (the
            earliest step; within a step, the metric logged first), located in that rank's
            capture.
        world_size: The number of ranks of a distributed run (``torchrun``), ``None`` for a
            single process.
        writer: The writing process as it recorded itself, ``{"pid", "host", "start"}``
            (:func:`hooks.store.liveness.this_process`), ``None`` when none did (a writer of an
            older mdb) or the row cannot say.
    """

    id: int
    name: str
    kind: str
    config: dict[str, Any]
    status: str
    pid: int | None
    host: str | None
    started: float
    ended: float | None
    heartbeat: float | None
    total_steps: int | None
    last_step: int
    last_loss: float | None
    paused: bool
    reason: str | None
    fail_step: int | None
    fail_module: str | None
    checkpoint_step: int | None
    checkpoint_path: str | None
    attempt: int
    nonfinite: dict[str, Any] | None = field(default=None, hash=False)
    world_size: int | None = None
    damaged: str | None = field(default=None, hash=False)
    writer: dict[str, Any] | None = field(default=None, hash=False)

    def writer_state(
        self, now: float | None = None, stale_after: float = DEFAULT_STALE_AFTER
    ) -> str:
        """The run's status as a reader should show it.

        Args:
            now: Current Unix time (defaults to ``time.time()``).
            stale_after: Seconds without heartbeat after which a running writer of another
                host (or one that did not record its process) counts as gone.

        Returns:
            ``finished``, ``interrupted`` or ``failed`` as stored; for a ``running`` run,
            ``running`` while the writer lives (see :meth:`writer_alive`), else ``gone``.
        """
        if self.status != "running":
            return self.status
        return "running" if self.writer_alive(now, stale_after) else "gone"

    def _recorded_start(self) -> tuple[bool, int | None]:
        """``(recorded, start)``: whether the writer named by ``pid``/``host`` recorded its
        process (:attr:`writer`), and its start time then."""
        w = self.writer
        if not w or w.get("pid") != self.pid or w.get("host") != self.host:
            return False, None  # none, or the previous writer's (a resume is taking over)
        return True, w.get("start")

    def writer_alive(
        self, now: float | None = None, stale_after: float = DEFAULT_STALE_AFTER
    ) -> bool:
        """Whether the writer of a ``running`` run lives.

        On this host, a writer that recorded its process (:attr:`writer`) lives while that
        process does — the same pid and start time, running or stopped (``SIGSTOP``), not a
        zombie — however old its heartbeat (:func:`hooks.store.liveness.process_lives`). A
        writer of another host cannot be asked: it lives while its heartbeat is at most
        ``stale_after`` seconds old (a writer stopped that long on another host counts as
        gone). A writer of an older mdb (no :attr:`writer`) on this host: its pid must exist
        and its heartbeat be fresh.
        """
        if self.status != "running":
            return False
        if self.host == socket.gethostname():
            recorded, start = self._recorded_start()
            if recorded:
                return process_lives(self.pid, start)
            if not pid_alive(self.pid):
                return False
        now = time.time() if now is None else now
        beat = self.heartbeat if self.heartbeat is not None else self.started
        return now - beat <= stale_after

    def gone_reason(
        self, now: float | None = None, stale_after: float = DEFAULT_STALE_AFTER
    ) -> str:
        """One line saying why the writer counts as gone, or ``""`` if it does not."""
        if self.writer_state(now, stale_after) != "gone":
            return ""
        now = time.time() if now is None else now
        here = self.host == socket.gethostname()
        if here and (self._recorded_start()[0] or not pid_alive(self.pid)):
            return f"writer gone: process {self.pid} on {self.host} no longer exists"
        beat = self.heartbeat if self.heartbeat is not None else self.started
        why = "" if here else " (another host: its process cannot be asked from here)"
        return (
            f"writer gone: no heartbeat from pid {self.pid} on {self.host} for "
            f"{now - beat:.0f} s{why}"
        )

    def status_line(self, now: float | None = None) -> str:
        """The status as ``mdb runs`` and the live screen show it: ``running``, ``paused``,
        ``finished``, ``interrupted (SIGTERM)``, ``failed @ step 7 in model.layers.1.mlp``,
        ``gone: ...``; ``damaged`` for a row that could not be read (see :attr:`damaged`)."""
        if self.damaged:
            return "damaged"
        state = self.writer_state(now)
        if state == "running":
            return "paused" if self.paused else "running"
        if state == "gone":
            return "gone: " + self.gone_reason(now).removeprefix("writer gone: ")
        if state == "interrupted":
            return f"interrupted ({self.reason})" if self.reason else "interrupted"
        if state == "failed":
            where = f" in {self.fail_module}" if self.fail_module else ""
            step = f" @ step {self.fail_step}" if self.fail_step is not None else ""
            return f"failed{step}{where}" if (step or where) else f"failed ({self.reason})"
        return state

    def nonfinite_line(self) -> str:
        """The non-finite finding in words, ``""`` without one (:func:`nonfinite_sentence`)."""
        return nonfinite_sentence(self.nonfinite) if self.nonfinite else ""

    def to_dict(self) -> dict[str, Any]:
        """The run as a JSON-serialisable dict."""
        return asdict(self)


@dataclass(frozen=True)
class MetricRow:
    """One training step's metrics: any number of named scalars (a row of ``metrics`` and its
    ``scalars``).

    Attributes:
        step: Step number (1-based for ``mdb overfit``; ``hooks.run`` counts from 1 too).
        wall: When the step was logged (Unix seconds).
        ce: Cross-entropy of the step's forward pass, in nats per token (``None`` = NaN or not
            logged). This and the next attributes are ``values[name]`` for the
            :data:`FIXED_METRICS` that ``mdb overfit`` logs.
        aux: Auxiliary (load-balancing) loss as added to the total (0 for dense models).
        total: ``ce + aux``, the loss that was back-propagated.
        grad_norm: Global L2 norm of all gradients before clipping.
        lr: Learning rate used for the update.
        step_time: Wall time of the step (forward, backward, update), seconds.
        tokens_per_s: Tokens trained on per second in this step.
        steps_per_s: ``1 / step_time``.
        expert_load: Per MoE layer, per expert, fraction of the routed slots (N*k) it received,
            shape (L_moe, E); rows sum to 1. ``None`` for dense models.
        values: Every scalar logged at this step, by name, in first-logged order: a float
            (infinities included) or ``None`` for NaN. A metric not logged at this step is
            absent. Built from the fixed attributes above when not given (a NaN attribute
            becomes ``None``, a ``None`` attribute stays absent).
    """

    step: int
    wall: float
    ce: float | None = None
    aux: float | None = None
    total: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    step_time: float | None = None
    tokens_per_s: float | None = None
    steps_per_s: float | None = None
    expert_load: list[list[float]] | None = None
    values: dict[str, float | None] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        values = dict(self.values)
        for name in FIXED_METRICS:
            attr = getattr(self, name)
            if attr is not None and name not in values:
                values[name] = _nan_to_none(float(attr))
            elif attr is None and name in values:
                object.__setattr__(self, name, values[name])
        object.__setattr__(self, "values", values)

    def to_dict(self) -> dict[str, Any]:
        """The row as a JSON-serialisable dict."""
        return asdict(self)


@dataclass(frozen=True)
class SampleRow:
    """A greedy continuation generated during training (a row of ``samples``)."""

    step: int
    prompt: str
    text: str


#: States of a rank of a distributed run (``ranks.state``): reporting; ended as it said; its
#: process no longer exists; no heartbeat for longer than the stale limit; never joined.
RANK_STATES = ("running", "finished", "interrupted", "failed", "dead", "silent", "absent")
#: Kinds of finding of a distributed run (``findings.kind``).
FINDING_KINDS = (
    "param_divergence",  # a parameter's checksum differs across ranks after an optimizer step
    "grad_not_reduced",  # a gradient differs across ranks after backward (not all-reduced)
    "rank_dead",  # a rank's process no longer exists
    "rank_silent",  # a rank stopped reporting (hung, stopped, or dead on another host)
    "rank_failed",  # a rank ended with an exception of its own
    "rank_absent",  # a rank never called hooks.run
    "gather_failed",  # the gathering of per-rank values stopped (one line why)
    # the training-loop doctor (hooks.doctor.loop.watch), a run of one process or of several
    "grad_accumulation",  # the accumulated gradient is not the one-batch gradient
    "scheduler_steps",  # the scheduler steps more often than the optimizer
    "weight_decay",  # decay on norm weights, biases (error) or embeddings (warning)
    "train_eval",  # a no_grad forward in train mode, a backward through eval mode
    "zero_grad",  # gradients left from the previous optimizer step
    "optimizer_params",  # parameters not held, held twice, or never given a gradient
    "labels",  # the loss's target alignment is not next-token
    "padding",  # pad positions count in the loss
    "precision",  # lost low-precision updates; an Adam eps that rounds to 0
    "memory_growth",  # a graph or outputs kept alive from step to step
)


@dataclass(frozen=True)
class RankInfo:
    """One rank of a distributed run (a row of ``ranks``).

    Attributes:
        rank: Its global rank (``RANK``), 0 … world_size − 1.
        host: Host name of its process.
        pid: Process id on that host.
        local_rank: ``LOCAL_RANK`` (its index on its host), if known.
        state: One of :data:`RANK_STATES`.
        last_step: The last step it logged that reached rank 0 (0 before the first).
        heartbeat: When rank 0 last heard from it (rank 0's clock, Unix seconds).
        reason: Why it ended, died or stopped reporting (one line), else ``None``.
    """

    rank: int
    host: str | None
    pid: int | None
    local_rank: int | None
    state: str
    last_step: int
    heartbeat: float | None
    reason: str | None

    def describe(self) -> str:
        """``rank 1 (pid 4242 on vm)``."""
        where = []
        if self.pid is not None:
            where.append(f"pid {self.pid}")
        if self.host:
            where.append(f"on {self.host}")
        return f"rank {self.rank}" + (f" ({' '.join(where)})" if where else "")

    def to_dict(self) -> dict[str, Any]:
        """The rank as a JSON-serialisable dict."""
        return asdict(self)


@dataclass(frozen=True)
class RankRow:
    """One step of one rank of a distributed run (a row of ``rank_steps`` and its
    ``rank_scalars``).

    Attributes:
        step: The step.
        rank: The rank that logged it.
        wall: When that rank logged it (that rank's clock, Unix seconds).
        step_time: Seconds since the rank's previous step was logged (``None`` for its first).
        compute_time: Seconds from the rank's previous ``log()`` until its backward produced the
            gradient of the watched model's first parameter — the rank's own work, before it
            waits for the others in the gradient all-reduce (``None``: not measured, no
            ``run.watch``).
        expert_load: Per MoE layer, per expert, the share of routed slots (L_moe, E) the rank
            logged, or ``None``.
        values: Every scalar the rank logged at this step, by name (``None`` = NaN).
    """

    step: int
    rank: int
    wall: float
    step_time: float | None = None
    compute_time: float | None = None
    expert_load: list[list[float]] | None = None
    values: dict[str, float | None] = field(default_factory=dict, hash=False)

    def to_dict(self) -> dict[str, Any]:
        """The row as a JSON-serialisable dict."""
        return asdict(self)


@dataclass(frozen=True)
class Finding:
    """A check that exists only with several ranks found something (a row of ``findings``).

    Attributes:
        id: 1, 2, … in the order found.
        kind: One of :data:`FINDING_KINDS`.
        step: The step it concerns (``None``: not tied to a step).
        rank: The rank it names (``None``: it names a parameter of several ranks).
        subject: The parameter's qualified name, or ``rank N``.
        line: One line for the user, naming the parameter or the rank (with its host and pid).
        detail: The evidence (checksums by rank, heartbeat ages …).
        wall: When rank 0 found it (Unix seconds).
    """

    id: int
    kind: str
    step: int | None
    rank: int | None
    subject: str
    line: str
    detail: dict[str, Any] = field(default_factory=dict, hash=False)
    wall: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The finding as a JSON-serialisable dict."""
        return asdict(self)


@dataclass(frozen=True)
class RunUpdate:
    """Everything new about a run since a reader's cursor, read in one snapshot.

    Attributes:
        run: The run row at the time of the snapshot.
        metrics: Steps with ``step > after_step``, in step order.
        samples: Samples with ``step > after_step``, in step order.
        internals_steps: Steps with captured internals and ``step > after_step``.
        spikes: Loss spikes whose episode lasted past ``after_step`` (new ones, and ones whose
            peak or end moved), in step order (:meth:`RunStore.spikes`).
        restarted: True when the run was resumed from an earlier checkpoint than the reader's
            cursor (``run.last_step < after_step``): the reader should drop what it has after
            ``run.checkpoint_step`` and read again from there.
    """

    run: RunInfo
    metrics: list[MetricRow] = field(default_factory=list)
    samples: list[SampleRow] = field(default_factory=list)
    internals_steps: list[int] = field(default_factory=list)
    restarted: bool = False
    spikes: list[Spike] = field(default_factory=list)

    @property
    def last_step(self) -> int:
        """The cursor to pass as ``after_step`` next time."""
        return self.metrics[-1].step if self.metrics else self.run.last_step


#: The columns of ``runs`` as :func:`run_from_row` reads them: (kind, may be NULL).
_RUN_COLUMNS: dict[str, tuple[str, bool]] = {
    "id": ("int", False), "name": ("text", False), "kind": ("text", False),
    "status": ("status", False), "pid": ("int", True), "host": ("text", True),
    "started": ("real", False), "ended": ("real", True), "heartbeat": ("real", True),
    "total_steps": ("int", True), "last_step": ("int", False), "last_loss": ("real", True),
    "paused": ("int", False), "reason": ("text", True), "fail_step": ("int", True),
    "fail_module": ("text", True), "checkpoint_step": ("int", True),
    "checkpoint_path": ("text", True), "attempt": ("int", False),
}
_EMPTY = {"int": 0, "real": 0.0, "text": "", "status": "failed"}
_KIND_WORDS = {"int": "an integer", "real": "a number", "text": "text",
               "status": "one of " + "/".join(STATUSES)}


def read_cell(kind: str, value: Any) -> tuple[bool, Any]:
    """``(readable, value)`` of one stored value of a column of this kind."""
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return False, None
    if kind == "real":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, None
    if kind == "status":
        return value in STATUSES, value
    return isinstance(value, str), value


def shown_value(value: Any) -> str:
    """``repr(value)`` cut to 40 characters (an unreadable stored value, in a message)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _writer_from_json(text: Any) -> dict[str, Any] | None:
    """:attr:`RunInfo.writer` from ``runs.writer`` (``None`` for anything else than what a
    writer records: a reader never trusts a start time it cannot read)."""
    if not isinstance(text, str) or not text:
        return None
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(d, dict) or not isinstance(d.get("pid"), int) \
            or not isinstance(d.get("host"), str):
        return None
    start = d.get("start")
    return {"pid": d["pid"], "host": d["host"],
            "start": start if isinstance(start, int) and not isinstance(start, bool) else None}


def run_from_row(row: sqlite3.Row) -> RunInfo:
    """A :class:`RunInfo` from a ``runs`` row; what cannot be read is left empty and named in
    :attr:`RunInfo.damaged` (a row changed outside mdb never raises here)."""
    problems: list[str] = []
    fields: dict[str, Any] = {}
    for name, (kind, nullable) in _RUN_COLUMNS.items():
        value = row[name]
        if value is None and nullable:
            fields[name] = None
            continue
        ok, got = read_cell(kind, value) if value is not None else (False, None)
        if not ok:
            problems.append(f"runs.{name} holds {shown_value(value)}, not {_KIND_WORDS[kind]}")
            got = None if nullable else _EMPTY[kind]
        fields[name] = got
    config: Any = {}
    text = row["config"]
    try:
        config = json.loads(text) if isinstance(text, str) and text else {}
    except (json.JSONDecodeError, RecursionError):
        config = None
    if not isinstance(config, dict):
        problems.append(f"runs.config holds {shown_value(text)}, not a JSON object")
        config = {}
    damaged = None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        damaged = (f"run {fields['name'] or fields['id']!r} cannot be read: {problems[0]}{more}; "
                   "the database was changed outside mdb")
    return RunInfo(
        config=config,
        paused=bool(fields.pop("paused")),
        nonfinite=_nonfinite_from_json(row["nonfinite"]),
        world_size=row["world_size"] if "world_size" in row.keys() else None,
        damaged=damaged,
        writer=_writer_from_json(row["writer"]) if "writer" in row.keys() else None,
        **fields,
    )
