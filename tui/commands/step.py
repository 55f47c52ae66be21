"""``mdb step``: walk through one forward and backward pass in a Textual debugger.

With no arguments: build the default model, cut a batch from the sample text, run one forward
and backward pass on CPU under :func:`hooks.capture`, and open the step view. ``--trace FILE``
opens a saved trace instead (``mdb capture --out FILE`` writes one), ``--run NAME@STEP`` a
capture stored in the run database (``run.watch`` of ``hooks.run``, ``mdb overfit --every``).
The model and batch are built before the app starts (so bad input is one line on stderr and
exit code 2); the app then paints a loading screen and captures the step in a thread worker. An
error raised by a user's model during the step ends the app with exit code 1 and one line on
stderr.
"""

from __future__ import annotations

import argparse
import os
import sys

from tui.commands.options import add_model_arguments
from tui.commands.process import is_terminal, require_terminal
from tui.errors import MdbError, print_error

HELP = "step through one forward and backward pass of the model in a terminal debugger"

_MODEL_OPTIONS = ("preset", "config", "model", "text")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="open a saved trace (a directory written by `mdb capture`) "
                             "instead of capturing a new step")
    add_run_arguments(parser)
    add_model_arguments(parser)
    add_threads_argument(parser)
    parser.epilog = (
        "keys: n/p next/previous call, N/P next/previous layer, b backward, f first NaN/Inf, "
        "/ find, r router, a attention, g gradients, ? all keys, q quit"
    )


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch CPU threads for the captured step (shared by step/summary/capture)."""
    from tui.commands.options import nonneg_int

    parser.add_argument(
        "--threads", type=nonneg_int, default=1, metavar="N",
        help="torch CPU threads for the captured step, at most the machine's CPUs (default 1: "
             "the small default model runs fastest on one thread, above all on a busy machine, "
             "and the statistics do not depend on the machine's core count; 0 = torch's "
             "default)",
    )  # fmt: skip


def set_threads(args: argparse.Namespace) -> None:
    """Apply ``--threads`` (imports torch)."""
    import torch

    if getattr(args, "threads", 0) and args.threads > 0:
        torch.set_num_threads(args.threads)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``--run NAME[@STEP]`` and ``--db``: a capture stored in the run database (shared by step
    and summary)."""
    parser.add_argument("--run", metavar="NAME[@STEP]", default=None,
                        help="open the capture of step STEP of a recorded run (stored by "
                             "run.watch(model, every=N) or `mdb overfit --every N`); without "
                             "@STEP the latest one")
    parser.add_argument("--db", metavar="PATH", default=None,
                        help="run database of --run (default $MDB_DB, else ./runs/mdb.sqlite)")


def _steps_text(steps: list[int]) -> str:
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return ", ".join(map(str, steps[:4])) + ", …, " + ", ".join(map(str, steps[-3:]))


def load_run_trace(spec: str, db: str | None, label: str = "--run"):
    """The :class:`hooks.Trace` stored for ``NAME@STEP`` (or ``NAME``: its latest capture) in
    the run database; every problem is one :class:`MdbError` line starting with
    ``{label} {spec}:`` (``{spec}:`` without a label)."""
    from hooks import TraceFormatError
    from hooks.store.store import RunStore, RunStoreError, default_db_path
    from hooks.train.trainer import load_trace as load_stored_trace

    where = f"{label} {spec}" if label else spec
    name, at, step_text = spec.partition("@")
    step = None
    if at:
        try:
            step = int(step_text)
        except ValueError:
            raise MdbError(f"{where}: STEP must be a step number, e.g. {name}@50") from None
    try:
        with RunStore(db if db else default_db_path()) as store:
            info = store.run(name)
            steps = store.internals_steps(info.id)
            if not steps:
                raise MdbError(
                    f"{where}: run {name} has no stored capture (record some with "
                    "run.watch(model, every=N), or `mdb overfit --every N`)"
                )
            if step is None:
                step = steps[-1]
            elif step not in steps:
                raise MdbError(f"{where}: no stored capture at step {step} (captured "
                               f"steps: {_steps_text(steps)})")
            trace = load_stored_trace(store, info.id, step)
    except RunStoreError as exc:
        raise MdbError(f"{where}: {exc}") from None
    except TraceFormatError as exc:
        raise MdbError(f"{where}: the stored capture cannot be read: {exc}") from None
    if trace is None:  # pragma: no cover - deleted between the two reads
        raise MdbError(f"{where}: no stored capture at step {step}")
    return trace


