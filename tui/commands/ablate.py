"""``mdb ablate``: seed 000's controlled-variable experiment in one command.

``mdb ablate --vary attention=mha,gqa,mqa`` trains one run per variant — MHA, GQA, MQA — each
the ``--preset``/``--config`` model with only that field changed (:mod:`hooks.train.ablate`),
on the same text, seed and steps, as a separate run of the run store named after it
(``abl-attention=mha``; ``--prefix``). Several ``--vary`` combine (cartesian product). The runs
go in parallel worker processes (``--jobs``, default: one per variant up to the CPU count, one
torch thread each), then the compare screen shows them live (:mod:`tui.screens.compare`);
``--headless`` (or no terminal) prints the table when they are done.

Each worker is this command again (hidden ``--worker SPEC``) running the ``mdb overfit``
machinery: an :class:`hooks.train.overfit.OverfitSession` under
:func:`tui.commands.overfit.run_headless` (signals, checkpoints, failures, the run store). The
end of the text (``--held-out``) is never trained on: after the last step each variant's CE on
held-out windows is logged as ``ce@N`` — at T, 2T and 4T when ``rope_scaling`` is varied, the
RoPE length-extrapolation study (the variants' ``max_position_embeddings`` is raised to 4T).

Ctrl-C (or SIGTERM, SIGHUP, or ``x`` on the screen) stops every worker after its current step:
each run is checkpointed and marked interrupted, variants not started yet are not started. A
worker that fails is reported in the table with its reason. Bad input — an unknown ``--vary``
field or value, a variant that is not a valid config, a run name that exists — is one line,
exit 2, before anything is created.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hooks.text import printable
from tui.commands.options import nonneg_int, positive_float, positive_int, seed_int
from tui.commands.process import has_screen
from tui.errors import MdbError

HELP = ("a controlled-variable experiment in one command: one run per --vary variant "
        "(attention=mha,gqa,mqa, "
        "positions=rope,learned, ffn=moe,dense, rope_scaling=none,linear,dynamic), in "
        "parallel, then compared")

_DEFAULTS: dict[str, Any] = {"preset": "seed-test-c", "steps": 200, "seq_len": 32,
                             "batch_size": 8, "lr": 3e-3, "seed": 0, "held_out": 0.2}
#: Seconds between two progress lines of a headless ablation.
PROGRESS_EVERY = 15.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``mdb ablate``."""
    g = parser.add_argument_group("the experiment")
    g.add_argument("--vary", metavar="FIELD=V1,V2", action="append", default=None,
                   help="what the variants change: attention=mha,gqa,mqa · positions=rope,learned "
                        "· ffn=moe,dense · rope_scaling=none,linear,dynamic · or any config "
                        "field (num_key_value_heads=1,2,4); repeat for every combination")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None,
                     help="the base minillm config (default seed-test-c); vocab_size becomes "
                          "the text's character count")
    src.add_argument("--config", metavar="FILE.toml", default=None,
                     help="the base config as TOML (see samples/presets/)")
    g.add_argument("--text", metavar="FILE", default=None,
                   help="UTF-8 text all variants train on (default samples/alice.txt)")
    g.add_argument("--steps", type=positive_int, default=None, help="steps per variant (200)")
    g.add_argument("--seq-len", type=positive_int, default=None,
                   help="T, tokens per training window (default 32)")
    g.add_argument("--batch-size", type=positive_int, default=None,
                   help="windows per step (default 8)")
    g.add_argument("--lr", type=positive_float, default=None, help="AdamW learning rate (3e-3)")
    g.add_argument("--seed", type=seed_int, default=None,
                   help="seed of every variant's weights and windows (default 0)")
    g.add_argument("--held-out", type=float, default=None, metavar="FRACTION",
                   help="the text's last FRACTION is never trained on; each variant's CE on it "
                        "is logged after the last step as ce@N (default 0.2)")
    g.add_argument("--eval-lengths", metavar="N,N", default=None,
                   help="held-out window lengths (default T; T,2T,4T with rope_scaling)")
    r = parser.add_argument_group("running")
    r.add_argument("--prefix", default="abl-",
                   help="run names are PREFIX + the variant (default abl-: abl-attention=mha)")
    r.add_argument("--db", metavar="PATH", default=None,
                   help="run database (default $MDB_DB, else ./runs/mdb.sqlite)")
    r.add_argument("--jobs", type=positive_int, default=None,
                   help="variants trained at once (default: one per variant, up to the CPU "
                        "count)")
    r.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads per worker (default 1)")
    r.add_argument("--every", type=nonneg_int, default=0,
                   help="record the internals every N steps (default 0: never)")
    r.add_argument("--headless", action="store_true",
                   help="no screen: progress lines, then the table (also without a terminal)")
    r.add_argument("--worker", metavar="SPEC", default=None, help=argparse.SUPPRESS)
    r.add_argument("--heartbeat", type=positive_float, default=1.0, help=argparse.SUPPRESS)
    r.add_argument("--poll", type=positive_float, default=0.3, help=argparse.SUPPRESS)


