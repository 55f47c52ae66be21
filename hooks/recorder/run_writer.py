"""The writer thread of a recorded run (:class:`hooks.recorder.run.Run`): it alone opens the run
store and writes what the training loop queued — steps with their captures (serialised here, off
the loop's thread), findings, rank data, the final status — committing in batches, falling back
to what still fits when the disk is full, and saying in one line, never raising into the loop,
when recording has to stop (the database deleted, a bug).

:class:`RunWriterThread` is mixed into ``Run``; it reads the queue and the flags ``Run`` keeps
(``_queue``, ``_stop``, ``_dead``, ``_final`` …), on the writer thread only.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from typing import Any

from hooks.store.reserve import finish_run
from hooks.store.store import RunStore, RunWriter
from hooks.store.writer import WriterLostError


def last_line(exc: BaseException) -> str:
    """The line a traceback ends with: ``ValueError: boom`` (for a message of several lines,
    or with notes, the line that names the exception)."""
    lines = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    names = (type(exc).__qualname__, f"{type(exc).__module__}.{type(exc).__qualname__}")
    named = [line for line in lines if line.startswith(names)]
    line = named[-1] if named else (lines[-1] if lines else type(exc).__name__)
    return line[:500]


class RunWriterThread:
    """The writer thread's half of :class:`hooks.recorder.run.Run` (see the module)."""

    def _writer_main(self) -> None:
        store = None
        try:
            store = RunStore(self.db)
            writer = RunWriter(store, self.id, self.name)
            self._writer_loop(writer)
        except Exception as exc:  # opening failed, or a bug: say it, never hang the loop
            self._die(exc, None)
        finally:
            if self._reserve is not None:
                self._reserve.release()
            if store is not None:
                with contextlib.suppress(Exception):
                    store.close()

    def _writer_loop(self, writer: RunWriter) -> None:
        last_beat = time.monotonic()
        while True:
            stopping = self._stop
            if self._queue and not self._dead:
                try:
                    self._write_pending(writer)
                    last_beat = time.monotonic()
                except Exception as exc:
                    self._die(exc, writer)
            elif not self._dead and time.monotonic() - last_beat >= self.HEARTBEAT_INTERVAL:
                try:
                    writer.heartbeat()
                except WriterLostError as exc:  # the database deleted while the loop is idle
                    self._die(exc, writer)
                except Exception:
                    pass
                last_beat = time.monotonic()
            if stopping and (not self._queue or self._dead):
                break
            self._wake.wait(self.FLUSH_INTERVAL)
            self._wake.clear()
        self._write_final(writer)

    def _write_pending(self, writer: RunWriter) -> None:
        q = self._queue
        steps: list[tuple] = []
        n_traces = 0
        try:
            while q and len(steps) < 5000:
                item = q[0]
                if item[0] != "step":
                    if steps:
                        break  # the steps before it first
                    self._write_other(writer, item)
                    q.popleft()
                    continue
                _, step, wall, values, trace, load, sample = item
                internals, tensors = self._serialise(trace, step) if trace is not None else (
                    None, None)
                if trace is not None:
                    n_traces += 1
                row = {"step": step, "wall": wall, "values": values}
                if load is not None:
                    row["expert_load"] = load
                steps.append((row, internals, sample, tensors))
                q.popleft()
            if steps:
                self._commit(writer, steps)
        finally:
            self._traces_out += n_traces

    def _write_other(self, writer: RunWriter, item: tuple) -> None:
        """Everything but a step: the non-finite finding, and a distributed run's rank data."""
        kind = item[0]
        if kind == "nonfinite":
            writer.set_nonfinite(item[1])
        elif kind == "world":
            writer.set_world_size(item[1])
        elif kind == "ranks":
            writer.set_ranks(item[1])
        elif kind == "rank_steps":
            writer.log_rank_steps(item[1], item[2], item[3])
        elif kind == "findings":
            writer.add_findings(item[1])
            for f in item[1]:
                self._say(f"{self._title}: {f['line']}")
        elif kind == "checks":
            writer.add_checks(item[1])
        elif kind == "paused":
            writer.set_paused(item[1])

    def _commit(self, writer: RunWriter, steps: list[tuple]) -> None:
        """Commit ``steps``; when the disk is full, commit as many of them as still fit (in
        halves) before giving up."""
        import sqlite3

        try:
            writer.log_steps(steps)
        except sqlite3.OperationalError as exc:
            if len(steps) < 2 or "full" not in str(exc):
                raise
            half = len(steps) // 2
            self._commit(writer, steps[:half])
            self._commit(writer, steps[half:])
            return
        self._committed_step = steps[-1][0]["step"]

    def _serialise(self, trace: Any, step: int) -> tuple[dict | None, bytes | None]:
        try:
            data = trace.to_dict()
            tensors = {k: v.detach().to("cpu").contiguous()
                       for k, v in trace.all_tensors().items()}
            blob = None
            if tensors:
                from safetensors.torch import save

                blob = save(tensors)
            return data, blob
        except Exception as exc:
            self._say(f"{self._title}: the capture of step {step} could not be stored: "
                      f"{last_line(exc)}")
            return None, None

    def _die(self, exc: BaseException, writer: RunWriter | None) -> None:
        if self._dead:
            return
        self._dead = True
        done = self._committed_step
        after = f"after step {done}" if done is not None else "before the first step"
        line = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        self.error = f"recording of run {self.name} stopped {after}: {line}"
        self._queue.clear()
        if isinstance(exc, WriterLostError):  # nothing of the run is this process's to write
            self._lost = self._stop_asked = True
            self._resumed.set()
            self._say(f"warning: {self.error}; run.should_stop is now True")
            return
        self._say(f"{self.error} (training goes on unrecorded; the database keeps every step "
                  "committed before)")
        if writer is not None:
            with contextlib.suppress(Exception):
                self._finish_writer(writer, "failed", self.error)

    def _finish_writer(self, writer: RunWriter, status: str, reason: str | None) -> None:
        """Write the run's status, with the reserve to fall back on (a full disk must not leave
        the run "running": :func:`hooks.store.reserve.finish_run`)."""
        finish_run(writer, self._reserve, status, reason=reason)

    def _write_final(self, writer: RunWriter) -> None:
        final = self._final
        if final is None:
            return
        status, reason = final
        if self._lost:
            return  # the database deleted, or the run resumed elsewhere: never written
        if self._dead:
            status = "failed"
            reason = f"{self.error}; the loop went on to step {self.step}"
            self._final = (status, reason)
        try:
            self._finish_writer(writer, status, reason)
        except Exception as exc:
            if not self._dead:
                self._say(f"{self._title}: its final status could not be written: "
                          f"{last_line(exc)}")
