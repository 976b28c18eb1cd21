"""Prometheus instruments of one supervisor instance (own registry, so tests can run many)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.heartbeats = Counter(
            "supervisor_heartbeats_received",
            "Host heartbeats accepted by the sensor.",
            registry=self.registry,
        )
        self.events = Counter(
            "supervisor_events",
            "Events raised, by type.",
            ["type"],
            registry=self.registry,
        )
        self.events_suppressed = Counter(
            "supervisor_events_suppressed",
            "Events not raised because the node is flapping or the report repeats.",
            ["type"],
            registry=self.registry,
        )
        self.actions = Counter(
            "supervisor_actions",
            "Actions finished, by type and outcome.",
            ["type", "outcome"],
            registry=self.registry,
        )
        self.action_seconds = Histogram(
            "supervisor_action_duration_seconds",
            "Time from an action's start to its end.",
            ["type"],
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        self.detection_lateness = Histogram(
            "supervisor_detection_lateness_seconds",
            "Time between a node's heartbeat deadline passing and the event being raised.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
            registry=self.registry,
        )
        self.nodes = Gauge(
            "supervisor_nodes",
            "Nodes tracked by the sensor, by liveness.",
            ["alive"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
