"""Builds the official client's `ApiClient` from the settings: a kubeconfig, or the
in-cluster service account."""

from __future__ import annotations

from typing import Protocol

from kubernetes import client, config
from kubernetes.config.config_exception import ConfigException

from supervisor.kube.errors import KubeConfigError


class ClientSettings(Protocol):
    """Where the API server is: the Kubernetes settings' kubeconfig and context."""

    @property
    def kube_config(self) -> str | None: ...
    @property
    def kube_context(self) -> str | None: ...


def api_client(settings: ClientSettings) -> client.ApiClient:
    """A new ApiClient; the caller closes it.

    `kube_config` set: that kubeconfig (and `kube_context`). Unset: the pod's service
    account (KUBERNETES_SERVICE_HOST and the mounted token), as in production.
    """
    configuration = client.Configuration()
    try:
        if settings.kube_config:
            config.load_kube_config(
                config_file=settings.kube_config,
                context=settings.kube_context,
                client_configuration=configuration,
                persist_config=False,
            )
        else:
            config.load_incluster_config(client_configuration=configuration)
    except (ConfigException, OSError) as exc:
        where = settings.kube_config or "the in-cluster service account"
        raise KubeConfigError(f"cannot load Kubernetes configuration from {where}: {exc}") from None
    return client.ApiClient(configuration)
