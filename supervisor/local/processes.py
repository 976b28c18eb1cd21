"""How the local cluster starts its processes (the host monitors, the supervisor): one
small interface, so that whoever runs the cluster may start them another way.

`start_process` is the way of `supervisor demo` and `supervisor run`: a new process of
the command, in a session of its own (Ctrl+C in the terminal reaches the launcher only,
which stops them), sent SIGTERM when the launcher dies however it dies, its output
appended to its log file. A `ProcessStarter` is anything with that signature whose
process answers what `LocalProcess` asks (the test suite's forks its Python services
from a process that imported them once).
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class LocalProcess(Protocol):
    """What the local cluster uses of a process it started (`subprocess.Popen`'s names)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code; `subprocess.TimeoutExpired` after `timeout` seconds."""
        ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class ProcessStarter(Protocol):
    def __call__(self, args: Sequence[str], env: Mapping[str, str], log_path: Path) -> LocalProcess:
        """`args` started with exactly `env`, stdout and stderr appended to `log_path`."""
        ...


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_process(args: Sequence[str], env: Mapping[str, str], log_path: Path) -> LocalProcess:
    with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            list(args),
            env=dict(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl+C in the terminal reaches us only; we stop them
            preexec_fn=_die_with_parent,
        )
