"""What goes wrong on the Kubernetes side, under one root.

KubeError                  anything this package raises of its own
├── KubeConfigError        no usable kubeconfig or service account (one line for the operator)
├── ApiUnreachable         no answer: timeouts, connection errors
├── LeadershipLost         this replica no longer holds the Lease (lease.py)
└── ApiError               the API server answered with an error: .status, .reason, .message
    ├── NotFound           404: the object is gone
    ├── Conflict           409: a stale resourceVersion, a failed precondition, AlreadyExists
    ├── Gone               410: a watch's resourceVersion was compacted away (list again)
    ├── TooManyRequests    429: throttled, or an eviction a PodDisruptionBudget refuses
    └── ServerError        5xx

The official client's `ApiException` becomes one of these in `api_error` and nowhere else
(`Calls.run`, the informers, the leader election all call it); a watch's ERROR event, a
Status object in the stream, in `status_error`. Code above the client decides on the type
and `.status`, never on the text.

`retryable`: whether the action that met the error may succeed if tried again later (a
409 is: read again). The backend's dispatch hands what reaches it to the actuator as an
`ActionError` with the same message and `retryable`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from supervisor.errors import SupervisorError

if TYPE_CHECKING:  # the client is heavy: the CLI imports KubeConfigError without it
    from kubernetes.client.exceptions import ApiException

#: Statuses that a later attempt may get past: throttling, and a server that is
#: restarting, overloaded or cannot reach etcd.
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})


class KubeError(SupervisorError):
    """Root of the errors of supervisor.kube (itself under the supervisor's root)."""

    retryable: bool = False


class KubeConfigError(KubeError, RuntimeError):
    """No usable Kubernetes configuration; the message is one line for the operator."""


class ApiUnreachable(KubeError):
    """No answer from the API server (a timeout, a refused or broken connection)."""

    retryable = True


class ApiError(KubeError):
    """The API server answered `status`; `reason` and `message` are those of the Status
    it sent (else the HTTP reason phrase), `what` the request."""

    def __init__(
        self,
        what: str,
        *,
        status: int,
        reason: str,
        message: str,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(self.describe(what, status, reason, message))
        self.what = what
        self.status = status
        self.reason = reason
        self.message = message
        #: Seconds the server asked us to wait (`Retry-After`), if it said.
        self.retry_after = retry_after
        self.retryable = type(self).retryable or status in TRANSIENT_STATUS

    @staticmethod
    def describe(what: str, status: int, reason: str, message: str) -> str:
        return f"{what}: HTTP {status} {reason}: {message}"


class NotFound(ApiError):
    """HTTP 404: the object is gone."""

    @staticmethod
    def describe(what: str, status: int, reason: str, message: str) -> str:
        return f"{what}: {message}"


class Conflict(ApiError):
    """HTTP 409: a stale resourceVersion, a failed precondition, or AlreadyExists."""

    retryable = True  # read again, decide again

    @staticmethod
    def describe(what: str, status: int, reason: str, message: str) -> str:
        return f"{what}: {message}"


class Gone(ApiError):
    """HTTP 410: the resourceVersion a watch resumes from is too old; list again."""


class TooManyRequests(ApiError):
    """HTTP 429: throttled, or an eviction that a PodDisruptionBudget refuses for now."""


class ServerError(ApiError):
    """HTTP 5xx."""


_BY_STATUS: dict[int, type[ApiError]] = {
    404: NotFound,
    409: Conflict,
    410: Gone,
    429: TooManyRequests,
}


def status_error(
    what: str,
    status: int,
    body: Mapping[str, Any],
    *,
    reason: str | None = None,
    retry_after: float | None = None,
) -> ApiError:
    """The error for HTTP `status` with the Status object `body` (empty if none came);
    `reason`: the HTTP reason phrase, for when the body has none."""
    cls = _BY_STATUS.get(status) or (ServerError if 500 <= status < 600 else ApiError)
    return cls(
        what,
        status=status,
        reason=str(body.get("reason") or reason or ""),
        message=str(body.get("message") or reason),
        retry_after=retry_after,
    )


def api_error(exc: ApiException, what: str) -> ApiError:
    """The error of the client's `ApiException` for the request `what`."""
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        body = {}
    return status_error(
        what,
        int(exc.status or 0),
        body if isinstance(body, dict) else {},
        reason=exc.reason,
        retry_after=_retry_after(exc.headers or {}),
    )


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("Retry-After") or headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
