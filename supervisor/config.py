"""Settings, read from `SUPERVISOR_*` environment variables and an optional YAML file.

Names follow the systems our users already run (see docs/configuration.md), so a
`heartbeat_timeout_s` means here what it means there.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from resiliency_protocol.tls import client_context
from supervisor.config_parts import (
    AccessSettings,
    ActuatorSettings,
    HistorySettings,
    KubernetesSettings,
    LeaderElectionSettings,
    LocalSettings,
    NotificationSettings,
    RemediationSettings,
    RuntimeSettings,
    SensingSettings,
    ServiceSettings,
    TlsSettings,
    WorkloadSettings,
)
from supervisor.errors import SupervisorError
from supervisor.notifications.settings import Routes
from supervisor.xid import XidResponse

CONFIG_FILE_ENV = "SUPERVISOR_CONFIG_FILE"

SECONDS_PER_DAY = 86400.0

BackendName = Literal["dry_run", "local", "kubernetes"]
# How a host monitor proves who it is (docs/security.md, "Agent identity").
AgentAuth = Literal["shared", "node_key", "kubernetes"]
NODE_KEY_MIN_CHARS = 32
# system:serviceaccount:<namespace>:<name>, both DNS names.
SERVICE_ACCOUNT_USER = (
    r"^system:serviceaccount:[a-z0-9]([-a-z0-9]*[a-z0-9])?:[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SUPERVISOR_",
        extra="forbid",
        validate_default=True,
    )

    # --- heartbeats and detection -------------------------------------------------
    heartbeat_polling_period_s: float = Field(
        5.0, gt=0, description="How often host monitors send a heartbeat."
    )
    heartbeat_timeout_s: float = Field(
        15.0, gt=0, description="A node is declared lost this long after its last heartbeat."
    )
    hang_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Fixed hang timeout. Unset: learned per job from observed step intervals.",
    )
    hang_min_timeout_s: float = Field(
        60.0, gt=0, description="Lower bound of the learned hang timeout."
    )
    hang_safety_factor: float = Field(
        5.0, ge=1, description="Learned hang timeout = longest observed step interval x this."
    )
    hang_warmup_intervals: int = Field(
        5, ge=0, description="Step intervals observed before hang detection starts for a job."
    )
    finishing_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A job's workers left their loop (finishing) this long ago and one is "
        "still finishing or at work: a hang of kind finishing. Not watched for hangs "
        "meanwhile.",
    )
    flap_window_s: float = Field(
        300.0, gt=0, description="Window in which repeated losses of one node count as flapping."
    )
    flap_max_losses: int = Field(
        3, ge=2, description="Losses within flap_window_s that mark a node as flapping."
    )
    gpu_report_cooldown_s: float = Field(
        60.0, ge=0, description="Repeats of the same GPU error on a node within this are dropped."
    )
    straggler_threshold: float = Field(
        1.1,
        gt=1,
        description="A rank whose compute time per step is this many times its job's median "
        "is slow (1.1: 10% slower).",
    )
    straggler_window_s: float = Field(
        30.0,
        gt=0,
        description="How long a rank must stay slow (or fast again) before straggler (or "
        "straggler_recovered) is raised; also the window its compute times are scored over.",
    )
    agent_clock_skew_s: float = Field(
        300.0,
        gt=0,
        description="A time an agent sends (GPU reports, checkpoint reports) further than "
        "this from the supervisor's clock is refused (422 naming the field).",
    )
    xid_responses: dict[int, XidResponse] = Field(
        {},
        description="Per XID code, a response instead of the XID table's: restart_workload, "
        'replace_node or ignore (for example {"94": "restart_workload"}).',
    )

    # --- Kubernetes-side thresholds (used by the Kubernetes backend) ------------------
    pod_termination_threshold_s: float = Field(
        60.0, gt=0, description="A pod terminating for longer than this is reported as stuck."
    )
    jobset_downtime_threshold_s: float = Field(
        180.0, gt=0, description="A workload not fully running for longer than this is reported."
    )

    # --- workload shape and remediation ladder ----------------------------------------
    num_dp_replicas: int = Field(4, ge=1, description="Data-parallel replicas of a job.")
    min_num_dp_replicas: int = Field(2, ge=1, description="Never scale a job below this.")
    max_num_dp_replicas: int = Field(4, ge=1, description="Never scale a job above this.")
    num_nodes_per_dp: int = Field(4, ge=1, description="Nodes in one data-parallel replica.")
    max_in_job_restarts: int = Field(
        3, ge=0, description="Restarts of a job's workers in place before a workload restart."
    )
    max_workload_restarts: int = Field(
        0, ge=0, description="Restarts on a failing node before it is hot-swapped for a spare."
    )
    enable_workload_scaling: bool = Field(
        False, description="Allow scaling a job down when no spare exists, and back up later."
    )
    restart_window_s: float = Field(
        3600.0, gt=0, description="Window over which restarts of a job are counted and bounded."
    )
    max_restarts_in_window: int = Field(
        30,
        ge=1,
        description="Disruptive actions per job per window before the policy gives up: a "
        "safety net beyond max_no_progress_restarts.",
    )
    max_no_progress_restarts: int = Field(
        3,
        ge=1,
        description="Remedies in a row not followed by training progress (every rank past "
        "the step it stood at) before the job is judged unhealable and given up.",
    )

    # --- actuator ---------------------------------------------------------------------
    emergency_checkpoint_timeout_s: float = Field(
        60.0, gt=0, description="Time allowed for healthy workers to save an emergency checkpoint."
    )
    action_timeout_s: float = Field(300.0, gt=0, description="Time allowed for any other action.")
    action_max_attempts: int = Field(3, ge=1, description="Attempts per action (retryable errors).")
    action_retry_backoff_s: float = Field(
        1.0, ge=0, description="First retry delay; doubles on each further attempt."
    )
    backend: BackendName = Field("dry_run", description="Where actions are carried out.")
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
        "world) not done in this long falls back to a full restart of every rank.",
    )
    dry_run: bool = Field(
        False,
        description="Record what the policy decides, and do nothing: the actions are marked "
        "dry run and counted apart from those carried out; on Kubernetes the cluster is "
        "still watched, read only. A shadow of the acting supervisor.",
    )
    policy: str = Field(
        "policies.default:DefaultPolicy",
        min_length=1,
        description="The policy: `module:Class` or a path to a .py file (`file.py:Class`).",
    )

    # --- Kubernetes backend (backend `kubernetes`) ------------------------------------
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
        9400,
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

    # --- high availability (Kubernetes Lease) -------------------------------------------
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

    # --- goodput -----------------------------------------------------------------------
    goodput_sample_period_s: float = Field(
        10.0,
        gt=0,
        description="How often each job's step is sampled for goodput (a row only when it "
        "moved; never per heartbeat).",
    )

    # --- history retention --------------------------------------------------------------
    history_retention_days: float = Field(
        30.0,
        ge=0,
        description="Events and finished actions older than this are deleted (0: kept "
        "forever). Never less than restart_window_s, the window the policy counts "
        "restarts over.",
    )
    goodput_retention_days: float | None = Field(
        None,
        ge=0,
        description="Progress samples and checkpoint reports (the per-rank, high-volume "
        "goodput input) older than this are deleted (0: kept forever). Unset: "
        "history_retention_days. Each job's newest sample is kept.",
    )
    history_prune_period_s: float = Field(
        3600.0,
        gt=0,
        description="How often old history is deleted (in batches of 1000 rows, with "
        "pauses, beside the service's work).",
    )

    # --- notifications (see docs/notifications.md) ---------------------------------------
    notification_routes: Routes = Field(
        [],
        description="Where events and finished actions are sent (webhook, Slack, "
        "Alertmanager) and which. Empty: nothing is sent.",
    )
    notification_timeout_s: float = Field(
        10.0, gt=0, description="Time allowed for one attempt to deliver a notification."
    )
    notification_max_attempts: int = Field(
        5, ge=1, description="Attempts per notification before it is marked failed."
    )
    notification_retry_backoff_s: float = Field(
        1.0,
        ge=0,
        description="First retry delay of a notification; doubles on each further attempt "
        "(up to 60 s), with jitter.",
    )
    notification_queue_size: int = Field(
        10000,
        ge=1,
        description="Events and action changes waiting to be routed to notifications; "
        "beyond it they are dropped (and counted) rather than slow the supervisor.",
    )
    public_url: str | None = Field(
        None,
        description="Where people open this supervisor's dashboard "
        "(https://supervisor.example); notifications link to it. Unset: no links.",
    )

    # --- fault injection ----------------------------------------------------------------
    enable_fault_injection: bool = Field(
        False, description="Accept POST /api/v1/faults. Off by default."
    )

    # --- service ----------------------------------------------------------------------
    database_url: str = Field(
        "sqlite:///./var/supervisor.db", min_length=1, description="SQLAlchemy database URL."
    )
    agent_token: SecretStr | None = Field(
        None, description="Bearer token of host monitors. Generated and logged when unset."
    )
    operator_token: SecretStr | None = Field(
        None, description="Bearer token of operators. Generated and logged when unset."
    )
    # --- agent identity (docs/security.md, "Agent identity") -----------------------------
    agent_auth: Annotated[list[AgentAuth], NoDecode] = Field(
        ["shared"],
        min_length=1,
        description="How host monitors prove who they are, one or more of (comma-separated "
        "in the environment): shared (agent_token, which may speak for any node), node_key "
        "(a credential per node, derived from node_key), kubernetes (the pod's service "
        "account token, checked with a TokenReview).",
    )
    node_key: SecretStr | None = Field(
        None,
        description="Secret the node credentials are derived from (agent_auth node_key; at "
        f"least {NODE_KEY_MIN_CHARS} characters). `supervisor node-credential NODE` prints "
        "a node's.",
    )
    agent_kube_audience: str = Field(
        "resiliency-supervisor",
        min_length=1,
        description="Audience the host monitors' service account tokens must be bound to "
        "(agent_auth kubernetes).",
    )
    agent_kube_service_account: str | None = Field(
        None,
        pattern=SERVICE_ACCOUNT_USER,
        description="User of the host monitors' service account, "
        "system:serviceaccount:<namespace>:<name> (required with agent_auth kubernetes).",
    )
    agent_kube_review_ttl_s: float = Field(
        120.0,
        gt=0,
        description="How long an accepted service account token is trusted before it is "
        "reviewed again (never past its expiry).",
    )
    read_requires_token: bool = Field(
        True, description="Read endpoints need the operator token (else open to all)."
    )
    host: str = Field("127.0.0.1", description="Address `supervisor serve` binds.")
    port: int = Field(8080, ge=0, le=65535, description="Port `supervisor serve` binds.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )

    # --- TLS (docs/security.md, "TLS") --------------------------------------------------
    tls_cert_file: str | None = Field(
        None,
        description="Certificate (PEM, its chain after it) `supervisor serve` presents: with "
        "tls_key_file, it serves HTTPS. Unset: HTTP.",
    )
    tls_key_file: str | None = Field(None, description="Private key (PEM) of tls_cert_file.")
    tls_ca_file: str | None = Field(
        None,
        description="CA bundle (PEM) the host monitors' certificates are verified with (set: "
        "a host monitor whose heartbeat gives no address is reached over HTTPS). Unset: the "
        "system's trust store.",
    )
    tls_host_monitor_server_name: str | None = Field(
        None,
        min_length=1,
        description="Name the host monitors' certificates are checked against instead of "
        "the address they are reached at (a pod IP), e.g. their Service's DNS name. Unset: "
        "the address.",
    )

    @model_validator(mode="after")
    def _check_relations(self) -> Self:
        if self.heartbeat_timeout_s <= self.heartbeat_polling_period_s:
            raise ValueError(
                "heartbeat_timeout_s must be greater than heartbeat_polling_period_s "
                f"({self.heartbeat_timeout_s} <= {self.heartbeat_polling_period_s})"
            )
        if not self.min_num_dp_replicas <= self.num_dp_replicas <= self.max_num_dp_replicas:
            raise ValueError(
                "need min_num_dp_replicas <= num_dp_replicas <= max_num_dp_replicas "
                f"(got {self.min_num_dp_replicas}, {self.num_dp_replicas}, "
                f"{self.max_num_dp_replicas})"
            )
        if self.leader_election and not (
            self.leader_election_retry_period_s
            < self.leader_election_renew_deadline_s
            < self.leader_election_lease_duration_s
        ):
            raise ValueError(
                "need leader_election_retry_period_s < leader_election_renew_deadline_s < "
                "leader_election_lease_duration_s"
            )
        retention_s = self.history_retention_days * SECONDS_PER_DAY
        if 0 < retention_s < self.restart_window_s:
            raise ValueError(
                f"history_retention_days ({self.history_retention_days:g} days = "
                f"{retention_s:g} s) must cover restart_window_s ({self.restart_window_s:g} s): "
                "the policy counts restarts over that window from the stored actions"
            )
        if (
            self.agent_token is not None
            and self.operator_token is not None
            and self.agent_token.get_secret_value() == self.operator_token.get_secret_value()
        ):
            raise ValueError("agent_token and operator_token must differ")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            given, missing = (
                ("tls_cert_file", "tls_key_file")
                if self.tls_key_file is None
                else ("tls_key_file", "tls_cert_file")
            )
            raise ValueError(f"{given} is set without {missing}: HTTPS needs both")
        return self._check_agent_auth()

    @field_validator("agent_auth", mode="before")
    @classmethod
    def _split_agent_auth(cls, value: object) -> object:
        if isinstance(value, str):  # the environment's "node_key,kubernetes"
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    def _check_agent_auth(self) -> Self:
        modes = self.agent_auth
        if len(set(modes)) != len(modes):
            raise ValueError(f"agent_auth names a mode twice: {modes}")
        if "node_key" in modes:
            key = self.node_key.get_secret_value() if self.node_key is not None else ""
            if len(key) < NODE_KEY_MIN_CHARS:
                raise ValueError(
                    f"agent_auth node_key needs node_key, at least {NODE_KEY_MIN_CHARS} "
                    "characters (e.g. `openssl rand -base64 32`)"
                )
            others = (self.agent_token, self.operator_token)
            if any(t is not None and t.get_secret_value() == key for t in others):
                raise ValueError("node_key must differ from agent_token and operator_token")
        if "kubernetes" in modes and self.agent_kube_service_account is None:
            raise ValueError(
                "agent_auth kubernetes needs agent_kube_service_account "
                "(system:serviceaccount:<namespace>:<name> of the host monitors)"
            )
        return self

    # --- the settings by the part they configure (supervisor/config_parts.py) ----------

    @property
    def sensing(self) -> SensingSettings:
        return SensingSettings.of(self)

    @property
    def workload(self) -> WorkloadSettings:
        return WorkloadSettings.of(self)

    @property
    def remediation(self) -> RemediationSettings:
        return RemediationSettings.of(self)

    @property
    def actuator(self) -> ActuatorSettings:
        return ActuatorSettings.of(self)

    @property
    def runtime(self) -> RuntimeSettings:
        return RuntimeSettings.of(self)

    @property
    def local(self) -> LocalSettings:
        return LocalSettings.of(self)

    @property
    def kubernetes(self) -> KubernetesSettings:
        return KubernetesSettings.of(self)

    @property
    def high_availability(self) -> LeaderElectionSettings:
        return LeaderElectionSettings.of(self)

    @property
    def history(self) -> HistorySettings:
        return HistorySettings.of(self)

    @property
    def notifications(self) -> NotificationSettings:
        return NotificationSettings.of(self)

    @property
    def service(self) -> ServiceSettings:
        return ServiceSettings.of(self)

    @property
    def access(self) -> AccessSettings:
        return AccessSettings.of(self)

    @property
    def tls(self) -> TlsSettings:
        return TlsSettings.of(self)

    def host_monitor_ssl_context(self) -> ssl.SSLContext:
        """How the supervisor's clients verify host monitors (tls_ca_file, else the system's
        trust store; tls_host_monitor_server_name). Raises TLSError for an unusable CA file."""
        return client_context(
            self.tls_ca_file,
            server_name=self.tls_host_monitor_server_name,
            ca_name="tls_ca_file",
        )

    @property
    def host_monitor_scheme(self) -> str:
        """Of a host monitor's URL built from its node's address (no address in its
        heartbeat): with a CA to verify them, host monitors serve HTTPS."""
        return "https" if self.tls_ca_file is not None else "http"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get(CONFIG_FILE_ENV)
        if config_file:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=config_file))
        return tuple(sources)


class ConfigError(SupervisorError):
    """Settings that cannot be used; the message is one line meant for the operator."""


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build settings from overrides > environment > YAML file > defaults.

    Raises ConfigError with a single readable line naming the offending setting.
    """
    config_file = config_file or os.environ.get(CONFIG_FILE_ENV) or None
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        os.environ[CONFIG_FILE_ENV] = str(path)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    except (OSError, ValueError, yaml.YAMLError) as exc:  # unreadable or malformed YAML
        detail = " ".join(str(exc).split())
        raise ConfigError(f"cannot read configuration: {detail}") from None


def describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        name = ".".join(str(p) for p in err["loc"]) or "settings"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown setting '{name}'")
        elif err["loc"] and isinstance(err.get("input"), dict | list):
            # A whole structure is no help on one line, and may hold a secret (a route).
            parts.append(f"invalid setting '{name}': {msg}")
        elif err["loc"]:
            parts.append(f"invalid setting '{name}': {msg} (got {err.get('input')!r})")
        else:
            parts.append(f"invalid settings: {msg}")
    return "; ".join(parts)
