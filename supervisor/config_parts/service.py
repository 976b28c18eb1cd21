"""The settings of the service around the loop: history, notifications, where it
listens, who may call it, and TLS."""

from __future__ import annotations

import ssl
from typing import Annotated, Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from resiliency_protocol.logs import LogFormat
from resiliency_protocol.shared_settings import (
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    LogLevel,
)
from resiliency_protocol.tls import client_context, half_key_pair
from supervisor.config_parts.group import SettingsGroup
from supervisor.config_parts.notification_routes import Routes

# How a host monitor proves who it is (docs/security.md, "Agent identity").
AgentAuth = Literal["shared", "node_key", "kubernetes"]
NODE_KEY_MIN_CHARS = 32
# system:serviceaccount:<namespace>:<name>, both DNS names.
SERVICE_ACCOUNT_USER = (
    r"^system:serviceaccount:[a-z0-9]([-a-z0-9]*[a-z0-9])?:[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
)


class HistorySettings(SettingsGroup):
    """Goodput sampling and how long history is kept."""

    title = "Goodput and history"

    goodput_sample_period_s: float = Field(
        10.0,
        gt=0,
        description="How often each job's step is sampled for goodput (a row only when it "
        "moved; never per heartbeat).",
    )
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
    schedule_misfire_grace_s: int = Field(
        300,
        ge=1,
        description="A scheduled run (a fault drill, a retention pass) missed while the "
        "supervisor was down or busy still runs if at most this late; runs missed in a "
        "row run once (coalesced). Maintenance windows' steps run however late.",
    )


class NotificationSettings(SettingsGroup):
    """Where events and actions are sent, and how hard delivery tries."""

    title = "Notifications"

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


class ServiceSettings(SettingsGroup):
    """The service itself: where it listens, its database, its log, fault injection."""

    title = "Service"

    host: str = Field("127.0.0.1", description="Address `supervisor serve` binds.")
    port: int = Field(8080, ge=0, le=65535, description="Port `supervisor serve` binds.")
    log_level: LogLevel = Field(DEFAULT_LOG_LEVEL, description="Log level.")
    log_format: LogFormat = Field(
        DEFAULT_LOG_FORMAT,
        description="Log lines for people (text) or one JSON object per line for a log "
        "pipeline (json), with the event, action, job, node and rank as fields.",
    )
    database_url: str = Field(
        "sqlite:///./var/supervisor.db", min_length=1, description="SQLAlchemy database URL."
    )
    enable_fault_injection: bool = Field(
        False, description="Accept POST /api/v1/faults. Off by default."
    )


class AccessSettings(SettingsGroup):
    """Who may call the API: the roles' tokens and how host monitors prove who they are."""

    title = "Access"

    agent_token: SecretStr | None = Field(
        None, description="Bearer token of host monitors. Generated and logged when unset."
    )
    operator_token: SecretStr | None = Field(
        None, description="Bearer token of operators. Generated and logged when unset."
    )
    read_requires_token: bool = Field(
        True, description="Read endpoints need the operator token (else open to all)."
    )
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
    agent_kube_relay_service_account: str | None = Field(
        None,
        pattern=SERVICE_ACCOUNT_USER,
        description="User of the heartbeat relays' service account, "
        "system:serviceaccount:<namespace>:<name> (agent_auth kubernetes): its tokens carry "
        "host monitors' heartbeats in batches and speak for no node. Unset: a batch is "
        "carried only with a host monitor's own credential.",
    )
    agent_kube_review_ttl_s: float = Field(
        120.0,
        gt=0,
        description="How long an accepted service account token is trusted before it is "
        "reviewed again (never past its expiry).",
    )

    @field_validator("agent_auth", mode="before")
    @classmethod
    def _split_agent_auth(cls, value: object) -> object:
        if isinstance(value, str):  # the environment's "node_key,kubernetes"
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _check_credentials(self) -> Self:
        if (
            self.agent_token is not None
            and self.operator_token is not None
            and self.agent_token.get_secret_value() == self.operator_token.get_secret_value()
        ):
            raise ValueError("agent_token and operator_token must differ")
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
        relay = self.agent_kube_relay_service_account
        if relay is not None and relay == self.agent_kube_service_account:
            raise ValueError(
                "agent_kube_relay_service_account must differ from agent_kube_service_account: "
                "a relay's token speaks for no node"
            )
        return self


class TlsSettings(SettingsGroup):
    """HTTPS for the API and the calls to host monitors."""

    title = "TLS"

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
    def _check_key_pair(self) -> Self:
        if half := half_key_pair(self.tls_cert_file, self.tls_key_file):
            raise ValueError(half)
        return self

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
