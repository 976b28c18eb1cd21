"""POST /api/v1/heartbeats: the hot path, served ahead of FastAPI's own machinery.

Every node calls it every few seconds, so it skips the framework: the token is checked
inline; the body is decoded with its fields validated by msgspec in one pass and applied
to the sensor in memory (which checks what spans fields, unless the heartbeat repeats
what it already holds for the node), all within the request's first step, with no await
between them; then a fixed reply is sent. Nothing is written to the database
unless something changed; then the events are committed before the reply. Its schema is
documented in /openapi.json like every other route (see app._openapi).
"""

from __future__ import annotations

import json
from hmac import compare_digest
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from supervisor.metrics import HeartbeatRejection
from supervisor.runtime import Supervisor
from supervisor.sensor.heartbeat import HeartbeatError, parse_heartbeat
from supervisor.sensor.sensor import UNCHANGED

PATH = "/api/v1/heartbeats"
MAX_BODY = 1 << 20

_JSON = [(b"content-type", b"application/json")]
RETRY_AFTER = [(b"retry-after", b"1")]
_NO_CONTENT_START: Message = {"type": "http.response.start", "status": 204, "headers": ()}
_NO_CONTENT_BODY: Message = {"type": "http.response.body", "body": b""}


class HeartbeatEndpoint:
    """A bare ASGI app for POST /api/v1/heartbeats (the app routes that path here)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._expected: bytes | None = None
        # The sensor finishes the validation (check_heartbeat) unless the heartbeat repeats
        # what it already validated for the node; it changes nothing if it is invalid.
        self._ingest = supervisor.sensor.ingest
        counter = supervisor.metrics.heartbeats_rejected
        self._rejected = {reason: counter.labels(reason.value) for reason in HeartbeatRejection}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        supervisor = self.supervisor
        if scope["method"] != "POST":
            self._rejected[HeartbeatRejection.WRONG_METHOD].inc()
            await _reply(send, 405, _error("Method Not Allowed"), [(b"allow", b"POST")])
            return
        if not supervisor.ready:  # a standby, or starting: the sender retries
            self._rejected[HeartbeatRejection.NOT_READY].inc()
            await _reply(send, 503, supervisor.readiness, RETRY_AFTER)
            return
        authorized = False
        content_type = None
        expected = self._expected or self._expected_header()
        for name, value in scope["headers"]:
            if name == b"authorization" and expected is not None:
                # The scheme is case-insensitive (RFC 9110): "bearer" as other routes take.
                authorized = compare_digest(value, expected) or (
                    value[:7].lower() == b"bearer " and compare_digest(value[7:], expected[7:])
                )
            elif name == b"content-type":
                content_type = value
        if not authorized:
            self._rejected[HeartbeatRejection.UNAUTHORIZED].inc()
            await _reply(
                send,
                401,
                _error("missing or invalid bearer token"),
                [(b"www-authenticate", b"Bearer")],
            )
            return
        if content_type is not None and not _is_json(content_type):
            self._rejected[HeartbeatRejection.NOT_JSON].inc()
            await _reply(send, 415, _error("content-type: a heartbeat is application/json"))
            return
        message = await receive()
        body: bytes | None = message.get("body", b"")
        if message.get("more_body", False):  # rare: heartbeats fit in one read
            body = await _read_rest(receive, message)
        if body is None:
            self._rejected[HeartbeatRejection.TOO_LARGE].inc()
            await _reply(send, 413, _error(f"body larger than {MAX_BODY} bytes"))
            return
        try:
            # Inline, not deferred: queuing the heartbeats of one loop turn to parse and apply
            # them together (warmer caches) cost more in futures and wake-ups than it saved,
            # 3 to 4.5 points of the ceiling in paired rounds (bench/README.md).
            changes = self._ingest(parse_heartbeat(body), body)
        except HeartbeatError as exc:
            self._rejected[HeartbeatRejection.INVALID].inc()
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
        events = (
            None
            if changes is UNCHANGED or not changes
            else await supervisor.record_or_hold(changes)
        )
        if events is None and changes is not UNCHANGED and changes:
            # Held until the database answers: not acknowledged. A retry changes nothing
            # more (the sensor took it in); the events are recorded in order once it is back.
            await _reply(
                send,
                503,
                _error(
                    "database unavailable: this heartbeat's events are held in memory and "
                    "recorded in order once it answers; send again"
                ),
                [(b"retry-after", b"1")],
            )
            return
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


def _error(message: str) -> dict[str, Any]:
    """The error shape of every other route: `message`, and `detail` as FastAPI's."""
    return {"message": message, "detail": message}


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json")


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
                "415": {**error, "description": "A Content-Type other than JSON."},
                "503": {
                    **error,
                    "description": "Not ready: a standby replica (`detail` names the leader), "
                    "or starting. Nothing was recorded; send it again.",
                },
                "422": {**error, "description": "Invalid heartbeat; `message` names the field."},
            },
        }
    }
