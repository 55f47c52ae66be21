"""``mdb stop RUN``: ask a running run to checkpoint and stop, and wait until it has.

The request goes through the run store (:mod:`hooks.store.control`), so it works from any
terminal on the machine, for a run started live, ``--detach`` ed or ``--headless`` by ``mdb
overfit`` (it stops after its step with a checkpoint: ``interrupted (stopped)``) and for a
``hooks.run`` loop that checks ``run.should_stop``.

A ``hooks.run`` loop that goes on logging steps for ``--wait`` seconds (10) after the request
without reading ``run.should_stop`` does not check it: ``mdb stop`` then says so, with the line
that makes it stop, and exits 1 (the request stays: ``run.should_stop`` is true in the loop).
Such a loop runs to its end and is marked ``finished``. A loop busy in one long step (no step
logged since the request) is waited for up to ``--timeout``.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import time

from hooks.text import printable
from tui.errors import MdbError

#: Reads the run store only: ``mdb`` does not import torch for it (a capture opened from
#: its screen imports it then).
NEEDS_TORCH = False

HELP = "ask a running run to write a checkpoint and stop; returns once it has stopped"

#: Seconds between two reads of the run's status while waiting.
POLL_S = 0.2
#: Seconds a ``hooks.run`` loop may log steps after a stop request without reading
#: ``run.should_stop`` before ``mdb stop`` says that it does not check it (``--wait``).
CHECK_WAIT_S = 10.0
#: The line that makes a ``hooks.run`` loop stop on request.
STOP_LINE = "if run.should_stop: break"


class NotStoppedError(MdbError):
    """The run did not stop in time, or its process died: exit code 1."""

    exit_code = 1


class UncheckedStopError(NotStoppedError):
    """A ``hooks.run`` loop logged steps after the stop request without reading
    ``run.should_stop``: it does not check it. Exit code 1."""


def _seconds(text: str) -> float:
    """A finite number of seconds, 0 or more (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds, 0 or "
                                         "more")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``mdb stop``."""
    parser.add_argument("run", metavar="RUN", help="run name (see `mdb runs`)")
    parser.add_argument("--db", metavar="PATH", default=None,
                        help="run database (default $MDB_DB, else ./runs/mdb.sqlite)")
    parser.add_argument("--timeout", type=_seconds, default=300.0, metavar="S",
                        help="seconds to wait for the run to stop (default 300); the request "
                             "stays if it has not stopped by then")
    parser.add_argument("--wait", type=_seconds, default=CHECK_WAIT_S, metavar="S",
                        help="seconds a hooks.run loop may go on logging steps without reading "
                             f"run.should_stop before mdb stop says that it does not check it "
                             f"(default {CHECK_WAIT_S:.0f}; exit 1)")


def ended_line(info, db: str | None) -> str:
    """What became of a stopped run, with the command that continues it where there is one."""
    line = f"run {info.name} {info.status_line()} at step {info.last_step}"
    if info.kind == "overfit" and info.checkpoint_step is not None:
        resume = f"mdb overfit --resume {info.name}" + (f" --db {db}" if db else "")
        line += f"; checkpoint @ step {info.checkpoint_step}; continue with: {resume}"
    return printable(line)  # the run's name and reason, read from the database


def detached_line(name: str, pid: int | None, db: str | None, paused: bool = False) -> str:
    """What a viewer says when it leaves a run training (``paused``: a paused run, which
    stays paused): the commands that re-attach (and resume) and stop."""
    where = f" --db {db}" if db else ""
    if paused:
        return printable(f"mdb: detached; run {name} stays paused (pid {pid}) · resume it: "
                         f"mdb watch {name}{where}, then p · stop it: mdb stop {name}{where}")
    return printable(f"mdb: detached; run {name} goes on training (pid {pid}) · re-attach: "
                     f"mdb watch {name}{where} · stop it: mdb stop {name}{where}")


def stays_paused(store, run_id: int) -> bool:
    """Whether run ``run_id`` is paused, or will be, when a viewer leaves it: its stored state,
    then the pause/resume requests its process has not acted on yet, the last one winning (a
    ``p`` pressed just before ``d``). ``False`` when the store cannot be read."""
    from hooks.store.control import pending
    from hooks.store.store import RunStoreError

    try:
        paused = bool(store.run(run_id).paused)
        for command in pending(store.path, run_id):
            if command in ("pause", "resume"):
                paused = command == "pause"
    except (RunStoreError, sqlite3.Error, OSError):  # cannot be read now: the usual line
        return False
    return paused


def unchecked_line(info, steps: int, waited: float) -> str:
    """What ``mdb stop`` says of a ``hooks.run`` loop that does not read ``run.should_stop``."""
    return (f"run {info.name} logged {steps} more step(s) in {waited:.0f} s after it received "
            f"the stop request without reading run.should_stop (at step {info.last_step}): "
            f"its loop does not check for stop requests; make it stop with `{STOP_LINE}` after "
            "run.log(...) in the loop. The request stays (run.should_stop is True in the loop); "
            "a loop that runs to its end is marked finished")


def wait_until_stopped(store, name: str, timeout: float, *, request_id: int | None = None,
                       check_wait: float = CHECK_WAIT_S) -> object:
    """Read run ``name`` until its writer is no longer ``running``; return its last
    :class:`hooks.store.store.RunInfo`.

    Args:
        store: The open :class:`hooks.store.store.RunStore`.
        name: The run.
        timeout: Seconds to wait at most.
        request_id: The stop request (:func:`hooks.store.control.request`): of a ``hooks.run``
            loop, whether the loop read ``run.should_stop`` since is checked after
            ``check_wait`` seconds.
        check_wait: See ``request_id``.

    Raises:
        UncheckedStopError: A ``hooks.run`` loop logged two steps or more since it received
            the request without reading ``run.should_stop``, and ``check_wait`` seconds
            passed.
        NotStoppedError: Still running after ``timeout`` seconds, or its process died.
    """
    from hooks.store.control import progress

    start = time.monotonic()
    deadline = start + timeout
    check = request_id is not None and store.run(name).kind == "api"
    received_at: int | None = None  # the run's last step when the loop got the request
    while True:
        info = store.run(name)
        state = info.writer_state()
        if state == "gone":
            raise NotStoppedError(f"run {name}: {info.gone_reason()} before it stopped")
        if state != "running":
            return info
        waited = time.monotonic() - start
        if check:
            got = progress(store.path, request_id)
            if received_at is None and got != "pending":
                received_at = info.last_step
            if waited >= check_wait and got == "received" \
                    and info.last_step >= received_at + 2:
                raise UncheckedStopError(
                    unchecked_line(info, info.last_step - received_at, waited))
        if time.monotonic() > deadline:
            raise NotStoppedError(
                f"run {name} has not stopped after {timeout:.0f} s (at step {info.last_step}); "
                "the request stays: it stops after its current step")
        time.sleep(POLL_S)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb stop``."""
    from hooks.store.control import progress, request
    from hooks.store.store import RunStore, RunStoreError, default_db_path

    path = args.db if args.db else default_db_path()
    try:
        with RunStore(path) as store:
            info = store.run(args.run)
            if info.writer_state() != "running":
                raise MdbError(f"run {info.name} is not running ({info.status_line()}): "
                               "nothing to stop")
            if (info.world_size or 1) > 1:
                raise MdbError(f"run {info.name} is a torchrun job of {info.world_size} ranks: "
                               "mdb stop reaches one process; stop the job with Ctrl-C in its "
                               f"terminal or kill -TERM {info.pid}")
            try:
                rid = request(store.path, info.id, "stop")
            except sqlite3.Error as exc:
                raise MdbError(f"cannot ask run {info.name} to stop: {store.path}: {exc}") \
                    from None
            print(printable(f"mdb: asked run {info.name} (pid {info.pid}) to stop after its "
                            "step; waiting for its checkpoint…"), file=sys.stderr)
            info = wait_until_stopped(store, info.name, args.timeout, request_id=rid,
                                      check_wait=args.wait)
            ran_to_end = info.status == "finished" and progress(store.path, rid) != "seen"
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None
    line = ended_line(info, args.db)
    if ran_to_end:
        line += ": its loop ran to its end without reading the stop request"
    print(line)
    return 0
