"""Prometheus instruments of one supervisor instance (own registry, so tests can run many)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

#: Why a host monitor's request was refused (supervisor_agent_requests_refused_total):
#: no valid credential (401); a node other than the credential's (403); a rank another
#: alive node runs (409).
REFUSAL_REASONS = ("invalid_credential", "other_node", "rank_claimed")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # A plain int, read when scraped: a prometheus Counter takes a lock per increment,
        # which is a measurable share of a heartbeat's cost.
        self.heartbeats_received = 0
        self.registry.register(_HeartbeatCollector(self))
        # Plain ints too: the heartbeat path counts its refusals.
        self.agent_requests_refused = dict.fromkeys(REFUSAL_REASONS, 0)
        self.registry.register(_AgentRefusalCollector(self))
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
        self.policy_errors = Counter(
            "supervisor_policy_errors",
            "Events on which the policy raised or returned something that is not an action "
            "(the event's policy_error says what), by event type.",
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
        self.history_pruned = Counter(
            "supervisor_history_pruned_rows",
            "Rows of old history deleted by retention, by table.",
            ["table"],
            registry=self.registry,
        )
        self.acting = Gauge(
            "supervisor_leader",
            "1 while this replica acts: it holds the leader Lease (or runs without leader "
            "election) and its runtime is started; 0 on a standby.",
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _HeartbeatCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "supervisor_heartbeats_received", "Host heartbeats accepted by the sensor."
        )
        family.add_metric([], self._metrics.heartbeats_received)
        yield family


class _AgentRefusalCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "supervisor_agent_requests_refused",
            "Host monitor requests refused for who sent them, by reason: invalid_credential "
            "(401), other_node (403: a node other than the credential's), rank_claimed (409: "
            "a rank another alive node reports running).",
            labels=["reason"],
        )
        for reason, count in self._metrics.agent_requests_refused.items():
            family.add_metric([reason], count)
        yield family
