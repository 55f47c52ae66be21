"""The test scaffold for ``mdb serve``: the server in a process of its own, and a page of it in
a real Chromium (Debian's ``chromium`` package, driven by Playwright for Python through
``chromium.launch(executable_path=…)``; no browser is downloaded).

What a page shows: xterm.js draws on a canvas, so the text is read from the bytes the page's
terminal is fed — every binary websocket frame the page receives, which is exactly what xterm.js
writes — replayed into a ``pyte`` terminal of the size the page asked for (its websocket URL's
``width`` and ``height``). :meth:`Tab.text` is that screen; :meth:`Tab.wait_text` waits for a
string to appear on it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path

import pytest

from tests.processes import mdb_env, spawn_mdb

#: Where Debian's package puts the browser (``apt-get install -y chromium``).
CHROMIUM_NAMES = ("chromium", "chromium-browser")


def chromium_path() -> str | None:
    """The Chromium executable: ``$MDB_CHROMIUM``, else ``chromium`` on PATH."""
    given = os.environ.get("MDB_CHROMIUM")
    if given:
        return given
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def need_browser() -> str:
    """The Chromium path, or skip with the install line (CI's ``.ci/run`` installs it)."""
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium: apt-get install -y chromium (.ci/run does it)")
    pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    pytest.importorskip("pyte", reason="pyte is in the test extra")
    return path


class Served:
    """``mdb serve --port 0 ARGS…`` running; :attr:`url` is the URL it printed (with token)."""

    def __init__(self, args: list[str], log: Path, cwd: Path | None = None,
                 timeout: float = 120.0) -> None:
        self.log = log
        self.proc = spawn_mdb(["serve", "--port", "0", *args], cwd=cwd, log=log,
                              env=mdb_env(TERM="xterm"))
        self.url = self._wait_url(timeout)
        parts = urllib.parse.urlsplit(self.url)
        self.base = f"{parts.scheme}://{parts.netloc}"
        self.token = urllib.parse.parse_qs(parts.query)["token"][0]

    def _wait_url(self, timeout: float) -> str:
        from tests.conftest import wait_for

        def printed() -> str | None:
            m = re.search(r"open  (http://\S+)", self.log.read_text())
            if m is None and self.proc.poll() is not None:
                raise AssertionError(f"mdb serve ended: {self.log.read_text()}")
            return m.group(1) if m else None

        return wait_for(printed, timeout, "mdb serve to print its URL")

    def stop(self) -> int:
        """Ctrl-C the server (SIGINT) and return its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Tab:
    """One page of a served command in ``browser``, its terminal replayed into ``pyte``."""

    def __init__(self, browser, url: str, width: int = 1000, height: int = 640) -> None:
        import pyte

        self.pyte = pyte
        self.screen = None
        self.stream = None
        self.frames = 0
        self.page = browser.new_page(viewport={"width": width, "height": height})
        self.page.on("websocket", self._on_websocket)
        self.page.goto(url)

    def _on_websocket(self, ws) -> None:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(ws.url).query)
        cols, rows = int(query["width"][0]), int(query["height"][0])
        self.screen = self.pyte.Screen(cols, rows)
        self.stream = self.pyte.ByteStream(self.screen)
        ws.on("framereceived", self._on_frame)

    def _on_frame(self, payload) -> None:
        if isinstance(payload, bytes):
            self.stream.feed(payload)
            self.frames += 1

    def text(self) -> str:
        """What the page's terminal shows now, one line per row."""
        self.page.wait_for_timeout(0)  # lets Playwright deliver the frames received so far
        return "" if self.screen is None else "\n".join(self.screen.display)

    def wait_text(self, pattern: str, timeout: float = 180.0, poll_ms: int = 50) -> re.Match:
        """Wait until the screen matches the regular expression ``pattern``; its match
        (the screen is read every ``poll_ms`` milliseconds)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            m = re.search(pattern, self.text())
            if m:
                return m
            self.page.wait_for_timeout(poll_ms)
        raise AssertionError(f"the page never showed {pattern!r}; it shows:\n{self.text()}")

    def press(self, key: str) -> None:
        """Type ``key`` into the page's terminal (its input element focused first, with no
        click: a click would reach the app as a mouse event)."""
        self.page.locator("textarea.xterm-helper-textarea").first.focus()
        self.page.keyboard.press(key)
