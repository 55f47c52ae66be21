"""``mdb overfit --nproc N``: the built-in overfit run as a job of N processes (DDP; FSDP2 with
``--fsdp``, tensor parallel with ``--tp``).

This process is the launcher: it writes the run's options to a file, starts
``python -m torch.distributed.run --standalone --nproc-per-node N -m hooks.train.ddp_overfit``
(``torchrun``; the workers use the ``gloo`` backend on CPU, see :mod:`hooks.train.ddp_overfit`)
in a process group of its own, with its output (torchrun's and the workers') in
``<db-name>-logs/<run>.log`` beside the database, and follows the run in the run store that
rank 0 writes: progress lines (``--headless``, or when not on a terminal) or the read-only live
screen of ``mdb watch`` (``q`` stops the job). SIGINT, SIGTERM and SIGHUP are passed on to the
job, which marks the run interrupted.

Exit status: 0 finished; 1 failed (a non-finite value, a rank that died, the job could not
start); 128 + n when stopped by signal n.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hooks.text import printable
from tui.commands.process import has_screen
from tui.errors import MdbError, print_error

#: Seconds the launcher waits for rank 0 to create the run.
START_TIMEOUT = 600.0
#: Seconds the job gets to end after it was asked to (then it is killed).
STOP_TIMEOUT = 60.0


def log_path(db: Path, run: str) -> Path:
    """Where the job's output goes: ``runs/mdb-logs/<run>.log`` for ``runs/mdb.sqlite``."""
    return db.with_name(f"{db.stem}-logs") / f"{run}.log"


def command(nproc: int, options_file: Path, db: Path, run: str, *, gather_every: int,
            threads: int, parallel: str = "ddp") -> list[str]:
    """The ``torchrun`` command line of the job (``parallel``: ``ddp``, ``fsdp`` or ``tp``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", "hooks.train.ddp_overfit",
            "--options", str(options_file), "--db", str(db), "--run-name", run,
            "--gather-every", str(gather_every), "--threads", str(threads),
            "--parallel", parallel]


def _parallel(args) -> str:
    return "fsdp" if getattr(args, "fsdp", False) else "tp" if getattr(args, "tp", False) \
        else "ddp"


_WHAT = {"ddp": "DDP", "fsdp": "FSDP2", "tp": "tensor-parallel"}


def job_kind(args) -> str:
    """The kind of ``--nproc`` job the options ask for, in words: ``DDP``, ``FSDP2`` (``--fsdp``)
    or ``tensor-parallel`` (``--tp``)."""
    return _WHAT[_parallel(args)]


class _Job:
    """The torchrun process group, its log, and the signals passed on to it."""

    def __init__(self, argv: list[str], log: Path, threads: int) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(threads))
        root = str(Path(__file__).resolve().parents[2])  # the workers import this mdb
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                    else "")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
        self.signal: str | None = None
        self._prev: dict[int, Any] = {}

    def forward_signals(self) -> None:
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            with contextlib.suppress(ValueError, OSError):
                self._prev[sig] = signal.signal(sig, self._on_signal)

    def restore_signals(self) -> None:
        for sig, prev in self._prev.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, prev)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
        self.send(signum)

    def send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask the job to end, wait :data:`STOP_TIMEOUT` seconds, then kill what is left."""
        if self.alive():
            self.send(signum)
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            self.proc.wait(30)
        self.send(signal.SIGKILL)  # a worker the launcher left behind

    def tail(self, lines: int = 3) -> str:
        try:
            text = self.log.read_text("utf-8", errors="replace").strip().splitlines()
        except OSError:
            return ""
        keep = [x for x in text if x.strip() and not x.startswith(("W", "I"))]
        return " | ".join(x.strip() for x in keep[-lines:])[:400]


def _wait_for_run(store, name: str, job: _Job, what: str = "DDP"):
    from hooks.store.store import RunNotFoundError

    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        try:
            return store.run(name)
        except RunNotFoundError:
            pass
        if not job.alive():
            raise MdbError(f"the {what} job ended before rank 0 created run {name} (exit "
                           f"{job.proc.returncode}): {job.tail() or 'no output'}; log: "
                           f"{job.log}")
        if job.signal is not None:
            job.stop(getattr(signal, job.signal))
            raise MdbError(f"stopped by {job.signal} before the run started")
        time.sleep(0.2)
    job.stop()
    raise MdbError(f"rank 0 did not create run {name} within {START_TIMEOUT:.0f} s; log: "
                   f"{job.log}")


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "nan" if x is None else format(x, spec)


