"""Finding, in our PID namespace, a worker that registered from another one.

On Kubernetes a training worker runs in its own pod, so in its own PID namespace: the pid
it knows itself by (`os.getpid()`) is not the pid the host monitor (a DaemonSet pod with
hostPID) polls and signals. So the worker also sends the inode of its /proc/self/ns/pid
and its start time (field 22 of /proc/self/stat: clock ticks since boot, the same number
seen from every PID namespace; see `self_identity`), and the host monitor looks for the
one process that has that pid in that namespace and started then (`find_host_pid`):
/proc/X/status `NSpid:` lists a process's pid in each namespace it belongs to, ours
first, its own last.

Reading /proc/X/ns/pid of another user's process takes CAP_SYS_PTRACE, which the host
monitor need not have (a process's stat and status are readable by everyone). Without
it, the innermost pid and the start time must point at exactly one process of a nested
namespace; two candidates are refused rather than guessed between.

Standard library only: the worker client imports `self_identity`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from host_monitor.errors import HostMonitorError

PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class PidIdentity:
    """What a process tells about itself so that another PID namespace can find it."""

    pid: int  # in its own PID namespace
    pid_namespace: int | None  # inode of /proc/self/ns/pid; None without /proc
    start_time: int | None  # clock ticks since boot (field 22 of /proc/self/stat)


class PidNotFound(HostMonitorError, LookupError):
    """No single process of this node matches a worker's identity (the message says why)."""


def self_identity() -> PidIdentity:
    return PidIdentity(os.getpid(), pid_namespace("self"), start_time("self"))


def pid_namespace(pid: int | str, proc: Path = PROC) -> int | None:
    """Inode of the PID namespace of `pid` ("self" for us); None if it cannot be read."""
    try:
        return os.stat(proc / str(pid) / "ns" / "pid").st_ino
    except OSError:
        return None


def start_time(pid: int | str, proc: Path = PROC) -> int | None:
    """Field 22 of /proc/PID/stat, None if it cannot be read."""
    stat = _read(f"{proc}/{pid}/stat")
    if stat is None:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def nspids(pid: int | str, proc: Path = PROC) -> list[int] | None:
    """The `NSpid:` line of /proc/PID/status (ours first, its own last); None if unknown."""
    status = _read(f"{proc}/{pid}/status")
    if status is None:
        return None
    for line in status.splitlines():
        if line.startswith(b"NSpid:"):
            try:
                return [int(field) for field in line.split()[1:]]
            except ValueError:
                return None
    return None  # kernels before 4.1 have no NSpid


def find_host_pid(
    worker: PidIdentity, proc: Path = PROC, *, own_pid_namespace: int | None = None
) -> int:
    """The pid, in our PID namespace, of the process `worker` describes.

    One pass over /proc; where the worker sent its start time, only the processes that
    started in the same clock tick have their status read. Raises PidNotFound.
    """
    unverified: list[int] = []  # right pid and start, namespace not readable
    try:
        entries = os.listdir(proc)
    except OSError as exc:
        raise PidNotFound(f"cannot list {proc}: {exc.strerror}") from None
    for name in entries:
        if not name.isdigit():
            continue
        if worker.start_time is not None and start_time(name, proc) != worker.start_time:
            continue
        chain = nspids(name, proc)
        # Length 1: a process of our own namespace, which the worker said it is not in.
        if chain is None or len(chain) < 2 or chain[-1] != worker.pid:
            continue
        try:
            namespace = os.stat(proc / name / "ns" / "pid").st_ino
        except PermissionError:
            unverified.append(int(name))
            continue
        except OSError:
            continue  # exited meanwhile
        if namespace == worker.pid_namespace:
            return int(name)
    if worker.start_time is not None and len(unverified) == 1:
        return unverified[0]
    where = f"pid {worker.pid} of PID namespace {worker.pid_namespace}"
    if worker.start_time is not None:
        where += f" started at tick {worker.start_time}"
    if len(unverified) > 1:
        raise PidNotFound(
            f"{len(unverified)} processes on this node could be {where} "
            f"(host pids {sorted(unverified)}) and the host monitor may not read their PID "
            "namespaces (that takes CAP_SYS_PTRACE): cannot tell which one is the worker"
        )
    hint = "does the host monitor run with hostPID?"
    if own_pid_namespace is not None:
        hint = f"the host monitor is in PID namespace {own_pid_namespace}: {hint}"
    if unverified:
        hint += (
            " (one process matches the pid but the host monitor may not read its PID "
            "namespace, and the registration carries no start_time to tell it by)"
        )
    raise PidNotFound(f"cannot find {where} on this node; {hint}")


_CHUNK = 16384  # more than a /proc/PID/stat or status holds: one read each


def _read(path: str) -> bytes | None:
    """The file's bytes, None if it cannot be read. Plain os calls on a str: a /proc scan
    reads a file per process, and this is about three times faster than Path.read_bytes."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, _CHUNK)
        if len(data) == _CHUNK:  # not expected from /proc, but never cut a file short
            chunks = [data]
            while chunk := os.read(fd, _CHUNK):
                chunks.append(chunk)
            data = b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data
