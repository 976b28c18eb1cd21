"""What /proc says of a pid (its state, its start time: a reused pid told apart), and what
the worker registry needs of a process it started (`LaunchedProcess`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol


class LaunchedProcess(Protocol):
    """A `subprocess.Popen`, or a worker a warm standby forked (host_monitor/standby.py)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


def proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of `pid` from /proc/PID/stat, None where /proc cannot tell.

    The start time (field 22) tells a reused pid apart; state `Z` is a zombie: exited,
    only waiting for its parent to reap it.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    return (fields[0], fields[19]) if len(fields) > 19 else None


def proc_start_time(pid: int) -> str | None:
    stat = proc_stat(pid)
    return stat[1] if stat else None


def pid_alive(pid: int, start_time: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    stat = proc_stat(pid)
    if stat is None:
        return True
    state, started = stat
    if state == "Z":
        return False
    # A different start time: the pid was reused by another process.
    return start_time is None or started == start_time
