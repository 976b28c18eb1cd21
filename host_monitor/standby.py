"""Warm standbys: one process per node with the job's modules imported, forking workers.

A recovery that starts a rank anew (a crashed worker restarted in place, the survivors of
a lost node started again in a new world, a spare taking a lost node's rank) waits for
Python to start and import the training code (torch: over a second per process here, far
more with CUDA). So the host monitor keeps, per node, one standby for the job it serves or
may serve: `python -m training.warm_start` with the job's modules imported, which forks a
worker for each start of that job's command on this node, with the rank's environment
and log file (training/warm_start.py). The standby stays for the next start: only its
first start pays for the import.

A forked worker is the standby's child, not ours: `ForkedWorker` is what the worker
registry needs of it (`pid`, `poll()`), with the exit code the standby reports when it
reaps it. Only Python commands have standbys: `[python, "-m", module, ...]` or
`[python, "script.py", ...]`, with `-u` at most before them (the standby is started with
it). One standby per node (the newest job asked for wins); a dropped standby takes no more
orders and ends after the workers it forked; it is killed when the host monitor dies. One
that dies on its own (its imports ended the interpreter) is not started again for that
job and command: their ranks start as new processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from host_monitor.processes import pid_alive, proc_start_time
from resiliency_protocol.standby_orders import (
    Exited,
    Forked,
    PythonArgs,
    Ready,
    WorkerOrder,
    parse_reply,
)

log = logging.getLogger(__name__)

LAUNCHER = "training.warm_start"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# How long a fork may take to be answered: the standby answers at once unless it is
# still importing the job's modules (its first order waits for that).
FORK_TIMEOUT_S = 60.0


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the host monitor dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def warm_startable(command: Sequence[str]) -> PythonArgs | None:
    """The program of a Python command a standby can fork (`python [-u] -m module ...` or
    `python [-u] script.py ...`); None for any other command."""
    return PythonArgs.of(tuple(command[1:])) if len(command) >= 2 else None


class Standby:
    """One standby process and the pipe its replies come on."""

    def __init__(
        self, job: str, command: tuple[str, ...], proc: subprocess.Popen[bytes], replies: int
    ):
        self.job = job
        self.command = command
        self.proc = proc
        self._replies = replies
        self._buffer = b""
        self._codes: dict[int, int] = {}
        self._forked: list[Forked] = []
        # Orders are sent from a thread (a fork waits for the standby's imports); exits
        # are read by the registry's polls: one reader at a time.
        self._lock = threading.Lock()
        self.closed = False  # its reply pipe ended: it has exited
        self.warm = False  # it said it has imported its modules

    def fork(self, order: WorkerOrder) -> ForkedWorker:
        """The worker of `order`, forked; OSError when the standby cannot fork it. Blocks
        until the standby answers (at once, once it is warm)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(order.to_line())
        self.proc.stdin.flush()
        deadline = time.monotonic() + FORK_TIMEOUT_S
        while True:
            with self._lock:
                if self._forked:
                    answer = self._forked.pop(0)
                    break
                left = deadline - time.monotonic()
                if self.closed or left <= 0:
                    raise OSError("the standby did not fork the worker")
                self._read(min(left, 0.1))
        if answer.pid is None:
            raise OSError(f"the standby refused the order: {answer.error}")
        return ForkedWorker(answer.pid, self)

    def collect(self) -> None:
        """Read the replies there are, without waiting."""
        with self._lock:
            self._read(0.0)

    def _read(self, wait_s: float) -> None:
        while not self.closed:
            ready, _, _ = select.select([self._replies], [], [], wait_s)
            if not ready:
                return
            wait_s = 0.0
            chunk = os.read(self._replies, 65536)
            if not chunk:
                self.closed = True
                os.close(self._replies)
                return
            self._buffer += chunk
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                try:
                    reply = parse_reply(line)
                except ValueError as exc:
                    log.warning("the standby of job %s replied %r: %s", self.job, line, exc)
                    continue
                if isinstance(reply, Ready):
                    self.warm = True
                elif isinstance(reply, Exited):
                    self._codes[reply.pid] = reply.code
                else:
                    self._forked.append(reply)

    def exit_code(self, pid: int) -> int | None:
        self.collect()
        return self._codes.get(pid)

    def stop_taking_orders(self) -> None:
        """It forks no more: it exits once its workers have (their codes still come)."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()


class ForkedWorker:
    """A worker a standby forked, as the worker registry sees a launched process."""

    def __init__(self, pid: int, standby: Standby) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._standby = standby
        self._started = proc_start_time(pid)  # a reused pid is not this worker

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._standby.exit_code(self.pid)
        if (
            self.returncode is None
            and self._standby.closed
            and not pid_alive(self.pid, self._started)
        ):
            # The standby was killed before its worker ended: the worker became init's
            # child, and its exit code is nobody's to know. Gone is all we can tell.
            self.returncode = -signal.SIGKILL
        return self.returncode


class Standbys:
    def __init__(self, run_dir: Path, node: str) -> None:
        self.run_dir = run_dir
        self.node = node
        self._standby: Standby | None = None
        self._dropped: list[Standby] = []  # still reporting the exits of their workers
        self._failed: set[tuple[str, tuple[str, ...]]] = set()  # (job, command) that died

    @property
    def ready(self) -> Standby | None:
        standby = self._standby
        if standby is not None and standby.proc.poll() is not None:
            log.warning(
                "the standby of job %s exited (%s): see %s; its ranks start without one",
                standby.job,
                standby.proc.returncode,
                self._log_path(standby.job),
            )
            # Not started again: a program whose imports end the interpreter would
            # otherwise cost an import at every request for a standby.
            self._failed.add((standby.job, standby.command))
            self._standby = standby = None
        return standby

    @property
    def warm(self) -> bool:
        """The current standby has imported its modules."""
        standby = self.ready
        if standby is None:
            return False
        standby.collect()
        return standby.warm

    def prepare(
        self, job: str, command: Sequence[str], env: dict[str, str], preload: Sequence[str]
    ) -> bool:
        """Have a standby of `command` for `job` ready (started now if there is none);
        False when this command cannot have one, or its standby here died."""
        program = warm_startable(command)
        if not preload or program is None:
            return False
        current = self.ready
        if (job, tuple(command)) in self._failed:
            return False
        if current is not None and current.job == job and current.command == tuple(command):
            return True
        self.drop()
        replies, reply_w = os.pipe()
        argv = [command[0], *program.options, "-m", LAUNCHER, "--reply-fd", str(reply_w)]
        for module in preload:
            argv += ["--preload", module]
        path = self._log_path(job)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with path.open("ab") as out:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group, apart from its workers'
                    close_fds=True,
                    pass_fds=(reply_w,),
                    # A standby dies with this host monitor, however it dies (a node_down
                    # fault kills it); the workers it forked do not (the kernel clears
                    # this in a forked child).
                    preexec_fn=_die_with_parent,
                )
        except BaseException:
            os.close(replies)
            raise
        finally:
            os.close(reply_w)
        self._standby = Standby(job, tuple(command), proc, replies)
        log.info("standby of job %s started (pid %d), preloading %s", job, proc.pid, preload)
        return True

    def take(
        self,
        job: str,
        command: Sequence[str],
        env: dict[str, str],
        log_path: Path,
        cwd: str | None = None,
    ) -> ForkedWorker | None:
        """A worker of `job` forked by the warm standby of `command`, with `env` and
        `log_path`; None when there is none, or it is still importing (start the worker
        the usual way)."""
        self._collect_dropped()
        standby = self.ready
        if standby is None or standby.job != job or standby.command != tuple(command):
            return None
        standby.collect()
        if not standby.warm:  # still importing: a worker of its own starts sooner
            log.info("the standby of job %s is still importing: launching the worker", job)
            return None
        order = WorkerOrder(tuple(command[1:]), env, cwd, str(log_path))
        try:
            return standby.fork(order)
        except (OSError, ValueError) as exc:
            log.warning("the standby of job %s did not fork the worker: %s", job, exc)
            self._standby = None
            self._kill(standby)
            return None

    def drop(self) -> None:
        """No more workers from the current standby: it ends after those it forked."""
        if self._standby is not None:
            self._standby.stop_taking_orders()
            self._dropped.append(self._standby)
            self._standby = None

    def _collect_dropped(self) -> None:
        for standby in list(self._dropped):
            standby.collect()
            if standby.closed:
                self._dropped.remove(standby)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    standby.proc.wait(1)

    def _kill(self, standby: Standby) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(standby.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            standby.proc.wait(5)
        standby.collect()

    def _log_path(self, job: str) -> Path:
        return self.run_dir / f"{self.node}.{job}.standby.log"