def check_run_options(args: argparse.Namespace) -> None:
    """``--run`` excludes ``--trace`` and the model options; ``--db`` needs ``--run``."""
    if getattr(args, "run", None):
        given = [f"--{o.replace('_', '-')}" for o in ("trace", *_MODEL_OPTIONS)
                 if getattr(args, o, None)]
        if given:
            raise MdbError(f"--run cannot be combined with {', '.join(given)}")
    elif getattr(args, "db", None):
        raise MdbError("--db is the database of --run NAME@STEP: give --run too")


def load_trace(path: str):
    """Read a saved trace; a missing or malformed file -> MdbError."""
    from hooks import Trace, TraceFormatError

    try:
        return Trace.load(path)
    except FileNotFoundError:
        raise MdbError(f"--trace {path}: no such trace (expected a directory with trace.json)") \
            from None
    except TraceFormatError as exc:
        raise MdbError(f"--trace {path}: {exc}") from None
    except OSError as exc:
        raise MdbError(f"--trace {path}: cannot read ({exc.strerror or exc})") from None


def build_from_args(args: argparse.Namespace):
    """Build the workload the options describe (all bad-input errors are raised here)."""
    from tui.commands.workload import build_workload

    set_threads(args)
    return build_workload(args)


#: The :class:`BackgroundStep` of this process (``mdb step`` starts at most one).
_LIVE: list[BackgroundStep] = []


class BackgroundStep:
    """Build minillm's workload from ``args`` and capture its step in a daemon thread, while
    the main thread imports Textual and starts the app (start-up of ``mdb step``, issue 25:
    torch's kernels, the weights' initialisation and most of the step's, release the GIL).

    :meth:`workload` waits for the model and raises what the build raised (bad input is still
    one line before the app takes the terminal); :meth:`trace` waits for the capture (the app's
    loader). A user's ``--model`` factory is not run here: it runs on the main thread, as
    before. Call :func:`set_threads` before (torch's thread count is set on the main thread).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        import threading

        self._built = threading.Event()
        self._done = threading.Event()
        self._workload = self._trace = self._error = None
        _LIVE.append(self)
        threading.Thread(target=self._run, args=(args,), name="mdb-build", daemon=True).start()

    def running(self) -> bool:
        """Whether the thread still builds or captures."""
        return not self._done.is_set()

    def _run(self, args: argparse.Namespace) -> None:
        from tui.commands.workload import build_workload

        try:  # an error is handed to the waiting thread, which raises it
            self._workload = build_workload(args)
        except BaseException as exc:
            self._error = exc
            self._done.set()
            return
        finally:
            self._built.set()
        try:
            self._trace = capture(self._workload)
        except BaseException as exc:
            self._error = exc
        finally:
            self._done.set()

    def workload(self):
        """The built workload; raises the build's error (:class:`MdbError` for bad input)."""
        self._built.wait()
        if self._workload is None:
            raise self._error
        return self._workload

    def trace(self):
        """The captured :class:`hooks.Trace`; raises the build's or the step's error."""
        self._done.wait()
        if self._trace is None:
            raise self._error
        return self._trace

    def finish(self) -> None:
        """Wait for the thread (before the process exits on an error: torch is not left
        running in a daemon thread while Python shuts down)."""
        self._done.wait()


def capture(workload):
    """Capture one forward and backward pass of ``workload``, attention included."""
    from tui.commands.capturing import capture_step

    return capture_step(workload, attention=True)


