"""POST /api/v1/heartbeats: the hot path, served ahead of FastAPI's own machinery.

Every node calls it every few seconds, so it skips the framework: the token is checked
inline, the body decoded and validated by msgspec in one pass, the sensor updated in
memory, and a fixed reply sent. Nothing is written to the database unless something
changed; then the events are committed before the reply. Its schema is documented in
/openapi.json like every other route (see app._openapi).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from supervisor.runtime import Supervisor
from supervisor.sensor.heartbeat import HeartbeatError, decode_heartbeat
from supervisor.sensor.sensor import UNCHANGED

PATH = "/api/v1/heartbeats"
MAX_BODY = 1 << 20

_JSON = [(b"content-type", b"application/json")]
RETRY_AFTER = [(b"retry-after", b"1")]


class HeartbeatEndpoint:
    """A bare ASGI app for POST /api/v1/heartbeats (the app routes that path here)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._expected: bytes | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await _reply(send, 405, {"detail": "Method Not Allowed"}, [(b"allow", b"POST")])
            return
        if not self.supervisor.ready:  # a standby, or starting: the sender retries
            await _reply(send, 503, self.supervisor.readiness, RETRY_AFTER)
            return
        if not self._authorized(scope):
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
            heartbeat = decode_heartbeat(body)
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
        changes = self.supervisor.sensor.ingest(heartbeat)
        events = (
            None if changes is UNCHANGED or not changes else await self.supervisor.record(changes)
        )
        if events:
            ids = [e.id for e in events]
            await _send(send, 202, json.dumps({"events": ids}).encode())
        else:
            # The common case has no body: the server writes a body apart from the headers,
            # so this saves a socket write on every heartbeat.
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    def _authorized(self, scope: Scope) -> bool:
        if self._expected is None:
            token = self.supervisor.settings.agent_token
            if token is None:
                return False
            self._expected = b"Bearer " + token.get_secret_value().encode()
        for name, value in scope["headers"]:
            if name == b"authorization":
                return secrets.compare_digest(value, self._expected)
        return False


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
