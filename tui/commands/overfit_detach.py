"""``mdb overfit`` with the trainer in a process of its own: ``--detach``, and the live screen.

The trainer is ``mdb overfit --headless`` with the same options, started in a session of its
own (``start_new_session``): the terminal's SIGHUP (an SSH link dropping) and its Ctrl-C do not
reach it. Its output goes to ``trainer.log`` in the run's checkpoint folder. Once its run is in
the database:

* ``--detach`` prints the run's name, the trainer's pid and the ``mdb watch`` line, and returns;
* the live screen is ``mdb watch``'s viewer of that run, with its keys (``d`` detach, ``p``
  pause, ``x`` stop, ``q`` asks, Ctrl-C detaches): losing the terminal loses only the view. A
  SIGTERM detaches too, with the same line, and the viewer exits 143.

Until the run exists (the model is being built), Ctrl-C stops the trainer and nothing is
recorded; a trainer that exits before its run exists is said with its last line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tui.commands.process import is_terminal
from tui.errors import MdbError, print_error

#: Seconds between two looks at the database while the trainer builds the model.
WAIT_POLL_S = 0.2


def trainer_argv(args: argparse.Namespace, name: str, db: Path) -> list[str]:
    """The command line of the trainer process: the user's options, headless, with the run
    name and the database made explicit (the last ``--run``/``--db`` given wins)."""
    # --detach, or an abbreviation argparse accepted for it (--det, --deta, --detac)
    argv = [a for a in getattr(args, "_argv", [])
            if not (a.startswith("--det") and "--detach".startswith(a))]
    if "overfit" in argv:
        argv = argv[argv.index("overfit") + 1:]
    argv = ["overfit", *argv, "--headless", "--db", str(db)]
    if not args.resume:
        argv += ["--run", name]
    return [sys.executable, "-m", "tui.cli", *argv]


def open_store(args: argparse.Namespace, *, create: bool):
    """The run database of ``args.db`` (else the default), as one ``mdb: error:`` line when it
    cannot be used."""
    from hooks.store.store import RunStore, RunStoreError, default_db_path

    path = args.db if args.db else default_db_path()
    try:
        return RunStore(path, create=create)
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None


def default_run_name(store) -> str:
    """``overfit-YYYYmmdd-HHMMSS``, with ``-2``, ``-3`` … when the database has it already."""
    base = time.strftime("overfit-%Y%m%d-%H%M%S")
    names = {r.name for r in store.runs()}
    name, i = base, 2
    while name in names:
        name, i = f"{base}-{i}", i + 1
    return name


def _run_name(args: argparse.Namespace) -> tuple[str, Path]:
    from hooks.store.store import RunStoreError, default_db_path
    from hooks.train.overfit_options import nproc_resume_error

    path = Path(args.db if args.db else default_db_path())
    if not args.resume and not path.exists():  # nothing to open: the trainer creates it
        return args.run or time.strftime("overfit-%Y%m%d-%H%M%S"), path.resolve()
    store = open_store(args, create=False)
    try:
        path = Path(store.path).resolve()
        if args.resume:
            info = store.run(args.resume)
            if info.writer_state() == "running":
                raise MdbError(f"run {info.name} is still running (pid {info.pid}): watch it "
                               f"with `mdb watch {info.name}` or stop it with `mdb stop "
                               f"{info.name}` first")
            refused = nproc_resume_error(info.name, info.kind, info.world_size, info.config)
            if refused:  # said here, before a trainer starts only to refuse it
                raise MdbError(refused)
            return info.name, path
        name = args.run or default_run_name(store)
        if any(r.name == name for r in store.runs()):
            raise MdbError(f"a run named {name!r} already exists in {store.path} (choose "
                           "another --run)")
        return name, path
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None
    finally:
        store.close()


def start_trainer(args: argparse.Namespace) -> tuple[subprocess.Popen, str, Path, Path]:
    """Start the trainer process; returns ``(process, run name, database, log file)``."""
    from hooks.store.store import checkpoint_dir

    name, db = _run_name(args)
    log = checkpoint_dir(db, name) / "trainer.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(trainer_argv(args, name, db), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, name, db, log


def _last_line(log: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        if lines:
            return lines[-1].removeprefix("mdb: error: ")
    return "(no output)"


def _run_of(proc: subprocess.Popen, name: str, db: Path):
    """Run ``name`` when process ``proc`` wrote it, else ``None``."""
    from hooks.store.store import RunStore, RunStoreError

    with contextlib.suppress(RunStoreError, OSError), RunStore(db) as store:
        info = store.run(name)
        return info if info.pid == proc.pid else None
    return None


def _forget_log(log: Path) -> None:
    """A trainer that never started its run leaves nothing behind (its last line was said)."""
    with contextlib.suppress(OSError):
        log.unlink()
        log.parent.rmdir()  # only when empty: never a run's checkpoints
        log.parent.parent.rmdir()


def wait_for_run(proc: subprocess.Popen, name: str, db: Path, log: Path):
    """Wait until the trainer's run is in the database, written by that process; return its
    :class:`hooks.store.store.RunInfo`.

    Raises:
        MdbError: The trainer exited first (its last line, its exit code), or Ctrl-C here
            (the trainer is stopped; nothing was recorded).
    """
    try:
        while True:
            code = proc.poll()  # before the look: a run written just before exiting is found
            info = _run_of(proc, name, db)
            if info is not None:  # its run, running or already ended (a short one)
                return info
            if code is not None:
                err = MdbError(f"the trainer exited ({code}) before its run started: "
                               f"{_last_line(log)}")
                _forget_log(log)
                err.exit_code = code or 1
                raise err
            time.sleep(WAIT_POLL_S)
    except KeyboardInterrupt:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait()
        _forget_log(log)
        err = MdbError("stopped while building the model; nothing was recorded")
        err.exit_code = 130
        raise err from None


def run_detached(args: argparse.Namespace) -> int:
    """``mdb overfit --detach``: start the trainer, wait for its run, say how to follow it."""
    proc, name, db, log = start_trainer(args)
    if is_terminal(sys.stderr):
        print("mdb: building the model… (Ctrl-C stops)", file=sys.stderr)
    info = wait_for_run(proc, name, db, log)
    where = f" --db {args.db}" if args.db else ""
    if info.status != "running":  # over before it could be said
        from tui.commands.stop import ended_line

        print(ended_line(info, args.db))
        return 0 if info.status == "finished" else 1
    print(f"run {name} is training in the background (pid {proc.pid}); follow it: mdb watch "
          f"{name}{where} · stop it: mdb stop {name}{where} · log: {log}")
    return 0


def _wait_for_trainer(proc: subprocess.Popen, name: str, say: str | None = None) -> int | None:
    """The trainer's exit status once it has ended; ``None`` after Ctrl-C here (it goes on in
    the background, and is said so). ``say`` is printed to stderr first, inside the guarded
    part: a Ctrl-C typed as soon as it shows is this wait's, never an unexpected interrupt."""
    try:
        if say is not None:
            print(say, file=sys.stderr, flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        print(f"mdb: run {name} stops after its current step (it goes on in the background "
              f"until then: pid {proc.pid})", file=sys.stderr)
        return None


def _run_app(app) -> bool:
    """Run the viewer app; True when a SIGTERM closed it. :class:`tui.driver.TerminalOutput`
    then raises ``SystemExit(143)``: caught here, so that the viewer still says what became of
    the trainer (a process of its own, which the signal did not reach) before it exits 143."""
    try:
        app.run()
    except SystemExit:
        if not app.terminated_by_signal:
            raise
        return True
    return False


def run_viewer(args: argparse.Namespace) -> int:
    """The live ``mdb overfit``: start the trainer, then view its run until the viewer is
    closed; returns the exit status (0 detached or stopped; the trainer's when the run ended
    on its own: 0 finished, 1 failed; 143 when a SIGTERM closed the viewer, after the same line
    as ``q``: detached while the run trains on)."""
    from hooks.store.store import RunStore
    from tui.commands.stop import detached_line, ended_line, stays_paused
    from tui.driver import SIGTERM_EXIT_CODE
    from tui.live_app import make_watch_app
    from tui.screens.live_controls import STOPPED

    proc, name, db, log = start_trainer(args)
    print("mdb: building the model… (Ctrl-C stops)", file=sys.stderr)
    info = wait_for_run(proc, name, db, log)
    with RunStore(db) as store:
        app = make_watch_app(store, info, heartbeat=getattr(args, "heartbeat", 1.0))
        terminated = _run_app(app)
        screen = app.live
        if screen.fatal:
            raise MdbError(f"{screen.fatal} (the trainer goes on: pid {proc.pid})")
        ended = screen.state not in ("reading", "running", "paused")
        if screen.outcome != STOPPED and not ended and proc.poll() is None:
            # d, Ctrl-C, q → d, SIGTERM; or closed before the first read: it goes on either way
            paused = screen.run is not None and stays_paused(store, screen.run.id)
            print(detached_line(name, proc.pid, args.db, paused=paused))
            return SIGTERM_EXIT_CODE if terminated else 0
        if terminated and screen.outcome == STOPPED and proc.poll() is None:
            # asked to stop, then SIGTERM: not waited for (a terminated command ends promptly)
            print(f"mdb: run {name} stops after its current step (it goes on in the background "
                  f"until then: pid {proc.pid})", file=sys.stderr)
            return SIGTERM_EXIT_CODE
        code = _wait_for_trainer(
            proc, name, f"mdb: asked run {name} to stop; waiting for its checkpoint…"
            if screen.outcome == STOPPED else None)
        if code is None:
            return 130
        final = store.run(name)
    line = ended_line(final, args.db)
    if final.status == "failed":
        print_error(f"{line}: {final.reason}")
        return SIGTERM_EXIT_CODE if terminated else 1
    print(line)
    if terminated:
        return SIGTERM_EXIT_CODE
    return 0 if screen.outcome == STOPPED or final.status == "finished" else code
