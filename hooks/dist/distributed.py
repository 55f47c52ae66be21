"""One run per ``torchrun`` job: what travels between the ranks, and the checks that need them.

``hooks.run(...)`` in a process of a job whose default process group is initialised
(``torch.distributed.init_process_group`` with two ranks or more; ``torchrun`` sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``) records the whole job as one run (:class:`hooks.recorder.run.Run`
uses a :class:`RankLink`); without one, nothing here is used. How it works:

* **Rank 0 alone writes the run store.** It creates the run and publishes its name in the job's
  own key-value store (the ``Store`` the process group was rendezvoused with, reached through
  a connection of its own, ``Store.clone``); no file is shared, so it works across nodes.
* **Per-rank values travel to rank 0 through the job's process group**: mdb makes a Gloo
  process group of its own over that store (``ProcessGroupGloo``, as ``init_process_group``
  does, so ``GLOO_SOCKET_IFNAME`` applies; on CPU tensors, whatever the job's backend), used
  only by one background thread per rank. Every ``every`` steps (a step whose number is a
  multiple of ``every``) each rank hands its rows since the last gather — every scalar it
  logged, its step time, compute time and expert load, its captures, its non-finite finding,
  its parameter and gradient checksums — to that thread, which sends them to rank 0 with two
  collectives (an ``allgather`` of sizes, a ``gather`` of the bytes: a JSON header and the
  captures' safetensors, never pickle); and once more when the run finishes or fails.
  The training thread only appends to a list: it never waits for the others, and rank 0's
  writing happens on its writer thread.
* **No collective can hang on a rank that is not there.** A rank announces each gather in the
  store (``Store.add``); the last one to announce marks it ``go`` (``Store.compare_set``), and
  only then do the ranks post it — rank 0's thread joins exactly the gathers marked ``go``
  and, when it finishes, marks the next one ``closed`` instead, atomically, so a rank waiting
  for it gives up rather than post a collective that nobody will answer.
* **Liveness:** each rank's thread writes a heartbeat to the store every second (its step, pid,
  host, and how it ended); rank 0 reads them. A rank whose process no longer exists (same
  host), whose heartbeat stopped changing for :attr:`RankLink.STALE_AFTER` seconds (hung,
  stopped, or dead on another host), or that ended with an error is named, with its host and
  pid, in a finding and in the run's final status.
* **Checks that exist only with several ranks** (with ``run.watch(model)`` on a
  ``DistributedDataParallel`` model): on the steps that are gathered, a global
  ``torch.optim`` step pre-hook takes one checksum per gradient (after backward and DDP's
  all-reduce) and a post-hook one per parameter (after the update); rank 0 compares them
  across ranks. DDP keeps both bitwise identical on every rank, so any difference is a
  finding: a parameter that diverged (a desync), a gradient that was not all-reduced.
  A checksum is a sum of the tensor's bit patterns as integers, weighted by pseudo-random
  row and column weights (:func:`tensor_checksum`): it changes with any single element, and
  with a reordering of the same values.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from hooks.dist.rank_job import Job, band, describe_rank, job, process_gone
from hooks.dist.rank_payload import decode_payload, encode_payload
from hooks.sharded.checksums import (
    checksums,
    compare_checksums,
    grads_by_key,
    hex64,
    shared_names,
    tensor_checksum,
)

__all__ = [
    "Job",
    "RankLink",
    "checksums",
    "compare_checksums",
    "decode_payload",
    "encode_payload",
    "band",
    "job",
    "process_gone",
    "tensor_checksum",
]

#: At most this many parameters of one check are named in findings of their own; the rest are
#: counted in one more.
MAX_NAMED = 20


# ---------------------------------------------------------------------------------------------
# The link of one rank
# ---------------------------------------------------------------------------------------------


class RankLink:
    """One rank's side of a distributed run: what it gathers, announces and checks.

    :class:`hooks.recorder.run.Run` makes one per rank and calls the training-thread methods
    (:meth:`row`, :meth:`gather_point`, :meth:`set_nonfinite`, :meth:`watch`, :meth:`finish`);
    a daemon thread does the store and process-group work. On rank 0, ``emit(kind, *args)`` is
    called from that thread with what to write (``"world"``, ``"ranks"``, ``"rank_steps"``,
    ``"findings"``, ``"checks"``, ``"nonfinite"``).

    Args:
        job: This process's :class:`Job`.
        key: Names this run among the job's runs (the store keys are ``mdb/<key>/…``).
        every: Gather every ``every`` steps.
        emit: Rank 0: the writer's intake.
        serialise: ``(trace, step) -> (dict | None, bytes | None)``: a capture as stored.
        say: Prints one line for the user (stderr).
    """

    #: Seconds rank 0 waits for every rank to call ``hooks.run`` (then it records alone).
    JOIN_TIMEOUT = 300.0
    #: Seconds without a changing heartbeat after which a rank counts as stopped reporting.
    STALE_AFTER = 15.0
    #: Seconds rank 0 waits, once it finishes, for ranks that are alive but have not ended.
    FINAL_GRACE = 10.0
    #: Seconds another rank waits at most, once it finishes, to hand over its last steps.
    FINAL_TIMEOUT = 300.0
    #: Seconds a gather may take once every rank announced it (the timeout of mdb's process
    #: group). A rank stopped in the middle of one (SIGSTOP, a hang) would otherwise hold rank
    #: 0's link thread, which also watches the heartbeats, so the rank could not be named;
    #: ``None``: :attr:`STALE_AFTER` + 15 s. Past it, gathering stops and the rank whose
    #: heartbeat went stale is named as the cause.
    GATHER_TIMEOUT: float | None = None
    #: Seconds between two heartbeats.
    BEAT_INTERVAL = 1.0
    #: Seconds between two looks at the store while a gather is awaited.
    POLL_INTERVAL = 0.1
    #: Seconds rank 0 keeps looking, after a collective failed, for a rank that has not ended
    #: to turn out gone. A peer's death reaches rank 0 first as a failed collective (gloo's
    #: "Connection reset by peer") a moment before its process is seen gone (a zombie, once
    #: the kernel has finished it): the rank that died is named, not that error.
    PEER_GONE_WAIT = 5.0

    def __init__(self, job: Job, key: str, *, every: int,
                 emit: Callable[..., None] | None = None,
                 serialise: Callable[[Any, int], tuple[Any, Any]] | None = None,
                 say: Callable[[str], None] = lambda line: None) -> None:
        import torch.distributed as dist

        self.job = job
        self.rank, self.world = job.rank, job.world_size
        self.every = max(1, int(every))
        self.emit = emit
        self.serialise = serialise
        self.say = say
        base = job.store
        with contextlib.suppress(Exception):  # a connection of our own where the store can
            base = base.clone()
        self.store = dist.PrefixStore(f"mdb/{key}/", base)
        self.run_info: dict[str, Any] | None = None  # the run rank 0 created (other ranks)
        self.state = "joining"  # joining, running, solo, broken, closed
        #: The link thread's work: gathers done, and seconds spent encoding and in the
        #: collectives (``benchmarks/bench_distributed.py`` reports them).
        self.stats = {"gathers": 0, "encode_s": 0.0, "collective_s": 0.0, "cpu_s": 0.0,
                      "thread_cpu_s": 0.0}
        self.last_step = 0
        # training thread
        self._rows: list[dict[str, Any]] = []
        self._traces: list[tuple[int, Any]] = []
        self._requests: collections.deque = collections.deque()
        self._prev_perf: float | None = None
        self._grad_perf: float | None = None
        self._armed: int | None = None  # the step the optimizer hooks check, if any
        self._results: dict[int, dict[str, Any]] = {}
        self._nonfinite: tuple[dict[str, Any], tuple[int, int]] | None = None
        self._nf_sent = None
        self._model: Any = None
        self._names: dict[int, str] = {}
        self._ddp = False
        self._checked = False  # DDP or sharded: the cross-rank checks run
        self._param_tags: set[int] = set()  # steps whose parameters were checked
        self._watch_every: int | None = None
        self._ignored: set[str] = set()
        self._handles: list[Any] = []
        self._ended: dict[str, Any] | None = None
        self._loop_found: collections.deque = collections.deque()  # for the next gather
        # the link thread
        self._wake = threading.Event()
        self._done = threading.Event()
        self._pg: Any = None
        self._seq = 1
        self._beats = 0
        self._next_beat = 0.0
        self._finish_mono: float | None = None
        self._root_n: Any = None
        self._root_seen = time.monotonic()
        # rank 0
        self._peers: dict[int, dict[str, Any]] = {}
        self._pending_checks: dict[int, dict[int, dict[str, Any]]] = {}
        self._reported: set[tuple[str, str]] = set()
        self._best_nf: tuple[tuple[int, int, int, int], dict[str, Any]] | None = None
        self._delivered: set[int] = set()
        self._loop_said: set[tuple[str, str]] = set()  # the loop doctor's, of every rank
        self._loop_lock = threading.Lock()
        self._break: dict[str, Any] | None = None  # gathering broke: when, why, said yet
        self._thread = threading.Thread(target=self._main, name=f"mdb-rank-link-{self.rank}",
                                        daemon=True)

    # -- set-up (training thread) ----------------------------------------------------------------
    def publish_run(self, info: Mapping[str, Any]) -> None:
        """Rank 0: say which run the job records into (``{"name", "id", "db"}``, or
        ``{"error": line}`` when it could not be created)."""
        self.store.set("run", json.dumps(dict(info), default=str))

    def start(self) -> None:
        """Start the link thread (it joins the other ranks in the background)."""
        self._thread.start()

    def watch(self, model: Any, every: int | None = None) -> None:
        """Measure the rank's compute time and, for a ``DistributedDataParallel`` model or a
        sharded one (DTensor parameters: FSDP2, HSDP, tensor parallel), check its parameters
        and gradients across ranks (see the module docstring) on the gathered steps, on every
        ``every``-th step (the steps ``run.watch`` captures) and at the job's last step. A
        DTensor's local piece is compared among the ranks that hold a replica of it
        (:func:`hooks.sharded.checksums.replica_key`)."""
        import torch

        from hooks.sharded.stats import is_dtensor

        self.unwatch()
        inner = model
        ddp_cls = getattr(getattr(torch.nn, "parallel", None), "DistributedDataParallel", None)
        self._ddp = ddp_cls is not None and isinstance(model, ddp_cls)
        if self._ddp:
            inner = model.module
            self._ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
        self._model = inner
        self._watch_every = int(every) if every else None
        self._names = {id(p): name for name, p in inner.named_parameters()}
        self._checked = self._ddp or any(is_dtensor(p) for p in inner.parameters())
        first = next((p for p in inner.parameters() if p.requires_grad), None)
        if first is not None and hasattr(first, "register_post_accumulate_grad_hook"):
            self._handles.append(first.register_post_accumulate_grad_hook(self._on_grad))
        if self._checked:
            from torch.optim.optimizer import (
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )

            self._handles.append(register_optimizer_step_pre_hook(self._pre_step))
            self._handles.append(register_optimizer_step_post_hook(self._post_step))

    def unwatch(self) -> None:
        """Remove every hook :meth:`watch` installed."""
        for h in self._handles:
            with contextlib.suppress(Exception):
                h.remove()
        self._handles = []
        self._model = None

    def _on_grad(self, _param: Any) -> None:
        self._grad_perf = time.perf_counter()

    def _optimizer_params(self, optimizer: Any) -> list[tuple[str, Any]]:
        out = []
        for group in getattr(optimizer, "param_groups", ()):
            for p in group.get("params", ()):
                name = self._names.get(id(p))
                if name is not None:
                    out.append((name, p))
        return out

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        tag = self._armed
        if tag is None:
            return
        with contextlib.suppress(Exception):  # a check must never break the user's step
            params = self._optimizer_params(optimizer)
            res = self._results.setdefault(tag, {})
            res.setdefault("grads", {}).update(checksums(grads_by_key(params)))

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        tag = self._armed
        if tag is None:
            return
        with contextlib.suppress(Exception):
            params = self._optimizer_params(optimizer)
            res = self._results.setdefault(tag, {})
            res.setdefault("params", {}).update(checksums(params))
            res["where"] = "optimizer"
            self._param_tags.add(tag)

    # -- per step (training thread) --------------------------------------------------------------
    def row(self, step: int, wall: float, values: Mapping[str, float], *, new: bool,
            expert_load: Any = None, trace: Any = None) -> None:
        """Record a ``log()`` of this rank (``new``: the first of this step)."""
        now = time.perf_counter()
        row: dict[str, Any] = {"step": step, "wall": wall, "values": dict(values)}
        if new:
            prev = self._prev_perf
            if prev is not None:
                row["step_time"] = now - prev
                g = self._grad_perf
                if g is not None and g > prev:
                    row["compute_time"] = g - prev
            self._prev_perf = now
            self._grad_perf = None
            self.last_step = step
        if expert_load is not None:
            row["expert_load"] = expert_load
        self._rows.append(row)
        if trace is not None and self.rank != 0:
            self._traces.append((step, trace))
        if new:
            self._armed = step + 1 if self._checks_at(step + 1) else None
            if step % self.every == 0:
                self.gather_point(step)

    def loop_findings(self, found: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """This rank's loop-doctor findings, tagged with the rank. Rank 0: those no rank said
        before (kind and subject), to be written; other ranks: kept for the next gather (so
        ``[]``), where rank 0 writes those no rank said before."""
        found = [{**f, "rank": self.rank} for f in found]
        if self.rank != 0:
            self._loop_found.extend(found)
            return []
        return self._fresh(found)

    def _fresh(self, found: list[dict[str, Any]]) -> list[dict[str, Any]]:
        with self._loop_lock:
            out = [f for f in found if (f["kind"], f["subject"]) not in self._loop_said]
            self._loop_said.update((f["kind"], f["subject"]) for f in out)
        return out

    def arm_first(self, next_step: int) -> None:
        """Arm the optimizer checks for ``next_step`` when it is a gathered or a captured one
        (before the first ``log()``)."""
        if self._checks_at(next_step):
            self._armed = next_step

    def _checks_at(self, step: int) -> bool:
        """Whether the cross-rank checks run at ``step``: a gathered or a captured step."""
        w = self._watch_every
        return self._checked and (step % self.every == 0 or (w is not None and step % w == 0))

    def _final_checks(self, step: int) -> None:
        """The parameters as they are at the job's last step (``step``), unless that step's
        optimizer step was checked already: compared like the others, at the end."""
        if self._model is None or not self._checked or int(step) in self._param_tags:
            return
        with contextlib.suppress(Exception):
            res = self._results.setdefault(int(step), {})
            res["params"] = checksums(self._model.named_parameters())
            res["where"] = "end"

    def set_nonfinite(self, nf: Mapping[str, Any], order: tuple[int, int]) -> None:
        """This rank's first non-finite value (``order``: (step, index of the metric in its
        ``log()`` call) ranks the ranks' findings)."""
        self._nonfinite = (dict(nf), order)
        if self.rank == 0:
            self._requests.append(("nonfinite", dict(nf), order))
            self._wake.set()

    def _results_all(self) -> dict[int, dict[str, Any]]:
        out, self._results = self._results, {}
        return out

    def _checks_upto(self, step: int) -> dict[int, dict[str, Any]]:
        out = {}
        for tag in sorted(t for t in self._results if t <= step):
            out[tag] = self._results.pop(tag)
        if step % self.every == 0 and self._model is not None and self._checked and (
            step not in out or "params" not in out[step]
        ):  # no torch.optim step between the two log() calls: the parameters as they are now
            with contextlib.suppress(Exception):
                res = out.setdefault(step, {})
                res["params"] = checksums(self._model.named_parameters())
                res["where"] = "log"
                self._param_tags.add(step)
        return out

    def gather_point(self, step: int, kind: str = "step") -> None:
        """Hand the rows since the last gather to the link thread (never blocks)."""
        rows, self._rows = self._rows, []
        traces, self._traces = self._traces, []
        checks = self._checks_upto(step) if kind == "step" else self._results_all()
        nf = None
        if self._nonfinite is not None and self._nonfinite is not self._nf_sent:
            nf = self._nonfinite
            self._nf_sent = nf
        self._requests.append((kind, rows, traces, checks, nf))
        self._wake.set()

    # -- finishing (training thread) -------------------------------------------------------------
    def finish(self, status: str, reason: str | None, step: int) -> dict[int, dict[str, Any]]:
        """Hand over the last rows and say how this rank ended; on rank 0 wait for the others'
        ends (a few seconds at most, see :attr:`FINAL_GRACE` and :attr:`STALE_AFTER`),
        elsewhere until rank 0 took them (at most :attr:`FINAL_TIMEOUT`).

        Returns:
            Rank 0: per rank, ``{"state", "reason", "last_step", "host", "pid"}`` as far as
            known; other ranks: ``{}``.
        """
        self._final_checks(step)
        self.unwatch()
        self._armed = None
        self._ended = {"status": status, "reason": reason, "step": int(step)}
        self._finish_mono = time.monotonic()
        self.gather_point(step, kind="final")
        if not self._thread.is_alive() and not self._done.is_set():
            self._done.set()
        if self.rank == 0:
            limit = max(self.FINAL_GRACE, self.STALE_AFTER) + 5.0
        else:
            limit = self.FINAL_TIMEOUT + 5.0
        if not self._done.wait(limit) and self.rank != 0:
            self.say(f"rank {self.rank}: its last steps could not be handed to rank 0 within "
                     f"{limit:.0f} s")
        return {r: dict(p) for r, p in self._peers.items()} if self.rank == 0 else {}

    # -- the link thread -------------------------------------------------------------------------
    def _main(self) -> None:
        c0 = time.thread_time()
        try:
            self._beat()
            if self._join():
                self._make_group()
            if self.rank == 0:
                self._root_loop()
            else:
                self._leaf_loop()
        except Exception as exc:  # a bug or a store that went away: say it, never hang
            self._broken(f"{type(exc).__name__}: {exc}")
            if self.rank == 0:
                with contextlib.suppress(Exception):
                    self._settle_break(final=True)
                    self._root_drain_local()
        finally:
            self.stats["thread_cpu_s"] = time.thread_time() - c0
            # the link's own gloo group, released by the thread that used it, while the
            # interpreter is whole: left to the interpreter's exit (destroy_process_group
            # does not know it), gloo's threads can abort the process (SIGABRT, "terminate
            # called without an active exception"; pytorch PR 179291 describes the same)
            pg, self._pg = self._pg, None
            del pg
            self._done.set()

    def _broken(self, why: str) -> None:
        if self.state == "broken":
            return
        self.state = "broken"
        error = why.splitlines()[0][:300]
        if self.rank != 0:
            self.say(f"rank {self.rank}: gathering from the ranks stopped: {error}; its steps "
                     "after that are not recorded")
            return
        # a rank that died explains it (and is named first); its death may show only a moment
        # after the collective failed: the finding waits for it (:attr:`PEER_GONE_WAIT`)
        self._break = {"mono": time.monotonic(), "step": self.last_step, "seq": self._seq,
                       "error": error}
        self._settle_break(final=False)

    def _settle_break(self, final: bool) -> None:
        """Rank 0, after gathering broke: once a rank is seen gone, or nothing more can show
        one (``final``, or :meth:`_unsettled` says so), say why in a ``gather_failed``
        finding: the first rank that died, stopped reporting or failed, else the error."""
        brk = self._break
        if brk is None or brk.get("said"):
            return
        with contextlib.suppress(Exception):
            self._monitor(rows=False)
        gone = [p for r, p in sorted(self._peers.items())
                if r != 0 and p["state"] in ("dead", "silent", "failed")]
        if not gone and not final and self._unsettled(brk["mono"]):
            return
        brk["said"] = True
        cause = f"{describe_rank(gone[0])} {gone[0]['state']}" if gone else brk["error"]
        line = f"gathering from the ranks stopped after step {brk['step']}: {cause}"
        self.say(f"{line}; rank 0's own steps are still recorded")
        self._emit("findings", [{"kind": "gather_failed", "step": brk["step"],
                                 "rank": None, "subject": "gather", "line": line,
                                 "detail": {"gather": brk["seq"], "error": brk["error"]}}])

    def _unsettled(self, since: float) -> bool:
        """Rank 0, after a failure at ``since`` (a collective that raised): whether a rank
        that has not ended may still be seen gone — its process may die or its heartbeat go
        stale within :attr:`PEER_GONE_WAIT` of ``since``, or its heartbeat stopped and has not
        been missing :attr:`STALE_AFTER` seconds yet."""
        now = time.monotonic()
        for r, p in self._peers.items():
            if r == 0 or r in self._delivered or p.get("ended") or \
                    p["state"] in ("absent", "dead", "silent", "failed"):
                continue
            fresh = now - p["seen"] <= 2.5 * self.BEAT_INTERVAL
            if now - since < self.PEER_GONE_WAIT or (not fresh and
                                                     now - p["seen"] <= self.STALE_AFTER):
                return True
        return False

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"beat/{self.rank}", json.dumps({
            "n": self._beats, "step": self.last_step, "t": time.time(), "pid": self.job.pid,
            "host": self.job.host, "local_rank": self.job.local_rank, "ended": self._ended,
        }))
        self._next_beat = time.monotonic() + self.BEAT_INTERVAL

    def _join(self) -> bool:
        """Wait until every rank has joined (or, on rank 0, :attr:`JOIN_TIMEOUT`): ``True``
        when all did."""
        store = self.store
        n = store.add("joined", 1)
        if n >= self.world:
            store.compare_set("state", "", "go")
        deadline = time.monotonic() + self.JOIN_TIMEOUT
        while True:
            if self.rank != 0 and self.run_info is None and store.check(["run"]):
                self.run_info = json.loads(store.get("run"))
            if store.check(["state"]):
                state = store.get("state")
                if state == b"go":
                    if self.rank != 0 and self.run_info is None:
                        store.wait(["run"])  # rank 0 publishes it before it joins
                        self.run_info = json.loads(store.get("run"))
                    if self.rank == 0:
                        self._peers_from_beats(initial=True)
                    return True
                self.state = "solo"
                if self.rank != 0:
                    self.say(f"rank {self.rank}: rank 0 stopped waiting for the ranks to call "
                             "hooks.run before this one did: its steps are not recorded")
                return False
            if self.rank != 0 and self._ended is not None:
                return False  # finished before rank 0 took the run over: nothing to wait for
            if self.rank == 0 and (time.monotonic() >= deadline or self._ended is not None):
                if store.compare_set("state", "", "solo") == b"go":
                    continue
                self.state = "solo"
                self._peers_from_beats(initial=True)
                absent = [r for r in range(1, self.world) if self._peers[r]["state"] == "absent"]
                names = ", ".join(str(r) for r in absent)
                self.say(f"rank(s) {names} did not call hooks.run within "
                         f"{self.JOIN_TIMEOUT:.0f} s: the run records rank 0 alone")
                return False
            if time.monotonic() >= self._next_beat:
                self._beat()
            time.sleep(0.05)

    @property
    def gather_timeout(self) -> float:
        """Seconds a gather may take (:attr:`GATHER_TIMEOUT`)."""
        t = self.GATHER_TIMEOUT
        return float(t) if t is not None else self.STALE_AFTER + 15.0

    def _make_group(self) -> None:
        import torch.distributed as dist

        self._pg = dist.ProcessGroupGloo(dist.PrefixStore("pg/", self.store), self.rank,
                                         self.world, timedelta(seconds=self.gather_timeout))
        self.state = "running"

    # -- other ranks -----------------------------------------------------------------------------
    def _leaf_loop(self) -> None:
        store = self.store
        encoded: bytes | None = None
        announced = False
        while True:
            if time.monotonic() >= self._next_beat:
                self._beat()
            if not self._requests:
                if self._ended is not None and self._done.is_set():
                    return
                self._wake.wait(max(0.0, self._next_beat - time.monotonic()))
                self._wake.clear()
                continue
            kind = self._requests[0][0]
            if self._pg is None or self.state == "broken":
                self._requests.popleft()  # nothing can reach rank 0
                if kind == "final":
                    return
                continue
            if encoded is None:
                t0, c0 = time.perf_counter(), time.thread_time()
                encoded = self._encode(self._requests[0])
                self.stats["encode_s"] += time.perf_counter() - t0
                self.stats["cpu_s"] += time.thread_time() - c0
            if not announced:
                if store.add(f"req/{self._seq}", 1) >= self.world - 1:
                    store.compare_set(f"ready/{self._seq}", "", "go")
                announced = True
            ready = store.get(f"ready/{self._seq}") if store.check([f"ready/{self._seq}"]) \
                else None
            if ready == b"go":
                try:
                    self._send(encoded)
                except Exception as exc:
                    self._broken(f"{type(exc).__name__}: {exc}")
                    return
                self._requests.popleft()
                self._seq += 1
                encoded, announced = None, False
                if kind == "final":
                    return
                continue
            if ready == b"closed":
                self.state = "closed"
                return
            if self._ended is not None and self._give_up():
                return
            time.sleep(self.POLL_INTERVAL)

    def _give_up(self) -> bool:
        """A finishing rank stops waiting: rank 0 is gone or the time is up."""
        if time.monotonic() - (self._finish_mono or time.monotonic()) > self.FINAL_TIMEOUT:
            return True
        try:
            beat = json.loads(self.store.get("beat/0"))
        except Exception:
            return True
        n = beat.get("n")
        now = time.monotonic()
        if n != self._root_n:
            self._root_n, self._root_seen = n, now
        if beat.get("host") == self.job.host and process_gone(beat.get("pid")):
            return True
        return now - self._root_seen > self.STALE_AFTER

    def _encode(self, request: tuple) -> bytes:
        kind, rows, traces, checks, nf = request
        blobs: list[bytes] = []
        caps = []
        for step, trace in traces:
            data, blob = (None, None)
            if self.serialise is not None:
                data, blob = self.serialise(trace, step)
            if data is None:
                continue
            idx = None
            if blob is not None:
                idx = len(blobs)
                blobs.append(blob)
            caps.append({"step": step, "data": data, "blob": idx})
        header = {"v": 1, "rank": self.rank, "kind": kind, "rows": rows, "captures": caps,
                  "checks": {str(k): v for k, v in checks.items()},
                  "nonfinite": list(nf) if nf is not None else None,
                  "ended": self._ended if kind == "final" else None,
                  "findings": [self._loop_found.popleft() for _ in range(len(self._loop_found))]}
        return encode_payload(header, blobs)

    def _sizes(self, size: int) -> list[int]:
        import torch

        mine = torch.tensor([size], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._pg.allgather(out, mine).wait()
        return [int(t.item()) for t in out]

    def _send(self, data: bytes) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self._send_sized(data)
        finally:
            self.stats["gathers"] += 1
            self.stats["collective_s"] += time.perf_counter() - t0
            self.stats["cpu_s"] += time.thread_time() - c0

    def _send_sized(self, data: bytes) -> None:
        import torch

        sizes = self._sizes(len(data))
        m = max(sizes)
        if m == 0:
            return
        buf = torch.zeros(m, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._pg.gather([], buf, 0).wait()

    # -- rank 0 ----------------------------------------------------------------------------------
    def _root_loop(self) -> None:
        store = self.store
        self._emit("world", self.world)
        self._emit("ranks", [self._rank_row(r) for r in sorted(self._peers)])
        for r, p in sorted(self._peers.items()):
            if p["state"] == "absent":
                self._finding("rank_absent", None, r, f"rank {r}",
                              f"rank {r} did not join the run (it did not call hooks.run within "
                              f"{self.JOIN_TIMEOUT:.0f} s of rank 0): its steps are not recorded",
                              {})
        next_look = next_check = 0.0
        while True:
            now = time.monotonic()
            if now >= self._next_beat:
                self._beat()
                self._monitor(rows=True)
            elif (self._finish_mono is not None or (self._break is not None
                                                    and not self._break.get("said"))) and \
                    now >= next_check:
                next_check = now + 0.25
                self._monitor(rows=False)  # finishing, or broken: notice a dead rank at once
                self._settle_break(final=False)
            self._root_drain_local()
            if self._pg is not None and self.state == "running" and now >= next_look:
                next_look = now + self.POLL_INTERVAL
                try:
                    if store.add(f"req/{self._seq}", 0) >= self.world - 1 and \
                            store.check([f"ready/{self._seq}"]) and \
                            store.get(f"ready/{self._seq}") == b"go":
                        self._receive()
                        continue
                except Exception as exc:
                    self._broken(f"{type(exc).__name__}: {exc}")
            if self._finish_mono is not None and not self._requests and self._can_close():
                self._close()
                return
            self._wake.wait(self.POLL_INTERVAL)
            self._wake.clear()

    def _root_drain_local(self) -> None:
        while self._requests:
            req = self._requests.popleft()
            if req[0] == "nonfinite":
                self._consider_nonfinite(0, req[1], req[2])
                continue
            kind, rows, _traces, checks, nf = req
            self._emit("rank_steps", 0, rows, [])
            if nf is not None:
                self._consider_nonfinite(0, *nf)
            self._add_checks(0, checks)
            if kind == "final":
                ended = self._ended or {}
                self._peers.setdefault(0, self._peer(0, {}))
                self._peers[0].update(state=ended.get("status", "finished"),
                                      reason=ended.get("reason"), last_step=self.last_step)

    def _receive(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self._receive_sized()
        finally:
            self.stats["gathers"] += 1
            self.stats["collective_s"] += time.perf_counter() - t0
            self.stats["cpu_s"] += time.thread_time() - c0

    def _receive_sized(self) -> None:
        import torch

        sizes = self._sizes(0)
        m = max(sizes)
        self._seq += 1
        if m == 0:
            return
        outs = [torch.zeros(m, dtype=torch.uint8) for _ in range(self.world)]
        self._pg.gather(outs, torch.zeros(m, dtype=torch.uint8), 0).wait()
        for r in range(1, self.world):
            if sizes[r]:
                try:
                    head, blobs = decode_payload(outs[r][: sizes[r]].numpy().tobytes())
                except ValueError as exc:
                    self.say(f"rank {r}: an unreadable payload was dropped ({exc})")
                    continue
                self._take(r, head, blobs)

    def _take(self, rank: int, head: dict[str, Any], blobs: list[bytes]) -> None:
        caps = []
        for c in head.get("captures") or ():
            idx = c.get("blob")
            caps.append((int(c["step"]), c["data"], blobs[idx] if idx is not None else None))
        rows = head.get("rows") or []
        self._emit("rank_steps", rank, rows, caps)
        p = self._peers.setdefault(rank, self._peer(rank, {}))
        if rows:
            p["last_step"] = max(p.get("last_step", 0), max(int(r["step"]) for r in rows))
        nf = head.get("nonfinite")
        if nf:
            self._consider_nonfinite(rank, nf[0], tuple(nf[1]))
        self._add_checks(rank, {int(k): v for k, v in (head.get("checks") or {}).items()})
        found = self._fresh([{**f, "rank": rank} for f in head.get("findings") or ()
                             if isinstance(f, dict) and "kind" in f and "subject" in f])
        if found:  # the loop doctor's on that rank
            self._emit("findings", found)
        if head.get("kind") == "final":
            self._delivered.add(rank)
            ended = head.get("ended") or {}
            self._set_state(rank, ended.get("status") or "finished", ended.get("reason"))

    def _consider_nonfinite(self, rank: int, nf: Mapping[str, Any], order: Sequence[int]) -> None:
        # at the same step and metric, a rank that located it (e.g. its shard holds the NaN)
        # comes before one that did not
        key = (int(order[0]), int(order[1]), 0 if nf.get("module") is not None else 1, rank)
        best = self._best_nf
        if best is None or key <= best[0]:
            record = {**{k: nf.get(k) for k in ("step", "metric", "module", "direction")},
                      **{k: nf[k] for k in ("detail", "note") if nf.get(k)}, "rank": rank}
            if best is None or record != best[1]:
                self._best_nf = (key, record)
                self._emit("nonfinite", dict(record))

    # -- checks (rank 0) -------------------------------------------------------------------------
    def _add_checks(self, rank: int, checks: Mapping[int, Mapping[str, Any]]) -> None:
        for tag, res in checks.items():
            self._pending_checks.setdefault(int(tag), {})[rank] = dict(res)
        self._compare_ready(final=False)

    def _compare_ready(self, final: bool) -> None:
        expected = {r for r, p in self._peers.items()
                    if p.get("state") not in ("absent", "dead", "silent")}
        for tag in sorted(self._pending_checks):
            got = self._pending_checks[tag]
            if not (set(got) >= expected or (final and len(got) >= 2)):
                continue
            del self._pending_checks[tag]
            for kind in ("params", "grads"):
                by_rank = {r: res[kind] for r, res in got.items() if kind in res}
                if len(by_rank) < 2:
                    continue
                diffs = compare_checksums(by_rank)
                # only the names two ranks hold are compared (FSDP2 shards never are)
                self._emit("checks", [{"step": tag, "kind": kind, "ranks": len(by_rank),
                                       "compared": len(shared_names(by_rank)),
                                       "differing": len(diffs)}])
                self._report(kind, tag, diffs)

    def _report(self, kind: str, step: int, diffs: list) -> None:
        fresh = [d for d in diffs if (kind, d[0]) not in self._reported]
        findings = []
        for name, values, odd in fresh[:MAX_NAMED]:
            self._reported.add((kind, name))
            ref = next(r for r in sorted(values) if r not in odd)
            who = ", ".join(f"rank {r}" for r in odd)
            sums = " vs ".join(f"{hex64(values[r])} (rank {r})" for r in [ref, *odd][:3])
            if kind == "params":
                line = (f"{name} differs across ranks after the optimizer step of step {step}: "
                        f"{who} {'differs' if len(odd) == 1 else 'differ'} from rank {ref} "
                        f"(checksums {sums}); "
                        + ("a DDP desync" if self._ddp else "a desync between replicas"))
                fk = "param_divergence"
            else:
                line = (f"{name}: its gradient differs across ranks after backward at step "
                        f"{step} ({who} vs rank {ref}; checksums {sums}): not all-reduced")
                fk = "grad_not_reduced"
            if name in self._ignored:
                line += " (DDP ignores this parameter: _ddp_params_and_buffers_to_ignore)"
            findings.append({"kind": fk, "step": step, "rank": odd[0] if len(odd) == 1 else None,
                             "subject": name, "line": line,
                             "detail": {"checksums": {str(r): v for r, v in values.items()},
                                        "odd_ranks": odd}})
        rest = fresh[MAX_NAMED:]
        if rest:
            for name, *_ in rest:
                self._reported.add((kind, name))
            what = "parameters" if kind == "params" else "gradients"
            findings.append({
                "kind": "param_divergence" if kind == "params" else "grad_not_reduced",
                "step": step, "rank": None, "subject": f"{len(rest)} more {what}",
                "line": f"and {len(rest)} more {what} differ across ranks at step {step}: "
                        + ", ".join(n for n, *_ in rest[:5]) + (" …" if len(rest) > 5 else ""),
                "detail": {"names": [n for n, *_ in rest]}})
        if findings:
            self._emit("findings", findings)

    # -- liveness (rank 0) -----------------------------------------------------------------------
    def _peer(self, rank: int, beat: Mapping[str, Any]) -> dict[str, Any]:
        return {"rank": rank, "host": beat.get("host"), "pid": beat.get("pid"),
                "local_rank": beat.get("local_rank"), "state": "running",
                "last_step": int(beat.get("step") or 0), "reason": None, "n": beat.get("n"),
                "seen": time.monotonic(), "heartbeat": time.time()}

    def _peers_from_beats(self, initial: bool = False) -> None:
        keys = [f"beat/{r}" for r in range(self.world)]
        present = [k for k in keys if self.store.check([k])]
        beats = dict(zip(present, self.store.multi_get(present), strict=True)) if present else {}
        for r, k in enumerate(keys):
            raw = beats.get(k)
            if raw is None:
                if r not in self._peers:
                    p = self._peer(r, {})
                    p["state"] = "absent"
                    self._peers[r] = p
                continue
            beat = json.loads(raw)
            p = self._peers.get(r)
            if p is None or p["state"] == "absent":
                self._peers[r] = p = self._peer(r, beat)
                continue
            if beat.get("n") != p.get("n"):
                p.update(n=beat.get("n"), seen=time.monotonic(), heartbeat=time.time())
            p["last_step"] = max(p.get("last_step", 0), int(beat.get("step") or 0))
            p["ended"] = beat.get("ended")

    def _monitor(self, rows: bool = True) -> None:
        try:
            self._peers_from_beats()
        except Exception:
            return  # the store is unreachable for a moment: look again at the next beat
        now = time.monotonic()
        for r, p in sorted(self._peers.items()):
            if r == 0 or p["state"] in ("absent", "dead") or r in self._delivered:
                continue
            ended = p.get("ended")
            if ended:
                if p["state"] != ended.get("status"):
                    self._set_state(r, ended.get("status") or "finished", ended.get("reason"))
                continue
            if p.get("host") == self.job.host and process_gone(p.get("pid")):
                self._set_state(r, "dead", f"its process no longer exists (last step "
                                           f"reported: {p['last_step']})")
            elif now - p["seen"] > self.STALE_AFTER:
                if p["state"] != "silent":
                    alive = p.get("host") == self.job.host
                    self._set_state(r, "silent", f"no heartbeat for {now - p['seen']:.0f} s, "
                                    f"last step reported {p['last_step']} ("
                                    + ("hung or stopped: its process still exists)" if alive
                                       else "hung, or dead on another host)"))
            elif p["state"] == "silent":
                self._set_state(r, "running", None)
        if rows:
            self._emit("ranks", [self._rank_row(r) for r in sorted(self._peers)])

    def _set_state(self, rank: int, state: str, reason: str | None) -> None:
        p = self._peers.setdefault(rank, self._peer(rank, {}))
        if p["state"] == state and p.get("reason") == reason:
            return
        p["state"], p["reason"] = state, reason
        self._emit("ranks", [self._rank_row(rank)])
        desc = describe_rank(p)
        if state == "dead":
            self._finding("rank_dead", p["last_step"], rank, f"rank {rank}",
                          f"{desc} died: its process no longer exists (the last step it "
                          f"reported: {p['last_step']})",
                          {"host": p.get("host"), "pid": p.get("pid")})
        elif state == "silent":
            self._finding("rank_silent", p["last_step"], rank, f"rank {rank}",
                          f"{desc} stopped reporting: {reason}",
                          {"host": p.get("host"), "pid": p.get("pid")})
        elif state == "failed":
            self._finding("rank_failed", p["last_step"], rank, f"rank {rank}",
                          f"{desc} failed after step {p['last_step']}: {reason or 'no reason'}",
                          {"host": p.get("host"), "pid": p.get("pid")})

    def _finding(self, kind: str, step: int | None, rank: int | None, subject: str, line: str,
                 detail: dict[str, Any]) -> None:
        if (kind, subject) in self._reported:
            return
        self._reported.add((kind, subject))
        self._emit("findings", [{"kind": kind, "step": step, "rank": rank, "subject": subject,
                                 "line": line, "detail": detail}])

    def _rank_row(self, rank: int) -> dict[str, Any]:
        p = self._peers.get(rank) or self._peer(rank, {})
        if rank == 0:
            p.update(host=self.job.host, pid=self.job.pid, local_rank=self.job.local_rank,
                     last_step=self.last_step, heartbeat=time.time())
        return {"rank": rank, "host": p.get("host"), "pid": p.get("pid"),
                "local_rank": p.get("local_rank"), "state": p["state"],
                "last_step": p.get("last_step", 0), "heartbeat": p.get("heartbeat"),
                "reason": p.get("reason")}

    def _can_close(self) -> bool:
        """Rank 0, finishing: every other rank delivered its end, is gone, or the wait is over
        (alive: :attr:`FINAL_GRACE`; silent: until :attr:`STALE_AFTER` proves it)."""
        now = time.monotonic()
        waited = now - self._finish_mono
        for r, p in self._peers.items():
            if r == 0 or r in self._delivered or p["state"] in ("absent", "dead", "silent"):
                continue
            if self._pg is None or self.state != "running":
                # nothing more can arrive; after a failed collective, wait to name the cause
                if self._break is not None and self._unsettled(self._break["mono"]):
                    return False
                continue
            if p.get("ended"):
                if waited < self.FINAL_GRACE:
                    return False  # it ended; its last gather is on its way
                continue
            fresh = now - p["seen"] <= 2.5 * self.BEAT_INTERVAL
            if fresh and waited < self.FINAL_GRACE:
                return False
            if not fresh and now - p["seen"] <= self.STALE_AFTER:
                return False  # its heartbeat stopped: wait until it counts as silent
        return True

    def _close(self) -> None:
        """Mark the next gather ``closed`` (joining any that is already ``go``), compare what
        is left, and give every other rank its final state."""
        store = self.store
        with contextlib.suppress(Exception):
            self._monitor(rows=False)  # the last look: a rank that died is named
        if self._pg is not None and self.state == "running":
            try:
                while store.compare_set(f"ready/{self._seq}", "", "closed") == b"go":
                    self._receive()
            except Exception as exc:
                self._broken(f"{type(exc).__name__}: {exc}")
        self._settle_break(final=True)
        self._root_drain_local()
        self._compare_ready(final=True)
        for r, p in sorted(self._peers.items()):
            if r != 0 and p["state"] == "running" and not p.get("ended"):
                p["reason"] = "had not ended when rank 0 finished"
        self._emit("ranks", [self._rank_row(r) for r in sorted(self._peers)])
        if self.state == "running":
            self.state = "closed"

    def _emit(self, kind: str, *args: Any) -> None:
        if self.emit is not None:
            self.emit(kind, *args)
