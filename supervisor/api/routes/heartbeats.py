"""POST /api/v1/heartbeats: the hot path, served ahead of FastAPI's own machinery.

Every node calls it every few seconds, so it skips the framework: the token is checked
inline; the body is queued and, with the others of the same loop turn (IngestQueue),
decoded with its fields validated by msgspec in one pass and applied to the sensor in
memory (which checks what spans fields, unless the heartbeat repeats what it already
holds for the node); then a fixed reply is sent. Nothing is written to the database
unless something changed; then the events are committed before the reply. Its schema is
documented in /openapi.json like every other route (see app._openapi).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from hmac import compare_digest
from typing import Any, Generic, TypeVar

from starlette.types import Message, Receive, Scope, Send

from supervisor.runtime import Supervisor
from supervisor.sensor.heartbeat import HeartbeatError, parse_heartbeat
from supervisor.sensor.sensor import UNCHANGED, Changes

PATH = "/api/v1/heartbeats"
Parsed = TypeVar("Parsed")
MAX_BODY = 1 << 20

_JSON = [(b"content-type", b"application/json")]
RETRY_AFTER = [(b"retry-after", b"1")]
_NO_CONTENT_START: Message = {"type": "http.response.start", "status": 204, "headers": ()}
_NO_CONTENT_BODY: Message = {"type": "http.response.body", "body": b""}


class IngestQueue(Generic[Parsed]):
    """Heartbeats that arrived in one turn of the event loop, parsed and applied together.

    Under load one turn of the loop reads many requests, and their handlers run one after
    another, each after the server's own socket and HTTP work for the next: every one of
    them would find the decoder and the sensor cold in the CPU's caches. Queued to the end
    of the turn, they are all parsed, then all applied, so that each stage runs back to
    back on warm caches; this costs each heartbeat a future and an extra await, and one
    that comes alone waits one loop turn. Under load (32 connections, 1,000 nodes), about
    9 heartbeats share a turn; against parsing and applying each in its own handler,
    throughput rose by a median 8% over 30 paired rounds on 2 shared cores.
    """

    def __init__(
        self, parse: Callable[[bytes], Parsed], apply: Callable[[Parsed], Changes]
    ) -> None:
        self._parse = parse
        self._apply = apply
        self._queued: list[tuple[bytes, asyncio.Future[Changes]]] = []

    def submit(self, body: bytes) -> asyncio.Future[Changes]:
        """Parse and apply `body` at the end of this loop turn. The future has its changes,
        or the error that refused it (HeartbeatError, or whatever else went wrong)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Changes] = loop.create_future()
        self._queued.append((body, future))
        if len(self._queued) == 1:
            loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        parse, apply = self._parse, self._apply
        parsed: list[tuple[Parsed, asyncio.Future[Changes]]] = []
        for body, future in queued:
            if future.done():  # its request was cancelled: it was never acknowledged
                continue
            try:
                parsed.append((parse(body), future))
            except Exception as exc:  # the request's handler raises it
                future.set_exception(exc)
        for item, future in parsed:  # in arrival order: a node's heartbeats stay in order
            try:
                future.set_result(apply(item))
            except Exception as exc:
                future.set_exception(exc)


class HeartbeatEndpoint:
    """A bare ASGI app for POST /api/v1/heartbeats (the app routes that path here)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._expected: bytes | None = None
        # The sensor finishes the validation (check_heartbeat) unless the heartbeat repeats
        # what it already validated for the node; it changes nothing if it is invalid.
        self._queue = IngestQueue(parse_heartbeat, supervisor.sensor.ingest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        supervisor = self.supervisor
        if scope["method"] != "POST":
            await _reply(send, 405, {"detail": "Method Not Allowed"}, [(b"allow", b"POST")])
            return
        if not supervisor.ready:  # a standby, or starting: the sender retries
            await _reply(send, 503, supervisor.readiness, RETRY_AFTER)
            return
        authorized = False
        expected = self._expected or self._expected_header()
        if expected is not None:
            for name, value in scope["headers"]:
                if name == b"authorization":
                    authorized = compare_digest(value, expected)
                    break
        if not authorized:
            await _reply(
                send,
                401,
                {"detail": "missing or invalid bearer token"},
                [(b"www-authenticate", b"Bearer")],
            )
            return
        message = await receive()
        body: bytes | None = message.get("body", b"")
        if message.get("more_body", False):  # rare: heartbeats fit in one read
            body = await _read_rest(receive, message)
        if body is None:
            await _reply(send, 413, {"detail": f"body larger than {MAX_BODY} bytes"})
            return
        try:
            changes = await self._queue.submit(body)
        except HeartbeatError as exc:
            where = ".".join(str(p) for p in exc.loc) or "body"
            await _reply(
                send,
                422,
                {
                    "message": f"{where}: {exc.message}",
                    "detail": [{"loc": ["body", *exc.loc], "msg": exc.message}],
                },
            )
            return
        # No coroutine in the common case (nothing changed): the sensor answers UNCHANGED.
        events = None if changes is UNCHANGED or not changes else await supervisor.record(changes)
        if events:
            ids = [e.id for e in events]
            await _send(send, 202, json.dumps({"events": ids}).encode())
        else:
            # The common case has no body: the server writes a body apart from the headers,
            # so this saves a socket write on every heartbeat. The messages are constants:
            # servers read them and never change them.
            await send(_NO_CONTENT_START)
            await send(_NO_CONTENT_BODY)

    def _expected_header(self) -> bytes | None:
        """The Authorization header the agents must send; None: no agent token is set."""
        token = self.supervisor.settings.agent_token
        if token is not None:
            self._expected = b"Bearer " + token.get_secret_value().encode()
        return self._expected


async def _read_rest(receive: Receive, first: Message) -> bytes | None:
    """The whole body, `first` being its first part; None when it exceeds MAX_BODY."""
    chunks = [first.get("body", b"")]
    size = len(chunks[0])
    message = first
    while message.get("more_body", False):
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _send(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*_JSON, (b"content-length", str(len(body)).encode()), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _reply(
    send: Send,
    status: int,
    payload: dict[str, Any],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await _send(send, status, json.dumps(payload).encode(), headers)


def openapi_operation(schema_ref: str) -> dict[str, Any]:
    """The OpenAPI description of the route (it bypasses FastAPI, so is added by hand)."""
    error = {"description": "", "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "post": {
            "tags": ["sensor"],
            "summary": "Report a host heartbeat (its workers and GPU errors)",
            "operationId": "post_heartbeat",
            "security": [{"HTTPBearer": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": schema_ref}}},
            },
            "responses": {
                "204": {"description": "Accepted; nothing changed, so no event was raised."},
                "202": {
                    "description": "Accepted; it raised events, already stored: their ids.",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "events": {"type": "array", "items": {"type": "integer"}}
                                },
                                "required": ["events"],
                            }
                        }
                    },
                },
                "401": {**error, "description": "Missing or wrong agent token."},
                "413": {**error, "description": "Body too large."},
                "503": {
                    **error,
                    "description": "Not ready: a standby replica (`detail` names the leader), "
                    "or starting. Nothing was recorded; send it again.",
                },
                "422": {**error, "description": "Invalid heartbeat; `message` names the field."},
            },
        }
    }
