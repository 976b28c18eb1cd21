"""Calls to the API server from async code: in a thread, bounded, retried where safe.

Every call the backend makes goes through `Calls.run`, which
- refuses (Fenced) when this replica may no longer act (leader election);
- runs the (synchronous) client call in a worker thread with a request timeout;
- retries 429 (honouring `Retry-After`), 500, 502, 503, 504, timeouts and connection
  errors with capped exponential backoff, a few times: the backend only sends requests
  that are safe to repeat (writes carry a resourceVersion or a UID precondition, creates
  have fixed names, deletes of a gone object answer 404);
- raises `NotFound` (404) and `Conflict` (409) for the caller to handle, and turns
  anything else into an `ActionError` that names the request and the server's reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from resiliency_protocol.backoff import Backoff
from supervisor.actuator.backend import ActionError, Fence, no_fence

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class NotFound(Exception):
    """HTTP 404: the object is gone."""


class Conflict(Exception):
    """HTTP 409: a stale resourceVersion, a failed precondition, or AlreadyExists."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TooManyRequests(ActionError):
    """HTTP 429 that outlived the retries (e.g. an eviction blocked by a PDB)."""


def status_message(exc: ApiException) -> tuple[str, str]:
    """(reason, message) of the Status body the API server sent, if any."""
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        body = {}
    if not isinstance(body, dict):
        body = {}
    return str(body.get("reason") or exc.reason or ""), str(body.get("message") or exc.reason)


def _retry_after(exc: ApiException) -> float | None:
    headers = exc.headers or {}
    value = headers.get("Retry-After") or headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class Calls:
    def __init__(
        self,
        *,
        request_timeout_s: float = 10.0,
        attempts: int = 4,
        backoff_s: tuple[float, float] = (0.2, 5.0),
    ) -> None:
        self.request_timeout_s = request_timeout_s
        self.attempts = attempts
        self.backoff_s = backoff_s
        #: Checked before every request: a replica that may no longer act sends none.
        self.fence: Fence = no_fence

    async def run(
        self,
        what: str,
        func: Callable[..., Any],
        *args: Any,
        retry_429: bool = True,
        **kwargs: Any,
    ) -> Any:
        """`func(*args, **kwargs)` with a request timeout; see the module docstring."""
        backoff = Backoff(*self.backoff_s)
        last = ""
        for attempt in range(1, self.attempts + 1):
            self.fence()
            try:
                return await asyncio.to_thread(
                    func, *args, _request_timeout=self.request_timeout_s, **kwargs
                )
            except ApiException as exc:
                reason, message = status_message(exc)
                if exc.status == 404:
                    raise NotFound(f"{what}: {message}") from None
                if exc.status == 409:
                    raise Conflict(reason, f"{what}: {message}") from None
                last = f"{what}: HTTP {exc.status} {reason}: {message}"
                if exc.status not in RETRYABLE_STATUS or (exc.status == 429 and not retry_429):
                    if exc.status == 429:
                        raise TooManyRequests(last, retryable=True) from None
                    raise ActionError(last) from None
                wait = max(backoff.peek(), _retry_after(exc) or 0.0)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                last = f"{what}: {type(exc).__name__}: {exc}"
                wait = backoff.peek()
            if attempt < self.attempts:
                log.info("%s; retry %d in %.1fs", last, attempt, wait)
                await asyncio.sleep(wait)
                backoff.next()
        if "HTTP 429" in last:
            raise TooManyRequests(last, retryable=True)
        raise ActionError(last, retryable=True)
