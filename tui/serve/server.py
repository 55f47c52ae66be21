"""``mdb serve``'s web server: mdb's own screens in a browser tab, through ``textual-serve``.

``textual-serve`` runs one app process per browser tab (its ``AppService``) and draws it with
xterm.js; this module adds what a debugger's page needs on a shared machine:

* **A token.** Every page, websocket and download request must carry the random token that
  ``mdb serve`` printed (``/?token=T``); the page that was opened with it gets it again as a
  cookie (``HttpOnly``, ``SameSite=Strict``), which its websocket sends back. Anything else is
  answered ``403 Forbidden``. The token is compared in constant time
  (:func:`hmac.compare_digest`). The static files (xterm.js, its CSS and fonts) are public.
* **URLs from the request.** ``textual-serve`` writes its ``host:port`` into the page's URLs,
  so a page served on ``0.0.0.0`` asks the browser to connect to ``0.0.0.0``. Here each page's
  URLs are built from the ``Host`` the browser used (or ``public_url`` when given), so the page
  works whichever address reached it (an ``ssh -L`` forward included).
* **The command.** Each tab runs ``python -m tui.cli COMMAND ARGS…`` (quoted with
  :func:`shlex.join`: no argument is read by a shell), with ``MDB_SERVED=1`` in its
  environment so that the command opens its screen (:func:`tui.commands.process.has_screen`).

Closing a tab ends that tab's process only (``textual-serve`` asks the app to quit): a run
that the tab watches goes on in its own process.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import shlex
import sys

import aiohttp_jinja2
import jinja2
from aiohttp import web
from textual_serve.server import Server

#: The name of the cookie that carries the token after the first page.
COOKIE = "mdb_token"
#: The environment variable that tells a served command it draws in a browser tab.
SERVED_ENV = "MDB_SERVED"


def new_token() -> str:
    """A fresh URL-safe token of 32 random bytes (:func:`secrets.token_urlsafe`)."""
    return secrets.token_urlsafe(32)


def app_command(words: list[str]) -> str:
    """The shell line that runs ``mdb WORDS…`` with this interpreter, every word quoted."""
    return shlex.join([sys.executable, "-m", "tui.cli", *words])


class TokenServer(Server):
    """A ``textual_serve.server.Server`` whose requests need ``token`` (see the module).

    Args:
        command: the shell line each tab runs (:func:`app_command`).
        token: the secret every request must carry.
        host, port: where to listen.
        title: the page's title.
        public_url: the base of the page's URLs (``http://name:port``); None builds them from
            each request's ``Host``.
    """

    def __init__(self, command: str, token: str, *, host: str, port: int, title: str,
                 public_url: str | None = None) -> None:
        super().__init__(command, host=host, port=port, title=title)
        self.token = token
        self.fixed_url = public_url.rstrip("/") if public_url else None

    def allows(self, request: web.Request) -> bool:
        """Whether ``request`` carries the token, in its query (``?token=``) or its cookie."""
        given = request.query.get("token") or request.cookies.get(COOKIE) or ""
        return hmac.compare_digest(given.encode(), self.token.encode())

    def make_app(self) -> web.Application:
        """The aiohttp application: ``textual-serve``'s routes behind the token check."""

        @web.middleware
        async def need_token(request: web.Request, handler):
            if not request.path.startswith("/static/") and not self.allows(request):
                return web.Response(status=403, text="mdb serve: this page needs the token "
                                    "in the URL that mdb serve printed\n")
            return await handler(request)

        app = web.Application(middlewares=[need_token])
        aiohttp_jinja2.setup(app, loader=jinja2.FileSystemLoader(self.templates_path))
        app.add_routes([
            web.get("/", self.handle_index, name="index"),
            web.get("/ws", self.handle_websocket, name="websocket"),
            web.get("/download/{key}", self.handle_download, name="download"),
            web.static("/static", self.statics_path, name="static"),
        ])
        return app

    def base_url(self, request: web.Request) -> str:
        """Where the browser reached this server: ``public_url``, else scheme and ``Host``."""
        return self.fixed_url or f"{request.scheme}://{request.host}"

    async def handle_index(self, request: web.Request) -> web.Response:
        """The page: ``textual-serve``'s template with URLs from :meth:`base_url`, and the
        token as a cookie for its websocket."""
        base = self.base_url(request)
        ws_base = ("wss:" if base.startswith("https:") else "ws:") + base.split(":", 1)[1]
        context = {
            "font_size": _int(request.query.get("fontsize"), 16),
            "app_websocket_url": ws_base + str(request.app.router["websocket"].url_for()),
            "config": {"static": {"url": base + "/static/"}},
            "application": {"name": self.title},
        }
        response = aiohttp_jinja2.render_template("app_index.html", request, context)
        response.set_cookie(COOKIE, self.token, httponly=True, samesite="Strict", path="/")
        response.headers["Cache-Control"] = "no-store"
        response.headers["Referrer-Policy"] = "no-referrer"
        return response


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


async def serve_until_stopped(server: TokenServer, ready, stop: asyncio.Event) -> None:
    """Listen on ``server.host:server.port`` until ``stop`` is set, then close every tab.

    Args:
        server: the server.
        ready: called with the bound ``(host, port)`` once the socket listens (port 0 asks
            the system for a free one; this is the port it gave).
        stop: set by the caller's signal handlers.

    Raises:
        OSError: the address cannot be bound (in use, not this machine's).
    """
    runner = web.AppRunner(server.make_app(), handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, server.host, server.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        ready(host, port)
        await stop.wait()
    finally:
        await runner.cleanup()
