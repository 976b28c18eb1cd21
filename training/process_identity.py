"""What a worker tells its host monitor so that it can be found from another PID namespace.

On Kubernetes a worker runs in its own pod, so the pid it knows itself by is not the pid
the host monitor sees. It also sends the inode of its PID namespace and its start time
(field 22 of /proc/self/stat, clock ticks since boot, the same from every namespace); the
host monitor looks for the one process with that pid in that namespace that started then.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    pid: int  # in its own PID namespace
    pid_namespace: int | None  # inode of /proc/self/ns/pid; None without /proc
    start_time: int | None  # clock ticks since boot; None without /proc


def self_identity() -> ProcessIdentity:
    try:
        namespace: int | None = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = None
    return ProcessIdentity(os.getpid(), namespace, _own_start_time())


def _own_start_time() -> int | None:
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    after_name = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(after_name[19])
    except (IndexError, ValueError):
        return None
