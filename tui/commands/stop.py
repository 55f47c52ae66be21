"""``mdb stop RUN``: ask a running run to checkpoint and stop, and wait until it has.

The request goes through the run store (:mod:`hooks.runs.control`), so it works from any
terminal on the machine, for a run started live, ``--detach`` ed or ``--headless`` by ``mdb
overfit`` (it stops after its step with a checkpoint: ``interrupted (stopped)``) and for a
``hooks.run`` loop that checks ``run.should_stop``.
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


class NotStoppedError(MdbError):
    """The run did not stop in time, or its process died: exit code 1."""

    exit_code = 1


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
    from hooks.runs.control import pending
    from hooks.runs.store import RunStoreError

    try:
        paused = bool(store.run(run_id).paused)
        for command in pending(store.path, run_id):
            if command in ("pause", "resume"):
                paused = command == "pause"
    except (RunStoreError, sqlite3.Error, OSError):  # cannot be read now: the usual line
        return False
    return paused


def wait_until_stopped(store, name: str, timeout: float) -> object:
    """Read run ``name`` until its writer is no longer ``running``; return its last
    :class:`hooks.runs.store.RunInfo`.

    Raises:
        NotStoppedError: Still running after ``timeout`` seconds, or its process died.
    """
    deadline = time.monotonic() + timeout
    while True:
        info = store.run(name)
        state = info.writer_state()
        if state == "gone":
            raise NotStoppedError(f"run {name}: {info.gone_reason()} before it stopped")
        if state != "running":
            return info
        if time.monotonic() > deadline:
            raise NotStoppedError(
                f"run {name} has not stopped after {timeout:.0f} s (at step {info.last_step}); "
                "the request stays: it stops after its current step")
        time.sleep(POLL_S)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb stop``."""
    from hooks.runs.control import request
    from hooks.runs.store import RunStore, RunStoreError, default_db_path

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
                request(store.path, info.id, "stop")
            except sqlite3.Error as exc:
                raise MdbError(f"cannot ask run {info.name} to stop: {store.path}: {exc}") \
                    from None
            print(printable(f"mdb: asked run {info.name} (pid {info.pid}) to stop after its "
                            "step; waiting for its checkpoint…"), file=sys.stderr)
            info = wait_until_stopped(store, info.name, args.timeout)
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None
    print(ended_line(info, args.db))
    return 0
