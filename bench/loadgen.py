"""Load generator process: lean HTTP/1.1 keep-alive client on raw asyncio streams.

Run as `python -m bench.loadgen --port P ...`. Each of `--connections` connections owns
a fixed share of the node names (so one node's steps only ever increase) and sends its
heartbeats back to back, one in flight per connection. Phases: prime (one heartbeat per
node: registers them), warm-up, measured window. Prints `primed`, `measure-start` and
`measure-end` as the phases begin (the parent samples the server there), then one JSON
line with the result.
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
class Shared:
    """State the connections share with the coordinator."""

    head: bytes
    expect: int
    templates: dict[int, bytes]
    all_primed: asyncio.Barrier
    go: asyncio.Event = field(default_factory=asyncio.Event)
    start: float = 0.0  # measured window, perf_counter time
    end: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


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


async def connection(port: int, nodes: list[int], shared: Shared) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head, expect, templates = shared.head, shared.expect, shared.templates
    steps = dict.fromkeys(nodes, 0)
    try:
        # Prime: one heartbeat per node, so registration writes happen before we measure.
        for node in nodes:
            body = templates[node] % ((0,) * WORKERS_PER_NODE)
            writer.write(head % len(body) + body)
            if await read_response(reader) != expect:
                shared.errors += 1
        await shared.all_primed.wait()
        await shared.go.wait()
        start, end = shared.start, shared.end
        latencies = shared.latencies
        perf = time.perf_counter
        count = len(nodes)
        i = 0
        while True:
            node = nodes[i % count]
            i += 1
            step = steps[node] + 1
            steps[node] = step
            body = templates[node] % ((step,) * WORKERS_PER_NODE)
            request = head % len(body) + body
            t0 = perf()
            if t0 >= end:
                break
            writer.write(request)
            status = await read_response(reader)
            t1 = perf()
            if status != expect:
                shared.errors += 1
                shared.statuses[status] = shared.statuses.get(status, 0) + 1
            elif start <= t1 <= end:
                latencies.append(t1 - t0)
    finally:
        writer.close()


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run(args: argparse.Namespace) -> dict[str, object]:
    conns: int = args.connections
    if args.nodes < conns:
        raise SystemExit("need at least as many nodes as connections")
    shared = Shared(
        head=(
            f"POST {args.path} HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{args.port}\r\n"
            f"Authorization: Bearer {args.token}\r\n"
            "Content-Type: application/json\r\n"
            "Content-Length: %d\r\n\r\n"
        ).encode(),
        expect=args.expect,
        templates={i: heartbeat_template(i) for i in range(args.nodes)},
        all_primed=asyncio.Barrier(conns + 1),
    )
    loop = asyncio.get_running_loop()
    cpu: dict[str, float] = {}
    ended = asyncio.Event()

    def mark(name: str) -> None:
        cpu[name] = _cpu_s()
        _say(name)
        if name == "measure-end":
            ended.set()

    async def coordinator() -> None:
        await shared.all_primed.wait()
        _say("primed")
        shared.start = time.perf_counter() + args.warmup
        shared.end = shared.start + args.duration
        loop.call_later(args.warmup, mark, "measure-start")
        loop.call_later(args.warmup + args.duration, mark, "measure-end")
        shared.go.set()

    shares = [list(range(c, args.nodes, conns)) for c in range(conns)]
    await asyncio.gather(coordinator(), *(connection(args.port, s, shared) for s in shares))
    await ended.wait()  # the last connection may stop just before the mark
    used = cpu.get("measure-end", 0.0) - cpu.get("measure-start", 0.0)
    return {
        "requests": len(shared.latencies),
        "rps": len(shared.latencies) / args.duration,
        "errors": shared.errors,
        "statuses": {str(k): v for k, v in shared.statuses.items()},
        "client_cpu_pct": 100 * used / args.duration,
        **summary_ms(shared.latencies),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", default="/api/v1/heartbeats")
    parser.add_argument("--token", default="bench-agent-token")
    parser.add_argument("--expect", type=int, default=204, help="expected status code")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=5.0)
    args = parser.parse_args(argv)
    _say(json.dumps(run_loop(run(args))))


if __name__ == "__main__":
    main()
