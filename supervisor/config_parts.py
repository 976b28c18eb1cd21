"""The settings grouped by the part of the supervisor they configure.

Users set them flat, as `SUPERVISOR_<NAME>` or a YAML key (supervisor/config.py reads
them, and those names stay as they are); a part of the supervisor takes only its group,
`settings.<group>`, so a reader knows what it can be tuned by and a test can build it
from a few values (the backends and the runtime, which span several groups, take all).
Every setting belongs to exactly one group (a test checks this), and
docs/configuration.md lists them under the same headings.

A group's fields are named exactly as the settings they are taken from.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, Self

from pydantic import SecretStr

from supervisor.notifications.settings import Routes
from supervisor.policy import PolicyLimits
from supervisor.xid import XidResponse


class _Part:
    """Built from the flat settings by field name."""

    #: The heading of the group in docs/configuration.md.
    title: ClassVar[str]

    @classmethod
    def of(cls, settings: Any) -> Self:
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class SensingSettings(_Part):
    """The sensor: liveness, hangs, flapping, GPU reports, stragglers."""

    title = "Sensing"
    heartbeat_polling_period_s: float
    heartbeat_timeout_s: float
    hang_timeout_s: float | None
    hang_min_timeout_s: float
    hang_safety_factor: float
    hang_warmup_intervals: int
    finishing_timeout_s: float
    flap_window_s: float
    flap_max_losses: int
    gpu_report_cooldown_s: float
    straggler_threshold: float
    straggler_window_s: float
    agent_clock_skew_s: float
    xid_responses: dict[int, XidResponse]


@dataclass(frozen=True, slots=True)
class WorkloadSettings(_Part):
    """The shape of the supervised job, and the bounds of its scaling."""

    title = "Workload"
    num_dp_replicas: int
    min_num_dp_replicas: int
    max_num_dp_replicas: int
    num_nodes_per_dp: int


@dataclass(frozen=True, slots=True)
class RemediationSettings(_Part):
    """The remediation ladder the policy climbs (`limits`: what a policy sees)."""

    title = "Remediation"
    max_in_job_restarts: int
    max_workload_restarts: int
    enable_workload_scaling: bool
    restart_window_s: float
    max_restarts_in_window: int
    max_no_progress_restarts: int

    @property
    def limits(self) -> PolicyLimits:
        return PolicyLimits(
            max_in_job_restarts=self.max_in_job_restarts,
            max_workload_restarts=self.max_workload_restarts,
            enable_workload_scaling=self.enable_workload_scaling,
            restart_window_s=self.restart_window_s,
            max_restarts_in_window=self.max_restarts_in_window,
            max_no_progress_restarts=self.max_no_progress_restarts,
        )


@dataclass(frozen=True, slots=True)
class ActuatorSettings(_Part):
    """How long an action may take and how often it is tried."""

    title = "Actuator"
    emergency_checkpoint_timeout_s: float
    action_timeout_s: float
    action_max_attempts: int
    action_retry_backoff_s: float


@dataclass(frozen=True, slots=True)
class RuntimeSettings(_Part):
    """What the service is composed of: its backend, its policy, and dry run."""

    title = "Backend and policy"
    backend: Literal["dry_run", "local", "kubernetes"]
    dry_run: bool
    policy: str


@dataclass(frozen=True, slots=True)
class LocalSettings(_Part):
    """The local backend (processes on this machine)."""

    title = "Local backend"
    local_run_dir: str
    local_stop_grace_s: float
    in_process_restart_timeout_s: float


@dataclass(frozen=True, slots=True)
class KubernetesSettings(_Part):
    """The Kubernetes backend: the cluster, its watchers' thresholds, the host monitors."""

    title = "Kubernetes backend"
    kube_config: str | None
    kube_context: str | None
    kube_namespace: str
    kube_jobset_selector: str
    kube_gpu_node_selector: str
    kube_taint_key: str
    kube_node_health_label: str
    pod_termination_threshold_s: float
    jobset_downtime_threshold_s: float
    node_recovery_healthy_s: float
    pod_deletion_grace_period_s: int
    eviction_patience_s: float
    controller_patience_s: float
    host_monitor_port: int
    host_monitor_actuator_token: SecretStr | None


@dataclass(frozen=True, slots=True)
class LeaderElectionSettings(_Part):
    """High availability: replicas and their Lease."""

    title = "High availability"
    leader_election: bool
    leader_election_lease_name: str
    leader_election_identity: str | None
    leader_election_lease_duration_s: float
    leader_election_renew_deadline_s: float
    leader_election_retry_period_s: float


@dataclass(frozen=True, slots=True)
class HistorySettings(_Part):
    """Goodput sampling and how long history is kept."""

    title = "Goodput and history"
    goodput_sample_period_s: float
    history_retention_days: float
    goodput_retention_days: float | None
    history_prune_period_s: float


@dataclass(frozen=True, slots=True)
class NotificationSettings(_Part):
    """Where events and actions are sent, and how hard delivery tries."""

    title = "Notifications"
    notification_routes: Routes
    notification_timeout_s: float
    notification_max_attempts: int
    notification_retry_backoff_s: float
    notification_queue_size: int
    public_url: str | None


@dataclass(frozen=True, slots=True)
class ServiceSettings(_Part):
    """The service itself: where it listens, its database, its log, fault injection."""

    title = "Service"
    host: str
    port: int
    log_level: Literal["debug", "info", "warning", "error"]
    database_url: str
    enable_fault_injection: bool


@dataclass(frozen=True, slots=True)
class AccessSettings(_Part):
    """Who may call the API: the roles' tokens and how host monitors prove who they are."""

    title = "Access"
    agent_token: SecretStr | None
    operator_token: SecretStr | None
    read_requires_token: bool
    agent_auth: list[Literal["shared", "node_key", "kubernetes"]]
    node_key: SecretStr | None
    agent_kube_audience: str
    agent_kube_service_account: str | None
    agent_kube_review_ttl_s: float


@dataclass(frozen=True, slots=True)
class TlsSettings(_Part):
    """HTTPS for the API and the calls to host monitors."""

    title = "TLS"
    tls_cert_file: str | None
    tls_key_file: str | None
    tls_ca_file: str | None
    tls_host_monitor_server_name: str | None


#: Every group, in the order docs/configuration.md lists them.
GROUPS: tuple[type[_Part], ...] = (
    SensingSettings,
    WorkloadSettings,
    RemediationSettings,
    ActuatorSettings,
    RuntimeSettings,
    LocalSettings,
    KubernetesSettings,
    LeaderElectionSettings,
    HistorySettings,
    NotificationSettings,
    ServiceSettings,
    AccessSettings,
    TlsSettings,
)


def field_names(group: type[_Part]) -> list[str]:
    return [f.name for f in fields(group)]  # type: ignore[arg-type]
