"""How long an operator command takes: `supervisor get nodes` against a live server (the
real app on SQLite, `python -m bench.server`), beside the least any Python command that
speaks HTTP pays in the same run: the interpreter started and `httpx` imported. And how
long `supervisor serve` takes to be ready (`/readyz` 200) on a new SQLite database (every
migration run) and on one it made before (a restart), beside the interpreter started and
the service's libraries imported.

Each is run CALLS times, one after another; the row gives the median wall time and the
CPU of one call (user + system, the children's rusage), and the command's cost over the
baseline as a ratio.
"""

from __future__ import annotations

import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.table import Row, verdict

CALLS = 10
#: What a user waits for a `get` on an idle machine, at most.
WALL_TARGET_S = 0.5
#: From `supervisor serve` started to `/readyz` 200 on an idle machine, at most.
READY_TARGET_S = 3.0
STARTS = 5
SERVICE_LIBRARIES = "import fastapi, uvicorn, sqlalchemy, alembic, pydantic_settings"
OPERATOR_TOKEN = "bench-operator-token"


@dataclass(frozen=True, slots=True)
class Timing:
    wall_s: float  # median of the calls
    cpu_s: float  # mean user + system CPU of one call


def timed(command: Sequence[str], env: dict[str, str], calls: int = CALLS) -> Timing:
    walls: list[float] = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(calls):
        started = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        walls.append(time.perf_counter() - started)
        if done.returncode != 0:
            raise RuntimeError(f"{command[:4]} exited {done.returncode}: {done.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timing(statistics.median(walls), cpu / calls)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ready_after(env: dict[str, str], database: str) -> float:
    """Seconds from `supervisor serve` started to its first `/readyz` 200 (polled every
    10 ms); the process is stopped after."""
    port = _free_port()
    serve = [sys.executable, "-m", "supervisor.cli", "serve", "--port", str(port)]
    started = time.perf_counter()
    server = subprocess.Popen(
        serve,
        env={**env, "SUPERVISOR_DATABASE_URL": database},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        with httpx.Client(timeout=1) as http:
            while time.perf_counter() - started < 60:
                if server.poll() is not None:
                    assert server.stderr is not None
                    raise RuntimeError(f"supervisor serve exited: {server.stderr.read()[-2000:]!r}")
                try:
                    if http.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                        return time.perf_counter() - started
                except httpx.TransportError:
                    pass
                time.sleep(0.01)
        raise RuntimeError("supervisor serve was not ready within 60 s")
    finally:
        server.terminate()
        server.wait(30)


def ready_rows(env: dict[str, str], tmp: Path) -> list[Row]:
    serve_env = {**env, "SUPERVISOR_OPERATOR_TOKEN": OPERATOR_TOKEN}
    serve_env["SUPERVISOR_AGENT_TOKEN"] = "bench-agent-token"
    fresh: list[float] = []
    again: list[float] = []
    for n in range(STARTS):
        database = f"sqlite:///{tmp / f'serve-{n}.db'}"
        fresh.append(ready_after(serve_env, database))
        again.append(ready_after(serve_env, database))
    baseline = timed([sys.executable, "-c", SERVICE_LIBRARIES], env, calls=STARTS)
    rows = []
    for what, times in (("a new database", fresh), ("its database of before", again)):
        ready = statistics.median(times)
        rows.append(
            Row(
                f"`supervisor serve` ready (`/readyz` 200) on {what}, median of {STARTS}",
                f"{ready:.2f} s",
                f"python -c '{SERVICE_LIBRARIES}': {baseline.wall_s:.2f} s "
                f"(x{ready / baseline.wall_s:.1f})",
                f"< {READY_TARGET_S:g} s",
                verdict(ready < READY_TARGET_S),
            )
        )
    return rows


def rows() -> list[Row]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        env["HOME"] = tmp  # no operator config file of the user's
        database = f"sqlite:///{Path(tmp) / 'supervisor.db'}"
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.server",
                "--app",
                "supervisor",
                "--database-url",
                database,
                "--operator-token",
                OPERATOR_TOKEN,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            get = [sys.executable, "-m", "supervisor.cli", "get", "nodes"]
            get += ["--server", f"http://127.0.0.1:{port}", "--token", OPERATOR_TOKEN]
            timed(get, env, calls=1)  # the server's first answer, and the files cached
            baseline = timed([sys.executable, "-c", "import httpx"], env)
            command = timed(get, env)
        finally:
            server.terminate()
            server.wait(30)
        ready = ready_rows(env, Path(tmp))
    return [
        *ready,
        Row(
            f"`supervisor get nodes`, median of {CALLS} calls (wall; CPU per call)",
            f"{command.wall_s:.2f} s; {command.cpu_s:.2f} s CPU",
            f"python -c 'import httpx': {baseline.wall_s:.2f} s; {baseline.cpu_s:.2f} s CPU "
            f"(x{command.wall_s / baseline.wall_s:.1f})",
            f"< {WALL_TARGET_S:g} s",
            verdict(command.wall_s < WALL_TARGET_S),
        ),
    ]
