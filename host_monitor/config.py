"""Settings of the host monitor: `HOST_MONITOR_*` environment variables, overridden by flags.

Names match the supervisor's where they mean the same thing (`heartbeat_polling_period_s`,
`gpu_report_cooldown_s`), so one value can be copied from one config to the other.
"""

from __future__ import annotations

import os
import re
import ssl
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from host_monitor.credentials import BearerCredential
from host_monitor.errors import HostMonitorError
from host_monitor.wire import Name  # the supervisor's rule for node and job names
from resiliency_protocol import worker_env
from resiliency_protocol.logs import LogFormat
from resiliency_protocol.shared_settings import (
    DEFAULT_CHECKPOINT_ROOT,
    DEFAULT_GPU_REPORT_COOLDOWN_S,
    DEFAULT_HEARTBEAT_POLLING_PERIOD_S,
    DEFAULT_HOST_MONITOR_PORT,
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    HOST_MONITOR_ENV_PREFIX,
    LogLevel,
    host_monitor_env,
)
from resiliency_protocol.tls import client_context, half_key_pair, server_context

DEV_KMSG = "/dev/kmsg"
# `kernel_log` values that turn the XID watchdog off explicitly.
KERNEL_LOG_OFF = ("none", "off")
DEFAULT_PEER_STORE_PARENT = "/dev/shm/resiliency-peer"
DEFAULT_PEER_MAX_FILE_BYTES = 2**40  # 1 TiB: no shard is that big; RAM runs out first
#: What launched workers are told of our certificate (training/worker_client.py reads them).
ENV_WORKER_CA_FILE = worker_env.HOST_MONITOR_CA_FILE
ENV_WORKER_SERVER_NAME = worker_env.HOST_MONITOR_SERVER_NAME
#: What the host monitor may present to the supervisor: exactly one of them.
CREDENTIALS = (
    "agent_token",
    "node_credential",
    "node_credential_file",
    "service_account_token_file",
)


_URL = re.compile(r"https?://[^\s/]+(/\S*)?")


class HostMonitorSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=HOST_MONITOR_ENV_PREFIX,
        # Unknown keyword settings are errors; unknown HOST_MONITOR_* environment variables
        # are not read at all (HOST_MONITOR_URL, say, is our workers' env, not a setting).
        extra="forbid",
        validate_default=True,
    )

    node: Name = Field(description="Name of this node, as the supervisor knows it.")
    supervisor_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="Base URL of the supervisor. Unset: no heartbeats (local API only).",
    )
    heartbeat_relay_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="Base URL of a heartbeat relay (`host-monitor relay`) that carries this "
        "node's heartbeats to the supervisor in batches. Heartbeats go to supervisor_url "
        "directly whenever the relay does not answer or cannot reach the supervisor.",
    )
    shadow_supervisor_urls: Annotated[list[str], NoDecode] = Field(
        [],
        description="Supervisors in dry run that shadow the acting one (comma-separated "
        "base URLs): each is sent a copy of every heartbeat, best effort, with the same "
        "credential; one that is down or slow never delays the acting supervisor's.",
    )
    agent_token: SecretStr | None = Field(
        None,
        description="The token all host monitors share, for the supervisor's heartbeats and "
        "checkpoint reports (it speaks for any node: prefer a node credential).",
    )
    node_credential: SecretStr | None = Field(
        None,
        description="This node's own credential (`supervisor node-credential NODE`), instead "
        "of agent_token: it speaks for this node only.",
    )
    node_credential_file: Path | None = Field(
        None,
        description="A file holding this node's credential (e.g. a mounted Secret), read "
        "again when it changes.",
    )
    service_account_token_file: Path | None = Field(
        None,
        description="The pod's projected service account token, bound to the supervisor's "
        "audience (Kubernetes identity), read again when the kubelet rotates it.",
    )
    actuator_token: SecretStr | None = Field(
        None,
        description="Bearer token the supervisor's actuator presents to us. "
        "Generated and logged when unset.",
    )
    worker_token: SecretStr | None = Field(
        None,
        description="Bearer token our workers present. Generated when unset; launched "
        "workers get it as HOST_MONITOR_WORKER_TOKEN.",
    )
    host: str = Field("127.0.0.1", min_length=1, description="Address the local API binds.")
    host_daemon_port: int = Field(
        DEFAULT_HOST_MONITOR_PORT,
        ge=0,
        le=65535,
        description="Port the local API binds; 0 picks a free one.",
    )
    heartbeat_polling_period_s: float = Field(
        DEFAULT_HEARTBEAT_POLLING_PERIOD_S,
        gt=0,
        description="How often a heartbeat is sent to the supervisor.",
    )
    probe_peers: bool = Field(
        True,
        description="Probe the peers the supervisor names (GET /healthz of their host "
        "monitors, every heartbeat period, 1 s at least) and name in the heartbeats those "
        "that do not answer: how the supervisor tells a node cut off from its peers.",
    )
    worker_heartbeat_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A registered worker whose process lives but reports no progress "
        "for this long is `lost`.",
    )
    initial_state: Literal["spare", "running"] = Field(
        "spare", description="Node state at start (`running` needs `job`)."
    )
    job: Name | None = Field(None, description="Job the node serves at start.")
    idle_release_s: float = Field(
        30.0,
        ge=0,
        description="A node whose workers all registered themselves (none launched) and "
        "are all gone for this long, their exit heartbeated, becomes a spare again.",
    )
    kernel_log: str | None = Field(
        None,
        description="Kernel log the XID watchdog reads: unset = /dev/kmsg if readable; "
        "a regular file is tailed; `none` turns the watchdog off.",
    )
    nvidia_smi: str = Field(
        "nvidia-smi",
        min_length=1,
        description="nvidia-smi command for the ECC watchdog; not found = nvidia-smi unused.",
    )
    nvml: bool = Field(
        True,
        description="Read GPU health through NVML (ECC, row remapping, NVLink errors, "
        "clock slowdowns, XID events) where the NVIDIA driver is; false: kernel log and "
        "nvidia-smi only.",
    )
    watchdog_period_s: float = Field(
        10.0, gt=0, description="How often the GPU watchdogs look at their sources."
    )
    gpu_report_cooldown_s: float = Field(
        DEFAULT_GPU_REPORT_COOLDOWN_S,
        ge=0,
        description="Repeats of one (kind, gpu, code) within this are not sent.",
    )
    run_dir: Path = Field(
        Path("var/host-monitor"), description="Where the logs of launched workers go."
    )
    shutdown_grace_s: float = Field(
        5.0,
        ge=0,
        le=600,
        description="On SIGTERM/SIGINT, time launched workers get between SIGTERM and SIGKILL.",
    )
    log_level: LogLevel = Field(DEFAULT_LOG_LEVEL, description="Log level.")
    metrics_token: SecretStr | None = Field(
        None,
        description="Bearer token Prometheus presents for GET /metrics (the actuator token "
        "works too); unset: only the actuator token.",
    )
    log_format: LogFormat = Field(
        DEFAULT_LOG_FORMAT,
        description="Log lines for people (text) or one JSON object per line (json); "
        "also given to the workers it launches (RESILIENCY_LOG_FORMAT).",
    )
    # The peer checkpoint tier (host_monitor/peer/tier.py): copies of the workers' RAM
    # checkpoints kept by a partner node, for a swapped-in spare whose RAM is empty.
    peer_token: SecretStr | None = Field(
        None,
        description="Bearer token host monitors present to each other (peer checkpoint "
        "tier). Unset: the tier is off (peer routes answer 503, nothing is replicated).",
    )
    checkpoint_root: Path = Field(
        Path(DEFAULT_CHECKPOINT_ROOT),
        description="The only directory tree workers may ask us to replicate from or fetch "
        "into (symlinks resolved).",
    )
    peer_store_dir: Path | None = Field(
        None,
        description=f"Where the copies received from the partner are kept. Unset: "
        f"{DEFAULT_PEER_STORE_PARENT}/<node>.",
    )
    peer_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Timeout of each network step of a transfer to or from the partner.",
    )
    peer_max_file_bytes: int = Field(
        DEFAULT_PEER_MAX_FILE_BYTES,
        ge=1,
        description="Largest checkpoint file the partner may upload to us.",
    )
    peer_store_max_bytes: int | None = Field(
        None,
        ge=1,
        description="Bytes the peer store may hold (copies, uploads in progress): an upload "
        "that would go over is refused (507). Set it with the store on tmpfs, whose pages "
        "count against the host monitor's memory limit (host_monitor/README.md, 'Where "
        "partner copies live'). Unset: no cap.",
    )
    peer_channel: bool = Field(
        True,
        description="Move checkpoint files to and from partners over the data channel "
        "(plain TCP, TLS when the API has it) rather than HTTP.",
    )
    peer_channel_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of the data channel, on the API's address; 0: any free port. "
        "Partners learn it from GET /v1/peer/channel.",
    )
    # TLS (docs/security.md, "TLS"): HTTPS for the local API, and how we verify who we call.
    tls_cert_file: Path | None = Field(
        None,
        description="Certificate (PEM, its chain after it) the local API presents: with "
        "tls_key_file, it serves HTTPS (and heartbeats an https:// address). Unset: HTTP.",
    )
    tls_key_file: Path | None = Field(None, description="Private key (PEM) of tls_cert_file.")
    tls_ca_file: Path | None = Field(
        None,
        description="CA bundle (PEM) that verifies the supervisor and the partner (peer "
        f"tier); launched workers get its path as {ENV_WORKER_CA_FILE}. Unset: the system's "
        "trust store.",
    )
    tls_server_name: str | None = Field(
        None,
        min_length=1,
        description="Name the host monitors' certificates are issued for (their Service's "
        "DNS name): the partner's is checked against it instead of its address, and "
        f"launched workers get it as {ENV_WORKER_SERVER_NAME}. Unset: the address.",
    )

    @field_validator("shadow_supervisor_urls", mode="before")
    @classmethod
    def _split_shadow_urls(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("shadow_supervisor_urls")
    @classmethod
    def _check_shadow_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not _URL.fullmatch(url):
                raise ValueError(f"{url!r} is not an http(s) base URL")
        return urls

    @model_validator(mode="after")
    def _check_relations(self) -> Self:
        if self.initial_state == "running" and self.job is None:
            raise ValueError("job is required when initial_state is running")
        if self.initial_state == "spare" and self.job is not None:
            raise ValueError("a spare node has no job (set initial_state=running)")
        credentials = [name for name in CREDENTIALS if getattr(self, name) is not None]
        if self.supervisor_url is not None and not credentials:
            raise ValueError(f"one of {', '.join(CREDENTIALS)} is required with supervisor_url")
        if self.shadow_supervisor_urls and self.supervisor_url is None:
            raise ValueError("shadow_supervisor_urls needs supervisor_url (they shadow it)")
        if self.heartbeat_relay_url is not None and self.supervisor_url is None:
            raise ValueError(
                "heartbeat_relay_url needs supervisor_url (heartbeats fall back to it)"
            )
        if len(credentials) > 1:
            raise ValueError(f"give one credential for the supervisor, not {credentials}")
        if self.node_credential is not None:
            prefix = f"node.{self.node}."
            if not self.node_credential.get_secret_value().startswith(prefix):
                raise ValueError(f"node_credential is not the credential of node {self.node}")
        tokens = [
            t.get_secret_value()
            for t in (self.agent_token, self.node_credential, self.actuator_token)
            if t is not None
        ]
        if self.worker_token is not None:
            tokens.append(self.worker_token.get_secret_value())
        if len(tokens) != len(set(tokens)):
            # A worker must never be able to act as the actuator or as the node itself.
            raise ValueError(
                "agent_token (or node_credential), actuator_token and worker_token must differ"
            )
        if half := half_key_pair(self.tls_cert_file, self.tls_key_file):
            raise ValueError(half)
        if self.peer_token is not None and self.peer_token.get_secret_value() in tokens:
            # Other host monitors hold the peer token: it must open nothing else.
            raise ValueError(
                "peer_token must differ from agent_token, actuator_token and worker_token"
            )
        return self

    def supervisor_credential(self) -> BearerCredential | None:
        """What to present to the supervisor; None when no supervisor is set."""
        if self.supervisor_url is None:
            return None
        for token in (self.agent_token, self.node_credential):
            if token is not None:
                return BearerCredential(token=token.get_secret_value())
        path = self.node_credential_file or self.service_account_token_file
        assert path is not None  # checked by _check_relations
        return BearerCredential(path=path)

    @property
    def scheme(self) -> str:
        """Of the local API's URLs."""
        return "https" if self.tls_cert_file is not None else "http"

    def ssl_context(self) -> ssl.SSLContext:
        """How we verify the supervisor and the partner (tls_ca_file, else the system's
        trust store). Raises TLSError for an unusable CA file."""
        return client_context(self.tls_ca_file, ca_name="tls_ca_file")

    def peer_ssl_context(self) -> ssl.SSLContext:
        """The partner, reached at its address, holds a host monitor certificate: checked
        against tls_server_name."""
        return client_context(
            self.tls_ca_file, server_name=self.tls_server_name, ca_name="tls_ca_file"
        )

    def check_tls_files(self) -> None:
        """Read the TLS files now (start-up): TLSError naming the setting."""
        if self.tls_cert_file is not None and self.tls_key_file is not None:
            server_context(
                self.tls_cert_file,
                self.tls_key_file,
                cert_name="tls_cert_file",
                key_name="tls_key_file",
            )
        self.ssl_context()

    def worker_tls_env(self) -> dict[str, str]:
        """What launched workers need to verify us."""
        env = {}
        if self.tls_ca_file is not None:
            env[ENV_WORKER_CA_FILE] = str(self.tls_ca_file.resolve())
        if self.tls_server_name is not None:
            env[ENV_WORKER_SERVER_NAME] = self.tls_server_name
        return env

    @property
    def kernel_log_disabled(self) -> bool:
        return self.kernel_log is not None and self.kernel_log.lower() in KERNEL_LOG_OFF

    @property
    def peer_store(self) -> Path:
        """`peer_store_dir`, or its default for this node."""
        if self.peer_store_dir is not None:
            return self.peer_store_dir
        return Path(DEFAULT_PEER_STORE_PARENT) / self.node


class ConfigError(HostMonitorError):
    """Settings that cannot be used; the message is one line meant for the operator."""


def load_settings(**overrides: Any) -> HostMonitorSettings:
    """Flags (`overrides`, None = not given) > `HOST_MONITOR_*` environment > defaults."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return HostMonitorSettings(**given)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        name = ".".join(str(p) for p in err["loc"]) or "settings"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            parts.append(
                f"missing setting '{name}' (flag --{name.replace('_', '-')} or env "
                f"{host_monitor_env(name)})"
            )
        elif err["loc"]:
            parts.append(f"invalid setting '{name}': {msg} (got {err.get('input')!r})")
        else:
            parts.append(f"invalid settings: {msg}")
    return "; ".join(parts)


def env_without_secrets(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The environment minus our own settings: workers must not see the agent's tokens."""
    return {k: v for k, v in environ.items() if not k.startswith(HOST_MONITOR_ENV_PREFIX)}
