"""A rank that dies is named, whichever side notices first (hooks.dist.distributed).

A peer's death reaches rank 0 first as a failed collective (gloo: "Connection reset by peer" /
"Connection closed by peer"), a moment before its process is seen gone: the kernel closes a
killed process's sockets before it becomes a zombie, and on a loaded machine that moment can
outlast rank 0's last look. Here rank 0 is a real :class:`RankLink` (its own thread, a real
Gloo group over a real TCPStore) and rank 1 a real process that joins, announces a gather and
is killed before it posts it: rank 0's collective fails for real. What rank 0 learns of rank 1's
death is delayed on purpose: its look at rank 1's process (``process_gone``, the public name
the link calls) reports the process as still there for its first looks once rank 0 finishes,
as the kernel does while it finishes the process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from hooks.dist import distributed
from hooks.dist.distributed import Job, RankLink
from tests.conftest import wait_for

KEY = "peer"

#: Rank 1: joins rank 0's run, makes the Gloo group, announces gather 1 and never posts it;
#: killed by the test while rank 0 is in that gather's collective, or (a line ``drop`` on its
#: stdin) it closes its Gloo group and lives on, its heartbeat going every 0.2 s.
RANK1 = """
import gc, json, os, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
host = sys.argv[2]
store = dist.PrefixStore("mdb/peer/", dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False,
                                                     timeout=timedelta(seconds=60)))
def beat(n):
    store.set("beat/1", json.dumps({"n": n, "step": 4, "t": time.time(), "pid": os.getpid(),
                                    "host": host, "local_rank": 1, "ended": None}))
def beats():
    n = 1
    while True:
        n += 1
        beat(n)
        time.sleep(0.2)
beat(1)
if store.add("joined", 1) >= 2:
    store.compare_set("state", "", "go")
pg = dist.ProcessGroupGloo(dist.PrefixStore("pg/", store), 1, 2, timedelta(seconds=60))
threading.Thread(target=beats, daemon=True).start()
if store.add("req/1", 1) >= 1:
    store.compare_set("ready/1", "", "go")
print("announced", flush=True)
if sys.stdin.readline().strip() == "drop":
    del pg
    gc.collect()
    print("dropped", flush=True)
