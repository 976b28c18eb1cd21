"""Load generator process: lean HTTP/1.1 keep-alive client on raw asyncio streams.

Run as `python -m bench.loadgen --ports P[,P2...] ...`. It primes every server (one
heartbeat per node, which registers the nodes), then measures them in turns: each
round gives every server one window (a warm-up, then the measured part), in the order
0, 1, ... on even rounds and reversed on odd ones, so that a slow drift of the machine
falls on both sides alike. Within a window `--connections` connections each own a fixed
share of the node names (so one node's steps only ever increase) and send heartbeats
back to back, one in flight per connection.

It prints `primed`, then per window `window-start I` and `window-end I` as the measured
part begins and ends (the parent samples server I's CPU there) followed by
`window {json}`, and finally `done {json}` with each server's latency percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from dataclasses import dataclass, field

from bench.loops import run as run_loop
from bench.payload import WORKERS_PER_NODE, heartbeat_template
from bench.stats import summary_ms


@dataclass
class Target:
    """One server under test and what the client keeps for it between windows."""

    port: int
    head: bytes
    steps: dict[int, int]
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


@dataclass
class Window:
    start: float = 0.0  # measured part, perf_counter time
    end: float = 0.0
    requests: int = 0


async def read_response(reader: asyncio.StreamReader) -> int:
    """Read one response (Content-Length framed, or bodiless 204/304); return its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    at = lower.find(b"\r\ncontent-length:")
    if at >= 0:
        start = at + 17
        length = int(lower[start : lower.index(b"\r\n", start)])
        if length:
            await reader.readexactly(length)
    elif status not in (204, 304):
        raise RuntimeError(f"response without Content-Length: {head[:200]!r}")
    return status


class Client:
    def __init__(self, args: argparse.Namespace) -> None:
        self.expect: int = args.expect
        self.templates = {i: heartbeat_template(i) for i in range(args.nodes)}
        conns: int = args.connections
        self.shares = [list(range(c, args.nodes, conns)) for c in range(conns)]
        self.targets = [
            Target(
                port=port,
                head=(
                    f"POST {args.path} HTTP/1.1\r\n"
                    f"Host: 127.0.0.1:{port}\r\n"
                    f"Authorization: Bearer {args.token}\r\n"
                    "Content-Type: application/json\r\n"
                    "Content-Length: %d\r\n\r\n"
                ).encode(),
                steps=dict.fromkeys(range(args.nodes), 0),
            )
            for port in args.ports
        ]

    def request(self, target: Target, node: int) -> bytes:
        step = target.steps[node] + 1
        target.steps[node] = step
        body = self.templates[node] % ((step,) * WORKERS_PER_NODE)
        return target.head % len(body) + body

    def check(self, target: Target, status: int) -> bool:
        if status == self.expect:
            return True
        target.errors += 1
        target.statuses[status] = target.statuses.get(status, 0) + 1
        return False

    async def prime(self, target: Target, nodes: list[int]) -> None:
        """One heartbeat per node, so registration writes happen before any window."""
        reader, writer = await asyncio.open_connection("127.0.0.1", target.port)
        try:
            for node in nodes:
                writer.write(self.request(target, node))
                self.check(target, await read_response(reader))
        finally:
            writer.close()

    async def connection(self, target: Target, nodes: list[int], window: Window) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", target.port)
        latencies = target.latencies
        perf = time.perf_counter
        count = len(nodes)
        i = 0
        try:
            while True:
                request = self.request(target, nodes[i % count])
                i += 1
                t0 = perf()
                if t0 >= window.end:
                    break
                writer.write(request)
                status = await read_response(reader)
                t1 = perf()
                if self.check(target, status) and window.start <= t1 <= window.end:
                    latencies.append(t1 - t0)
                    window.requests += 1
        finally:
            writer.close()

    async def window(self, index: int, warmup: float, duration: float) -> Window:
        target = self.targets[index]
        window = Window()
        window.start = time.perf_counter() + warmup
        window.end = window.start + duration
        loop = asyncio.get_running_loop()
        loop.call_later(warmup, _say, f"window-start {index}")
        ended = asyncio.Event()

        def end() -> None:
            _say(f"window-end {index}")
            ended.set()

        loop.call_later(warmup + duration, end)
        await asyncio.gather(*(self.connection(target, s, window) for s in self.shares))
        await ended.wait()  # the last connection may stop just before the mark
        return window


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run(args: argparse.Namespace) -> dict[str, object]:
    if args.nodes < args.connections:
        raise SystemExit("need at least as many nodes as connections")
    client = Client(args)
    for target in client.targets:
        await asyncio.gather(*(client.prime(target, share) for share in client.shares))
    _say("primed")
    order = list(range(len(client.targets)))
    for round_ in range(args.rounds):
        for index in order if round_ % 2 == 0 else order[::-1]:
            cpu0 = _cpu_s()
            window = await client.window(index, args.warmup, args.duration)
            used = _cpu_s() - cpu0
            result = {
                "server": index,
                "round": round_,
                "requests": window.requests,
                "rps": window.requests / args.duration,
                "client_cpu_pct": 100 * used / (args.warmup + args.duration),
            }
            _say("window " + json.dumps(result))
    return {
        "servers": [
            {
                "errors": t.errors,
                "statuses": {str(k): v for k, v in t.statuses.items()},
                **summary_ms(t.latencies),
            }
            for t in client.targets
        ]
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen")
    parser.add_argument("--ports", required=True, type=lambda s: [int(p) for p in s.split(",")])
    parser.add_argument("--path", default="/api/v1/heartbeats")
    parser.add_argument("--token", default="bench-agent-token")
    parser.add_argument("--expect", type=int, default=204, help="expected status code")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds, per window")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds, per window")
    args = parser.parse_args(argv)
    _say("done " + json.dumps(run_loop(run(args))))


if __name__ == "__main__":
    main()
