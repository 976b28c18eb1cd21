"""The settings of the backends that carry actions out, and of high availability."""

from __future__ import annotations

from typing import Self

from pydantic import Field, SecretStr, model_validator

from resiliency_protocol.shared_settings import DEFAULT_HOST_MONITOR_PORT
from supervisor.config_parts.group import SettingsGroup


class LocalSettings(SettingsGroup):
    """The local backend (processes on this machine)."""

    title = "Local backend"

    local_run_dir: str = Field(
        "./var/local", description="Run directory of the local cluster (backend `local`)."
    )
    local_stop_grace_s: float = Field(
        5.0, ge=0, description="Time local workers get between SIGTERM and SIGKILL."
    )
    in_process_restart_timeout_s: float = Field(
        20.0,
        gt=0,
        description="An in-process restart (survivors keep their processes and join a new "
        "world) not done in this long falls back to a full restart of every rank, in the "
        "same action: the wait is at most half of `action_timeout_s`, and it ends at once "
        "when a rank's process ends before it joined.",
    )


class KubernetesSettings(SettingsGroup):
    """The Kubernetes backend: the cluster, its watchers' thresholds, the host monitors."""

    title = "Kubernetes backend"

    kube_config: str | None = Field(
        None,
        description="Path to a kubeconfig. Unset: the in-cluster service account.",
    )
    kube_context: str | None = Field(
        None, description="Context of the kubeconfig to use. Unset: its current context."
    )
    kube_namespace: str = Field(
        "default",
        min_length=1,
        max_length=63,
        description="Namespace of the supervised JobSets (and of the leader Lease).",
    )
    kube_jobset_selector: str = Field(
        "",
        description="Label selector of the JobSets to supervise. Empty: all in the namespace.",
    )
    kube_gpu_node_selector: str = Field(
        "",
        description="Label selector of the GPU nodes (workers and spares). Empty: all nodes.",
    )
    kube_taint_key: str = Field(
        "resiliency.supervisor.io/unhealthy",
        min_length=1,
        description="Key of the NoExecute taint put on a node that is swapped out.",
    )
    kube_node_health_label: str = Field(
        "resiliency.supervisor.io/node-health-status",
        min_length=1,
        description="Node label carrying its health (Schedulable, Unschedulable, ...).",
    )
    pod_termination_threshold_s: float = Field(
        60.0, gt=0, description="A pod terminating for longer than this is reported as stuck."
    )
    jobset_downtime_threshold_s: float = Field(
        180.0, gt=0, description="A workload not fully running for longer than this is reported."
    )
    node_recovery_healthy_s: float = Field(
        300.0,
        ge=0,
        description="A swapped-out node is uncordoned once healthy (Ready, heartbeating) "
        "this long.",
    )
    pod_deletion_grace_period_s: int = Field(
        30,
        ge=0,
        description="Grace period of pods deleted when eviction is impossible.",
    )
    kube_platform_fences_nodes: bool = Field(
        False,
        description="The platform fences a node that stops answering (powers it off, or "
        "otherwise makes sure its pods are dead) before it turns NotReady: its pods may then "
        "be deleted with grace 0. Off: only a node carrying the "
        "node.kubernetes.io/out-of-service taint, or gone, has its pods force-deleted.",
    )
    kube_recreate_replaced_jobs: bool = Field(
        True,
        description="An in-process heal recreates the child Job of each pod it replaces "
        "(a Job of one pod), so that the new pod starts at once; off: the Job replaces the "
        "pod itself, after its pod-failure backoff (10 s, doubling at each failure of the "
        "Job, reset only by a pod that succeeds).",
    )
    eviction_patience_s: float = Field(
        30.0,
        gt=0,
        description="How long an eviction refused by a PodDisruptionBudget is retried "
        "before the pod is deleted instead.",
    )
    controller_patience_s: float = Field(
        10.0,
        ge=0,
        description="How long a restart waits for the Job and JobSet controllers to react "
        "to failed pods or Jobs of its generation before it acts itself.",
    )
    host_monitor_port: int = Field(
        DEFAULT_HOST_MONITOR_PORT,
        ge=1,
        le=65535,
        description="Port of the host monitors' local API (emergency checkpoints), when "
        "their heartbeat gives no address.",
    )
    host_monitor_actuator_token: SecretStr | None = Field(
        None,
        description="Bearer token the supervisor presents to host monitors (their "
        "`actuator_token`).",
    )


class LeaderElectionSettings(SettingsGroup):
    """High availability: replicas and their Lease."""

    title = "High availability"

    leader_election: bool = Field(
        False,
        description="Elect one leader among replicas with a coordination.k8s.io Lease; "
        "only the leader acts.",
    )
    leader_election_lease_name: str = Field(
        "resiliency-supervisor", min_length=1, description="Name of the leader Lease."
    )
    leader_election_identity: str | None = Field(
        None, description="This replica's identity in the Lease. Unset: the host name."
    )
    leader_election_lease_duration_s: float = Field(
        15.0, gt=0, description="A leader that has not renewed for this long can be replaced."
    )
    leader_election_renew_deadline_s: float = Field(
        10.0, gt=0, description="A leader that cannot renew within this stops acting (exits)."
    )
    leader_election_retry_period_s: float = Field(
        2.0, gt=0, description="How often the Lease is renewed or tried."
    )

    @model_validator(mode="after")
    def _check_lease_timing(self) -> Self:
        if self.leader_election and not (
            self.leader_election_retry_period_s
            < self.leader_election_renew_deadline_s
            < self.leader_election_lease_duration_s
        ):
            raise ValueError(
                "need leader_election_retry_period_s < leader_election_renew_deadline_s < "
                "leader_election_lease_duration_s"
            )
        return self
