"""Warm standby worker processes: the next worker of a job, already started.

A recovery that starts a rank anew (a crashed worker restarted in place, a spare taking a
lost node's rank) waits for Python to start and import the training code (torch: over a
second per process here, far more with CUDA). So the host monitor keeps, per node, one
standby for the job it serves or may serve: `python -m training.warm_start` with the
job's modules imported, waiting for its order on stdin (training/warm_start.py). The next
start of that job's command on this node hands the standby its rank's environment and
log file and adopts the process as the worker; a new standby is started behind it.

Only commands of the form `[python, "-m", module, ...]` have standbys. One standby per
node (the newest job asked for wins); it is killed when the host monitor stops.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

LAUNCHER = "training.warm_start"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class Standby:
    job: str
    command: tuple[str, ...]
    proc: subprocess.Popen[bytes]


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the host monitor dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def warm_startable(command: Sequence[str]) -> bool:
    return len(command) >= 3 and command[1] == "-m"


class Standbys:
    def __init__(self, run_dir: Path, node: str) -> None:
        self.run_dir = run_dir
        self.node = node
        self._standby: Standby | None = None

    @property
    def ready(self) -> Standby | None:
        standby = self._standby
        if standby is not None and standby.proc.poll() is not None:
            log.warning(
                "the standby of job %s exited (%s): see %s",
                standby.job,
                standby.proc.returncode,
                self._log_path(standby.job),
            )
            self._standby = standby = None
        return standby

    def prepare(
        self, job: str, command: Sequence[str], env: dict[str, str], preload: Sequence[str]
    ) -> bool:
        """Have a standby of `command` for `job` ready (started now if there is none);
        False when this command cannot have one."""
        if not preload or not warm_startable(command):
            return False
        current = self.ready
        if current is not None and current.job == job and current.command == tuple(command):
            return True
        self.drop()
        argv = [command[0], "-m", LAUNCHER]
        for module in preload:
            argv += ["--preload", module]
        path = self._log_path(job)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as out:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # as a launched worker: its own process group
                close_fds=True,
                # A standby nobody will ever order dies with this host monitor, however
                # it dies (a node_down fault kills it); the standby clears this once it
                # becomes a worker.
                preexec_fn=_die_with_parent,
            )
        self._standby = Standby(job, tuple(command), proc)
        log.info("standby of job %s started (pid %d), preloading %s", job, proc.pid, preload)
        return True

    def take(
        self,
        job: str,
        command: Sequence[str],
        env: dict[str, str],
        log_path: Path,
        cwd: str | None = None,
    ) -> subprocess.Popen[bytes] | None:
        """The ready standby of `job` and `command`, told to run as the worker with `env`
        and `log_path`; None when there is none (start the worker the usual way)."""
        standby = self.ready
        if standby is None or standby.job != job or standby.command != tuple(command):
            return None
        self._standby = None
        order = {"argv": list(command[1:]), "env": env, "log": str(log_path), "cwd": cwd}
        try:
            assert standby.proc.stdin is not None
            standby.proc.stdin.write(json.dumps(order).encode() + b"\n")
            standby.proc.stdin.close()
        except (OSError, ValueError) as exc:
            log.warning("the standby of job %s did not take its order: %s", job, exc)
            self._kill(standby)
            return None
        return standby.proc

    def drop(self) -> None:
        if self._standby is not None:
            self._kill(self._standby)
            self._standby = None

    def _kill(self, standby: Standby) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(standby.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            standby.proc.wait(5)

    def _log_path(self, job: str) -> Path:
        return self.run_dir / f"{self.node}.{job}.standby.log"
