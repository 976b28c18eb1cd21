"""Heartbeat ingest over real HTTP: the supervisor app against a bare ASGI ceiling.

Each server runs in its own process (uvicorn, uvloop, httptools) and the load generator
in another, so the client never competes with the server inside one interpreter. The
machine is shared and its speed moves by up to 2x within seconds, so the two servers are
measured in many short windows, back to back in each round, and compared round by round:
the result is the median of the per-round ratios.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import httpx

AGENT_TOKEN = "bench-agent-token"
OPERATOR_TOKEN = "bench-operator-token"
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Window:
    """One measured window of one server."""

    round: int
    rps: float
    requests: int
    server_cpu_s: float  # user + system, during the window
    client_cpu_pct: float

    @property
    def cpu_us_per_request(self) -> float:
        return 1e6 * self.server_cpu_s / self.requests if self.requests else float("nan")


@dataclass(frozen=True, slots=True)
class IngestResult:
    app: str
    windows: tuple[Window, ...]
    p50_ms: float
    p99_ms: float
    errors: int
    duration_s: float
    events_rows: int | None = None  # supervisor only
    nodes_rows: int | None = None
    #: Tables whose content changed during the windows: {table: rows added}.
    db_changed: dict[str, int] | None = None
    #: Seconds between the two looks at the database.
    db_watched_s: float | None = None
    #: The job's learned step interval (s) at the first and the second look.
    learned_interval_s: tuple[float | None, float | None] = (None, None)

    @property
    def rps(self) -> float:
        """The median window's throughput."""
        return statistics.median(w.rps for w in self.windows)

    @property
    def requests(self) -> int:
        return sum(w.requests for w in self.windows)

    @property
    def cpu_us_per_request(self) -> float:
        return statistics.median(w.cpu_us_per_request for w in self.windows)

    @property
    def server_cpu_pct(self) -> float:
        return statistics.median(100 * w.server_cpu_s / self.duration_s for w in self.windows)

    @property
    def client_cpu_pct(self) -> float:
        return statistics.median(w.client_cpu_pct for w in self.windows)


@dataclass(frozen=True, slots=True)
class Comparison:
    """The supervisor against the bare ceiling, window by window."""

    supervisor: IngestResult
    bare: IngestResult

    @property
    def ratios(self) -> list[float]:
        """Per round: the supervisor's throughput over the bare app's in the same round.
        The two windows of a round are back to back, so they share the machine's mood."""
        bare = {w.round: w.rps for w in self.bare.windows}
        return [w.rps / bare[w.round] for w in self.supervisor.windows if bare.get(w.round)]

    @property
    def pct(self) -> float:
        """Median of the per-round ratios, in percent."""
        return 100 * statistics.median(self.ratios) if self.ratios else 0.0

    @property
    def cpu_pct(self) -> float:
        """The bare app's server CPU per request over the supervisor's, in percent."""
        return 100 * self.bare.cpu_us_per_request / self.supervisor.cpu_us_per_request


@dataclass(frozen=True, slots=True)
class IngestConfig:
    connections: int = 32
    nodes: int = 1000
    warmup_s: float = 0.5
    duration_s: float = 2.0
    rounds: int = 15  # each round measures both servers, back to back
    profile_dir: Path | None = None


def _clean_env() -> dict[str, str]:
    """Our environment without SUPERVISOR_* settings, which would change the server."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


#: Columns a steady fleet may write, not per heartbeat: a job's longest step interval is
#: persisted when it grows (so that a restarted supervisor keeps its learned hang
#: timeout), a new maximum at a time, and the row's update time with it.
LEARNED = {("jobs", "step_interval_s"), ("jobs", "updated_at")}


def _db_tables(db: Path) -> dict[str, tuple[int, str]]:
    """Each table's row count and a hash of its content, to spot any write and name it
    (the files' size and mtime also change when SQLite checkpoints its journal)."""
    out = {}
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        tables = [
            row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        ]
        for table in tables:
            digest = hashlib.sha256()
            count = 0
            columns = [
                row[1]
                for row in conn.execute(f'PRAGMA table_info("{table}")')
                if (table, row[1]) not in LEARNED
            ]
            listed = ", ".join(f'"{c}"' for c in columns)
            for row in conn.execute(f'SELECT {listed} FROM "{table}"'):
                digest.update(repr(row).encode())
                count += 1
            out[table] = (count, digest.hexdigest())
    return out


def _learned_interval(db: Path) -> float | None:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        row = conn.execute("SELECT MAX(step_interval_s) FROM jobs").fetchone()
    return None if row is None or row[0] is None else float(row[0])


def _changed(
    before: dict[str, tuple[int, str]], after: dict[str, tuple[int, str]]
) -> dict[str, int]:
    return {
        table: after[table][0] - before.get(table, (0, ""))[0]
        for table in after
        if after[table] != before.get(table)
    }


def _count(db: Path, table: str) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        row = conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
    return int(row[0])


def _wait_ready(port: int, path: str, proc: subprocess.Popen[Any]) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=2.0) as client:
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if client.get(path).status_code < 300:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    raise RuntimeError("server did not become ready")


