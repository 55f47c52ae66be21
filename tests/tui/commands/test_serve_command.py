"""``mdb serve``'s command line without a browser: what it refuses (one line, exit 2), the
address it prints, and the page's URLs when it listens on every interface (textual-serve writes
its own host into them; mdb builds them from the address the browser used)."""

from __future__ import annotations

import re
import socket
import urllib.request

import pytest

from tests.browser import Served
from tests.processes import error_line, run_mdb

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("argv", "said"), [
    (["serve"], "name the command to serve"),
    (["serve", "runs"], "`mdb runs` has no screen to serve"),
    (["serve", "\x1b[31mx"], r"`mdb \x1b[31mx` has no screen"),
])
def test_a_command_that_cannot_be_served_is_one_line(argv, said):
    r = run_mdb(argv)
    assert r.returncode == 2
    assert said in error_line(r.stderr)


def test_a_bad_argument_of_the_served_command_is_its_own_one_line_error():
    r = run_mdb(["serve", "step", "--seq-len", "abc"])
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mdb step: error:"), r.stderr
    assert "Traceback" not in r.stderr


def test_a_port_in_use_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_mdb(["serve", "--port", str(port), "step"])
    assert r.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in error_line(r.stderr)


def test_the_default_address_is_this_machine_only_with_the_ssh_line(tmp_path):
    server = Served(["step", "--preset", "tiny"], tmp_path / "serve.log")
    try:
        text = server.log.read_text()
        assert server.base.startswith("http://127.0.0.1:")
        port = server.base.rsplit(":", 1)[1]
        assert re.search(rf"ssh -N -L {port}:127\.0\.0\.1:{port} \S+@\S+", text), text
        assert len(server.token) >= 40
    finally:
        assert server.stop() == 0


def test_on_every_interface_it_warns_and_the_page_uses_the_address_the_browser_used(tmp_path):
    server = Served(["--host", "0.0.0.0", "step", "--preset", "tiny"], tmp_path / "serve.log")
    try:
        assert "no other protection" in server.log.read_text()
        port = server.base.rsplit(":", 1)[1]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/?token={server.token}",
                                         headers={"Host": host})
            with urllib.request.urlopen(req, timeout=30) as r:
                page = r.read().decode()
            assert f'data-session-websocket-url="ws://{host}/ws"' in page
            assert f'href="http://{host}/static/css/xterm.css"' in page
            assert "0.0.0.0" not in page
    finally:
        assert server.stop() == 0
