"""The ``mdb`` command line: one argparse parser, one module per subcommand.

Each subcommand lives in ``tui/commands/<name>.py`` and defines ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. Command modules import torch, Textual and
the model lazily inside ``run`` so that ``mdb --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tui import __version__
from tui.errors import MdbError, OneLineParser, print_error

#: Subcommand name -> module under ``tui.commands``, in the order ``mdb --help`` lists them.
COMMANDS: dict[str, str] = {
    "step": "step",
    "summary": "summary",
    "capture": "capture",
    "overfit": "overfit",
    "watch": "watch",
    "runs": "runs",
    "stop": "stop",
    "export": "export",
    "doctor": "doctor",
    "diff": "diff",
    "compare": "compare",
    "ablate": "ablate",
    "lens": "lens",
    "memory": "memory",
    "roles": "roles",
    "serve": "serve",
    "sweep": "sweep",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Return the full ``mdb`` parser with every available subcommand registered (``only``: that
    subcommand alone, so that running one imports no other command's module)."""
    parser = OneLineParser(
        prog="mdb",
        description="mdb: a terminal debugger for the internals of a small "
        "Llama/Mixtral-style LLM.",
    )
    parser.add_argument("--version", action="version", version=f"mdb {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            module = importlib.import_module(f"tui.commands.{module_name}")
        except ModuleNotFoundError as exc:  # a command not built yet is simply not listed
            if exc.name == f"tui.commands.{module_name}":
                continue
            raise
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _torch=getattr(module, "NEEDS_TORCH", True))
    return parser


#: Options that name a file or directory, checked by :func:`check_common_options`.
PATH_OPTIONS = ("db", "config", "text", "trace", "out")


def check_common_options(args: argparse.Namespace) -> None:
    """Checks every subcommand shares, made before it creates or opens anything: ``--threads``
    (at most the machine's CPUs, :func:`tui.commands.options.check_threads`) and the file
    options of :data:`PATH_OPTIONS` (a name too long for the file system, a symbolic-link
    loop: :func:`tui.commands.options.check_path`).

    Raises:
        MdbError: the first option that fails, in one line.
    """
    from tui.commands.options import check_path, check_threads

    threads = getattr(args, "threads", None)
    if isinstance(threads, int):
        check_threads(threads)
    for name in PATH_OPTIONS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value:
            check_path(f"--{name}", value)


def import_torch_uninterrupted() -> None:
    """Import torch (and numpy) with SIGINT blocked in this thread, so that a Ctrl-C or
    ``kill -INT`` that arrives meanwhile is delivered once the import is done (then
    ``KeyboardInterrupt``: ``mdb: interrupted``, exit 130). Every subcommand imports torch;
    a SIGINT landing inside numpy's or torch's C initialisation left them half-initialised:
    of 40 SIGINTs sent to a starting ``mdb watch``, 1 ended in a traceback (``ImportError:
    cannot load module more than once per process``) and 4 in a hang. A command module
    that sets ``NEEDS_TORCH = False`` (the store commands: ``runs``, ``export``, ``watch``,
    ``compare``, ``stop``) is run without it.

    The cyclic garbage collector is off during the import, and the ~170,000 objects torch
    leaves (modules, functions, classes: they live as long as the process) are then moved out
    of its reach (``gc.freeze``): its full collections during the import and later, each a
    walk over all of them, cost ~0.1–0.2 s of ``mdb step``'s start-up (issue 25). The ~7,000
    objects of the import's own cyclic garbage are frozen with them (~1 MB, once)."""
    import gc
    import signal

    if "torch" in sys.modules or not hasattr(signal, "pthread_sigmask"):
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    collecting = gc.isenabled()
    gc.disable()
    try:
        import torch  # noqa: F401
    finally:
        gc.freeze()
        if collecting:
            gc.enable()
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mdb`` console script; returns the process exit code: the
    command's, 2 with one ``mdb: error:`` line for bad input (:class:`MdbError`) and for
    output that cannot be written (``mdb runs > /dev/full``, a closed stdout: ``cannot write
    output: No space left on device``), 0 when the reader of a pipe stopped reading (``mdb
    runs --json | head -c 20``: quiet, :mod:`tui.output`), 130 with ``mdb: interrupted`` for
    a SIGINT at any point, the parser's start included."""
    from tui.output import guarded_stdout, is_output_error, silence

    try:
        with guarded_stdout() as out:
            try:
                code = _run(argv)
                out.flush()  # a full disk is often said only here, by the last flush
                return code
            except OSError as exc:
                if not is_output_error(exc):
                    raise
                silence(out)  # what is still buffered goes nowhere at exit
                if isinstance(exc, BrokenPipeError):
                    return 0
                raise MdbError(f"cannot write output: {exc.strerror or exc}") from None
            except SystemExit:
                if not isinstance(out.error, BrokenPipeError):
                    raise
                return 0  # rich's console ended the command on the closed pipe (exit 1)
    except MdbError as exc:
        try:
            print_error(exc)
        except OSError:  # stderr cannot be written either (2>/dev/full): the code still says it
            pass
        return exc.exit_code
    except KeyboardInterrupt:
        print("mdb: interrupted", file=sys.stderr)
        return 130


def _run(argv: list[str] | None) -> int:
    """Parse ``argv`` and run its command (see :func:`main`)."""
    words = list(argv) if argv is not None else sys.argv[1:]
    # `mdb step ...` builds step's parser only (the start-up of mdb step, issue 25)
    parser = build_parser(words[0] if words and words[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    args._argv = words  # the trainer's
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    check_common_options(args)
    if getattr(args, "_torch", True):  # the store commands read SQLite only
        import_torch_uninterrupted()
    return int(args._run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