def _readline(stream: IO[str]) -> str:
    line = stream.readline()
    if not line:
        raise RuntimeError("load generator exited early")
    return line.strip()


def _start_server(app: str, workdir: Path, config: IngestConfig) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "bench.server", "--app", app]
    cmd += ["--agent-token", AGENT_TOKEN, "--operator-token", OPERATOR_TOKEN]
    if app == "supervisor":
        cmd += ["--database-url", f"sqlite:///{workdir / 'supervisor.db'}"]
    if config.profile_dir is not None:
        cmd += ["--profile", str(config.profile_dir / f"{app}.prof")]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=_clean_env())


def _stop(server: subprocess.Popen[str]) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def run(config: IngestConfig) -> Comparison:
    """Both servers run side by side, idle but for their own windows; one client
    measures them in turns (see bench.loadgen)."""
    apps = ("supervisor", "bare")
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        workdir = Path(tmp)
        db = workdir / "supervisor.db"
        servers = [_start_server(app, workdir, config) for app in apps]
        try:
            ports = []
            for app, server in zip(apps, servers, strict=True):
                assert server.stdout is not None
                ports.append(int(server.stdout.readline()))
                _wait_ready(ports[-1], "/readyz" if app == "supervisor" else "/", server)
            gen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.loadgen",
                    "--ports",
                    ",".join(map(str, ports)),
                    "--token",
                    AGENT_TOKEN,
                    "--expect",
                    "204",
                    "--connections",
                    str(config.connections),
                    "--nodes",
                    str(config.nodes),
                    "--rounds",
                    str(config.rounds),
                    "--warmup",
                    str(config.warmup_s),
                    "--duration",
                    str(config.duration_s),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert gen.stdout is not None
            windows: list[list[Window]] = [[] for _ in apps]
            try:
                assert _readline(gen.stdout) == "primed"
                before, watched = _db_tables(db), time.monotonic()
                learned_before = _learned_interval(db)
                cpu0 = 0.0
                while True:
                    line = _readline(gen.stdout)
                    kind, _, rest = line.partition(" ")
                    if kind == "window-start":
                        cpu0 = _cpu_s(servers[int(rest)].pid)
                    elif kind == "window-end":
                        cpu1 = _cpu_s(servers[int(rest)].pid)
                    elif kind == "window":
                        w = json.loads(rest)
                        windows[w["server"]].append(
                            Window(
                                round=w["round"],
                                rps=w["rps"],
                                requests=w["requests"],
                                server_cpu_s=cpu1 - cpu0,
                                client_cpu_pct=w["client_cpu_pct"],
                            )
                        )
                    elif kind == "done":
                        done: dict[str, Any] = json.loads(rest)
                        break
            finally:
                if gen.wait(timeout=30) != 0:
                    raise RuntimeError(f"load generator failed ({gen.returncode})")
            results = [
                IngestResult(
                    app=app,
                    windows=tuple(windows[i]),
                    p50_ms=done["servers"][i]["p50_ms"],
                    p99_ms=done["servers"][i]["p99_ms"],
                    errors=done["servers"][i]["errors"],
                    duration_s=config.duration_s,
                )
                for i, app in enumerate(apps)
            ]
            sup = replace(
                results[0],
                events_rows=_count(db, "events"),
                nodes_rows=_count(db, "nodes"),
                db_changed=_changed(before, _db_tables(db)),
                db_watched_s=time.monotonic() - watched,
                learned_interval_s=(learned_before, _learned_interval(db)),
            )
            return Comparison(supervisor=sup, bare=results[1])
        finally:
            for server in servers:
                _stop(server)