def run_doctor(workload, on_result):
    """``mdb doctor``'s checks (without the slow overfit check) on the workload's model; the
    step view's ``d`` key runs this on demand."""
    from hooks.doctor.model import run_checks

    return run_checks(workload, on_result=on_result)


def precheck(args: argparse.Namespace) -> None:
    """Checks that need no torch, done before the terminal switches to the app."""
    from pathlib import Path

    from tui.commands.inputs import read_text

    if args.text:
        read_text(args.text)
    if args.trace and not Path(args.trace).exists():
        raise MdbError(f"--trace {args.trace}: no such file or directory")
    if args.config and not Path(args.config).exists():
        raise MdbError(f"--config {args.config}: no such file")


def _loading_app(args: argparse.Namespace):
    """``(app, background)``: the app that captures the step of the model ``args`` describe,
    and the :class:`BackgroundStep` that builds and captures minillm's while Textual is
    imported (None for a ``--model`` factory: called here, its step captured by the app's
    loader)."""
    background = None
    if getattr(args, "model", None):
        from tui.app import make_loading_app

        workload = build_from_args(args)
        load = lambda: capture(workload)  # noqa: E731
    else:
        set_threads(args)
        background = BackgroundStep(args)
        try:
            import tui.screens.step  # noqa: F401  (imported meanwhile, not after the capture)
            from tui.app import make_loading_app

            workload = background.workload()
        except KeyboardInterrupt:  # not waited for: see run()
            raise
        except BaseException:
            background.finish()
            raise
        load = background.trace
    app = make_loading_app(
        load,
        doctor_runner=lambda on_result: run_doctor(workload, on_result),
        loading_text=f"mdb · capturing one forward and backward pass of "
                     f"{workload.description or 'the model'}…",
    )
    return app, background


def run(args: argparse.Namespace) -> int:
    import gc

    # no cyclic garbage collection until the step view is painted (MdbApp.step_painted): its
    # passes over the start-up's ~100,000 new objects cost ~0.1 s of it (issue 25)
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _run(args, collecting)
    except KeyboardInterrupt:
        if any(b.running() for b in _LIVE):
            # the build thread may wait on an import lock the interrupted main thread left,
            # and torch still running in a daemon thread at interpreter exit aborts it
            # ("terminate called without an active exception"): leave at once
            print("mdb: interrupted", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        raise
    finally:
        if collecting:
            gc.enable()


def _run(args: argparse.Namespace, collecting: bool) -> int:
    precheck(args)
    check_run_options(args)
    background = None
    if args.run:
        from tui.app import make_step_app

        app = make_step_app(load_run_trace(args.run, args.db))
    elif args.trace:
        from tui.app import make_step_app

        given = [f"--{o.replace('_', '-')}" for o in _MODEL_OPTIONS if getattr(args, o, None)]
        if given:
            raise MdbError(f"--trace cannot be combined with {', '.join(given)}")
        app = make_step_app(load_trace(args.trace))
    else:
        # Build before the app starts: every bad-input error (preset, config, text, sequence
        # length, --model) is then one line on a normal terminal, not a flash of the app.
        if is_terminal(sys.stderr):
            print("mdb: building the model…", file=sys.stderr, flush=True)
        app, background = _loading_app(args)
    # after the input checks, so that bad input is reported as such with or without a terminal
    try:
        require_terminal("mdb step", "`mdb summary` for a table, or `mdb capture --out FILE` "
                         "to save a trace and open it later with `mdb step --trace FILE`")
    except MdbError:
        if background is not None:
            background.finish()
        raise
    app.gc_after_paint = collecting
    code = app.run()
    if getattr(app, "loading", False):
        # quit while the user's forward still runs in the loader thread: a Python thread cannot
        # be stopped, and waiting for it would keep the process alive after the UI closed
        print("mdb: quit during the capture; the model's step was abandoned", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if app.return_code is None else int(app.return_code or 0))
    if app.error:
        print_error(app.error)
        return app.return_code or 2
    return int(app.return_code or code or 0)
