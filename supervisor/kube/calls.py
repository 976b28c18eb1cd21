"""Calls to the API server from async code: in a thread, bounded, retried where safe.

Every call the backend makes goes through `Calls.run`, which
- refuses (Fenced) when this replica may no longer act (leader election);
- runs the (synchronous) client call in a worker thread with a request timeout;
- retries 429 (honouring `Retry-After`), 500, 502, 503, 504, timeouts and connection
  errors with capped exponential backoff, a few times: the backend only sends requests
  that are safe to repeat (writes carry a resourceVersion or a UID precondition, creates
  have fixed names, deletes of a gone object answer 404);
- raises what outlived the retries, and anything else at once, as the `errors.KubeError`
  it is (`NotFound`, `Conflict` for the caller to handle; the message names the request
  and the server's reason).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from resiliency_protocol.backoff import Backoff
from supervisor.actuator.backend import Fence, no_fence
from supervisor.kube.errors import (
    ApiUnreachable,
    Conflict,
    KubeError,
    NotFound,
    TooManyRequests,
    api_error,
)

log = logging.getLogger(__name__)


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
        last: KubeError = ApiUnreachable(f"{what}: no attempt made")
        for attempt in range(1, self.attempts + 1):
            self.fence()
            try:
                return await asyncio.to_thread(
                    func, *args, _request_timeout=self.request_timeout_s, **kwargs
                )
            except ApiException as exc:
                error = api_error(exc, what)
                # A 409 is retryable by reading again: the caller's business, not ours.
                if isinstance(error, NotFound | Conflict) or not error.retryable:
                    raise error from None
                if isinstance(error, TooManyRequests) and not retry_429:
                    raise error from None
                last = error
                wait = max(backoff.peek(), error.retry_after or 0.0)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                last = ApiUnreachable(f"{what}: {type(exc).__name__}: {exc}")
                wait = backoff.peek()
            if attempt < self.attempts:
                log.info("%s; retry %d in %.1fs", last, attempt, wait)
                await asyncio.sleep(wait)
                backoff.next()
        raise last
