"""Who a host monitor's service account token belongs to: an `authentication.k8s.io/v1`
TokenReview, for the audience the token must be bound to (agent_auth kubernetes).

The API server checks the token's signature, expiry, audience and that the pod (and
node) it was bound to still exist; its answer names the service account and, for a
token bound to a pod (Kubernetes 1.30 and later), the pod's node in
`user.extra["authentication.kubernetes.io/node-name"]`. The supervisor's service
account needs `create` on `tokenreviews` (cluster-wide: the chart's ClusterRole with
only that). Judging the answer is supervisor/identity's business.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from kubernetes import client

from supervisor.identity.authenticator import Review, ReviewUnavailable
from supervisor.kube.calls import Calls
from supervisor.kube.client import ClientSettings, api_client
from supervisor.kube.errors import KubeError

NODE_NAME = "authentication.kubernetes.io/node-name"


class ReviewSettings(ClientSettings, Protocol):
    """The API server (Kubernetes settings) and the audience tokens must be bound to
    (access settings)."""

    @property
    def agent_kube_audience(self) -> str: ...


class KubeTokenReviewer:
    """`TokenReviewer` through the Kubernetes API."""

    def __init__(self, api: client.ApiClient, audience: str) -> None:
        self.api = api
        self.audience = audience
        # Dicts in, JSON out; the client's type stubs only know its models.
        self._raw: Any = client.AuthenticationV1Api(api)
        # A heartbeat waits on its review: a short timeout and one retry, then 503 and
        # the host monitor sends it again. Never fenced: reviews change nothing.
        self._calls = Calls(request_timeout_s=5.0, attempts=2, backoff_s=(0.2, 1.0))

    @classmethod
    def from_settings(cls, settings: ReviewSettings) -> KubeTokenReviewer:
        return cls(api_client(settings), settings.agent_kube_audience)

    async def review(self, token: str) -> Review:
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [self.audience]},
        }
        try:
            response = await self._calls.run(
                "create TokenReview", self._raw.create_token_review, body, _preload_content=False
            )
        except KubeError as exc:
            raise ReviewUnavailable(str(exc)) from None
        return review_of(json.loads(response.data))

    async def close(self) -> None:
        self.api.close()


def review_of(token_review: dict[str, Any]) -> Review:
    """The status of a TokenReview the API server answered, as a Review."""
    status = token_review.get("status") or {}
    if not status.get("authenticated"):
        return Review(False, error=str(status.get("error") or "not authenticated"))
    user = status.get("user") or {}
    nodes = (user.get("extra") or {}).get(NODE_NAME) or []
    return Review(
        True,
        username=str(user.get("username") or ""),
        node=str(nodes[0]) if nodes else None,
        audiences=tuple(str(a) for a in status.get("audiences") or ()),
    )
