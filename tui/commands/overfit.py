"""``mdb overfit``: memorise one batch (the overfit test: a short text, or your --model's batch)
as a recorded, resumable run.

By default minillm memorises a short text; ``--model module:function`` trains the user's own
model on the batch its factory returns (``(model, batch)`` or ``(model, batch, loss_fn)``).

Every run is written to the run store (``--db``, ``$MDB_DB``, default ``./runs/mdb.sqlite``) step
by step, so ``mdb watch`` in another terminal (or after an SSH reconnect) sees all of it, and
``mdb runs`` lists it. SIGINT, SIGTERM and SIGHUP stop the run after the current step, write a
checkpoint, mark it interrupted and exit 130 / 143 / 129 (a second Ctrl-C while it stops changes
nothing: the checkpoint is still written); ``mdb overfit --resume RUN`` continues (a run killed
before its first checkpoint starts again from step 0). A signal the process was started with
ignored (``nohup`` ignores SIGHUP) stays ignored: the run goes on.

``--nproc N`` runs the built-in overfit as a DDP job of N processes through ``torchrun`` (gloo
on CPU), each rank on its own seeded windows of the text, recorded as one run
(:mod:`tui.commands.overfit_ddp`); ``--fsdp`` shards it with FSDP2, ``--tp`` splits it tensor
parallel. Such a job keeps no checkpoints: ``--resume`` refuses it (one line, exit 2).

This module builds the session (:func:`build_session`) and runs it headless
(:func:`run_headless`); the live screen reuses :func:`build_session`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import sys
import time
from typing import Any

from hooks.text import printable
from tui.commands.options import nonneg_int, positive_float, positive_int, seed_int
from tui.commands.overfit_detach import default_run_name
from tui.commands.overfit_detach import open_store as open_run_store
from tui.commands.process import has_screen, is_terminal
from tui.errors import MdbError, ModelError, error_line, print_error
from tui.run_end import EXIT_FAILED, end_of_run

HELP = (
    "memorise one batch (the overfit test: a short text, or your --model's batch) as a "
    "recorded run, on a live screen (or --headless); watch it from elsewhere with `mdb watch`"
)

#: Options that choose minillm's text and batch, and so do not apply with --model.
_MINILLM_ONLY = ("text", "seq_len", "batch_size", "sample_every")

_DEFAULTS: dict[str, Any] = {
    "preset": "seed-test-c",
    "steps": 300,
    "lr": 3e-3,
    "batch_size": 1,
    "seed": 0,
    "every": 50,
    "sample_every": 25,
    "checkpoint_every": 0,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``mdb overfit``: what to train, how it is recorded, how it runs."""
    _training_arguments(parser.add_argument_group("what to train"))
    _recording_arguments(parser.add_argument_group("recording"))
    _running_arguments(parser.add_argument_group("running"))


def _training_arguments(g) -> None:
    g.add_argument("--text", metavar="FILE", default=None,
                   help="UTF-8 text to memorise (default: samples/overfit_zh.txt, the sentence "
                        "人工智能正在改变世界。 x6); one trailing newline is dropped")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None,
                     help="a named minillm config (default: seed-test-c: D=128, 4 layers, 4 heads, "
                          "1 KV head, 4 experts, top-2); vocab_size becomes the text's "
                          "character count")
    src.add_argument("--config", metavar="FILE.toml", default=None,
                     help="a minillm config as TOML (see samples/presets/)")
    src.add_argument("--model", metavar="MODULE:FUNCTION", default=None,
                     help="memorise your own model's batch: FUNCTION() returns (model, batch) or "
                          "(model, batch, loss_fn), as for `mdb step --model` (a module name or "
                          "path/to/file.py); the loss is loss_fn(out, batch), else out.loss, "
                          "else the scalar of a returned tuple. Importing the file runs its code")
    g.add_argument("--steps", type=positive_int, default=None,
                   help="total training steps (default 300; with --resume: a new total)")
    g.add_argument("--lr", type=positive_float, default=None,
                   help="AdamW learning rate, constant (default 3e-3)")
    g.add_argument("--schedule", choices=("constant", "warmup-cosine"), default=None,
                   help="learning-rate schedule: constant (default: the tutorial's test C, "
                        "which spikes at step 266) or warmup-cosine (20 warmup steps, then a "
                        "cosine decay to 0.1× --lr at the last step; no spike in 300 steps, "
                        "see docs/spikes.md)")
    g.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per sequence (default: the whole text); shorter windows are "
                        "drawn at seeded random offsets each step")
    g.add_argument("--batch-size", type=positive_int, default=None,
                   help="sequences per step (default 1)")
    g.add_argument("--seed", type=seed_int, default=None,
                   help="seed of the weights and the window offsets (default 0)")