def _headless(store, info, job: _Job, nproc: int, what: str = "DDP") -> None:
    """Plain progress lines from the store until the job ends (every ~5 % or 10 s); the speed
    is the run's end-to-end steps/s, as every view shows it (:class:`hooks.store.rates.StepRate`),
    not one step's own ``steps_per_s``."""
    from hooks.store.rates import StepRate

    rate = StepRate()
    total = info.total_steps or 0
    every = max(1, total // 20)
    cursor, last_print = 0, 0.0
    print(f"mdb overfit: run {info.name} · {what} job of {nproc} ranks (gloo, CPU) · steps "
          f"1..{total} · db {store.path} · log {job.log}", flush=True)
    while True:
        alive = job.alive()
        update = store.poll(info.id, cursor)
        if update.restarted:
            rate.reset()
        for row in update.metrics:
            v = row.values
            rate.add(row.wall)
            now = time.monotonic()
            if row.step % every == 0 or row.step == total or row.step == 1 or \
                    now - last_print >= 10:
                last_print = now
                print(f"step {row.step}/{total}  ce {_fmt(v.get('ce'))}  aux "
                      f"{_fmt(v.get('aux'))}  |g| {_fmt(v.get('grad_norm'), '.3g')}  "
                      f"{_fmt(rate.steps_per_s(v.get('step_time')), '.1f')} steps/s",
                      flush=True)
        cursor = update.last_step if update.metrics else cursor
        if not alive:
            return
        time.sleep(0.5)


def run_ddp(args, options, store_path: Path, name: str) -> int:
    """Run ``options`` (:class:`hooks.train.overfit.OverfitOptions`) as a job of ``args.nproc``
    ranks (DDP, or FSDP2 / tensor parallel with ``args.fsdp`` / ``args.tp``) recorded as run
    ``name`` in ``store_path``; return the exit status."""
    from hooks.store.store import RunStore, RunStoreError
    from hooks.train.trainer import signal_exit_code

    tmp = Path(tempfile.mkdtemp(prefix="mdb-ddp-"))
    options_file = tmp / "options.json"
    options_file.write_text(json.dumps(options.to_dict()), encoding="utf-8")
    argv = command(args.nproc, options_file, store_path, name,
                   gather_every=args.gather_every, threads=args.threads,
                   parallel=_parallel(args))
    job = _Job(argv, log_path(store_path, name), args.threads)
    job.forward_signals()
    what = job_kind(args)
    quit_early = False  # q on the live screen stopped it: a normal end, as in mdb overfit
    try:
        store = RunStore(store_path)
        try:
            info = _wait_for_run(store, name, job, what)
            live = not args.headless and has_screen()
            if live:
                from tui.live_app import make_watch_app

                make_watch_app(store, info).run()
                if job.alive():
                    print(f"mdb: stopping the {what} job…", file=sys.stderr)
                    quit_early = True
                    job.stop(signal.SIGTERM)
            else:
                _headless(store, info, job, args.nproc, what)
            job.stop()
            end = store.run(info.id)
            ranks = store.ranks(info.id)
            findings = store.findings(info.id)
        finally:
            store.close()
    except RunStoreError as exc:
        job.stop()
        raise MdbError(str(exc)) from None
    finally:
        job.restore_signals()
        with contextlib.suppress(OSError):
            options_file.unlink()
            tmp.rmdir()
    for f in findings:
        print_error(f.line, "finding")
    steps = {r.rank: r.last_step for r in ranks}
    per_rank = ", ".join(f"rank {r} {s}" for r, s in sorted(steps.items()))
    if end.status == "finished":
        print(f"run {name} finished: step {end.last_step}/{end.total_steps} on {args.nproc} "
              f"ranks ({per_rank}); loss {_fmt(end.last_loss)} (rank 0)")
        return 0
    if end.status == "running":  # the job ended without a word from rank 0
        print_error(f"run {name}: the {what} job ended (exit {job.proc.returncode}) but the "
                    f"run was not closed: {job.tail() or 'no output'}; log: {job.log}")
        return 1
    if end.status == "interrupted":
        print(printable(f"run {name} interrupted ({end.reason}) after step {end.last_step} "
                        f"({per_rank})"))
        if quit_early and job.signal is None:
            return 0
        return signal_exit_code(job.signal or end.reason) or 130
    print_error(f"run {name} failed: {end.reason}; log: {job.log}")
    return 1
