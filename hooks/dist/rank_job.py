"""The ``torchrun`` job this process is a rank of, and what tells about its ranks: the
:class:`Job` (rank, world size, the job's key-value store), whether a rank's process has ended
(:func:`process_gone`), and the ``(min, median, max)`` band of a per-rank value (:func:`band`).
Used by :mod:`hooks.dist.distributed` (re-exported there)."""

from __future__ import annotations

import math
import os
import socket
import statistics
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hooks.store.store import pid_alive


@dataclass(frozen=True)
class Job:
    """This process's place in a distributed job.

    Attributes:
        rank: Global rank.
        world_size: Number of ranks (≥ 2).
        local_rank: ``LOCAL_RANK`` (index on this host), if set.
        store: The default process group's key-value store (``torch.distributed.Store``).
        host: ``socket.gethostname()``.
        pid: ``os.getpid()``.
    """

    rank: int
    world_size: int
    local_rank: int | None
    store: Any
    host: str
    pid: int


def job() -> Job | None:
    """This process's :class:`Job`, or ``None`` outside a distributed job of two ranks or more.

    Only looks: ``torch.distributed`` must already be imported and its default process group
    initialised (``init_process_group``); nothing is imported or initialised here.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not dist.is_available() or not dist.is_initialized():
            return None
        world = int(dist.get_world_size())
        if world < 2:
            return None
        rank = int(dist.get_rank())
        from torch.distributed import distributed_c10d

        # torch private: the process group's store, no public getter
        store = distributed_c10d._get_default_store()
    except Exception:  # a process group that cannot tell: not a job we can follow
        return None
    local = os.environ.get("LOCAL_RANK", "")
    return Job(rank, world, int(local) if local.isdigit() else None, store,
               socket.gethostname(), os.getpid())


def process_gone(pid: int | None) -> bool:
    """Whether process ``pid`` of this host has ended: it no longer exists, or it is a zombie
    (it exited and its parent, e.g. the ``torchrun`` agent, has not reaped it yet; read from
    ``/proc/<pid>/stat`` where there is one)."""
    if not pid_alive(pid):
        return True
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return False
    # "pid (comm) S ...": the state follows the last ")" (comm may hold spaces or parens)
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def describe_rank(p: Mapping[str, Any]) -> str:
    """``rank R (pid P on HOST)`` for a rank's row (``rank``, and ``pid``, ``host`` when
    known)."""
    where = []
    if p.get("pid") is not None:
        where.append(f"pid {p['pid']}")
    if p.get("host"):
        where.append(f"on {p['host']}")
    return f"rank {p['rank']}" + (f" ({' '.join(where)})" if where else "")


def band(values: Iterable[float | None]) -> tuple[float, float, float] | None:
    """``(min, median, max)`` of the finite values, ``None`` without one."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return None
    return min(xs), statistics.median(xs), max(xs)
