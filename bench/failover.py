"""Leader failover: two `supervisor serve` replicas, one Lease, the leader killed.

Real processes: each replica is `python -m supervisor.cli serve` with leader election on,
a kubeconfig pointing at the fake Kubernetes API server (`tests.kube.FakeKube`, which
models Leases with resourceVersion and 409 as the real server does), the dry-run
backend, and one SQLite database shared by both. Per round:

1. The leader is ready (`/readyz` 200), the standby is not (503).
2. Nodes register with heartbeats; GPU errors are injected through
   `POST /api/v1/faults` at once, so that the policy's decisions and actions are in
   flight; the leader is SIGKILLed as soon as the last fault is acknowledged.
3. kill -> ready: until the standby's `/readyz` answers 200 (polled every 10 ms).
   kill -> action resumed: until the first action finished by the new leader (its
   `finished_at`), when something was in flight at the kill (read from the database).
4. The killed replica is started again and becomes the standby; the next round kills
   the other one.

The new leader may take the Lease once it has seen it unchanged for
`lease_duration_s` (it cannot know when the old leader died), so kill -> ready is about
`lease_duration_s` minus the age of the last renewal at the kill, plus up to a retry
period, plus the runtime's start. A graceful stop (SIGTERM) releases the Lease: the
standby takes it at its next try, within a retry period.

The classes here are also the harness of `tests/test_leader_election.py`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.table import Row, render, verdict
from resiliency_protocol.faults import FaultKind
from supervisor.kube.leader import JITTER
from supervisor.local.ports import free_port
from supervisor.local.processes import LocalProcess
from tests.kube import FakeKube

AGENT_TOKEN = "failover-agent-token"
OPERATOR_TOKEN = "failover-operator-token"
KUBE_TOKEN = "failover-kube-token"
AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
LEASE = "resiliency-supervisor"
NAMESPACE = "default"


def write_kubeconfig(path: Path, server: str, token: str) -> Path:
    """A minimal kubeconfig: one cluster, one user with a bearer token, one context."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "supervisor", "user": {"token": token}}],
        "contexts": [
            {
                "name": "fake",
                "context": {"cluster": "fake", "user": "supervisor", "namespace": NAMESPACE},
            }
        ],
        "current-context": "fake",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass(frozen=True, slots=True)
class Timing:
    lease_duration_s: float = 2.0
    renew_deadline_s: float = 1.5
    retry_period_s: float = 0.25


