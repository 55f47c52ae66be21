"""``mdb serve`` in a real Chromium (:mod:`tests.browser`): the page loads and shows the
served screen, keys drive the step view, ``mdb serve watch`` follows a running ``hooks.run``
loop, two tabs run side by side, and a request without the token is refused.

What the page shows is read from the bytes its xterm.js terminal is fed (see
:mod:`tests.browser`); the expected text is what the same screen shows in a terminal (its
header ``forward · call 1/N``, ``backward``, the router view's title); Ctrl-C quits the step
view as it does in a terminal, ending that tab's session only."""

from __future__ import annotations

import os
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.browser import Served, Tab, need_browser
from tests.processes import REPO, spawn_mdb

pytestmark = [pytest.mark.browser, pytest.mark.slow]

#: A small model, quick to build: the step view of the tiny preset.
STEP = ["step", "--preset", "tiny"]


@pytest.fixture
def browser():
    path = need_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def served_step(tmp_path):
    server = Served(STEP, tmp_path / "serve.log")
    try:
        yield server
    finally:
        assert server.stop() == 0, server.log.read_text()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_request_without_the_token_or_with_a_wrong_one_is_refused(served_step):
    base, token = served_step.base, served_step.token
    assert _status(f"{base}/") == 403
    assert _status(f"{base}/?token={token[:-1]}x") == 403
    assert _status(f"{base}/ws") == 403
    assert _status(f"{base}/download/x") == 403
    assert _status(f"{base}/?token={token}") == 200
    assert _status(f"{base}/static/js/textual.js") == 200  # xterm.js itself is public


def test_the_page_shows_the_step_view_and_keys_drive_it(served_step, browser, tmp_path):
    tab = Tab(browser, served_step.url)
    n = int(tab.wait_text(r"forward · call 1/(\d+)").group(1))
    tab.press("n")
    tab.wait_text(rf"forward · call 2/{n}")
    tab.press("b")
    tab.wait_text(r"backward · grad \d+/\d+")
    tab.press("r")
    tab.wait_text(r"router · layer \d+ \(\d+/\d+\) · \S+ · E=\d+ top-\d+")
    shot = Path(os.environ.get("MDB_SERVE_SHOT", tmp_path / "serve.png"))
    tab.page.screenshot(path=str(shot))
    assert shot.stat().st_size > 0


def test_two_tabs_run_side_by_side_each_with_its_own_view(served_step, browser):
    one, two = Tab(browser, served_step.url), Tab(browser, served_step.url)
    n = int(one.wait_text(r"forward · call 1/(\d+)").group(1))
    two.wait_text(rf"forward · call 1/{n}")
    one.press("n")
    one.wait_text(rf"call 2/{n}")
    two.press("b")
    two.wait_text(r"backward · grad")
    assert f"forward · call 2/{n}" in one.text()  # each tab its own process
    two.press("Control+c")  # quits mdb step, as in a terminal: that tab's session ends
    two.page.wait_for_function("document.body.classList.contains('-closed')", timeout=120_000)
    one.press("n")  # the other tab goes on
    one.wait_text(rf"forward · call 3/{n}")
    one.page.close()


LOOP = textwrap.dedent("""
    import sys, time
    import hooks
    with hooks.run("served", db=sys.argv[1]) as run:
        for step in range(1, 3001):
            run.log(step=step, loss=1.0 / step)
            if run.should_stop:
                break
            time.sleep(0.05)  # the simulated work of a training step
""")


def test_serve_watch_follows_a_running_loop_and_closing_the_tab_leaves_it_running(
        browser, tmp_path):
    db = tmp_path / "runs.db"
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    import subprocess

    loop = subprocess.Popen([sys.executable, str(script), str(db)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    server = None
    try:
        from tests.conftest import wait_for

        wait_for(lambda: db.exists(), what="the loop's run store")
        server = Served(["watch", "served", "--db", str(db)], tmp_path / "serve.log")
        tab = Tab(browser, server.url)
        first = int(tab.wait_text(r"step (\d+)").group(1))
        tab.wait_text(rf"step (?!{first}\b)\d+")  # a later step is drawn
        tab.page.close()
        assert loop.poll() is None  # the run goes on training without its view
    finally:
        if server is not None:
            assert server.stop() == 0
        stop = spawn_mdb(["stop", "served", "--db", str(db)])
        stop.wait(120)
        loop.wait(120)
    assert loop.returncode == 0, loop.stderr.read()