# ---------------------------------------------------------------------------------------------
# The plan: every check before anything is created
# ---------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What an ablation will run (built and checked by :func:`make_plan`).

    Attributes:
        db: The run store's path (absolute).
        variants: The :class:`hooks.train.ablate.Variant` list.
        options: Per variant, the ``OverfitOptions`` fields its worker trains with.
        eval_lengths: The held-out lengths.
        jobs: Workers at once.
    """

    db: Path
    variants: list
    options: list[dict[str, Any]]
    eval_lengths: list[int]
    jobs: int
    threads: int = 1
    heartbeat: float = 1.0

    @property
    def names(self) -> list[str]:
        return [v.name for v in self.variants]


def _lengths(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise MdbError(f"--eval-lengths {text!r}: give integers separated by commas") from None
    if not out or any(n < 2 for n in out):
        raise MdbError(f"--eval-lengths {text!r}: every length must be at least 2")
    return out


def make_plan(args: argparse.Namespace) -> Plan:
    """Check every option, variant, length and name; nothing is written.

    Raises:
        MdbError: bad input (one line; the CLI exits 2).
    """
    from hooks.store.store import default_db_path
    from hooks.train.ablate import AblateError, expand_variants, parse_vary
    from minillm import CharTokenizer
    from tui.commands.inputs import default_text_path, load_config, read_text

    d = _settings(args)
    try:
        varies = [parse_vary(v) for v in args.vary]
    except AblateError as exc:
        raise MdbError(str(exc)) from None
    if args.config is None and args.preset is None:
        args.preset = d["preset"]
    base = load_config(args)
    text_path = Path(args.text) if args.text else default_text_path()
    text = read_text(text_path).removesuffix("\n")
    tokenizer = CharTokenizer.from_text(text)
    base = base.replace(vocab_size=tokenizer.vocab_size)
    seq = int(d["seq_len"])
    if seq < 2:
        raise MdbError("--seq-len must be at least 2")
    lengths = _lengths(args.eval_lengths)
    try:
        variants = expand_variants(base, varies, prefix=args.prefix, seq_len=seq,
                                   eval_lengths=lengths)
    except AblateError as exc:
        raise MdbError(str(exc)) from None
    from hooks.train.ablate import eval_lengths_for

    lengths = lengths or eval_lengths_for(varies, seq)
    _check_windows(text_path, len(tokenizer.encode(text)), d["held_out"], seq, lengths,
                   variants)
    db = Path(args.db if args.db else default_db_path()).resolve()
    _check_names_free(db, variants)
    options = _variant_options(args, d, variants, text, seq, lengths)
    jobs = args.jobs or min(len(variants), os.cpu_count() or 1)
    jobs = max(1, min(jobs, len(variants)))
    _check_memory(variants, text, int(d["batch_size"]), seq, jobs)
    return Plan(db, variants, options, lengths, jobs,
                threads=args.threads, heartbeat=args.heartbeat)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The options given, with :data:`_DEFAULTS` for the others.

    Raises:
        MdbError: no ``--vary``, or ``--held-out`` not between 0 and 1.
    """
    if not args.vary:
        raise MdbError("give at least one --vary FIELD=VALUE,VALUE (e.g. "
                       "--vary attention=mha,gqa,mqa)")
    d = {k: getattr(args, k) if getattr(args, k, None) is not None else v
         for k, v in _DEFAULTS.items()}
    if not (0.0 < d["held_out"] < 1.0):
        raise MdbError(f"--held-out must be between 0 and 1, got {d['held_out']}")
    return d