def _recording_arguments(r) -> None:
    r.add_argument("--run", metavar="NAME", default=None,
                   help="run name (default overfit-YYYYmmdd-HHMMSS)")
    r.add_argument("--db", metavar="PATH", default=None,
                   help="run database (default $MDB_DB, else ./runs/mdb.sqlite); checkpoints go "
                        "beside it in <db-name>-checkpoints/<run>/")
    r.add_argument("--every", type=nonneg_int, default=None,
                   help="record the internals (hooks statistics) every N steps; 0 = never "
                        "(default 50)")
    r.add_argument("--sample-every", type=nonneg_int, default=None,
                   help="greedy continuation of the text's beginning every N steps; 0 = never "
                        "(default 25)")
    r.add_argument("--checkpoint-every", type=nonneg_int, default=None,
                   help="also checkpoint every N steps (default 0: at the end and on "
                        "interruption only); lets a run killed with -9 resume")
    r.add_argument("--resume", metavar="RUN", default=None,
                   help="continue an interrupted run from its checkpoint (takes only --steps, "
                        "--db, --headless, --threads, --model); a --model run imports its "
                        "factory again only if the file's sha256 is the one stored with the "
                        "run, or if you name it again with --model")


def _running_arguments(x) -> None:
    x.add_argument("--headless", action="store_true",
                   help="no UI: one progress line on a terminal, plain lines otherwise (for "
                        "nohup, tmux, batch jobs); also used when stdin or stdout is not a "
                        "terminal")
    x.add_argument("--detach", action="store_true",
                   help="start the run in the background and return at once (its name, pid "
                        "and the `mdb watch` line are printed); `mdb stop RUN` stops it")
    x.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads (default 1: small models train fastest on one); "
                        "with --nproc, per rank")
    x.add_argument("--nproc", type=positive_int, default=None, metavar="N",
                   help="run it as a job of N processes through torchrun (gloo backend, "
                        "CPU; DDP, or --fsdp / --tp), each rank on its own seeded windows of "
                        "the text (--seq-len, "
                        "default half the text); one run, every rank in `mdb watch`")
    x.add_argument("--fsdp", action="store_true",
                   help="with --nproc: shard the model with FSDP2 (fully_shard per decoder "
                        "layer) instead of DDP; the same windows, the same losses")
    x.add_argument("--tp", action="store_true",
                   help="with --nproc: tensor parallel (q/o projections and MLPs split across "
                        "the ranks); every rank runs every rank's windows")
    x.add_argument("--gather-every", type=positive_int, default=None, metavar="N",
                   help="with --nproc: every rank's steps reach rank 0 (and the run store) "
                        "every N steps (default 10)")
    x.add_argument("--heartbeat", type=positive_float, default=1.0, help=argparse.SUPPRESS)
    x.add_argument("--debug-nan-at", type=positive_int, default=None, metavar="STEP",
                   help=argparse.SUPPRESS)


# ---------------------------------------------------------------------------------------------


