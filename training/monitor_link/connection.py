"""The worker client's HTTP link to its host monitor: one httpx client, bodies checked
against the protocol's models before they are sent, failures logged once per kind."""

from __future__ import annotations

import enum
import logging
import ssl
import urllib.parse
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from resiliency_protocol import worker_env
from resiliency_protocol.tls import TLSError, client_context

# Every part of the client logs as the module users import and configure.
log = logging.getLogger("training.worker_client")

_REQUEST_TIMEOUT_S = 2.0
MAX_ERROR_CHARS = 2000

Body = TypeVar("Body", bound=BaseModel)

# Answers that say "not now" rather than "never": the host monitor busy, restarting, or
# not (yet) knowing the worker, which registers again (registration.py).
_TRY_AGAIN_STATUSES = frozenset({404, 408, 425, 429})


class Delivery(enum.Enum):
    """How a report that must not be lost went."""

    DELIVERED = "delivered"
    REFUSED = "refused"  # for good: sending it again changes nothing
    TRY_AGAIN = "try again"  # no answer, or one that may change: the report is kept
    UNREACHABLE = "unreachable"  # nothing listens: a host monitor down or restarting


class MonitorConnection:
    """The host monitor at `monitor_url` (offline: `http` is None)."""

    def __init__(
        self,
        monitor_url: str | None,
        token: str | None,
        ca_file: str | None,
        server_name: str | None,
    ) -> None:
        self.url = monitor_url.rstrip("/") if monitor_url else None
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http: httpx.Client | None = None
        self.ssl: ssl.SSLContext | None = None
        if self.url is not None:
            self.ssl = ssl_context_for(self.url, ca_file, server_name)
            self.http = httpx.Client(
                base_url=self.url,
                headers=self.headers,
                timeout=_REQUEST_TIMEOUT_S,
                trust_env=False,  # the monitor is local: never go through a proxy
                verify=self.ssl if self.ssl is not None else True,
            )
        self._failing: set[str] = set()
        # A progress report got 404: the monitor does not know this worker (see Registration).
        self.unknown_to_monitor = False

    def first_failure(self, kind: str) -> bool:
        """True the first time `kind` fails since it last worked: what gets logged."""
        if kind in self._failing:
            return False
        self._failing.add(kind)
        return True

    def works(self, kind: str) -> bool:
        """`kind` worked; True if it was failing."""
        if kind not in self._failing:
            return False
        self._failing.discard(kind)
        return True

    def body(self, model: type[Body], kind: str, **fields: object) -> Body | None:
        """`model`'s body of `fields`, sent with only the fields given (the others are left
        out, as older host monitors take them, `wire`); None, logged once per kind, when
        the host monitor would refuse it."""
        try:
            return model.model_validate(fields)
        except ValidationError as exc:
            if self.first_failure(kind):
                log.warning(
                    "worker client: %s not sent, the host monitor refuses it: %s", kind, exc
                )
            return None

    def post(self, path: str, body: BaseModel, kind: str) -> Any | None:
        """POST; the decoded reply (or {}), or None on any failure (logged once)."""
        reply, _ = self._post(path, body, kind, None)
        return reply

    def deliver(self, path: str, body: BaseModel, kind: str, headers: dict[str, str]) -> Delivery:
        """POST a report that must not be lost; whether to send it again (failures logged
        once per kind, as by `post`)."""
        _, delivery = self._post(path, body, kind, headers)
        return delivery

    def _post(
        self, path: str, body: BaseModel, kind: str, headers: dict[str, str] | None
    ) -> tuple[Any | None, Delivery]:
        if self.http is None:
            return None, Delivery.REFUSED
        try:
            response = self.http.post(path, json=wire(body), headers=headers)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            if (
                kind == "progress"
                and isinstance(exc, httpx.HTTPStatusError)
                and exc.response.status_code == 404
            ):
                self.unknown_to_monitor = True
            if self.first_failure(kind):
                # A refusal says why in its body (e.g. a registration whose pid the host
                # monitor cannot find): show it, not only the status line.
                why = (
                    f": {_error_text(exc.response)}"
                    if isinstance(exc, httpx.HTTPStatusError)
                    else ""
                )
                log.warning("worker client: %s to host monitor failed: %s%s", kind, exc, why)
            return None, _delivery_of(exc)
        if self.works(kind):
            log.info("worker client: %s to host monitor works again", kind)
        try:
            return (response.json() if response.content else {}), Delivery.DELIVERED
        except ValueError:
            return {}, Delivery.DELIVERED

    def close(self) -> None:
        if self.http is not None:
            self.http.close()


def _delivery_of(exc: httpx.HTTPError) -> Delivery:
    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        if code in _TRY_AGAIN_STATUSES or code >= 500:
            return Delivery.TRY_AGAIN
        return Delivery.REFUSED
    if isinstance(exc, httpx.ConnectError):
        return Delivery.UNREACHABLE
    if isinstance(exc, httpx.TransportError):
        return Delivery.TRY_AGAIN
    return Delivery.REFUSED  # a request httpx could not even build: the same next time


def wire(body: BaseModel) -> object:
    """`body` as JSON, with only the fields it was given."""
    return body.model_dump(mode="json", exclude_unset=True)


def _error_text(response: httpx.Response) -> str:
    """The `detail` or `message` of an error body, else its text (shortened)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        text = body.get("message") or body.get("detail")
        if isinstance(text, str):
            return text[:MAX_ERROR_CHARS]
    return response.text[:MAX_ERROR_CHARS]


def ssl_context_for(
    url: str, ca_file: str | None, server_name: str | None
) -> ssl.SSLContext | None:
    """How an https:// monitor is verified; None for http://. Never unverified."""
    if urllib.parse.urlsplit(url).scheme != "https":
        return None
    try:
        return client_context(
            ca_file, server_name=server_name, ca_name=worker_env.HOST_MONITOR_CA_FILE
        )
    except TLSError as exc:
        raise ValueError(f"worker client: {exc}") from None