def _check_windows(text_path: Path, n: int, held_out: float, seq: int, lengths: list[int],
                   variants: list) -> None:
    """Check that the ``n``-token text leaves more than one training window after the
    held-out part, that the held-out part holds the longest evaluation window, and that every
    variant accepts the longest window.

    Raises:
        MdbError: naming the text or the variant.
    """
    held = int(round(n * held_out))
    if n - held <= seq:
        raise MdbError(f"{text_path}: {n - held} tokens to train on (after --held-out "
                       f"{held_out:g}), not more than one window of --seq-len {seq}")
    if max(lengths) > held:
        raise MdbError(f"{text_path}: the held-out part has {held} tokens, fewer than an "
                       f"evaluation window of {max(lengths)}; use a longer text, a larger "
                       "--held-out or shorter --eval-lengths")
    for v in variants:
        if max(lengths + [seq]) > v.config.max_position_embeddings:
            raise MdbError(f"variant {v.label}: windows of {max(lengths + [seq])} tokens exceed "
                           f"its max_position_embeddings ({v.config.max_position_embeddings})")


def _check_names_free(db: Path, variants: list) -> None:
    """Refuse variant run names that already exist in the run store at ``db``.

    Raises:
        MdbError: a name is taken, or the store cannot be read.
    """
    from hooks.store.store import RunStore, RunStoreError

    if db.exists():
        try:
            with RunStore(db) as store:
                existing = {r.name for r in store.runs()}
        except RunStoreError as exc:
            raise MdbError(str(exc)) from None
        taken = [v.name for v in variants if v.name in existing]
        if taken:
            raise MdbError(f"run {taken[0]!r} already exists in {db}; choose another "
                           f"--prefix (or compare the runs: mdb compare {' '.join(taken[:8])})")


def _variant_options(args: argparse.Namespace, d: dict[str, Any], variants: list, text: str,
                     seq: int, lengths: list[int]) -> list[dict[str, Any]]:
    """Each variant's validated :class:`hooks.train.overfit.OverfitOptions` as a dict, with its
    ``ablation`` choices.

    Raises:
        MdbError: options a variant rejects.
    """
    from hooks.train.overfit import OverfitOptions

    options = []
    source = str(args.text) if args.text else "samples/alice.txt"
    for v in variants:
        opts = OverfitOptions(
            text=text, text_source=source, model_config=v.config.to_dict(),
            preset=None if args.config else args.preset, steps=int(d["steps"]),
            lr=float(d["lr"]), seq_len=seq, batch_size=int(d["batch_size"]),
            seed=int(d["seed"]), every=int(args.every), sample_every=0,
            held_out=float(d["held_out"]), eval_lengths=list(lengths))
        try:
            opts.validate()
        except ValueError as exc:
            raise MdbError(str(exc)) from None
        options.append({**opts.to_dict(), "ablation": v.choices})
    return options


