"""The settings grouped by the part of the supervisor they configure, each declared once.

Users set them flat, as `SUPERVISOR_<NAME>` or a YAML key: `Settings`
(supervisor/config.py) inherits every group's fields, so those names are the fields'
names. A part of the supervisor takes only its group, `settings.<group>`, so a reader
knows what it can be tuned by and a test can build it from a few values; a part that
reads a few settings of several groups takes a Protocol of exactly those, declared
beside it. Only the assembly (the runtime, what builds it, the Kubernetes backend and
its actions' context) takes all. A group checks the relations among its own settings;
`Settings` checks those across groups. docs/configuration.md lists the settings under
the groups' headings.
"""

from __future__ import annotations

from supervisor.config_parts.backends import (
    KubernetesSettings,
    LeaderElectionSettings,
    LocalSettings,
)
from supervisor.config_parts.group import SettingsGroup
from supervisor.config_parts.loop import (
    ActuatorSettings,
    BackendName,
    RemediationSettings,
    RuntimeSettings,
    SensingSettings,
    WorkloadSettings,
)
from supervisor.config_parts.service import (
    AccessSettings,
    AgentAuth,
    HistorySettings,
    NotificationSettings,
    ServiceSettings,
    TlsSettings,
)

__all__ = [
    "GROUPS",
    "AccessSettings",
    "ActuatorSettings",
    "AgentAuth",
    "BackendName",
    "HistorySettings",
    "KubernetesSettings",
    "LeaderElectionSettings",
    "LocalSettings",
    "NotificationSettings",
    "RemediationSettings",
    "RuntimeSettings",
    "SensingSettings",
    "ServiceSettings",
    "SettingsGroup",
    "TlsSettings",
    "WorkloadSettings",
    "field_names",
]

#: Every group, in the order docs/configuration.md lists them.
GROUPS: tuple[type[SettingsGroup], ...] = (
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


def field_names(group: type[SettingsGroup]) -> list[str]:
    return list(group.model_fields)
