"""A ``torchrun`` job's final status, from rank 0's and the other ranks' ends (used by
:meth:`hooks.recorder.run.Run.finish`), and the line said when ``WORLD_SIZE`` names a job
that has no process group.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["job_end", "say_world_size"]


def job_end(status: str, reason: str | None,
            ends: Mapping[int, Mapping[str, Any]]) -> tuple[str, str | None]:
    """A distributed run's final status from rank 0's and the other ranks' ends: a rank that
    died, failed or stopped reporting fails the run, named first."""
    parts = []
    for r, e in sorted(ends.items()):
        if r == 0 or e.get("state") not in ("dead", "failed", "silent"):
            continue
        who = f"rank {r}"
        where = " ".join(x for x in (f"pid {e['pid']}" if e.get("pid") is not None else "",
                                      f"on {e['host']}" if e.get("host") else "") if x)
        if where:
            who += f" ({where})"
        step = e.get("last_step", 0)
        if e["state"] == "dead":
            parts.append(f"{who} died (last step reported: {step})")
        elif e["state"] == "failed":
            parts.append(f"{who} failed after step {step}: {e.get('reason') or 'no reason'}")
        else:
            parts.append(f"{who} stopped reporting (last step reported: {step})")
    if not parts:
        return status, reason
    if status != "finished":
        parts.append(f"rank 0 {status}" + (f" ({reason[:150]})" if reason else ""))
    return "failed", "; ".join(parts)[:500]


def say_world_size(job: Any) -> None:
    """A ``WORLD_SIZE`` above 1 without a process group: say that this process is a run of
    its own."""
    world_env = os.environ.get("WORLD_SIZE", "").strip()
    if job is None and world_env.isdigit() and int(world_env) > 1:
        print(f"mdb: WORLD_SIZE={world_env} but no torch.distributed process group is "
              "initialised: this process is recorded as a run of its own (call "
              "init_process_group before hooks.run to record the job as one run)",
              file=sys.stderr)
