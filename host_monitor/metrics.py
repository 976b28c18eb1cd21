"""The host monitor's own metrics, in Prometheus' text format at `GET /metrics`.

What an operator of a large fleet watches a node agent by: whether its heartbeats reach
the supervisor (sent, failed, failing in a row, the last success), whether its watchdogs
run, how often it starts workers and what state they are in, how long emergency
checkpoint rounds take, what the peer checkpoint tier moves (bytes and seconds, each
way), and the pushes it refused as an older world's. The counters live in the parts that
count them (the heartbeat sender, the worker registry, the peer tier); a collector reads
them at scrape time, so that nothing on the hot paths waits for a metrics library. Each
agent has a registry of its own (several agents can share a process in tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Emergency checkpoint rounds: from a fraction of a second to the supervisor's bound.
EMERGENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True, slots=True)
class HeartbeatCounts:
    sent: int
    failed: int
    failing_in_a_row: int
    last_success_unix_s: float | None


@dataclass(frozen=True, slots=True)
class PeerCounts:
    """Bytes and seconds of peer-tier copies, by direction (`sent`, `received`), and the
    uploads and commits refused as an older world's (host_monitor/peer/worlds.py)."""

    bytes: Mapping[str, int]
    seconds: Mapping[str, float]
    stale_world_refusals: int = 0


@dataclass(slots=True)
class Sources:
    """Where the collector reads each figure (None: that part is off on this node)."""

    heartbeats: Callable[[], HeartbeatCounts] | None = None
    watchdogs: Callable[[], Mapping[str, bool]] | None = None
    worker_starts: Callable[[], int] | None = None
    worker_states: Callable[[], Iterable[str]] | None = None
    peer: Callable[[], PeerCounts] | None = None
    stale_leader_commands: Callable[[], int] | None = None


class _Live(Collector):
    def __init__(self, node: str, sources: Sources) -> None:
        self.node = node
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        s = self.sources
        if s.heartbeats is not None:
            hb = s.heartbeats()
            yield self._counter("heartbeats_sent", "Heartbeats the supervisor accepted.", hb.sent)
            yield self._counter(
                "heartbeats_failed", "Heartbeats that did not reach the supervisor.", hb.failed
            )
            yield self._gauge(
                "heartbeat_consecutive_failures",
                "Heartbeats failed since the last one that got through.",
                hb.failing_in_a_row,
            )
            if hb.last_success_unix_s is not None:
                yield self._gauge(
                    "heartbeat_last_success_timestamp_seconds",
                    "When a heartbeat last got through (Unix time).",
                    hb.last_success_unix_s,
                )
        if s.watchdogs is not None:
            up = GaugeMetricFamily(
                "host_monitor_watchdog_up",
                "1 when the watchdog's last check ran, 0 when it failed.",
                labels=["node", "watchdog"],
            )
            for name, ok in sorted(s.watchdogs().items()):
                up.add_metric([self.node, name], 1.0 if ok else 0.0)
            yield up
        if s.worker_starts is not None:
            yield self._counter(
                "worker_starts", "Worker processes this agent started.", s.worker_starts()
            )
        if s.worker_states is not None:
            workers = GaugeMetricFamily(
                "host_monitor_workers", "Workers of this node by state.", labels=["node", "state"]
            )
            counts: dict[str, int] = {}
            for state in s.worker_states():
                counts[state] = counts.get(state, 0) + 1
            for state, n in sorted(counts.items()):
                workers.add_metric([self.node, state], n)
            yield workers
        if s.peer is not None:
            peer = s.peer()
            moved = CounterMetricFamily(
                "host_monitor_peer_bytes",
                "Bytes of peer checkpoint copies, sent to the partner or received from it.",
                labels=["node", "direction"],
            )
            took = CounterMetricFamily(
                "host_monitor_peer_seconds",
                "Seconds spent moving peer checkpoint copies, by direction.",
                labels=["node", "direction"],
            )
            for direction in ("sent", "received"):
                moved.add_metric([self.node, direction], peer.bytes.get(direction, 0))
                took.add_metric([self.node, direction], peer.seconds.get(direction, 0.0))
            yield moved
            yield took
            yield self._counter(
                "peer_stale_world_refusals",
                "Peer-tier uploads and commits refused: the save was of an older world than "
                "the job's newest seen here (a node cut off).",
                peer.stale_world_refusals,
            )
        if s.stale_leader_commands is not None:
            yield self._counter(
                "stale_leader_commands",
                "Commands refused for an older supervisor epoch than the newest obeyed.",
                s.stale_leader_commands(),
            )

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        family = CounterMetricFamily(f"host_monitor_{name}", doc, labels=["node"])
        family.add_metric([self.node], value)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        family = GaugeMetricFamily(f"host_monitor_{name}", doc, labels=["node"])
        family.add_metric([self.node], value)
        return family


class HostMonitorMetrics:
    def __init__(self, node: str) -> None:
        self.node = node
        self.registry = CollectorRegistry()
        self.sources = Sources()
        self.registry.register(_Live(node, self.sources))
        self._emergency = Histogram(
            "host_monitor_emergency_checkpoint_seconds",
            "Emergency checkpoint rounds, from the supervisor's request to the last answer.",
            ["node"],
            buckets=EMERGENCY_BUCKETS,
            registry=self.registry,
        )

    def emergency_round(self, seconds: float) -> None:
        self._emergency.labels(self.node).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