def _check_memory(variants, text: str, batch_size: int, seq: int, jobs: int) -> None:
    """Refuse, before any worker starts or any run is created, a variant that cannot fit in
    memory, or ``jobs`` variants that cannot fit together (the largest ones running at once).

    Raises:
        MdbError: naming the variant and how much it needs.
    """
    from tui.commands.inputs import available_memory, check_memory, human_bytes, step_memory

    vocab = max(1, len(set(text)))  # the vocabulary becomes the text's characters
    needs = []
    for v in variants:
        cfg = v.config.replace(vocab_size=vocab)
        try:
            check_memory(cfg, batch_size, seq)
        except MdbError as exc:
            raise MdbError(f"variant {v.label}: {exc}") from None
        needs.append(sum(step_memory(cfg, batch_size, seq)))
    together = sum(sorted(needs, reverse=True)[:jobs])
    free = available_memory()
    if jobs > 1 and free is not None and together > free:
        raise MdbError(f"{jobs} variants at once need at least {human_bytes(together)}; this "
                       f"machine has {human_bytes(free)} available: give --jobs 1 or a smaller "
                       "config")


# ---------------------------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One variant's worker process."""

    name: str
    spec: Path
    log: Path
    state: str = "queued"  # queued, running, exited, not started
    proc: subprocess.Popen | None = None
    code: int | None = None
    reason: str | None = None
    signalled: bool = False
    started: float | None = None


