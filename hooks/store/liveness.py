"""Whether a run's writer still lives: a writer is its process, named by (pid, process start
time, host).

A writer records its identity in the run row when it starts writing (``runs.writer``, JSON
``{"pid", "host", "start"}``, :func:`this_process`). A reader on the same host then asks the
system whether that very process still exists (:func:`process_lives`): a process with that pid
and that start time (``/proc/<pid>/stat``, field 22, on Linux), stopped (``SIGSTOP``, ``T``) or
not; a zombie (exited, not yet reaped) does not count. A pid reused by another process has
another start time and does not count either. Where there is no ``/proc`` the start time is
unknown (``None``) and the pid alone is probed (``os.kill(pid, 0)``), which a reused pid
fools. A writer on another host cannot be asked: its liveness is its heartbeat (see
:meth:`hooks.store.rows.RunInfo.writer_alive`).

This module uses only the standard library (no psutil).
"""

from __future__ import annotations

import os
import socket
from typing import Any

__all__ = ["pid_alive", "process_lives", "process_start", "this_process"]

#: ``/proc`` of this system, where process start times are read.
PROC = "/proc"


def pid_alive(pid: int | None) -> bool:
    """Whether a process with this id exists on this machine (signal 0 probe).

    A zombie (exited, not yet reaped by its parent) still counts as alive; a process owned by
    another user counts as alive (``EPERM``).
    """
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, OverflowError):
        return False
    return True


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (the state first), ``None``
    when there is no such file (no such process, or no ``/proc``)."""
    try:
        with open(f"{PROC}/{int(pid)}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except (OSError, ValueError, OverflowError):
        return None
    # "pid (comm) S ...": the fields follow the last ")" (comm may hold spaces or parens)
    return text.rpartition(")")[2].split()


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field
    22): with the pid, it names one process for as long as the machine runs. ``None`` where
    the system does not say (no ``/proc``) or there is no such process."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20 or not fields[19].isdigit():
        return None
    return int(fields[19])


def this_process() -> dict[str, Any]:
    """This process's identity as a writer records it: ``{"pid", "host", "start"}``
    (``start`` ``None`` where the system does not tell it)."""
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "start": process_start(pid)}


def process_lives(pid: int | None, start: int | None) -> bool:
    """Whether process ``pid`` of this host that started at ``start`` (see
    :func:`process_start`) still exists: running, sleeping or stopped (``SIGSTOP``), not a
    zombie. With ``start`` ``None``, or on a system without ``/proc``, whether any process has
    that pid (:func:`pid_alive`)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    fields = _stat_fields(pid)
    if fields is None:
        # no such process where /proc exists; elsewhere only the pid can be asked
        return False if os.path.isdir(f"{PROC}/self") else pid_alive(pid)
    if fields[:1] in (["Z"], ["X"]):  # exited: not reaped yet (zombie), or being reaped
        return False
    if start is None:
        return True
    return len(fields) >= 20 and fields[19] == str(start)