class Replica:
    """One `supervisor serve` process with leader election on."""

    def __init__(self, identity: str, run_dir: Path, kubeconfig: Path, timing: Timing) -> None:
        self.identity = identity
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = run_dir / f"replica-{identity}.log"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")},
            "SUPERVISOR_DATABASE_URL": f"sqlite:///{run_dir}/supervisor.db",
            "SUPERVISOR_AGENT_TOKEN": AGENT_TOKEN,
            "SUPERVISOR_OPERATOR_TOKEN": OPERATOR_TOKEN,
            "SUPERVISOR_ENABLE_FAULT_INJECTION": "true",
            "SUPERVISOR_BACKEND": "dry_run",
            # No job trains here: remedies in a row without progress must not make the
            # supervisor give up on it (an event of its own) while failover is measured.
            "SUPERVISOR_MAX_NO_PROGRESS_RESTARTS": "1000",
            # No timer-driven events: what happens is what the faults cause.
            "SUPERVISOR_HEARTBEAT_POLLING_PERIOD_S": "5",
            "SUPERVISOR_HEARTBEAT_TIMEOUT_S": "60",
            "SUPERVISOR_LEADER_ELECTION": "true",
            "SUPERVISOR_LEADER_ELECTION_IDENTITY": identity,
            "SUPERVISOR_LEADER_ELECTION_LEASE_DURATION_S": str(timing.lease_duration_s),
            "SUPERVISOR_LEADER_ELECTION_RENEW_DEADLINE_S": str(timing.renew_deadline_s),
            "SUPERVISOR_LEADER_ELECTION_RETRY_PERIOD_S": str(timing.retry_period_s),
            "SUPERVISOR_KUBE_CONFIG": str(kubeconfig),
            "SUPERVISOR_KUBE_NAMESPACE": NAMESPACE,
        }
        # `subprocess.Popen`, or a process a test forked (tests/forked_services.py).
        self.proc: LocalProcess | None = None
        # One client for all polls: a new one costs ~40 ms (it loads the CA bundle).
        self.http = httpx.Client(base_url=self.url, timeout=2)

    def start(self, timeout_s: float = 30.0) -> Replica:
        """Start the process and wait until it serves HTTP (leader or standby)."""
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "supervisor.cli", "serve", "--port", str(self.port)],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.identity} exited:\n{self.log_text()}")
            try:
                if self.http.get("/healthz").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"replica {self.identity} did not serve:\n{self.log_text()}")

    def readyz(self) -> tuple[int, dict[str, Any]]:
        """(status, body) of /readyz; (0, {}) when it does not answer."""
        try:
            r = self.http.get("/readyz")
        except httpx.TransportError:
            return 0, {}
        return r.status_code, r.json()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_exit(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def kill(self) -> float:
        """SIGKILL; returns the wall-clock time of the kill."""
        assert self.proc is not None
        killed = time.time()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        return killed

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def close(self) -> None:
        self.stop()
        self.http.close()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Pair:
    """A fake API server and replicas (two by default) sharing one database."""

    def __init__(
        self,
        run_dir: Path,
        timing: Timing,
        identities: tuple[str, ...] = ("a", "b"),
        env: dict[str, str] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.timing = timing
        self.identities = identities
        #: Added to each replica's environment (e.g. SUPERVISOR_POLICY).
        self.env = env or {}
        # (Controllers run, idle: FakeKube.stop() fails when they never started.)
        self.kube = FakeKube(token=KUBE_TOKEN, tick=0.5)
        self.replicas: list[Replica] = []
        self.db = run_dir / "supervisor.db"

    def start(self, timeout_s: float = 30.0) -> Pair:
        """Start the API server and the replicas, each serving HTTP within `timeout_s`."""
        self.kube.start()
        kubeconfig = write_kubeconfig(self.run_dir / "kubeconfig", self.kube.url, KUBE_TOKEN)
        self.replicas = [Replica(i, self.run_dir, kubeconfig, self.timing) for i in self.identities]
        for replica in self.replicas:
            replica.env.update(self.env)
            replica.start(timeout_s)
        return self

    def stop(self) -> None:
        for replica in self.replicas:
            replica.close()
        self.kube.stop()

    def wait_leader(self, timeout_s: float = 30.0) -> tuple[Replica, Replica]:
        """(leader, standby) once exactly one running replica is ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            running = [r for r in self.replicas if r.running]
            ready = [r for r in running if r.readyz()[0] == 200]
            if len(ready) == 1 and len(running) == 2:
                leader = ready[0]
                return leader, next(r for r in self.replicas if r is not leader)
            time.sleep(0.05)
        logs = "\n".join(r.log_text() for r in self.replicas)
        raise RuntimeError(f"no single leader within {timeout_s} s:\n{logs}")

    def lease(self) -> dict[str, Any] | None:
        return self.kube.get("Lease", LEASE, NAMESPACE)

    def in_flight(self) -> tuple[list[int], list[int]]:
        """(unhandled event ids, unfinished action ids), read from the database."""
        events = query(self.db, "SELECT id FROM events WHERE handled_at IS NULL")
        actions = query(self.db, "SELECT id FROM actions WHERE status IN ('pending', 'running')")
        return [r[0] for r in events], [r[0] for r in actions]


def query(db: Path, sql: str) -> list[tuple[Any, ...]]:
    """Rows from the shared SQLite database (read-write: after a SIGKILL, reading a WAL
    database may need its recovery, which a read-only connection cannot do)."""
    with closing(sqlite3.connect(db, timeout=10)) as conn:
        return list(conn.execute(sql))


@contextmanager
def pair(
    run_dir: Path,
    timing: Timing,
    identities: tuple[str, ...] = ("a", "b"),
    env: dict[str, str] | None = None,
    start_timeout_s: float = 30.0,
) -> Iterator[Pair]:
    """A started Pair (each replica serving within `start_timeout_s`), stopped after."""
    cluster = Pair(run_dir, timing, identities, env)
    try:
        yield cluster.start(start_timeout_s)
    finally:
        cluster.stop()


def heartbeat(node: str, job: str = "train") -> dict[str, Any]:
    index = int(node.removeprefix("n"))
    workers = [
        {"rank": 2 * index + i, "local_rank": i, "pid": 100 + i, "state": "running", "step": 10}
        for i in range(2)
    ]
    return {"node": node, "state": "running", "job": job, "workers": workers}


async def register(leader: Replica, nodes: dict[str, str]) -> None:
    """Heartbeats from `nodes` (node -> job)."""
    async with httpx.AsyncClient(base_url=leader.url, timeout=10, headers=AGENT) as client:
        for node, job in nodes.items():
            r = await client.post("/api/v1/heartbeats", json=heartbeat(node, job))
            r.raise_for_status()


async def inject_xids(leader: Replica, nodes: list[str], codes: list[int]) -> list[int]:
    """GPU errors on every node, sent at once; returns the acknowledged event ids."""
    async with httpx.AsyncClient(base_url=leader.url, timeout=10, headers=OPERATOR) as client:

        async def one(node: str, code: int) -> list[int]:
            r = await client.post(
                "/api/v1/faults", json={"kind": FaultKind.XID, "node": node, "code": code}
            )
            r.raise_for_status()
            events: list[int] = r.json()["events"]
            return events

        batches = await asyncio.gather(*(one(n, c) for n in nodes for c in codes))
    return [e for batch in batches for e in batch]


def actions(replica: Replica) -> list[dict[str, Any]]:
    r = replica.http.get("/api/v1/actions", params={"limit": 1000}, headers=OPERATOR)
    r.raise_for_status()
    items: list[dict[str, Any]] = r.json()["items"]
    return items


def wait_ready(replica: Replica, timeout_s: float, poll_s: float = 0.01) -> float:
    """Wall-clock time at which `replica` first answered /readyz 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if replica.readyz()[0] == 200:
            return time.time()
        time.sleep(poll_s)
    raise RuntimeError(f"replica {replica.identity} not ready within {timeout_s} s")


def first_finished_after(items: list[dict[str, Any]], after: float) -> float | None:
    times = [
        datetime.fromisoformat(a["finished_at"]).timestamp()
        for a in items
        if a["finished_at"] is not None
    ]
    later = [t for t in times if t > after]
    return min(later) if later else None


# --- the measurement ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FailoverConfig:
    timing: Timing = Timing()
    rounds: int = 3
    nodes_per_round: int = 2  # fresh nodes each round: the GPU-report cooldown is per node
    codes: tuple[int, ...] = (13, 31, 43, 48)


@dataclass(slots=True)
class FailoverResult:
    timing: Timing
    to_ready_s: list[float] = field(default_factory=list)
    to_resumed_s: list[float] = field(default_factory=list)
    handover_s: float | None = None  # SIGTERM of the leader -> standby ready
    duplicated: int = 0  # idempotency keys seen on more than one action row
    unfinished: int = 0  # actions not finished at the end
    error: str | None = None


def run(config: FailoverConfig) -> FailoverResult:
    result = FailoverResult(config.timing)
    with ExitStack() as stack:
        run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="failover-")))
        cluster = stack.enter_context(pair(run_dir, config.timing))
        try:
            _rounds(cluster, config, result)
        except (RuntimeError, httpx.HTTPError, OSError) as exc:
            result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return result