def _options_from_args(args: argparse.Namespace):
    from hooks.train.overfit import OverfitOptions, default_overfit_text
    from tui.commands.inputs import check_memory, load_config, read_text, samples_dir

    if args.text:
        text, source = read_text(args.text), str(args.text)
    else:
        path = samples_dir() / "overfit_zh.txt"
        if path.exists():
            text, source = read_text(path), "samples/overfit_zh.txt"
        else:
            text, source = default_overfit_text()
    if text.endswith("\n"):
        text = text[:-1]
        if text.endswith("\r"):
            text = text[:-1]
    if args.config is None and args.preset is None:
        args.preset = _DEFAULTS["preset"]
    config = load_config(args)
    d = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in _DEFAULTS.items()}
    # the vocabulary becomes the text's characters, a step sees min(--seq-len, the text)
    seq = min(args.seq_len or len(text), len(text))
    check_memory(config.replace(vocab_size=max(1, len(set(text)))), d["batch_size"], seq)
    return OverfitOptions(
        text=text,
        text_source=source,
        model_config=config.to_dict(),
        preset=None if args.config else args.preset,
        steps=d["steps"],
        lr=d["lr"],
        seq_len=args.seq_len,
        batch_size=d["batch_size"],
        seed=d["seed"],
        every=d["every"],
        sample_every=d["sample_every"],
        checkpoint_every=d["checkpoint_every"],
        schedule=args.schedule or "constant",
    )


def _model_options(args: argparse.Namespace):
    from hooks.train.overfit import ModelOverfitOptions

    if getattr(args, "schedule", None) not in (None, "constant"):
        raise MdbError("--schedule applies to the text run of minillm, not to --model")
    d = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in _DEFAULTS.items()}
    return ModelOverfitOptions(model=args.model, steps=d["steps"], lr=d["lr"], seed=d["seed"],
                               every=d["every"], checkpoint_every=d["checkpoint_every"])


def _build_workload(spec: str):
    """``--model``'s factory, imported and called (errors: :class:`MdbError`, one line)."""
    from tui.commands.workload import load_user_workload

    return load_user_workload(spec)


def build_session(args: argparse.Namespace, control=None):
    """The session the options describe, new or resumed: an
    :class:`hooks.train.overfit.OverfitSession` (minillm) or a
    :class:`hooks.train.overfit.ModelOverfitSession` (``--model``).

    Args:
        args: Parsed ``mdb overfit`` options.
        control: A :class:`hooks.train.trainer.TrainControl` to use (e.g. one whose signal handlers
            are already installed), or ``None`` for a fresh one.

    Raises:
        MdbError: Any bad option, database or run (one line).
    """
    import torch

    from hooks.store.store import RunStoreError, validate_run_name
    from hooks.train.overfit import ModelOverfitSession, OverfitSession

    torch.set_num_threads(args.threads)
    if args.resume:
        session = _resumed_session(args)
    else:
        if getattr(args, "model", None):
            given = [f"--{k.replace('_', '-')}" for k in _MINILLM_ONLY
                     if getattr(args, k) is not None]
            if given:
                raise MdbError(f"{', '.join(given)} does not apply with --model: your function "
                               "returns the batch")
        if args.run is not None:
            try:
                validate_run_name(args.run)
            except RunStoreError as exc:
                raise MdbError(f"--run: {exc}") from None
        # Every check, and the model, come before the database: a rejected run creates none.
        opened = []

        def open_store():
            opened.append(open_run_store(args, create=True))
            return opened[-1]

        def name_in(store) -> str:
            return args.run or default_run_name(store)

        try:
            if getattr(args, "model", None):
                session = ModelOverfitSession.create(open_store, name_in, _model_options(args),
                                                     _build_workload)
            else:
                session = OverfitSession.create(open_store, name_in, _options_from_args(args))
        except RunStoreError as exc:
            for store in opened:
                store.close()
            raise MdbError(str(exc)) from None
        except (ValueError, MdbError) as exc:
            for store in opened:
                store.close()
            if isinstance(exc, MdbError):
                raise
            from hooks.errors import ModelRaisedError

            if isinstance(exc, ModelRaisedError):  # the user's code raised: exit 1
                raise ModelError(str(exc)) from None
            raise MdbError(str(exc)) from None
    if control is not None:
        session.control = control
    if args.debug_nan_at is not None:
        _arm_nan(session, args.debug_nan_at)
    return session


