"""Prometheus instruments of one supervisor instance (own registry, so tests can run many)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterator
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from supervisor.domain import (
    RESTART_ACTIONS,
    ActionRecord,
    ActionStatus,
    ActionType,
    CheckpointReport,
)


class HeartbeatRejection(StrEnum):
    """Why a heartbeat was refused (the reply's status)."""

    UNAUTHORIZED = "unauthorized"  # 401: no or a wrong agent token
    INVALID = "invalid"  # 422: not a valid heartbeat
    TOO_LARGE = "too_large"  # 413
    NOT_JSON = "not_json"  # 415
    NOT_READY = "not_ready"  # 503: a standby, or starting or stopping; the agent retries
    WRONG_METHOD = "wrong_method"  # 405


class RestartKind(StrEnum):
    """How a job was restarted: the disruptive action, and whether the surviving workers
    kept their processes (the backend's result says `path: in_process`)."""

    RESTART_IN_PLACE = "restart_in_place"
    IN_PROCESS_RESTART = "in_process_restart"
    RESTART_WORKLOAD = "restart_workload"
    HOT_SWAP = "hot_swap"
    IN_PROCESS_HOT_SWAP = "in_process_hot_swap"
    SCALE_DOWN = "scale_down"
    SCALE_UP = "scale_up"


def restart_kind(action: ActionRecord) -> RestartKind | None:
    """The kind of restart a finished action was; None for an action that restarts nothing."""
    if action.type not in RESTART_ACTIONS:
        return None
    in_process = (action.result or {}).get("path") == "in_process"
    if in_process and action.type is ActionType.RESTART_IN_PLACE:
        return RestartKind.IN_PROCESS_RESTART
    if in_process and action.type is ActionType.HOT_SWAP:
        return RestartKind.IN_PROCESS_HOT_SWAP
    return RestartKind(action.type.value)


class JobActionCounts:
    """Restarts (succeeded) and emergency checkpoints (by outcome) of each job, as this
    replica's actuator finished them. Plain counts, exported per job at scrape time (see
    supervisor.api.job_metrics), so that a forgotten job's series can go."""

    def __init__(self) -> None:
        self.restarts: defaultdict[str, dict[RestartKind, int]] = defaultdict(dict)
        self.emergency_checkpoints: defaultdict[str, dict[ActionStatus, int]] = defaultdict(dict)

    def count(self, action: ActionRecord) -> None:
        if action.job is None or not action.status.finished:
            return
        if action.type is ActionType.EMERGENCY_CHECKPOINT:
            outcomes = self.emergency_checkpoints[action.job]
            outcomes[action.status] = outcomes.get(action.status, 0) + 1
            return
        kind = restart_kind(action)
        if kind is not None and action.status is ActionStatus.SUCCEEDED:
            kinds = self.restarts[action.job]
            kinds[kind] = kinds.get(kind, 0) + 1

    def keep_only(self, jobs: Collection[str]) -> None:
        """Forget the counts of jobs not in ``jobs``."""
        for counts in (self.restarts, self.emergency_checkpoints):
            for job in [j for j in counts if j not in jobs]:
                del counts[job]


class JobCheckpoints:
    """Each job's checkpoints as its workers report them: failed saves by tier, and per
    tier the newest step every reporting rank has saved, with when the last of them did
    (its age is what an alert watches). Exported per job at scrape time (see
    supervisor.api.job_metrics); fed by the checkpoint reports' route."""

    def __init__(self) -> None:
        self.failures: defaultdict[str, dict[str, int]] = defaultdict(dict)
        #: job -> tier -> rank -> (newest step saved, its report time, epoch seconds)
        self._saved: defaultdict[str, dict[str, dict[int, tuple[int, float]]]] = defaultdict(dict)

    def count(self, report: CheckpointReport) -> None:
        if report.job is None:
            return
        if report.event == "failed":
            by_tier = self.failures[report.job]
            by_tier[report.tier] = by_tier.get(report.tier, 0) + 1
        elif report.event == "saved":
            ranks = self._saved[report.job].setdefault(report.tier, {})
            have = ranks.get(report.rank)
            if have is None or report.step >= have[0]:
                ranks[report.rank] = (report.step, report.time.timestamp())

    def newest(self, job: str) -> dict[str, tuple[int, float]]:
        """tier -> (the newest step every rank that reported has saved, when the last of
        them saved theirs)."""
        out = {}
        for tier, ranks in self._saved.get(job, {}).items():
            if ranks:
                oldest = min(ranks.values())
                out[tier] = oldest
        return out

    def keep_only(self, jobs: Collection[str]) -> None:
        for counts in (self.failures, self._saved):
            for job in [j for j in counts if j not in jobs]:
                del counts[job]


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
        self.dry_run_actions = Counter(
            "supervisor_dry_run_actions",
            "Actions a dry run recorded and did not carry out, by type and outcome (never "
            "in supervisor_actions_total nor the job's restarts).",
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
        self.losses_deferred = Counter(
            "supervisor_node_losses_deferred",
            "Node losses checked again because the deadline passed while the supervisor ran "
            "behind (paused, starved of CPU): the node's heartbeat may have sat in its queue.",
            registry=self.registry,
        )
        self.behind = Histogram(
            "supervisor_behind_seconds",
            "How far behind its node deadlines the supervisor ran when it deferred a loss.",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
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
        self.notifications = Counter(
            "supervisor_notifications",
            "Notification deliveries finished, by route, sink and outcome (delivered, failed).",
            ["route", "sink", "outcome"],
            registry=self.registry,
        )
        self.notifications_dropped = Counter(
            "supervisor_notifications_dropped",
            "Events and action changes never routed to notifications: the queue was full.",
            registry=self.registry,
        )
        self.heartbeats_rejected = Counter(
            "supervisor_heartbeats_rejected",
            "Heartbeats refused, by reason (not_ready: sent to a standby or while starting).",
            ["reason"],
            registry=self.registry,
        )
        for reason in HeartbeatRejection:  # every reason exported from the start, at 0
            self.heartbeats_rejected.labels(reason.value)
        self.jobs_given_up = Gauge(
            "supervisor_jobs_given_up",
            "Jobs the supervisor gave up healing (their restart budget spent: a job_given_up "
            "event), until an operator resets their budget.",
            registry=self.registry,
        )
        self.job_actions = JobActionCounts()
        self.job_checkpoints = JobCheckpoints()
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
