"""Load generator of the fleet-shaped ingest rows: nodes heartbeating on their own clocks.

Run as `python -m bench.fleet_loadgen --ports SUP,BARE --plan JSON ...`. Open loop, as a
fleet is: node i beats every `period` s on a clock of its own (a random phase), each beat
sent late by a random 0..`jitter` s (a host monitor's loop, GC, a congested link), so
arrivals bunch and thin out at random while their mean rate stays nodes / period. Every
beat goes to both servers (the supervisor and the bare ASGI app), so both see the same
requests at the same times. Nodes are spread over a pool of keep-alive connections per
server (one request in flight on each, as a host monitor sends), node i on connection
i mod pool.

The plan is a list of phases `{"nodes", "period", "jitter"}` of one node count: nodes the
supervisor restored from its database (bench/fleet_database.py), so no registration storm
(a registration is a write; thousands at once would starve every beat). Each node's
first beat goes out at once, then its beats on its own clock; `--settle` s after a
phase starts it prints
`window-start I`, then after `--duration` s `window-end I` (the parent samples the servers'
CPU and statements at both marks) and `window {json}`. It prints `done` at the end.
Beats go on between windows, so no node is ever lost.

A phase with `"batch": B` > 1 sends the supervisor's beats as a relay would
(`host-monitor relay`): held until B are, or for `RELAY_HOLD_S` at most, then sent as one
request to `POST /api/v1/heartbeats/batch` (each entry with its node's credential); the
bare app still gets each beat as a request of its own, so its CPU per request stays the
stack's ceiling; with `"bare_batched": true` the bare app is sent the same batches, one
request each (at a fleet's rate, 5,000 beats a second, one client cannot send every beat
as a request of its own). A batch's entries answered 202 or 204 count as answered
heartbeats.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import resource
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from bench.loadgen import read_response
from bench.loops import run as run_loop
from bench.payload import heartbeat_template
from bench.stats import summary_ms
from resiliency_protocol.heartbeat_batch import BATCH_PATH, encode_batch, parse_answer

HEARTBEATS_PATH = "/api/v1/heartbeats"
#: What a response is read as: its status, or its status and body.
Answer = TypeVar("Answer")

#: A job's step time: every node of a job reports the step its job is at (as one job's
#: ranks do), so most beats repeat the job's newest step.
STEP_S = 1.0
#: A first beat answered 503 is sent again a second later, this many times at most.
RETRIES = 60
#: A relay sends what it holds once it holds a batch, or after this long.
RELAY_HOLD_S = 0.5
#: The relays' keep-alive connections: a few racks' relays, each one request at a time
#: (spread over the whole pool, each connection would sit idle past uvicorn's keep-alive
#: timeout and be opened again every few batches, which no relay does).
RELAYS = 4


def job_name(index: int) -> str:
    return f"fleet-{index:03d}"


def node_template(node: int, workers: int, nodes_per_job: int) -> bytes:
    """Node `node`'s heartbeat template (bench/payload.py): its job's ranks are the nodes'
    in order, `workers` each."""
    return heartbeat_template(
        node,
        workers=workers,
        job=job_name(node // nodes_per_job),
        first_rank=(node % nodes_per_job) * workers,
    )


class Stream:
    """A keep-alive connection that reconnects when the server closed it (uvicorn closes
    one idle for 5 s),
    and sends the request again, as a host monitor does: a heartbeat is idempotent."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reconnects = 0
        self._pair: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def exchange(self, request: bytes) -> int:
        """One heartbeat's request: its status."""
        return await self._exchange(request, read_response)

    async def exchange_batch(self, request: bytes) -> tuple[int, bytes]:
        """One batch's request: its status and body."""
        return await self._exchange(request, _read_with_body)

    async def _exchange(
        self, request: bytes, read: Callable[[asyncio.StreamReader], Awaitable[Answer]]
    ) -> Answer:
        for attempt in range(3):
            if self._pair is None:
                self._pair = await asyncio.open_connection("127.0.0.1", self.port)
            reader, writer = self._pair
            try:
                writer.write(request)
                return await read(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                self._pair = None
                self.reconnects += 1
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._pair is not None:
            self._pair[1].close()


def _request_head(path: str, port: int, token: str) -> bytes:
    """A POST's head up to its body, `%d` standing for the body's length."""
    return (
        f"POST {path} HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {token}\r\n"
        "Content-Type: application/json\r\n"
        "Content-Length: %d\r\n\r\n"
    ).encode()


async def _read_with_body(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One Content-Length framed response: its status and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    at = lower.find(b"\r\ncontent-length:") + 17
    length = int(lower[at : lower.index(b"\r\n", at)]) if at >= 17 else 0
    return int(head[9:12]), await reader.readexactly(length) if length else b""


@dataclass
class Connection:
    """One keep-alive connection to one server and the requests waiting for it."""

    port: int
    # (queued at, request, heartbeats in it: 0 for a single one, else a batch's entries)
    queue: deque[tuple[float, bytes, int]] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Server:
    port: int
    head: bytes
    connections: list[Connection]
    answered: int = 0
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    measuring: bool = False
    requests: int = 0  # answered, each batch one
    batch_head: bytes = b""
    held: list[bytes] = field(default_factory=list)  # beats a relay holds (batch phases)
    held_since: float = 0.0
    next_connection: int = 0


class Fleet:
    def __init__(self, args: argparse.Namespace) -> None:
        self.workers: int = args.workers
        self.nodes_per_job = max(1, args.ranks_per_job // args.workers)
        self.rng = random.Random(args.rng)
        self.templates: list[bytes] = []
        self.t0 = time.monotonic()
        self.period = 5.0
        self.jitter = 0.0
        self.heap: list[tuple[float, float, int]] = []  # (send at, nominal time, node)
        self.servers = [
            Server(
                port=port,
                head=_request_head(HEARTBEATS_PATH, port, args.token),
                connections=[Connection(port) for _ in range(args.pool)],
                batch_head=_request_head(BATCH_PATH, port, args.token),
            )
            for port in args.ports
        ]
        self.token: str = args.token
        self.batch = 1  # the supervisor's beats in batches of this many (1: one a request)
        self.bare_batched = False  # the bare app sent the same batches (else one a request)
        self.late: list[float] = []  # how late the scheduler sent beats, in the window

    async def add_nodes(self, count: int) -> None:
        """Nodes the supervisor knows (restored from its database): a first beat each, as
        fast as the servers answer (the supervisor checks a restored node's first beat in
        full, and gave it one heartbeat timeout), then each beats on its own clock from a
        random phase within the next period. A server sent batches in this phase gets the
        first beats in batches too, as a relay sends them after the supervisor's restart."""
        self.build(count)
        todo = deque(range(len(self.heap), count))
        pool = len(self.servers[0].connections)

        async def one_connection() -> None:
            streams = [Stream(s.port) for s in self.servers]
            try:
                while todo:
                    nodes = [todo.popleft() for _ in range(min(self.batch, len(todo)))]
                    now = time.monotonic()
                    bodies = [self.body(node, now) for node in nodes]
                    for index, stream in enumerate(streams):
                        await self.first_beats(index, stream, bodies)
                    for node in nodes:
                        nominal = time.monotonic() + self.rng.uniform(0, self.period)
                        heapq.heappush(self.heap, (nominal, nominal, node))
            finally:
                for stream in streams:
                    stream.close()

        await asyncio.gather(*(one_connection() for _ in range(pool)))

    async def first_beats(self, index: int, stream: Stream, bodies: list[bytes]) -> None:
        """Nodes' first beats to server `index`: in one batch when it is sent batches, else
        one request each. A beat answered 503 (busy: Retry-After 1) is sent again."""
        server = self.servers[index]
        statuses: list[int] = []
        for _ in range(RETRIES):
            if self.batches(index):
                body = encode_batch([(self.token, beat) for beat in bodies])
                status, answer = await stream.exchange_batch(server.batch_head % len(body) + body)
                statuses = (
                    [r.status for r in parse_answer(answer).results]
                    if status == 200
                    else [status] * len(bodies)
                )
            else:
                statuses = [await stream.exchange(server.head % len(b) + b) for b in bodies]
            if 503 not in statuses:
                break
            bodies = [b for b, status in zip(bodies, statuses, strict=True) if status == 503]
            await asyncio.sleep(1.0)
        if bad := [status for status in statuses if status not in (202, 204)]:
            raise RuntimeError(f"first beats to server {index}: HTTP {bad[0]}")

    def batches(self, index: int) -> bool:
        """Whether server `index` is sent its beats in batches (a relay's) in this phase:
        the supervisor in a batch phase, the bare app too when `bare_batched`."""
        return self.batch > 1 and (index == 0 or self.bare_batched)

    def build(self, count: int) -> None:
        """The nodes' heartbeat templates, up to `count` nodes."""
        for i in range(len(self.templates), count):
            self.templates.append(node_template(i, self.workers, self.nodes_per_job))

    def body(self, node: int, now: float) -> bytes:
        step = int((now - self.t0) / STEP_S) + 1
        return self.templates[node] % ((step,) * self.workers)

    async def schedule(self) -> None:
        """Send every beat that is due, then sleep until the next one."""
        heap = self.heap
        while True:
            now = time.monotonic()
            while heap and heap[0][0] <= now:
                send_at, nominal, node = heapq.heappop(heap)
                if self.servers[0].measuring:
                    self.late.append(now - send_at)
                body = self.body(node, now)
                for index, server in enumerate(self.servers):
                    if self.batches(index):  # to the relay (`relay`)
                        if not server.held:
                            server.held_since = now
                        server.held.append(body)
                        continue
                    conn = server.connections[node % len(server.connections)]
                    conn.queue.append((now, server.head % len(body) + body, 0))
                    conn.ready.set()
                nominal += self.period
                later = nominal + self.rng.uniform(0, self.jitter) if self.jitter else nominal
                heapq.heappush(heap, (max(later, now), nominal, node))
            wait = heap[0][0] - time.monotonic() if heap else 0.01
            await asyncio.sleep(min(max(wait, 0.0), 0.01))

    async def relay(self) -> None:
        """The beats of a server sent batches, as a relay sends them: a batch once `batch`
        are held, or what is held after RELAY_HOLD_S; batches spread over RELAYS
        connections."""
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            for server in self.servers:
                held = server.held
                while len(held) >= self.batch or (held and now - server.held_since >= RELAY_HOLD_S):
                    taken, server.held = held[: self.batch], held[self.batch :]
                    held = server.held
                    server.held_since = now
                    body = encode_batch([(self.token, beat) for beat in taken])
                    conn = server.connections[
                        server.next_connection % min(RELAYS, len(server.connections))
                    ]
                    server.next_connection += 1
                    conn.queue.append((now, server.batch_head % len(body) + body, len(taken)))
                    conn.ready.set()

    async def connection(self, index: int, conn: Connection) -> None:
        server = self.servers[index]
        stream = Stream(conn.port)
        queue = conn.queue
        while True:
            if not queue:
                conn.ready.clear()
                await conn.ready.wait()
                continue
            queued_at, request, entries = queue.popleft()
            if entries:
                status, body = await stream.exchange_batch(request)
                statuses = (
                    [r.status for r in parse_answer(body).results]
                    if status == 200
                    else [status] * entries
                )
            else:
                statuses = [await stream.exchange(request)]
            server.requests += 1
            if server.measuring:
                server.latencies.append(time.monotonic() - queued_at)
            for status in statuses:
                if status in (202, 204):
                    server.answered += 1
                else:
                    server.errors += 1
                    server.statuses[status] = server.statuses.get(status, 0) + 1


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run(args: argparse.Namespace) -> None:
    fleet = Fleet(args)
    plan = json.loads(args.plan)
    # Ready to beat at once: the supervisor restored the nodes and gives them one
    # heartbeat timeout from its start; the parent says `go` once both servers answer.
    fleet.build(max(phase["nodes"] for phase in plan))
    _say("ready")
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("expected `go` on stdin")
    tasks = [
        asyncio.create_task(fleet.connection(i, conn))
        for i, server in enumerate(fleet.servers)
        for conn in server.connections
    ]
    tasks.append(asyncio.create_task(fleet.schedule()))
    tasks.append(asyncio.create_task(fleet.relay()))
    for index, phase in enumerate(plan):
        fleet.period, fleet.jitter = float(phase["period"]), float(phase["jitter"])
        fleet.batch = int(phase.get("batch", 1))
        fleet.bare_batched = bool(phase.get("bare_batched", False))
        await fleet.add_nodes(phase["nodes"])
        await asyncio.sleep(args.settle)
        answered = [s.answered for s in fleet.servers]
        errors = [s.errors for s in fleet.servers]
        requests = [s.requests for s in fleet.servers]
        fleet.late.clear()
        for server in fleet.servers:
            server.latencies.clear()
            server.measuring = True
        cpu0 = _cpu_s()
        _say(f"window-start {index}")
        started = time.monotonic()
        await asyncio.sleep(args.duration)
        _say(f"window-end {index}")
        elapsed = time.monotonic() - started
        used = _cpu_s() - cpu0
        for server in fleet.servers:
            server.measuring = False
        late = summary_ms(fleet.late)
        result = {
            "phase": index,
            "seconds": elapsed,
            "answered": [s.answered - a for s, a in zip(fleet.servers, answered, strict=True)],
            "errors": [s.errors - e for s, e in zip(fleet.servers, errors, strict=True)],
            "requests": [s.requests - r for s, r in zip(fleet.servers, requests, strict=True)],
            "statuses": [{str(k): v for k, v in s.statuses.items()} for s in fleet.servers],
            "latency": [summary_ms(s.latencies) for s in fleet.servers],
            "late_p99_ms": late["p99_ms"],
            "client_cpu_pct": 100 * used / elapsed,
        }
        _say("window " + json.dumps(result))
    for task in tasks:
        task.cancel()
    _say("done")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_loadgen")
    parser.add_argument("--ports", required=True, type=lambda s: [int(p) for p in s.split(",")])
    parser.add_argument(
        "--plan",
        required=True,
        help="JSON list of {nodes, period, jitter[, batch, bare_batched]}",
    )
    parser.add_argument("--token", default="bench-agent-token")
    parser.add_argument("--workers", type=int, default=8, help="workers (ranks) per node")
    parser.add_argument("--ranks-per-job", type=int, default=8000)
    parser.add_argument("--pool", type=int, default=128, help="connections per server")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before a window")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds, per window")
    parser.add_argument("--rng", type=int, default=1)
    args = parser.parse_args(argv)
    run_loop(run(args))


if __name__ == "__main__":
    main()
