"""``mdb serve [--port P] [--host H] COMMAND [ARGS…]``: one of mdb's screens in a browser tab.

``mdb serve watch RUN``, ``mdb serve step --model F:fn``, ``mdb serve --port 8800 overfit``…
serve the command's own Textual screen through ``textual-serve`` (:mod:`tui.serve.server`):
each browser tab runs the command in a process of its own, drawn by xterm.js, and every key,
resize and Ctrl-C reaches it as in a terminal. Closing a tab ends that tab's view only: a run
that it watches, or that ``mdb serve overfit`` started, goes on training (as when a terminal
is closed under it).

It listens on 127.0.0.1 unless ``--host`` says otherwise, and prints the URL with a random
token (a request without it gets 403) and the ``ssh -L`` line that reaches it from another
machine. The command's arguments are checked before the server starts: a bad one is the
command's own one-line error, here.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import ipaddress
import os
import signal
import socket
import sys

from hooks.text import printable
from tui.errors import MdbError

#: Starts no model: the served command imports torch in its own process.
NEEDS_TORCH = False

HELP = "serve one of mdb's screens (step, watch, overfit, diff, compare, ablate) in a browser"

#: The commands that open a screen, and so can be served.
SERVABLE = ("step", "watch", "overfit", "diff", "compare", "ablate")

#: The default port.
DEFAULT_PORT = 8800


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT,
                        help=f"the TCP port (default {DEFAULT_PORT}; 0: any free port)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to listen on (default 127.0.0.1, this machine only; "
                        "0.0.0.0: every interface, protected by the token alone)")
    parser.add_argument("--public-url", default=None,
                        help="the base URL browsers reach the server at, when a proxy in "
                        "front of it changes it (default: the address each browser used)")
    parser.add_argument("served", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS…]",
                        help=f"the mdb command to serve: {', '.join(SERVABLE)}")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0 to 65535)")
    return value


def check_served(words: list[str]) -> None:
    """Check the served command and its arguments with its own parser, before serving.

    Raises:
        MdbError: no command, or one without a screen.
        SystemExit: the command's parser rejected an argument (its one-line error, exit 2).
    """
    if not words:
        raise MdbError(f"name the command to serve, e.g. `mdb serve step` (one of "
                       f"{', '.join(SERVABLE)})")
    if words[0] not in SERVABLE:
        raise MdbError(f"`mdb {printable(words[0])}` has no screen to serve (mdb serve serves "
                       f"{', '.join(SERVABLE)})")
    import importlib

    from tui.errors import OneLineParser

    parser = OneLineParser(prog=f"mdb {words[0]}")
    importlib.import_module(f"tui.commands.{words[0]}").add_arguments(parser)
    parser.parse_args(words[1:])


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def banner(words: list[str], host: str, port: int, token: str) -> list[str]:
    """The lines ``mdb serve`` prints once it listens: the URL with its token, how to reach
    it from another machine, and what protects it."""
    shown = "[" + host + "]" if ":" in host else host
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else shown
    lines = [f"mdb serve: `mdb {printable(' '.join(words))}` in a browser",
             f"  open  http://{url_host}:{port}/?token={token}"]
    if is_loopback(host):
        lines.append(f"  from another machine: ssh -N -L {port}:127.0.0.1:{port} "
                     f"{printable(getpass.getuser())}@{printable(socket.gethostname())}, then "
                     "open the URL there")
    else:
        lines.append(f"  listening on {shown}:{port}: anyone who can reach it and has the "
                     "token can use the page; it has no other protection (no TLS) — prefer "
                     "the default 127.0.0.1 with ssh -L")
    lines.append("  each tab runs its own view; closing one ends that view only. Ctrl-C stops "
                 "the server")
    return lines


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mdb serve``: serve until SIGINT, SIGTERM or SIGHUP, then exit 0."""
    check_served(args.served)
    from tui.commands.process import SERVED_ENV
    from tui.serve.server import TokenServer, app_command, new_token, serve_until_stopped

    token = new_token()
    server = TokenServer(app_command(args.served), token, host=args.host, port=args.port,
                         title=f"mdb {' '.join(args.served)}", public_url=args.public_url)
    os.environ[SERVED_ENV] = "1"  # for the tabs' processes, which inherit it

    def ready(host: str, port: int) -> None:
        for line in banner(args.served, args.host, port, token):
            print(line, flush=True)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, stop.set)
        await serve_until_stopped(server, ready, stop)

    try:
        asyncio.run(main())
    except OSError as exc:
        raise MdbError(f"cannot listen on {args.host}:{args.port}: "
                       f"{exc.strerror or exc} (choose another with --port)") from None
    print("mdb serve: stopped", file=sys.stderr, flush=True)
    return 0