def _resumed_session(args: argparse.Namespace):
    """``--resume RUN``: the run's session from its checkpoint, or from step 0 (said on
    stderr) when it has none.

    Raises:
        MdbError: Options that do not apply, a database or run that cannot be resumed.
    """
    from hooks.store.store import RunStoreError
    from hooks.train.overfit import resume_session

    given = [
        f"--{k.replace('_', '-')}"
        for k in ("text", "preset", "config", "lr", "seq_len", "batch_size", "seed",
                  "run", "every", "sample_every", "checkpoint_every")
        if getattr(args, k, None) is not None
    ]
    if given:
        raise MdbError(
            f"--resume continues a run with its own settings; drop {', '.join(given)}"
        )
    store = open_run_store(args, create=False)
    try:
        session = resume_session(store, args.resume, steps=args.steps, build=_build_workload,
                                 model=getattr(args, "model", None))
    except RunStoreError as exc:
        store.close()
        raise MdbError(str(exc)) from None
    except (MdbError, ValueError, FileNotFoundError) as exc:
        store.close()
        raise MdbError(f"cannot resume {args.resume!r}: {exc}") from None
    if session.restarted:
        _stderr_line(f"mdb: run {args.resume} has no checkpoint (its writer stopped before "
                     "the first one was written): it starts again from step 0, with its own "
                     "settings and seed")
    return session


def _arm_nan(session, step: int) -> None:
    """Testing aid (hidden ``--debug-nan-at``): poison a weight so step ``step`` is non-finite
    (minillm's last ``v_proj``; for a ``--model``, its last parameter of two or more
    dimensions)."""
    import torch

    try:
        layer = session.model.model.layers[-1].self_attn.v_proj
    except AttributeError:
        weights = [p for p in session.model.parameters() if p.dim() >= 2]
        layer = type("W", (), {"weight": weights[-1]})()
    trainer = session.trainer
    original = trainer.batch

    def batch(s: int):
        if s == step:
            with torch.no_grad():
                layer.weight[0, 0] = float("nan")
        return original(s) if callable(original) else original

    trainer.batch = batch


# ---------------------------------------------------------------------------------------------
# Headless output
# ---------------------------------------------------------------------------------------------


class _SafeStream:
    """A text stream that survives its terminal going away (SIGHUP): on the first write error
    it points fds 1 and 2 at /dev/null and drops all further output, so neither this process's
    output nor Python's exit-time flush fails."""

    def __init__(self, stream):
        self.stream = stream
        self.broken = False

    def write(self, s: str) -> int:
        if self.broken:
            return len(s)
        try:
            n = self.stream.write(s)
            return n if n is not None else len(s)
        except (OSError, ValueError):
            self._break()
            return len(s)

    def flush(self) -> None:
        if self.broken:
            return
        try:
            self.stream.flush()
        except (OSError, ValueError):
            self._break()

    def isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", "utf-8") or "utf-8"

    def _break(self) -> None:
        self.broken = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.close(devnull)
        except OSError:
            pass


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "nan" if x is None else format(x, spec)