threading.Event().wait()
"""


class SlowDeath:
    """``process_gone`` as rank 0 sees it: rank 1's process counts as still there for its first
    ``hidden`` looks once :attr:`finishing` is set (``None``: for ever), then as it is."""

    def __init__(self, pid: int, hidden: int | None) -> None:
        self.pid, self.hidden = pid, hidden
        self.finishing = False
        self.looks = 0
        self.real = distributed.process_gone

    def __call__(self, pid: int | None) -> bool:
        if pid != self.pid:
            return self.real(pid)
        if self.finishing:
            self.looks += 1
        if self.hidden is None or not self.finishing or self.looks <= self.hidden:
            return False
        return self.real(pid)


def _run(monkeypatch, tmp_path, *, host: str, hidden: int | None, drop: bool = False):
    """Rank 0's link with rank 1 started, killed mid-gather (``drop``: its Gloo group closed,
    the process alive), and rank 0 finishing as its training thread does once its own
    collective raised: (ends, findings, rank 1's pid)."""
    server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    me = socket.gethostname()
    findings: list[dict] = []
    lock = threading.Lock()

    def emit(kind, *args):
        if kind == "findings":
            with lock:
                findings.extend(args[0])

    log = open(tmp_path / "rank1.log", "wb")  # noqa: SIM115 (closed below)
    rank1 = subprocess.Popen([sys.executable, "-c", RANK1, str(server.port), host],
                             stdout=subprocess.PIPE, stderr=log, stdin=subprocess.PIPE)
    try:
        slow = SlowDeath(rank1.pid, hidden)
        monkeypatch.setattr(distributed, "process_gone", slow)
        link = RankLink(Job(0, 2, 0, server, me, os.getpid()), KEY, every=5, emit=emit)
        link.start()
        assert rank1.stdout.readline() == b"announced\n", (tmp_path / "rank1.log").read_text()
        wait_for(lambda: link.state == "running", what="rank 0's Gloo group")
        if drop:
            rank1.stdin.write(b"drop\n")
            rank1.stdin.flush()
        else:
            os.kill(rank1.pid, signal.SIGKILL)
            rank1.wait(60)  # reaped: its process no longer exists (only SlowDeath hides it)
        wait_for(lambda: link.state == "broken", what="rank 0's collective to fail")
        slow.finishing = True
        ends = link.finish("failed", "RuntimeError: [gloo] Connection reset by peer", 4)
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait(60)
        log.close()
    with lock:
        return ends, list(findings), rank1.pid


@pytest.mark.parametrize("hidden", [3, 8])
def test_a_rank_whose_death_shows_after_the_collective_failed_is_named_dead(monkeypatch,
                                                                          tmp_path, hidden):
    ends, findings, pid1 = _run(monkeypatch, tmp_path, host=socket.gethostname(),
                                hidden=hidden)
    me = socket.gethostname()
    assert ends[1]["state"] == "dead" and ends[1]["pid"] == pid1 and ends[1]["host"] == me
    dead = [f for f in findings if f["kind"] == "rank_dead"]
    assert [(f["rank"], f["detail"]["pid"]) for f in dead] == [(1, pid1)]
    assert dead[0]["line"].startswith(f"rank 1 (pid {pid1} on {me}) died: ")
    broke = [f for f in findings if f["kind"] == "gather_failed"]
    assert [f["line"] for f in broke] == [
        f"gathering from the ranks stopped after step 0: rank 1 (pid {pid1} on {me}) dead"]
    assert "by peer" in broke[0]["detail"]["error"]  # what the collective said, kept


def test_a_rank_dead_on_another_host_is_named_as_stopped_reporting(monkeypatch, tmp_path):
    """Rank 1 on another host: its process cannot be looked at, only its heartbeat, which
    stops; rank 0 waits for it to go stale and names the rank, not the collective's error."""
    monkeypatch.setattr(RankLink, "STALE_AFTER", 3.0)
    ends, findings, pid1 = _run(monkeypatch, tmp_path, host="node2", hidden=None)
    assert ends[1]["state"] == "silent" and ends[1]["pid"] == pid1
    assert ends[1]["host"] == "node2"
    silent = [f for f in findings if f["kind"] == "rank_silent"]
    assert [f["rank"] for f in silent] == [1]
    assert silent[0]["line"].startswith(f"rank 1 (pid {pid1} on node2) stopped reporting: ")
    broke = [f for f in findings if f["kind"] == "gather_failed"]
    assert [f["line"] for f in broke] == [
        f"gathering from the ranks stopped after step 0: rank 1 (pid {pid1} on node2) silent"]


def test_a_collective_that_fails_with_every_rank_alive_names_its_error_in_bounded_time(
        monkeypatch, tmp_path):
    """Rank 1 closes its Gloo group and lives on (its process there, its heartbeat fresh):
    rank 0 waits :attr:`RankLink.PEER_GONE_WAIT` at most, then names the collective's error."""
    monkeypatch.setattr(RankLink, "PEER_GONE_WAIT", 1.0)
    t0 = time.monotonic()
    ends, findings, _ = _run(monkeypatch, tmp_path, host=socket.gethostname(), hidden=None,
                             drop=True)
    assert time.monotonic() - t0 < 30  # bounded: not the collective's 60 s timeout
    assert ends[1]["state"] == "running"
    broke = [f for f in findings if f["kind"] == "gather_failed"]
    assert len(broke) == 1 and "by peer" in broke[0]["line"], broke
    assert not [f for f in findings if f["kind"] in ("rank_dead", "rank_silent")]
