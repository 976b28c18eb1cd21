"""Heartbeat ingest at a fleet's shape: nodes beating at a fleet's rate, late at random.

Where bench/ingest.py saturates the server with a closed loop, here the load is what a
fleet sends (bench/fleet_loadgen.py): each node every `period` s on its own clock, each
beat late by up to `jitter` s, nodes of `workers` ranks in jobs of `ranks_per_job` ranks,
every beat sent to the supervisor and to the bare ASGI app alike. Measured per window:
each server's CPU (user + system, from /proc) per heartbeat it answered, and the SQL
statements the supervisor sent (SQLAlchemy's cursor events, counted in its process; the
history pruner's passes apart: its first comes a minute after the start, then hourly, and
is no steady rate).
For each node count of a group, a supervisor restores that fleet from a fresh database
(as after a restart: no registration storm), with the bare app beside it. A phase with
`batch` > 1 sends the supervisor its beats in batches of that many, as a relay does
(`POST /api/v1/heartbeats/batch`), the bare app still one request a beat (or the same
batches, `bare_batched`: at the fleet's rate).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fleet_database import fill_fleet
from bench.ingest import AGENT_TOKEN, OPERATOR_TOKEN, _clean_env, _cpu_s, _readline, _stop
from bench.ingest import _wait_ready as wait_ready

#: The heartbeat timeout in periods, as by default (5 s and 15 s).
TIMEOUT_PERIODS = 3


@dataclass(frozen=True, slots=True)
class Phase:
    nodes: int
    jitter_s: float  # each beat late by 0..jitter_s
    period_s: float = 5.0
    batch: int = 1  # the supervisor's beats in batches of this many (a relay's)
    # The bare app sent the same batches, one request each (else one request a beat): at
    # a fleet's rate (5,000 beats a second) one client cannot send every beat alone.
    bare_batched: bool = False
    timeout_periods: float = TIMEOUT_PERIODS  # the heartbeat timeout, in periods

    @property
    def timeout_s(self) -> float:
        return self.timeout_periods * self.period_s


@dataclass(frozen=True, slots=True)
class Group:
    database: str  # "sqlite" or "postgresql"
    workers: int  # per node
    ranks_per_job: int
    phases: tuple[Phase, ...]


@dataclass(frozen=True, slots=True)
class FleetWindow:
    group: Group
    phase: Phase
    seconds: float
    heartbeats: int  # answered by the supervisor
    requests: int  # the supervisor's requests those came in (batches count one)
    bare_heartbeats: int
    bare_requests: int
    cpu_s: float
    bare_cpu_s: float
    statements: int  # all but the history pruner's
    pruner_statements: int  # the history pruner's passes' and wake-ups' (reported apart)
    errors: int
    p99_ms: float
    bare_p99_ms: float
    late_p99_ms: float  # how late the generator sent beats (its own lag)
    client_cpu_pct: float

    @property
    def cpu_us(self) -> float:
        return 1e6 * self.cpu_s / self.heartbeats if self.heartbeats else float("nan")

    @property
    def bare_cpu_us(self) -> float:
        return 1e6 * self.bare_cpu_s / self.bare_heartbeats if self.bare_heartbeats else 0.0

    @property
    def rate(self) -> float:
        return self.heartbeats / self.seconds

    @property
    def sql_per_s(self) -> float:
        return self.statements / self.seconds


@contextlib.contextmanager
def database(kind: str, workdir: Path) -> Iterator[str]:
    """A fresh database's URL: a SQLite file, or a private PostgreSQL server."""
    if kind == "sqlite":
        yield f"sqlite:///{workdir / 'supervisor.db'}"
        return
    from tests.postgres import running_postgres

    with running_postgres() as server:
        yield server.url


def _server(app: str, url: str, phase: Phase) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "bench.server", "--app", app]
    cmd += ["--agent-token", AGENT_TOKEN, "--operator-token", OPERATOR_TOKEN]
    if app == "supervisor":
        timers = {"period_s": phase.period_s, "timeout_s": phase.timeout_s}
        cmd += ["--database-url", url, "--fleet", json.dumps(timers), "--count-sql"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=_clean_env())


def _sql_counts(server: subprocess.Popen[str]) -> tuple[int, int]:
    """The SQL statements the supervisor has sent (bench/server.py --count-sql): all but
    the history pruner's, and the pruner's."""
    assert server.stdout is not None
    server.send_signal(signal.SIGUSR1)
    others, pruner = _readline(server.stdout).split()
    return int(others), int(pruner)


def _statements(server: subprocess.Popen[str]) -> int:
    """The SQL statements the supervisor has sent, the history pruner's left out."""
    return _sql_counts(server)[0]