class _Reporter:
    """Progress output of a headless run: a Rich progress line on a terminal, else plain lines
    (every ~5 % of the run or 10 s, plus samples and the end)."""

    def __init__(self, session, stream=None):
        self.session = session
        self.out = _SafeStream(stream or sys.stdout)
        self.total = session.trainer.total_steps
        self.start_step = session.trainer.start_step
        self.tty = self.out.isatty()
        self.every = max(1, (self.total - self.start_step) // 20)
        self.last_print = 0.0
        self.t0 = time.perf_counter()
        self.progress = None
        self.sample = ""
        self.last_metrics = None
        self._spikes_said: set[int] = set()
        from hooks.store.rates import StepRate

        self.rate = StepRate()  # the speed every view shows (hooks.store.rates)

    def line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def __enter__(self):
        s = self.session
        self.line(
            f"mdb overfit: run {s.name} · {s.describe()} · steps "
            f"{self.start_step + 1}..{self.total} · db {s.store.path}"
        )
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
            from rich.table import Column

            console = Console(file=self.out, highlight=False)
            self.progress = Progress(
                BarColumn(bar_width=20),
                MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=9)),
                TextColumn(
                    "{task.fields[stats]}",
                    markup=False,  # the sample is the model's text: never markup
                    table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"),
                ),
                expand=True,
                console=console,
                auto_refresh=False,
                transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task(
                s.name, total=self.total, completed=self.start_step, stats=""
            )
        return self

    def say_spikes(self, current_step: int | None = None) -> None:
        """One line per loss spike the writer recorded, once its episode is over (so that the
        line gives its peak and length); with ``current_step=None`` every one not said yet."""
        writer = getattr(self.session, "writer", None)
        for spike in list(getattr(writer, "spikes", ()))[-3:]:
            if spike.step in self._spikes_said:
                continue
            if current_step is not None and spike.last_step >= current_step:
                continue  # still going
            self._spikes_said.add(spike.step)
            text = spike.describe()
            if self.progress is not None:
                try:
                    self.progress.console.print(text, markup=False, highlight=False)
                except (OSError, ValueError):
                    pass
            else:
                self.line(text)

    def __exit__(self, *exc) -> None:
        self.say_spikes()
        if self.progress is not None:
            try:
                self.progress.refresh()
                self.progress.stop()
            except (OSError, ValueError):
                pass

    def on_step(self, report) -> None:
        from tui.screens.live_data import metric_values

        m = report.metrics
        self.last_metrics = m
        self.rate.add(m.wall)
        self.say_spikes(m.step)
        values = metric_values(m, self.session.metric_names)
        if report.sample is not None:
            self.sample = printable(report.sample[0] + "|" + report.sample[1])
        losses = "  ".join(f"{name} {_fmt(values.get(name))}"
                           for name in self.session.headline_metrics)
        stats = (
            f"{losses}  |g| {_fmt(values.get('grad_norm'), '.3g')}  "
            f"{_fmt(self.rate.steps_per_s(values.get('step_time')), '.1f')} steps/s"
        )
        if self.progress is not None:  # one terminal line: the sample goes last, cut to fit
            stats = stats.replace("  ", " ")
        now = time.perf_counter()
        if self.progress is not None:
            self.progress.update(
                self.task,
                completed=m.step,
                stats=stats + (f" {self.sample}" if self.sample else ""),
            )
            if now - self.last_print >= 0.1 or m.step == self.total:
                self.last_print = now
                try:
                    self.progress.refresh()
                except (OSError, ValueError):
                    pass
            return
        if report.sample is not None:
            self.line(f"sample @{m.step}: {self.sample}")
        if (
            m.step % self.every == 0
            or m.step == self.total
            or m.step == self.start_step + 1
            or now - self.last_print >= 10
        ):
            self.last_print = now
            self.line(f"step {m.step}/{self.total}  {stats}")


def stop_signals() -> list[str]:
    """The signals that stop a run: SIGINT, SIGTERM and SIGHUP, except those this process
    ignores. ``nohup`` starts a command with SIGHUP ignored (and a shell's ``&`` one with
    SIGINT ignored) to ask that the terminal going away does not stop it: such a signal stays
    ignored."""
    names = []
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
            names.append(name)
    return names


