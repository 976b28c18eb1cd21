"""POST /api/v1/heartbeats/batch: many nodes' heartbeats in one request, from a relay.

A bare ASGI app like the single route (heartbeats.py), and the same work per heartbeat:
each entry (resiliency_protocol/heartbeat_batch.py) is the node's own heartbeat with the
node's own credential, authenticated as the single route authenticates it (a cached
dict lookup once verified), and taken by the single route's `take` and `settle`. The
request's own credential is the relay's: any agent credential the supervisor accepts,
which carries heartbeats and speaks for no node. An entry refused (a credential that is
not its node's, an invalid heartbeat, a rank claimed elsewhere) is refused alone: its
result says what the single route would have answered, and the others are taken. The
answer is 200 with one result per entry, in order; the whole batch is refused only when
it is not one (401 for the relay's credential, 413, 415, 422 naming the field).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import msgspec
from starlette.types import Receive, Scope, Send

from resiliency_protocol.heartbeat import HeartbeatError, HostHeartbeat
from resiliency_protocol.heartbeat_batch import (
    MAX_BATCH,
    MAX_BATCH_BODY,
    HeartbeatResult,
    encode_answer,
    parse_batch,
)
from supervisor.api.routes.heartbeats import (
    RETRY_AFTER,
    HeartbeatEndpoint,
    Refusal,
    error_payload,
    invalid,
    is_json,
    reply,
    send_json,
)
from supervisor.identity.authenticator import ReviewUnavailable
from supervisor.metrics import HeartbeatRejection
from supervisor.sensor.sensor import UNCHANGED, Changes

_UNAUTHORIZED = HeartbeatResult(
    401,
    body=msgspec.Raw(
        json.dumps(
            error_payload("missing or invalid credential for this heartbeat's node")
        ).encode()
    ),
)


class HeartbeatBatchEndpoint:
    """A bare ASGI app for POST /api/v1/heartbeats/batch (the app routes that path here)."""

    def __init__(self, single: HeartbeatEndpoint) -> None:
        self.single = single
        self.supervisor = single.supervisor
        self.agents = single.agents
        self._cached = single.agents.cached
        self._take = single.take
        self._settle = single.settle
        self._newest_world = single._newest_world
        self._refused = single._refused
        self._rejected = single._rejected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await reply(send, 405, error_payload("Method Not Allowed"), [(b"allow", b"POST")])
            return
        if not self.supervisor.ready:
            await reply(send, 503, self.supervisor.readiness, RETRY_AFTER)
            return
        token = content_type = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                if value[:7].lower() == b"bearer ":
                    token = value[7:]
            elif name == b"content-type":
                content_type = value
        try:
            relay = None if not token else await self.agents.authenticate(token)
        except ReviewUnavailable as exc:
            await reply(send, 503, error_payload(f"cannot check the token now: {exc}"), RETRY_AFTER)
            return
        if relay is None:
            self._refused["invalid_credential"] += 1
            await reply(
                send,
                401,
                error_payload("missing or invalid bearer token (the relay's own credential)"),
                [(b"www-authenticate", b"Bearer")],
            )
            return
        if content_type is not None and not is_json(content_type):
            await reply(send, 415, error_payload("content-type: a batch is application/json"))
            return
        body = await _read_body(receive)
        if body is None:
            await reply(send, 413, error_payload(f"body larger than {MAX_BATCH_BODY} bytes"))
            return
        try:
            batch = parse_batch(body)
        except HeartbeatError as exc:
            refusal = invalid(exc)
            if exc.loc == ("heartbeats",) and "<=" in exc.message:
                refusal = invalid(
                    HeartbeatError(exc.loc, f"at most {MAX_BATCH} heartbeats in a batch")
                )
            await reply(send, refusal.status, refusal.payload)
            return
        results = []
        for entry in batch.heartbeats:
            # The common case without a coroutine: a credential verified before, and a
            # heartbeat that changes nothing to record.
            token = entry.credential.encode()
            principal = self._cached(token)
            if principal is None:
                results.append(await self._authenticated(token, bytes(entry.heartbeat)))
                continue
            taken = self._take(principal, bytes(entry.heartbeat))
            if isinstance(taken, Refusal):
                results.append(_result(taken.status, taken.payload))
                continue
            hb, changes = taken
            if changes is UNCHANGED or not changes:
                results.append(_no_content(None if hb.job is None else self._newest_world(hb.job)))
            else:
                results.append(await self._settled(hb, changes))
        await send_json(send, 200, encode_answer(results))

    async def _authenticated(self, token: bytes, body: bytes) -> HeartbeatResult:
        """An entry whose credential was not verified before: verified, then taken."""
        try:
            principal = await self.agents.authenticate(token)
        except ReviewUnavailable as exc:
            return _result(503, error_payload(f"cannot check the token now: {exc}"))
        if principal is None:
            self._refused["invalid_credential"] += 1
            self._rejected[HeartbeatRejection.UNAUTHORIZED].inc()
            return _UNAUTHORIZED
        taken = self._take(principal, body)
        if isinstance(taken, Refusal):
            return _result(taken.status, taken.payload)
        return await self._settled(*taken)

    async def _settled(self, hb: HostHeartbeat, changes: Changes) -> HeartbeatResult:
        answer = await self._settle(hb, changes)
        if answer is None:
            return _no_content(None if hb.job is None else self._newest_world(hb.job))
        return HeartbeatResult(answer.status, answer.world, msgspec.Raw(answer.body))


@functools.lru_cache(maxsize=4096)  # a job's worlds are few: made once per world
def _no_content(world: int | None) -> HeartbeatResult:
    return HeartbeatResult(204, world)


def _result(status: int, payload: dict[str, Any]) -> HeartbeatResult:
    return HeartbeatResult(status, body=msgspec.Raw(json.dumps(payload).encode()))


async def _read_body(receive: Receive) -> bytes | None:
    """The whole body; None when it exceeds MAX_BATCH_BODY."""
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BATCH_BODY:
            return None
        chunks.append(chunk)
        more = message.get("more_body", False)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def openapi_operation(schema_ref: str) -> dict[str, Any]:
    """The OpenAPI description of the route (it bypasses FastAPI, so is added by hand)."""
    error = {"description": "", "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "post": {
            "tags": ["sensor"],
            "summary": "Report many nodes' heartbeats at once (a relay)",
            "operationId": "post_heartbeat_batch",
            "security": [{"HTTPBearer": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": schema_ref}}},
            },
            "responses": {
                "200": {
                    "description": "One result per entry, in order: the status, world and "
                    "body the single route would have answered that heartbeat with.",
                    "content": {"application/json": {"schema": {"type": "object"}}},
                },
                "401": {**error, "description": "Missing or invalid relay credential."},
                "413": {**error, "description": "Body too large."},
                "415": {**error, "description": "A Content-Type other than JSON."},
                "422": {
                    **error,
                    "description": f"Not a batch (at most {MAX_BATCH} entries); `message` "
                    "names the field. Nothing was recorded.",
                },
                "503": {**error, "description": "Not ready; send it again."},
            },
        }
    }
