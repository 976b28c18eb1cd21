"""The supervisor's HTTP API as the operator commands use it: JSON in and out, and the
one place where transport failures and error answers become exit codes."""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

from resiliency_protocol.error_reading import error_message
from resiliency_protocol.tls import TLSError, client_context
from supervisor.ops.errors import CliError, ExitCode

API_PREFIX = "/api/v1"
#: The most items one page of events or actions holds (the API's bound on `limit`).
PAGE_MAX = 1000
#: The stream sends a keepalive comment every 15 s: four missed ones mean it is dead.
STREAM_READ_TIMEOUT_S = 60.0


def api_path(*parts: str | int) -> str:
    """`/api/v1/<parts>`, each part quoted, so a name cannot reach another route."""
    return API_PREFIX + "".join("/" + quote(str(part), safe="") for part in parts)


@dataclass(frozen=True, slots=True)
class StreamMessage:
    """One server-sent event of the live stream: `event`, `action` or `resync`."""

    kind: str
    id: str | None
    data: Any


class Client:
    def __init__(
        self,
        server: str,
        token: str | None,
        *,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        ca_file: str | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        """`ca_file`: the CA bundle (PEM) that verifies an https:// server; None: the
        system's trust store. `tls_server_name`: the name its certificate is checked
        against; None: the URL's host."""
        self.server = server.rstrip("/")
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._timeout_s = timeout_s
        try:
            verify = (
                # Plain HTTP reads no CA bundle (tens of ms of every call): a context that
                # trusts no certificate, so that a redirect to https fails, never unverified.
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                if self.server.startswith("http://") and ca_file is None
                else client_context(
                    ca_file, server_name=tls_server_name, ca_name="certificate-authority"
                )
            )
        except TLSError as exc:
            raise CliError(str(exc), ExitCode.USAGE) from None
        self._http = httpx.Client(
            base_url=self.server,
            headers=headers,
            timeout=timeout_s,
            transport=transport,
            follow_redirects=True,
            verify=verify,
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def get(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        return self._request("GET", path, params=params)

    def post(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> Any:
        return self._request("POST", path, body=body, headers=headers)

    def delete(self, path: str) -> Any:
        return self._request("DELETE", path)

    def pages(self, path: str, params: Mapping[str, Any], limit: int) -> list[dict[str, Any]]:
        """Up to `limit` items of a paginated list (newest first), following its cursor."""
        items: list[dict[str, Any]] = []
        cursor: str | None = None
        while len(items) < limit:
            page = self.get(
                path, {**params, "limit": min(PAGE_MAX, limit - len(items)), "cursor": cursor}
            )
            items.extend(page["items"])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        return items

    def stream(
        self, path: str, on_open: Callable[[], None] | None = None
    ) -> Iterator[StreamMessage]:
        """The messages of a text/event-stream until the server ends it (an error then:
        a live stream only ends when the server stops)."""
        timeout = httpx.Timeout(self._timeout_s, read=STREAM_READ_TIMEOUT_S)
        headers = {"Accept": "text/event-stream"}
        with (
            self._reaching(),
            self._http.stream("GET", path, headers=headers, timeout=timeout) as response,
        ):
            if response.status_code != 200:
                response.read()
                raise_for_status(response)
            if on_open is not None:
                on_open()
            yield from parse_event_stream(response.iter_lines())
        raise CliError(f"{self.server} ended the stream", ExitCode.UNAVAILABLE)

    def _request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        with self._reaching():
            response = self._http.request(method, path, params=query, json=body, headers=headers)
        raise_for_status(response)
        try:
            return response.json()
        except ValueError:
            raise CliError(
                f"{self.server} answered {method} {path} with something other than JSON "
                "(is it a supervisor?)",
                ExitCode.UNAVAILABLE,
            ) from None

    @contextmanager
    def _reaching(self) -> Iterator[None]:
        try:
            yield
        except httpx.TimeoutException as exc:
            raise CliError(
                f"{self.server} did not answer in time ({type(exc).__name__})",
                ExitCode.UNAVAILABLE,
            ) from None
        except httpx.HTTPError as exc:
            hint = ""
            if "mismatch, certificate is not valid" in str(exc):
                hint = " (the name its certificate holds: --tls-server-name)"
            elif "CERTIFICATE_VERIFY_FAILED" in str(exc):
                hint = " (the CA that issued its certificate: --certificate-authority)"
            raise CliError(
                f"cannot reach {self.server}: {exc}{hint}", ExitCode.UNAVAILABLE
            ) from None


def raise_for_status(response: httpx.Response) -> None:
    """CliError for an error answer, with the API's own message and the status."""
    status = response.status_code
    if status < 400:
        return
    if status in (401, 403):
        code = ExitCode.UNAUTHORIZED
    elif status == 404:
        code = ExitCode.NOT_FOUND
    elif status >= 500:
        code = ExitCode.UNAVAILABLE
    else:
        code = ExitCode.REFUSED
    raise CliError(f"{error_message(response)} (HTTP {status})", code)


def parse_event_stream(lines: Iterable[str]) -> Iterator[StreamMessage]:
    """Server-sent events (as the WHATWG spec frames them) whose data is JSON."""
    fields: dict[str, str] = {}
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                try:
                    payload = json.loads("\n".join(data))
                except ValueError:
                    raise CliError(
                        "the stream sent data that is not JSON", ExitCode.UNAVAILABLE
                    ) from None
                yield StreamMessage(fields.get("event", "message"), fields.get("id"), payload)
            fields, data = {}, []
        elif not line.startswith(":"):  # a comment: the keepalive
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                data.append(value)
            else:
                fields[name] = value