def _rounds(cluster: Pair, config: FailoverConfig, result: FailoverResult) -> None:
    timing = config.timing
    limit = timing.lease_duration_s + timing.retry_period_s + 30
    leader, standby = cluster.wait_leader()
    per_round = config.nodes_per_round
    # Fresh nodes and a fresh job each round: GPU-report cooldowns are per node and the
    # policy's restart budget per job.
    jobs = {f"n{i}": f"job{(i - 1) // per_round}" for i in range(1, config.rounds * per_round + 1)}
    asyncio.run(register(leader, jobs))
    for n in range(config.rounds):
        victims = [node for node, job in jobs.items() if job == f"job{n}"]
        asyncio.run(inject_xids(leader, victims, list(config.codes)))
        killed = leader.kill()
        events, unfinished = cluster.in_flight()
        ready = wait_ready(standby, limit)
        result.to_ready_s.append(ready - killed)
        if events or unfinished:
            deadline = time.monotonic() + limit
            while any(cluster.in_flight()) and time.monotonic() < deadline:
                time.sleep(0.02)
            resumed = first_finished_after(actions(standby), killed)
            if resumed is not None:
                result.to_resumed_s.append(resumed - killed)
        leader.start()  # back as the standby
        leader, standby = cluster.wait_leader()
    # A rolling update: SIGTERM releases the Lease.
    stopped = time.time()
    leader.stop()
    result.handover_s = wait_ready(standby, limit) - stopped
    items = actions(standby)
    keys = [a["idempotency_key"] for a in items]
    result.duplicated = len(keys) - len(set(keys))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result.unfinished = sum(a["status"] in ("pending", "running") for a in items)
        if not result.unfinished:
            break
        time.sleep(0.1)
        items = actions(standby)


