"""Settings, read from `SUPERVISOR_*` environment variables and an optional YAML file.

Names follow the systems our users already run (see docs/configuration.md), so a
`heartbeat_timeout_s` means here what it means there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Self

import yaml
from pydantic import ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

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

CONFIG_FILE_ENV = "SUPERVISOR_CONFIG_FILE"

SECONDS_PER_DAY = 86400.0


# Every group's fields, flat: pydantic lists the fields of the last base first, so the
# groups are given in the reverse of their order in docs/configuration.md.
class Settings(
    TlsSettings,
    AccessSettings,
    ServiceSettings,
    NotificationSettings,
    HistorySettings,
    LeaderElectionSettings,
    KubernetesSettings,
    LocalSettings,
    RuntimeSettings,
    ActuatorSettings,
    RemediationSettings,
    WorkloadSettings,
    SensingSettings,
    BaseSettings,
):
    model_config = SettingsConfigDict(
        env_prefix="SUPERVISOR_",
        extra="forbid",
        frozen=False,
        validate_default=True,
    )

    @model_validator(mode="after")
    def _check_retention(self) -> Self:
        retention_s = self.history_retention_days * SECONDS_PER_DAY
        if 0 < retention_s < self.restart_window_s:
            raise ValueError(
                f"history_retention_days ({self.history_retention_days:g} days = "
                f"{retention_s:g} s) must cover restart_window_s ({self.restart_window_s:g} s): "
                "the policy counts restarts over that window from the stored actions"
            )
        return self

    @property
    def in_process_wait_s(self) -> float:
        """How long an in-process restart may take before the full restart: its bound, but
        at most half an action's attempt. The fallback runs in the same attempt; an
        in-process wait as long as the attempt left it no time, and the attempt timed out
        instead (its retries then only waited again for the same world)."""
        return min(self.in_process_restart_timeout_s, self.action_timeout_s / 2)

    # --- the settings by the part they configure (supervisor/config_parts/) ----------

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
