"""``mdb step``: walk through one forward and backward pass in a Textual debugger.

With no arguments: build the default model, cut a batch from the sample text, run one forward
and backward pass on CPU under :func:`hooks.capture`, and open the step view. ``--trace FILE``
opens a saved trace instead (``mdb capture --out FILE`` writes one). The app paints a loading
screen first and captures in a thread worker; bad input ends the app with exit code 2 and one
line on stderr.
"""

from __future__ import annotations

import argparse
import sys

from tui.commands._common import add_model_arguments
from tui.errors import MdbError

HELP = "step through one forward and backward pass of the model in a terminal debugger"

_MODEL_OPTIONS = ("preset", "config", "model", "text")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="open a saved trace (a directory written by `mdb capture`) "
                             "instead of capturing a new step")
    add_model_arguments(parser)
    parser.epilog = (
        "keys: n/p next/previous call, N/P next/previous layer, b backward, f first NaN/Inf, "
        "/ find, r router, a attention, g gradients, ? all keys, q quit"
    )


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


def capture_from_args(args: argparse.Namespace):
    """Build the workload the options describe and capture one step of it."""
    from tui.commands._common import build_workload, capture_step

    return capture_step(build_workload(args), attention=True)


def run(args: argparse.Namespace) -> int:
    from tui.app import make_loading_app

    if args.trace:
        given = [f"--{o.replace('_', '-')}" for o in _MODEL_OPTIONS if getattr(args, o, None)]
        if given:
            raise MdbError(f"--trace cannot be combined with {', '.join(given)}")
        path = args.trace
        app = make_loading_app(lambda: load_trace(path), loading_text=f"loading {path}…")
    else:
        what = args.model or args.config or args.preset or "default"
        app = make_loading_app(
            lambda: capture_from_args(args),
            loading_text=f"mdb · capturing one forward and backward pass of {what}…",
        )
    code = app.run()
    if app.error:
        print(f"mdb: error: {app.error}", file=sys.stderr)
        return app.return_code or 2
    return int(app.return_code or code or 0)
