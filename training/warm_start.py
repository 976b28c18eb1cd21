"""A standby worker process: imports the training code now, runs it when told.

A worker's start is mostly Python starting and importing torch (1.1-1.5 s per process on
a 2-core machine, far more with CUDA on a large node), all of it on the critical path of
a recovery. The host monitor keeps one standby per job on its node:

    python -m training.warm_start --preload training.torch_workload.train

It imports the `--preload` modules, then waits for one JSON line on stdin:
{"argv": ["-m", "training.torch_workload", ...], "env": {...}, "cwd": "...",
"log": "/path/to/rank.log"}. It then sends its output to `log` (appended), replaces its
environment with `env`, and runs the module as `python -m` would (`runpy`), in this very
process: the host monitor adopts it as the worker. Anything that reads the environment
only when imported (OMP_NUM_THREADS in torch) comes from the environment the standby was
started with, which the host monitor makes the job's.

Standard library only, besides what it preloads. Exit codes: 64 when stdin closes
without an order (the host monitor dropped the standby), 2 for an order it cannot run.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import sys
from typing import Any

EXIT_DROPPED = 64
PR_SET_PDEATHSIG = 1  # linux/prctl.h
EXIT_BAD_ORDER = 2


def _order(line: str) -> tuple[str, list[str], dict[str, str], str | None, str | None]:
    order: Any = json.loads(line)
    if not isinstance(order, dict):
        raise ValueError("the order is not an object")
    argv, env = order.get("argv"), order.get("env")
    if (
        not isinstance(argv, list)
        or len(argv) < 2
        or argv[0] != "-m"
        or not all(isinstance(a, str) for a in argv)
    ):
        raise ValueError("argv must be ['-m', module, ...]")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValueError("env must map strings to strings")
    cwd, log = order.get("cwd"), order.get("log")
    if cwd is not None and not isinstance(cwd, str):
        raise ValueError("cwd must be a string")
    if log is not None and not isinstance(log, str):
        raise ValueError("log must be a string")
    return argv[1], argv[2:], env, cwd, log


def _outlive_the_host_monitor() -> None:
    """A standby dies with its host monitor (it set PR_SET_PDEATHSIG); a worker does not,
    like one the host monitor launched: clear it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 0)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m training.warm_start")
    parser.add_argument("--preload", action="append", default=[], help="A module to import now.")
    args = parser.parse_args()
    for module in args.preload:
        importlib.import_module(module)
    line = sys.stdin.readline()
    if not line:
        return EXIT_DROPPED
    try:
        module, rest, env, cwd, log = _order(line)
    except ValueError as exc:
        print(f"warm start: bad order: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_ORDER
    _outlive_the_host_monitor()
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # as a launched worker: nothing on stdin
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
