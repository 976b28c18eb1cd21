"""POST /api/v1/heartbeats/batch: many nodes' heartbeats in one request, from a relay.

A bare ASGI app like the single route (heartbeats.py), and the same work per heartbeat:
each entry (resiliency_protocol/heartbeat_batch.py) is the node's own heartbeat with the
node's own credential, authenticated as the single route authenticates it (a cached
dict lookup once verified), and taken by the single route's `take` and `settle`. The
request's own credential is the relay's: any agent credential the supervisor accepts, or
a token of the relays' own service account (agent_kube_relay_service_account); either
only carries the heartbeats here, and speaks for no node. An entry refused (a credential
that is not its node's, an invalid heartbeat, a rank claimed elsewhere) is refused alone: its
result says what the single route would have answered, and the others are taken. The
answer is 200 with one result per entry, in order; the whole batch is refused only when
it is not one (401 for the relay's credential, 413, 415, 422 naming the field).
"""

from __future__ import annotations

import functools

import msgspec
from starlette.types import Receive, Scope, Send

from resiliency_protocol.bare_asgi import (
    bearer_and_type,
    body_within,
    refuse_credential,
    send_json,
)
from resiliency_protocol.heartbeat import HeartbeatError, HostHeartbeat
from resiliency_protocol.heartbeat_batch import (
    MAX_BATCH,
    MAX_BATCH_BODY,
    HeartbeatResult,
    encode_answer,
    parse_batch,
    refused,
)
from supervisor.api.routes.heartbeats import (
    RETRY_AFTER,
    HeartbeatEndpoint,
    Refusal,
    error_payload,
    invalid,
    is_json,
    reply,
)
from supervisor.identity.authenticator import ReviewUnavailable
from supervisor.metrics import HeartbeatRejection
from supervisor.sensor.sensor import UNCHANGED, Changes

_UNAUTHORIZED = refused(
    401, error_payload("missing or invalid credential for this heartbeat's node")
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
        token, content_type = bearer_and_type(scope["headers"])
        try:
            relay = None if not token else await self.agents.authenticate_carrier(token)
        except ReviewUnavailable as exc:
            await reply(send, 503, error_payload(f"cannot check the token now: {exc}"), RETRY_AFTER)
            return
        if relay is None:
            self._refused["invalid_credential"] += 1
            await refuse_credential(
                send, "missing or invalid bearer token (the relay's own credential)"
            )
            return
        if content_type is not None and not is_json(content_type):
            await reply(send, 415, error_payload("content-type: a batch is application/json"))
            return
        body = await body_within(receive, send, MAX_BATCH_BODY)
        if body is None:
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
                results.append(refused(taken.status, taken.payload))
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
            return refused(503, error_payload(f"cannot check the token now: {exc}"))
        if principal is None:
            self._refused["invalid_credential"] += 1
            self._rejected[HeartbeatRejection.UNAUTHORIZED].inc()
            return _UNAUTHORIZED
        taken = self._take(principal, body)
        if isinstance(taken, Refusal):
            return refused(taken.status, taken.payload)
        return await self._settled(*taken)

    async def _settled(self, hb: HostHeartbeat, changes: Changes) -> HeartbeatResult:
        answer = await self._settle(hb, changes)
        if answer is None:
            return _no_content(None if hb.job is None else self._newest_world(hb.job))
        return HeartbeatResult(answer.status, answer.world, msgspec.Raw(answer.body))


@functools.lru_cache(maxsize=4096)  # a job's worlds are few: made once per world
def _no_content(world: int | None) -> HeartbeatResult:
    return HeartbeatResult(204, world)