def _stderr_line(text: str) -> None:
    """One line on stderr with a plain ``os.write`` (safe inside a signal handler)."""
    try:
        os.write(2, (text + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _say_already_stopping(session):
    def on_repeat(name: str) -> None:
        saved = session.last_checkpoint_step
        after = f"; the run then resumes from step {saved}" if saved is not None else ""
        _stderr_line(f"mdb: already stopping ({name}): finishing the step in progress and "
                     f"writing its checkpoint (kill -9 ends it at once{after})")
    return on_repeat


def run_headless(session, args: argparse.Namespace | None = None) -> int:
    """Run ``session`` to its end with progress output; return the exit status.

    Installs SIGINT/SIGTERM/SIGHUP handlers (main thread) that stop the run gracefully, for
    those of them this process does not ignore (:func:`stop_signals`); a signal while it stops
    (a second Ctrl-C) only says that it is stopping. A checkpoint that cannot be
    written is said at once on stderr (``mdb: warning: ...``) and the run goes on.

    Returns:
        0 finished; 128 + signal number when stopped by a signal (130 SIGINT, 143 SIGTERM,
        129 SIGHUP); 130 when stopped otherwise; :data:`tui.run_end.EXIT_FAILED` (1) when a
        non-finite value appeared, the last checkpoint could not be written, a database write
        failed (disk full) or the model raised — each with one ``mdb: error:`` line.
    """
    from hooks.store.writer import WriterLostError
    from hooks.train.trainer import install_stop_signals

    restore = install_stop_signals(session.control, stop_signals(),
                                   on_repeat=_say_already_stopping(session))
    poller = _control_poller(session)
    reporter = _Reporter(session)
    session.on_warning = lambda line: _stderr_line(error_line(line, "warning"))
    heartbeat = getattr(args, "heartbeat", 1.0) if args is not None else 1.0
    try:
        with reporter:
            result = session.run(on_step=reporter.on_step, heartbeat_interval=heartbeat)
    except WriterLostError as exc:  # the database deleted, or the run resumed elsewhere
        print(f"mdb: error: {exc}; training stopped at step {session.trainer.step}; "
              f"{_kept(session)}", file=sys.stderr)
        return EXIT_FAILED
    except sqlite3.Error as exc:
        print_error(f"run {session.name}: writing step {session.trainer.step} to "
                    f"{session.store.path} failed: {exc}; {_recorded(session)}")
        return EXIT_FAILED
    except Exception as exc:  # the user's model, a loss_fn: one line, the run marked failed
        from hooks.errors import describe_error

        where = describe_error(exc, getattr(session.trainer, "model", None))
        print_error(f"run {session.name} failed at step {session.trainer.step + 1}: "
                    f"{where}; {_recorded(session)}")
        return EXIT_FAILED
    finally:
        poller.close()
        restore()
        verdict = _verdict_lines(session, args.db if args is not None else None)
        session.store.close()
    line, is_error, code = end_of_run(session, result, reporter.last_metrics,
                                      args.db if args is not None else None)
    if is_error:
        print_error(line)
    else:
        reporter.line(line)
    for text in verdict:
        reporter.line(text)
    return code


def _verdict_lines(session, db: str | None) -> list[str]:
    """The verdict's lines (:meth:`hooks.train.overfit.RunSession.verdict`), printable; none
    when the store cannot say (a run that never started)."""
    try:
        return [printable(x) for x in session.verdict().lines(db)]
    except Exception:  # the end line says what happened; a verdict is extra
        return []


#: When this process started (about): requests to the run written before it were for an
#: earlier attempt (a resumed run ignores them).
PROCESS_STARTED = time.time()


def _control_poller(session):
    """Act on ``mdb stop`` and the viewers' ``p``/``x`` (requests in the run store's control
    table, :mod:`hooks.store.control`): stop after the step with a checkpoint, pause, resume."""
    from hooks.store.control import ControlPoller

    control = session.control
    actions = {"stop": lambda: control.stop("stopped"), "pause": control.pause,
               "resume": control.resume}
    return ControlPoller(session.store.path, session.writer.run_id,
                         lambda command: actions[command](), since=PROCESS_STARTED).start()


def _kept(session) -> str:
    """Where the run's last checkpoint stays, after its database was lost."""
    saved = session.last_checkpoint_step
    if saved is None:
        return "no checkpoint was written"
    return f"its checkpoint of step {saved} is kept in {session.last_checkpoint}"


def _recorded(session) -> str:
    """Which steps the store holds and where a resume would start, after a failed write."""
    saved = session.last_checkpoint_step
    resume = (f"a resume starts from step {saved}" if saved is not None
              else "it cannot be resumed")
    return f"the database holds steps up to {session.recorded_step}, {resume}"


def _run_nproc(args: argparse.Namespace) -> int:
    """``--nproc N``: the options checked here (one line each), the job in overfit_ddp."""
    from tui.commands.overfit_ddp import run_ddp

    if args.nproc < 2:
        raise MdbError("--nproc must be 2 or more (without it the run is one process)")
    if getattr(args, "fsdp", False) and getattr(args, "tp", False):
        raise MdbError("--fsdp and --tp exclude each other (one way of splitting the model)")
    given = [f"--{k.replace('_', '-')}" for k in ("resume", "model", "checkpoint_every",
                                                  "debug_nan_at", "schedule")
             if getattr(args, k, None) is not None]
    if given:
        from tui.commands.overfit_ddp import job_kind

        raise MdbError(f"{', '.join(given)} does not apply with --nproc (the {job_kind(args)} "
                       "job trains the built-in model and keeps no checkpoints)")
    options = _options_from_args(args)
    n = len(options.text) if options.tokenizer == "char" else len(options.text.encode())
    if options.seq_len is None:
        options.seq_len = max(2, n // 2)
    elif options.seq_len >= n:
        raise MdbError(f"--seq-len {options.seq_len} covers the whole text ({n} tokens): with "
                       "--nproc every rank trains on its own window, pass a shorter one")
    try:
        options.validate()
    except ValueError as exc:
        raise MdbError(str(exc)) from None
    store = open_run_store(args, create=True)
    try:
        name = args.run or default_run_name(store)
        if args.run and any(r.name == name for r in store.runs()):
            raise MdbError(f"a run named {name!r} already exists in {store.path} (choose "
                           "another --run)")
        from hooks.store.store import RunStoreError, validate_run_name

        try:
            validate_run_name(name)
        except RunStoreError as exc:
            raise MdbError(str(exc)) from None
        path = store.path
    finally:
        store.close()
    return run_ddp(args, options, path, name)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb overfit``."""
    from hooks.store.store import RunStoreError, validate_run_name
    from hooks.train.trainer import TrainControl, install_stop_signals

    if args.resume is not None:  # checked as --run is, before it names anything on disk
        try:
            validate_run_name(args.resume)
        except RunStoreError as exc:
            raise MdbError(f"--resume: {exc}") from None
    if getattr(args, "nproc", None) is not None:
        if args.detach:
            from tui.commands.overfit_ddp import job_kind

            raise MdbError(f"--detach does not apply with --nproc (the {job_kind(args)} job runs "
                           "in the foreground; start it under nohup, it is recorded as one run)")
        if args.gather_every is None:
            args.gather_every = 10
        return _run_nproc(args)
    if getattr(args, "gather_every", None) is not None:
        raise MdbError("--gather-every applies only with --nproc (a job of N processes)")
    if getattr(args, "fsdp", False) or getattr(args, "tp", False):
        raise MdbError(f"--{'fsdp' if args.fsdp else 'tp'} applies only with --nproc (a job "
                       "of N processes)")
    if args.detach and args.headless:
        raise MdbError("--detach and --headless exclude each other: --detach runs headless in "
                       "the background, --headless in the foreground (for nohup and batch jobs)")
    from tui.commands import overfit_detach

    if args.detach:
        return overfit_detach.run_detached(args)
    if not args.headless and has_screen():
        return overfit_detach.run_viewer(args)  # the trainer in a process of its own

    control = TrainControl()
    building = [True]

    def on_signal(name: str) -> None:
        # While the model is built nothing is recorded yet (a rejected or interrupted build
        # leaves no run behind), so a signal ends the process at once — also when the user's
        # factory or forward hangs. Once the run exists, it stops the run after its step.
        if building[0]:
            if name == "SIGINT":
                raise KeyboardInterrupt
            _stderr_line(f"mdb: stopped by {name} while building the model; nothing was "
                         "recorded")
            raise SystemExit(128 + int(getattr(signal, name)))

    # Signals arriving just after the model is built stop the run before its first step; the
    # handlers stay until the run's own are installed, so no signal finds Python's default.
    restore = install_stop_signals(control, stop_signals(), on_signal=on_signal)
    try:
        if is_terminal(sys.stderr) and not args.headless:
            _stderr_line("mdb: building the model… (Ctrl-C stops)")
        session = build_session(args, control=control)
        building[0] = False
        return run_headless(session, args)  # (live, it runs as the viewer's trainer process)
    finally:
        building[0] = False
        from tui.commands.process import release_stop_signals

        release_stop_signals(control, restore)
