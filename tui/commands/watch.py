"""``mdb watch [RUN]``: follow a recorded run from its database on the live screen; of a run
that is training, ``p`` pauses or resumes it, ``x`` stops it, ``d`` (or Ctrl-C) detaches and
``q`` asks which (:mod:`tui.screens.live_controls`).

Any number of watchers may follow a run at once, from any terminal (an SSH session opened after
the run started sees every step from the first). A new step shows within ~0.3 s of being
written; when the writer finishes, is interrupted, fails, or dies without saying so (its pid is
gone, or its heartbeat is stale) the status line says which, and for a run that can continue,
its checkpoint step and the ``mdb overfit --resume`` command. Watching a finished run replays
it. A run whose rows were changed outside mdb ends the watch with one line (exit 2).
"""

from __future__ import annotations

import argparse
import sys

from hooks.text import printable
from tui.commands.process import require_terminal
from tui.errors import MdbError

#: Reads the run store only: ``mdb`` does not import torch for it (a capture opened from
#: its screen imports it then).
NEEDS_TORCH = False

HELP = ("follow a run live from the run database (default: the latest run); p pauses, x "
        "stops, d detaches; replays a finished one")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``mdb watch``."""
    parser.add_argument("run", metavar="RUN", nargs="?", default=None,
                        help="run name (default: the most recently started run; see `mdb runs`)")
    parser.add_argument("--db", metavar="PATH", default=None,
                        help="run database (default $MDB_DB, else ./runs/mdb.sqlite)")
    parser.add_argument("--poll", metavar="SECONDS", type=float, default=0.2,
                        help=argparse.SUPPRESS)


def open_run(db: str | None, name: str | None):
    """Open the database read-only and find the run to watch.

    Returns:
        ``(store, run)``: a :class:`hooks.store.store.RunStore` and the
        :class:`hooks.store.store.RunInfo` of ``name`` (or of the latest run).

    Raises:
        MdbError: Missing or unreadable database, a database of something else, no such run,
            or no runs at all (one line each).
    """
    from hooks.store.store import RunStore, RunStoreError, default_db_path

    path = db if db else default_db_path()
    try:
        store = RunStore(path)
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None
    try:
        run = store.run(name) if name else store.latest_run()
    except RunStoreError as exc:
        store.close()
        raise MdbError(str(exc)) from None
    if run is None:
        store.close()
        raise MdbError(f"no runs in {path} yet (start one with `mdb overfit`)")
    return store, run


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb watch``."""
    if not (args.poll > 0):
        raise MdbError(f"--poll must be a positive number of seconds, got {args.poll}")
    store, info = open_run(args.db, args.run)
    try:
        require_terminal("mdb watch", "`mdb runs` for a table of runs")
        from tui.live_app import make_watch_app

        app = make_watch_app(store, info, poll_interval=args.poll)
        app.run()
        if app.live.fatal:  # the run's rows cannot be read: one line, no screen left to say it
            raise MdbError(app.live.fatal)
        return after_viewer(app.live, store, args.db)
    finally:
        store.close()


def after_viewer(screen, store, db: str | None) -> int:
    """What the terminal says once a viewer closed: detached (the run goes on; the command
    that re-attaches), stopped (waits for the run's checkpoint and says what became of it), or
    nothing when the run had ended. Returns the exit status (0)."""
    from tui.commands.stop import detached_line, ended_line, stays_paused, wait_until_stopped
    from tui.screens.live_controls import DETACHED, STOPPED

    run = screen.run
    if screen.outcome == DETACHED:
        print(detached_line(run.name, run.pid, db, paused=stays_paused(store, run.id)))
    elif screen.outcome == STOPPED:
        how = ("waiting for its checkpoint…" if run.kind == "overfit" else "waiting for its "
               "loop to see run.should_stop… (Ctrl-C leaves it running)")
        print(printable(f"mdb: asked run {run.name} to stop; {how}"), file=sys.stderr)
        print(ended_line(wait_until_stopped(store, run.name, 300.0), db))
    return 0