# --- the table's rows -------------------------------------------------------------------------

#: What `make bench` runs: short leases (3 kills), then the defaults (one kill).
CONFIGS = (
    FailoverConfig(Timing(2.0, 1.5, 0.25), rounds=3),
    FailoverConfig(Timing(15.0, 10.0, 2.0), rounds=1),
)
SLACK_S = 1.0  # the runtime's start and the probe's poll, on top of the Lease's own wait


def _p50_max(values: list[float]) -> str:
    if not values:
        return "n/a"
    ordered = sorted(values)
    return f"{ordered[(len(ordered) - 1) // 2]:.2f} / {ordered[-1]:.2f} s"


def rows(configs: tuple[FailoverConfig, ...] = CONFIGS) -> list[Row]:
    out: list[Row] = []
    for config in configs:
        t = config.timing
        result = run(config)
        n = config.rounds
        limit = t.lease_duration_s + t.retry_period_s + SLACK_S
        timing = f"lease {t.lease_duration_s:g} s, retry {t.retry_period_s:g} s"
        complete = result.error is None and len(result.to_ready_s) == n
        out += [
            Row(
                f"Leader failover, SIGKILL -> standby ready ({timing}, n={n}) p50/max",
                _p50_max(result.to_ready_s),
                f"lease duration {t.lease_duration_s:g} s",
                f"< lease + retry + {SLACK_S:g} s = {limit:g} s",
                verdict(complete and max(result.to_ready_s, default=limit) < limit),
            ),
            Row(
                "  SIGKILL -> first in-flight action finished p50/max",
                _p50_max(result.to_resumed_s) + f" ({len(result.to_resumed_s)} of {n} kills)",
            ),
            Row(
                "  SIGTERM -> standby ready (the Lease is released)",
                "n/a" if result.handover_s is None else f"{result.handover_s:.2f} s",
                "-",
                f"< retry + {SLACK_S:g} s",
                verdict(
                    result.handover_s is not None
                    and result.handover_s < t.retry_period_s * (1 + JITTER) + SLACK_S
                ),
            ),
            Row(
                "  actions repeated / unfinished at the end",
                f"{result.duplicated} / {result.unfinished}",
                "-",
                "0 / 0",
                verdict(complete and result.duplicated == 0 and result.unfinished == 0),
            ),
        ]
        if result.error is not None:
            out.append(Row("  failover run stopped early", result.error, verdict="FAIL"))
    return out


def main() -> None:
    print(render(rows()))


if __name__ == "__main__":
    main()
