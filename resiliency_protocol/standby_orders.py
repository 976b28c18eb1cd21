"""The pipe between a host monitor and its warm standby (training/warm_start.py): the
orders the host monitor writes on the standby's stdin, one JSON line each, and the
standby's replies on the pipe it was given (`--reply-fd`), one JSON line each.

Standard library only: the standby imports this before the job's modules, and a NumPy
job's standby should not pay for pydantic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: Interpreter options a forked worker can have: the standby is started with them (its
#: workers inherit them). Any other option, and the command gets no standby.
STANDBY_OPTIONS = frozenset({"-u"})


@dataclass(frozen=True)
class PythonArgs:
    """A Python command's arguments after the interpreter: its options, then `-m module`
    or a script's path, then the program's own arguments."""

    options: tuple[str, ...]
    module: str | None
    script: str | None
    args: tuple[str, ...]

    @classmethod
    def of(cls, argv: tuple[str, ...] | list[str]) -> PythonArgs | None:
        """None when a standby cannot run these arguments as the interpreter would: an
        option it does not take on, `-c`, a script that is not a `.py` file."""
        options = []
        for i, arg in enumerate(argv):
            if arg in STANDBY_OPTIONS:
                options.append(arg)
                continue
            if arg == "-m":
                if i + 1 >= len(argv) or not argv[i + 1] or argv[i + 1].startswith("-"):
                    return None
                return cls(tuple(options), argv[i + 1], None, tuple(argv[i + 2 :]))
            if arg.startswith("-") or not arg.endswith(".py"):
                return None
            return cls(tuple(options), None, arg, tuple(argv[i + 1 :]))
        return None


@dataclass(frozen=True)
class WorkerOrder:
    """Fork a worker: `python <argv>` (`-m module args` or `script.py args`, after the
    options in STANDBY_OPTIONS) with `env` (replacing the standby's), in `cwd`, its output
    appended to `log`."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str | None = None
    log: str | None = None

    @property
    def program(self) -> PythonArgs:
        parsed = PythonArgs.of(self.argv)
        assert parsed is not None  # checked when made
        return parsed

    def __post_init__(self) -> None:
        if PythonArgs.of(self.argv) is None:
            raise ValueError("argv must be [options] -m module ... or [options] script.py ...")

    def to_line(self) -> bytes:
        body = {"argv": list(self.argv), "env": self.env, "cwd": self.cwd, "log": self.log}
        return json.dumps(body).encode() + b"\n"

    @classmethod
    def parse(cls, line: str | bytes) -> WorkerOrder:
        """ValueError naming the field when the line is not an order."""
        body = _object(line)
        argv, env, cwd, log = body.get("argv"), body.get("env"), body.get("cwd"), body.get("log")
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ValueError("argv must be a list of strings")
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ValueError("env must map strings to strings")
        if cwd is not None and not isinstance(cwd, str):
            raise ValueError("cwd must be a string")
        if log is not None and not isinstance(log, str):
            raise ValueError("log must be a string")
        return cls(tuple(argv), dict(env), cwd, log)


@dataclass(frozen=True)
class Ready:
    """The standby has imported what it preloads: an order is forked at once."""


@dataclass(frozen=True)
class Forked:
    """The worker of the last order runs as `pid`; or the order was refused (`error`)."""

    pid: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class Exited:
    """A worker the standby forked ended with `code`, as `subprocess.Popen.returncode`
    says it: the exit status, or minus the signal that killed it."""

    pid: int
    code: int


Reply = Ready | Forked | Exited


def reply_line(reply: Reply) -> bytes:
    if isinstance(reply, Ready):
        body: dict[str, Any] = {"ready": True}
    elif isinstance(reply, Exited):
        body = {"exited": reply.pid, "code": reply.code}
    else:
        body = {"forked": reply.pid, "error": reply.error}
    return json.dumps(body).encode() + b"\n"


def parse_reply(line: str | bytes) -> Reply:
    """ValueError naming the field when the line is not a reply."""
    body = _object(line)
    if body.get("ready") is True:
        return Ready()
    if "exited" in body:
        pid, code = body["exited"], body.get("code")
        if not isinstance(pid, int) or not isinstance(code, int):
            raise ValueError("exited and code must be integers")
        return Exited(pid, code)
    pid, error = body.get("forked"), body.get("error")
    if pid is not None and not isinstance(pid, int):
        raise ValueError("forked must be an integer")
    if error is not None and not isinstance(error, str):
        raise ValueError("error must be a string")
    if (pid is None) == (error is None):
        raise ValueError("a reply has forked or error, not both")
    return Forked(pid, error)


def _object(line: str | bytes) -> dict[str, Any]:
    body: Any = json.loads(line)
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    return body