def _last_error(log: Path) -> str | None:
    """The last ``mdb: error:`` line of a worker's log (its reason), else its last line."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    errors = [ln.removeprefix("mdb: error: ") for ln in lines if ln.startswith("mdb: error:")]
    if errors:
        return errors[-1][:300]
    tail = [ln for ln in lines if ln.strip()]
    return tail[-1][:300] if tail else None


class Workers:
    """The worker processes of an ablation, ``jobs`` at a time (the screen's controller).

    Each worker runs in its own session (``start_new_session``) so that a terminal's Ctrl-C
    reaches only this process, which passes one SIGINT on to every worker: each finishes its
    step, checkpoints and marks its run interrupted.

    Args:
        jobs: The :class:`Job` of every variant, in order.
        parallel: Most workers at once.
        on_event: Called (in the scheduler thread) with one line per start and end.
    """

    def __init__(self, jobs: list[Job], parallel: int, on_event=None) -> None:
        self.jobs = jobs
        self.parallel = parallel
        self.on_event = on_event
        self.stop_reason: str | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.done = threading.Event()

    # -- the controller of the compare screen ----------------------------------------------------
    def status(self, name: str) -> str | None:
        job = next((j for j in self.jobs if j.name == name), None)
        if job is None:
            return None
        if job.state == "queued":
            return "queued"
        if job.state == "not started":
            return f"not started ({self.stop_reason})"
        if job.state == "exited" and job.code not in (0, None):
            if job.code < 0:
                with contextlib.suppress(ValueError):
                    return f"worker killed by {signal.Signals(-job.code).name}"
                return f"worker killed by signal {-job.code}"
            if job.code in (129, 130, 143):
                return f"worker stopped (exit {job.code})"
            return f"worker failed (exit {job.code})" + (f": {job.reason}" if job.reason else "")
        return None

    def running(self) -> bool:
        return any(j.state in ("queued", "running") for j in self.jobs)

    def stop(self, reason: str) -> None:
        """Start no more workers; send SIGINT once to each running one."""
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = reason
            for job in self.jobs:
                if job.state == "queued":
                    job.state = "not started"
                elif job.state == "running" and not job.signalled and job.proc is not None:
                    job.signalled = True
                    with contextlib.suppress(OSError):
                        job.proc.send_signal(signal.SIGINT)

    # -- scheduling ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="mdb-ablate", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def _say(self, line: str) -> None:
        if self.on_event is not None:
            self.on_event(line)

    def _launch(self, job: Job) -> None:
        job.log.parent.mkdir(parents=True, exist_ok=True)
        with open(job.log, "wb") as log:
            job.proc = subprocess.Popen(
                [sys.executable, "-m", "tui.cli", "ablate", "--worker", str(job.spec)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        job.state, job.started = "running", time.time()
        self._say(f"started {job.name} (pid {job.proc.pid})")

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    running = [j for j in self.jobs if j.state == "running"]
                    for job in running:
                        code = job.proc.poll()
                        if code is not None:
                            job.state, job.code = "exited", code
                            job.reason = _last_error(job.log) if code else None
                            self._say(f"{job.name}: done" if code == 0 else
                                      f"{job.name}: worker exited {code}"
                                      + (f" ({job.reason})" if job.reason else ""))
                    running = [j for j in self.jobs if j.state == "running"]
                    queued = [j for j in self.jobs if j.state == "queued"]
                    if self.stop_reason is None:
                        for job in queued[: max(0, self.parallel - len(running))]:
                            self._launch(job)
                    if not any(j.state in ("queued", "running") for j in self.jobs):
                        return
                time.sleep(0.1)
        finally:
            self.done.set()


def _jobs(plan: Plan, spec_dir: Path) -> list[Job]:
    from hooks.store.store import checkpoint_dir

    jobs = []
    for i, (variant, options) in enumerate(zip(plan.variants, plan.options, strict=True)):
        spec = spec_dir / f"variant-{i}.json"
        spec.write_text(json.dumps({"name": variant.name, "db": str(plan.db), "options": options,
                                    "threads": plan.threads, "heartbeat": plan.heartbeat}),
                        encoding="utf-8")
        log = checkpoint_dir(plan.db, variant.name) / "ablate-worker.log"
        jobs.append(Job(variant.name, spec, log))
    return jobs


def _worker(args: argparse.Namespace) -> int:
    """``mdb ablate --worker SPEC``: train one variant (the ``mdb overfit --headless`` path)."""
    from hooks.train.trainer import TrainControl, install_stop_signals

    control = TrainControl()
    restore = install_stop_signals(control)  # a stop before the first step is still clean
    try:
        spec = json.loads(Path(args.worker).read_text(encoding="utf-8"))
        import torch

        from hooks.store.store import RunStore, RunStoreError
        from hooks.train.overfit import OverfitOptions, OverfitSession
        from tui.commands.overfit import run_headless

        torch.set_num_threads(int(spec.get("threads", 1)))
        options = OverfitOptions.from_dict(spec["options"])
        try:
            store = RunStore(spec["db"], create=True)
        except RunStoreError as exc:
            raise MdbError(str(exc)) from None
        try:
            session = OverfitSession.create(store, spec["name"], options)
        except (ValueError, RunStoreError) as exc:
            store.close()
            raise MdbError(str(exc)) from None
        session.control = control
        ns = argparse.Namespace(heartbeat=float(spec.get("heartbeat", 1.0)), db=spec["db"])
        return run_headless(session, ns)
    finally:
        from tui.commands.process import release_stop_signals

        release_stop_signals(control, restore)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def _install_signals(workers: Workers, on_hangup=None):
    """SIGINT / SIGTERM / SIGHUP stop every worker (once; a repeat says it is stopping)."""
    previous = {}

    def handler(signum, frame):
        name = signal.Signals(signum).name
        again = workers.stop_reason is not None
        workers.stop(name)
        with contextlib.suppress(OSError):
            os.write(2, (f"mdb: {'already stopping' if again else 'stopping'} ({name}): every "
                         "worker finishes its step, writes a checkpoint and marks its run "
                         "interrupted\n").encode())
        if name == "SIGHUP" and on_hangup is not None:
            on_hangup()

    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None:
            previous[sig] = signal.signal(sig, handler)

    def restore():
        for sig, old in previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)

    return restore


def _progress(plan: Plan) -> str:
    from hooks.store.store import RunStore, RunStoreError

    try:
        with RunStore(plan.db) as store:
            runs = {r.name: r for r in store.runs()}
    except RunStoreError:
        return ""
    from tui.screens.compare_data import short_labels

    parts = []
    for name, label in zip(plan.names, short_labels(plan.names), strict=True):
        r = runs.get(name)
        parts.append(f"{label} {r.last_step}/{r.total_steps}" if r else f"{label} —")
    return "progress: " + " · ".join(parts)


def _exit_code(workers: Workers, views) -> int:
    """The exit status of ``mdb ablate``: a stop by a signal is 128 + its number (SIGINT 130,
    SIGTERM 143, SIGHUP 129); a stop from the screen (``x``, Ctrl-C, or ``q`` while workers run)
    sent every worker SIGINT and interrupted their runs, so it is 130 as Ctrl-C is; a stop by
    an error is 1. Otherwise 1 when a worker failed or a run did not finish, else 0."""
    from hooks.train.trainer import signal_exit_code

    if workers.stop_reason is not None:
        if workers.stop_reason == "error":
            return 1
        return signal_exit_code(workers.stop_reason) or 128 + signal.SIGINT
    failed = any(j.code not in (0, None) for j in workers.jobs) or any(
        v.info is None or v.info.status != "finished" for v in views)
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb ablate``."""
    if args.worker:
        return _worker(args)
    plan = make_plan(args)
    from hooks.store.store import RunStore, RunStoreError
    from tui.commands.compare import print_table, read_views

    try:
        RunStore(plan.db, create=True).close()
    except RunStoreError as exc:
        raise MdbError(str(exc)) from None
    headless = args.headless or not has_screen()
    out = sys.stdout

    def say(line: str) -> None:
        if headless:
            print(f"mdb ablate: {printable(line)}", file=out, flush=True)  # a worker's reason

    with tempfile.TemporaryDirectory(prefix="mdb-ablate-") as tmp:
        workers = Workers(_jobs(plan, Path(tmp)), plan.jobs, on_event=say)
        say(f"{len(plan.variants)} variants, {plan.jobs} at a time, {plan.options[0]['steps']} "
            f"steps each, held-out ce@{','.join(map(str, plan.eval_lengths))} · db {plan.db}")
        hung_up = threading.Event()
        restore = _install_signals(workers, on_hangup=hung_up.set)
        try:
            workers.start()
            if headless:
                next_line = time.monotonic() + PROGRESS_EVERY
                while not workers.wait(0.2):
                    if time.monotonic() >= next_line:
                        next_line = time.monotonic() + PROGRESS_EVERY
                        line = _progress(plan)
                        if line:
                            say(line)
            else:
                _run_screen(plan, workers, hung_up)
                if workers.running():
                    print("mdb ablate: stopping the workers (each finishes its step and writes "
                          "a checkpoint)…", file=sys.stderr)
                    workers.stop("quit")
                workers.wait()
        finally:
            if workers.running():  # an exception on the way: leave no worker behind
                workers.stop("error")
                workers.wait(60)
            restore()
    with RunStore(plan.db) as store:
        views = read_views(store, plan.names, status=workers.status)
    print_table(views, plan.db)
    return _exit_code(workers, views)


def _run_screen(plan: Plan, workers: Workers, hung_up: threading.Event) -> None:
    from tui.screens.compare import CompareApp, CompareScreen

    labels = ", ".join(sorted({k for v in plan.variants for k in v.choices}))
    title = f"mdb ablate · {labels} · {len(plan.variants)} runs · {plan.db}"
    app = CompareApp(CompareScreen(plan.db, plan.names, controller=workers, title=title))

    def after_hangup() -> None:  # the terminal is gone: Textual cannot restore it (see live_app)
        hung_up.wait()
        workers.wait(300)
        os._exit(128 + signal.SIGHUP)

    threading.Thread(target=after_hangup, name="mdb-ablate-hangup", daemon=True).start()
    app.run()


__all__ = ["Job", "Plan", "Workers", "make_plan", "run"]