def run_group(
    group: Group,
    duration_s: float,
    settle_s: float | None = None,
    profile_dir: Path | None = None,
) -> list[FleetWindow]:
    """The group's phases, a window each: for each node count a fresh database holding
    that fleet (bench/fleet_database.py), a supervisor restoring it and a bare app beside
    it. With `profile_dir`, py-spy samples the supervisor through each window (collapsed
    stacks, one file a window: see bench/profile_top.py)."""
    windows: list[FleetWindow] = []
    for nodes, period_s in dict.fromkeys((p.nodes, p.period_s) for p in group.phases):
        phases = [p for p in group.phases if (p.nodes, p.period_s) == (nodes, period_s)]
        # Beats late by up to `jitter` s: the rate ramps up over that long from the first
        # beats (and moves for as long when the lateness changes).
        settle = max(p.jitter_s for p in phases) + 2.0 if settle_s is None else settle_s
        with (
            tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp,
            database(group.database, Path(tmp)) as url,
        ):
            fill_fleet(url, nodes, group.workers, group.ranks_per_job)
            servers = [_server(app, url, phases[0]) for app in ("supervisor", "bare")]
            try:
                windows += _measure(group, phases, servers, duration_s, settle, profile_dir)
            finally:
                for server in servers:
                    _stop(server)
    return windows


def _measure(
    group: Group,
    phases: list[Phase],
    servers: list[subprocess.Popen[str]],
    duration_s: float,
    settle_s: float,
    profile_dir: Path | None,
) -> list[FleetWindow]:
    ports = []
    for server in servers:
        assert server.stdout is not None
        ports.append(int(server.stdout.readline()))
    plan = [
        {
            "nodes": p.nodes,
            "period": p.period_s,
            "jitter": p.jitter_s,
            "batch": p.batch,
            "bare_batched": p.bare_batched,
        }
        for p in phases
    ]
    gen = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.fleet_loadgen",
            "--ports",
            ",".join(map(str, ports)),
            "--token",
            AGENT_TOKEN,
            "--workers",
            str(group.workers),
            "--ranks-per-job",
            str(group.ranks_per_job),
            "--plan",
            json.dumps(plan),
            "--settle",
            str(settle_s),
            "--duration",
            str(duration_s),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert gen.stdout is not None and gen.stdin is not None
    # Its nodes' beats start as the supervisor is ready: it gave the nodes it restored
    # one heartbeat timeout from its start.
    if _readline(gen.stdout) != "ready":
        raise RuntimeError("fleet load generator did not start")
    for server, port, ready in zip(servers, ports, ("/readyz", "/"), strict=True):
        wait_ready(port, ready, server)
    gen.stdin.write("go\n")
    gen.stdin.flush()
    windows: list[FleetWindow] = []
    cpu0: list[float] = []
    cpu1: list[float] = []
    sql0 = sql1 = (0, 0)
    spy: subprocess.Popen[bytes] | None = None
    try:
        while True:
            kind, _, rest = _readline(gen.stdout).partition(" ")
            if kind == "window-start":
                cpu0 = [_cpu_s(s.pid) for s in servers]
                sql0 = _sql_counts(servers[0])
                if profile_dir is not None:
                    out = profile_dir / _profile_name(group, phases[int(rest)])
                    spy = _py_spy(servers[0].pid, duration_s, out)
            elif kind == "window-end":
                cpu1 = [_cpu_s(s.pid) for s in servers]
                sql1 = _sql_counts(servers[0])
                if spy is not None:
                    spy.wait(timeout=60)
                    spy = None
            elif kind == "window":
                w: dict[str, Any] = json.loads(rest)
                windows.append(
                    FleetWindow(
                        group=group,
                        phase=phases[w["phase"]],
                        seconds=w["seconds"],
                        heartbeats=w["answered"][0],
                        requests=w["requests"][0],
                        bare_heartbeats=w["answered"][1],
                        bare_requests=w["requests"][1],
                        cpu_s=cpu1[0] - cpu0[0],
                        bare_cpu_s=cpu1[1] - cpu0[1],
                        statements=sql1[0] - sql0[0],
                        pruner_statements=sql1[1] - sql0[1],
                        errors=sum(w["errors"]),
                        p99_ms=w["latency"][0]["p99_ms"],
                        bare_p99_ms=w["latency"][1]["p99_ms"],
                        late_p99_ms=w["late_p99_ms"],
                        client_cpu_pct=w["client_cpu_pct"],
                    )
                )
            elif kind == "done":
                break
    finally:
        if gen.wait(timeout=30) != 0:
            raise RuntimeError(f"fleet load generator failed ({gen.returncode})")
    return windows


def _profile_name(group: Group, phase: Phase) -> str:
    return (
        f"{group.database}-{group.workers}w-{group.ranks_per_job}r-"
        f"{phase.nodes}n-{phase.period_s:g}p-{phase.jitter_s:g}j"
        + (f"-{phase.batch}b" if phase.batch > 1 else "")
        + ".txt"
    )


def _py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling `pid` for `seconds`, collapsed stacks to `out` (needs ptrace: root,
    or kernel.yama.ptrace_scope 0)."""
    spy = Path(sys.executable).with_name("py-spy")
    return subprocess.Popen(
        [
            *(str(spy), "record", "--pid", str(pid), "--duration", str(max(1, round(seconds)))),
            *("--rate", "250", "--format", "raw", "--nonblocking", "--output", str(out)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
