"""``mdb runs`` laid out for 80 columns: one-word statuses never cut, every line within the
width, a long reason on one ``└`` line cut with ``…``; piped output is never cut."""

from __future__ import annotations

import time

from rich.console import Console

from hooks.store.store import RunStore
from tui.commands.runs import run_record, table_lines

LONG = ("RuntimeError: view size is not compatible with input tensor's size and stride (at "
        "least one dimension spans across two contiguous subspaces). Use .reshape(...) "
        "instead — in model.layers.0.self_attn (Attention), at model.py:42: q = q.view(B, T)")


def _store(tmp_path) -> RunStore:
    store = RunStore(tmp_path / "mdb.sqlite", create=True)
    for name, status, reason in [
        ("a-run-that-finished", "finished", None),
        ("a-run-that-was-interrupted", "interrupted", "SIGINT"),
        ("a-run-that-failed-with-a-very-long-reason", "failed", LONG),
    ]:
        w = store.create_run(name, {}, total_steps=100, kind="api")
        w.log_steps([({"step": s, "wall": time.time(), "values": {"loss": 2.0 / s}}, None, None)
                     for s in range(1, 11)])
        w.finish(status, reason=reason)
    return store


def _render(lines, width: int | None) -> list[str]:
    console = Console(width=width or 100_000, record=True, color_system=None,
                      force_terminal=False)
    for line in lines:
        console.print(line, overflow="ellipsis" if width else "ignore", no_wrap=True)
    return console.export_text().splitlines()


def test_at_80_columns_statuses_are_whole_and_every_line_fits(tmp_path):
    with _store(tmp_path) as store:
        now = time.time()
        runs = store.runs()
        records = [run_record(r, store, now) for r in runs]
    out = [t.plain for t in table_lines(runs, records, now, 80)]  # as laid out, not as cut
    assert all(len(line) <= 80 for line in out), out
    assert _render(table_lines(runs, records, now, 80), 80) == [x.rstrip() for x in out]
    rows = [line for line in out if not line.startswith("  └")]
    for status in ("finished", "interrupted", "failed"):
        assert any(f" {status} " in line for line in rows), (status, rows)
    details = [line for line in out if line.startswith("  └")]
    failed = [line for line in details if "view size" in line]
    assert len(failed) == 1 and failed[0].endswith("…")  # one line, cut at the width
    assert any("SIGINT" in line for line in details)


def test_piped_the_table_is_never_cut(tmp_path):
    with _store(tmp_path) as store:
        now = time.time()
        runs = store.runs()
        records = [run_record(r, store, now) for r in runs]
    out = _render(table_lines(runs, records, now, None), None)
    assert any("a-run-that-failed-with-a-very-long-reason" in line for line in out)
    assert any("at model.py:42: q = q.view(B, T)" in line for line in out)
