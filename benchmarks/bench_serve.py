"""``mdb serve``: the page's first frame against ``mdb step``'s start-up in a terminal, and a
key's round trip in the page.

* **First frame.** Interleaved in one run: ``mdb step --preset P`` spawned in an 80×24
  pseudo-terminal (pexpect) until its header ``forward · call 1/N`` is on the screen; and a new
  tab of a running ``mdb serve step --preset P`` in Debian's Chromium (Playwright) from
  ``page.goto`` until the same header is in the bytes its terminal was fed (each tab starts its
  own ``mdb step``, so both build the model and capture the step). Bound (issue 39): the page
  ≤ 2× the terminal, medians.
* **A key.** In the page: from ``keyboard.press("n")`` until the next call's header
  (``call K+1/N``) has reached the page's terminal; ``--keys`` presses, median. Bound: ≤ 100 ms
  on localhost. Beside it, the same key in ``mdb step`` in a pty, to show the machine's state.

Run: ``python benchmarks/bench_serve.py [--runs 5] [--keys 30] [--preset tiny]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.browser import Served, Tab, chromium_path  # noqa: E402
from tests.processes import mdb_env  # noqa: E402

HEADER = r"forward · call 1/\d+"


def terminal_start(preset: str) -> float:
    """Seconds from spawning ``mdb step`` in an 80×24 pty to its header on the screen."""
    import pexpect

    t0 = time.perf_counter()
    child = pexpect.spawn(sys.executable, ["-m", "tui.cli", "step", "--preset", preset],
                          env=mdb_env(TERM="xterm"), dimensions=(24, 80), encoding="utf-8")
    child.expect(HEADER, timeout=300)
    elapsed = time.perf_counter() - t0
    child.send("q")
    child.expect(pexpect.EOF, timeout=60)
    return elapsed


def page_start(browser, url: str) -> float:
    """Seconds from ``page.goto`` of a new tab to the header in its terminal."""
    t0 = time.perf_counter()
    tab = Tab(browser, url)
    tab.wait_text(HEADER, timeout=300)
    elapsed = time.perf_counter() - t0
    tab.page.close()
    return elapsed


def key_round_trips(browser, url: str, presses: int) -> list[float]:
    """Seconds from pressing ``n`` to the next call's header in the page, ``presses`` times."""
    tab = Tab(browser, url)
    n = int(tab.wait_text(r"forward · call 1/(\d+)", timeout=300).group(1))
    times = []
    for k in range(2, min(presses + 2, n + 1)):
        t0 = time.perf_counter()
        tab.press("n")
        tab.wait_text(rf"forward · call {k}/{n}\b", timeout=60, poll_ms=2)
        times.append(time.perf_counter() - t0)
    tab.page.close()
    return times


def terminal_key_round_trips(preset: str, presses: int) -> list[float]:
    """The same key in ``mdb step`` in an 80×24 pty: from sending ``n`` to the next header."""
    import pexpect

    child = pexpect.spawn(sys.executable, ["-m", "tui.cli", "step", "--preset", preset],
                          env=mdb_env(TERM="xterm"), dimensions=(24, 80), encoding="utf-8")
    child.expect(r"forward · call 1/(\d+)", timeout=300)
    n = int(child.match.group(1))
    times = []
    for k in range(2, min(presses + 2, n + 1)):
        t0 = time.perf_counter()
        child.send("n")
        child.expect(rf"call {k}/{n}\b", timeout=60)
        times.append(time.perf_counter() - t0)
    child.send("q")
    child.expect(pexpect.EOF, timeout=60)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--keys", type=int, default=30)
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args()
    path = chromium_path()
    if path is None:
        print("no Chromium: apt-get install -y chromium")
        return 1
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        server = Served(["step", "--preset", args.preset], Path(tmp) / "serve.log")
        try:
            terminal, page = [], []
            for i in range(args.runs):  # interleaved, the order flipped every round
                order = (terminal_start, page_start) if i % 2 == 0 else (page_start,
                                                                        terminal_start)
                for fn in order:
                    if fn is terminal_start:
                        terminal.append(terminal_start(args.preset))
                    else:
                        page.append(page_start(browser, server.url))
            keys = key_round_trips(browser, server.url, args.keys)
            term_keys = terminal_key_round_trips(args.preset, args.keys)
        finally:
            server.stop()
            browser.close()
    t, w = statistics.median(terminal), statistics.median(page)
    print(f"mdb step in a terminal: median {t:.2f} s  ({', '.join(f'{x:.2f}' for x in terminal)})")
    print(f"first frame in a page : median {w:.2f} s  ({', '.join(f'{x:.2f}' for x in page)})")
    print(f"page / terminal       : {w / t:.2f}×  (bound ≤ 2×)")
    q = statistics.quantiles(keys, n=4)
    print(f"key n → redrawn page  : median {statistics.median(keys) * 1e3:.1f} ms, IQR "
          f"[{q[0] * 1e3:.1f}, {q[2] * 1e3:.1f}] ms over {len(keys)} presses (bound ≤ 100 ms)")
    print(f"key n → redrawn pty   : median {statistics.median(term_keys) * 1e3:.1f} ms (the "
          "same key in a terminal, for the machine's state)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
