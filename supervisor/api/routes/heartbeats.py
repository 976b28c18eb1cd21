"""POST /api/v1/heartbeats: the hot path, served ahead of FastAPI's own machinery.

Every node calls it every few seconds, so it skips the framework: the token is checked
inline (a dict lookup once verified, supervisor/identity); the body is decoded with its
fields validated by msgspec in one pass, refused if it is another node's than the
token's (403), and applied to the sensor in memory (which checks what spans fields,
unless the heartbeat repeats what it already holds for the node, and refuses a rank
another alive node runs: 409), all within the request's first step, with no await
between them; then a fixed reply is sent. Nothing is written to the database
unless something changed; then the events are committed before the reply, which names the
job's newest world in a header (resiliency_protocol/worlds.py: no body on the common
204). It is documented in /openapi.json like every other route (supervisor/api/
heartbeat_openapi.py).
What is done with a heartbeat once its credential is known (`take`, then `settle`) is
shared with the batched route of relays (heartbeat_batch.py).
"""

from __future__ import annotations

import functools
import json
from typing import Any, NamedTuple

import msgspec
from starlette.types import Message, Receive, Scope, Send

from resiliency_protocol.bare_asgi import (
    bearer_and_type,
    body_within,
    refuse_credential,
    send_json,
)
from resiliency_protocol.errors import error_body
from resiliency_protocol.heartbeat import (
    HEARTBEAT_PATH,
    MAX_HEARTBEAT_BODY_BYTES,
    HeartbeatError,
    HostHeartbeat,
    parse_heartbeat,
)
from resiliency_protocol.worlds import job_world_header
from supervisor.agent_time import AgentTimeError, agent_time
from supervisor.api.parts import HeartbeatParts
from supervisor.identity.authenticator import AgentAuthenticator, Principal, ReviewUnavailable
from supervisor.metrics import HeartbeatRejection
from supervisor.runtime import Supervisor
from supervisor.sensor.sensor import UNCHANGED, Changes, RankClaimed
from supervisor.sensor.worlds import StaleWorldReport

PATH = HEARTBEAT_PATH
MAX_BODY = MAX_HEARTBEAT_BODY_BYTES

RETRY_AFTER = [(b"retry-after", b"1")]
_NO_CONTENT_START: Message = {"type": "http.response.start", "status": 204, "headers": ()}
_NO_CONTENT_BODY: Message = {"type": "http.response.body", "body": b""}


class HeartbeatEndpoint:
    """A bare ASGI app for POST /api/v1/heartbeats (the app routes that path here)."""

    def __init__(
        self, supervisor: Supervisor, parts: HeartbeatParts, agents: AgentAuthenticator
    ) -> None:
        """`supervisor`: for what the service does as a whole (whether it is ready,
        recording what a heartbeat changed); `parts`: what else a heartbeat uses."""
        self.supervisor = supervisor
        self.agents = agents
        self._cached = agents.cached
        self._refused = parts.refused
        # The sensor finishes the validation (check_heartbeat) unless the heartbeat repeats
        # what it already validated for the node; it changes nothing if it is invalid.
        self._ingest = parts.ingest
        self._answered = parts.answered
        # Worker reports of an older world than their job's newest are never applied.
        self._fence = parts.fence
        self._newest_world = parts.newest_world
        self._max_skew_s = parts.max_clock_skew_s
        counter = parts.rejected
        self._rejected = {reason: counter.labels(reason.value) for reason in HeartbeatRejection}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        supervisor = self.supervisor
        if scope["method"] != "POST":
            self._rejected[HeartbeatRejection.WRONG_METHOD].inc()
            await reply(send, 405, error_payload("Method Not Allowed"), [(b"allow", b"POST")])
            return
        if not supervisor.ready:  # a standby, or starting: the sender retries
            self._rejected[HeartbeatRejection.NOT_READY].inc()
            await reply(send, 503, supervisor.readiness, RETRY_AFTER)
            return
        token, content_type = bearer_and_type(scope["headers"])
        principal = None if token is None else self._cached(token)
        if principal is None and token:
            try:
                principal = await self.agents.authenticate(token)
            except ReviewUnavailable as exc:
                await reply(
                    send, 503, error_payload(f"cannot check the token now: {exc}"), RETRY_AFTER
                )
                return
        if principal is None:
            self._refused["invalid_credential"] += 1
            self._rejected[HeartbeatRejection.UNAUTHORIZED].inc()
            await refuse_credential(send, "missing or invalid bearer token")
            return
        if content_type is not None and not is_json(content_type):
            self._rejected[HeartbeatRejection.NOT_JSON].inc()
            await reply(send, 415, error_payload("content-type: a heartbeat is application/json"))
            return
        message = await receive()
        body: bytes | None = message.get("body", b"")
        if message.get("more_body", False):  # rare: heartbeats fit in one read
            body = await body_within(receive, send, MAX_BODY, message)
        if body is None:
            self._rejected[HeartbeatRejection.TOO_LARGE].inc()
            return
        taken = self.take(principal, body)
        if isinstance(taken, Refusal):
            await reply(send, taken.status, taken.payload)
            return
        hb, changes = taken
        # No coroutine in the common case (nothing changed): the sensor answers UNCHANGED.
        answer = None if changes is UNCHANGED or not changes else await self.settle(hb, changes)
        if answer is None:
            # The common case has no body: the server writes a body apart from the headers,
            # so this saves a socket write on every heartbeat. The messages are constants:
            # servers read them and never change them.
            await send(_no_content_start(None if hb.job is None else self._newest_world(hb.job)))
            await send(_NO_CONTENT_BODY)
        elif answer.status == 202:
            named = None if answer.world is None else [job_world_header(answer.world)]
            await send_json(send, 202, answer.body, named)
        else:
            await send_json(send, answer.status, answer.body, RETRY_AFTER)

    def take(self, principal: Principal, body: bytes) -> tuple[HostHeartbeat, Changes] | Refusal:
        """Decode the heartbeat in `body`, sent with `principal`'s credential, and apply it
        to the sensor: the heartbeat and the changes to record, or why it was refused
        (nothing changed then). Without an await: the single route and the batch's."""
        try:
            hb = parse_heartbeat(body)
        except HeartbeatError as exc:
            self._rejected[HeartbeatRejection.INVALID].inc()
            return invalid(exc)
        if principal.node is not None and hb.node != principal.node:
            self._refused["other_node"] += 1
            return Refusal(403, error_payload(other_node(hb.node, principal.node)))
        if hb.gpu_reports:  # rare: the times an agent sends, by the one rule
            try:
                _check_times(hb, self._max_skew_s)
            except AgentTimeError as exc:
                self._rejected[HeartbeatRejection.INVALID].inc()
                return invalid(HeartbeatError(exc.loc, exc.message))
        try:
            fenced = self._fence(hb)
        except StaleWorldReport as exc:
            return Refusal(409, {**msgspec.structs.asdict(exc.reply), "detail": str(exc)})
        kept: bytes | None = body
        if fenced is not hb:  # ended workers of an older world left out: not the body's
            hb, kept = fenced, None
        try:
            # Inline, not deferred: queuing the heartbeats of one loop turn to parse and apply
            # them together (warmer caches) cost more in futures and wake-ups than it saved,
            # 3 to 4.5 points of the ceiling in paired rounds (bench/README.md).
            changes = self._ingest(hb, kept)
        except HeartbeatError as exc:
            self._rejected[HeartbeatRejection.INVALID].inc()
            return invalid(exc)
        except RankClaimed as exc:
            self._refused["rank_claimed"] += 1
            return Refusal(409, error_payload(str(exc)))
        return hb, changes

    async def settle(self, hb: HostHeartbeat, changes: Changes) -> Answer | None:
        """Record what a taken heartbeat changed: None when nothing did (204); else the
        answer (202 naming the events, or 503 while the database does not answer)."""
        if changes is UNCHANGED or not changes:
            return None
        events = await self.supervisor.record_or_hold(changes)
        if events is None:
            # Held until the database answers: not acknowledged. A retry changes nothing
            # more (the sensor took it in); the events are recorded in order once it is back.
            return Answer(503, _error_body(_HELD), None)
        self._answered(hb.node)  # its silence counts from this answer
        if not events:
            return None
        world = None if hb.job is None else self._newest_world(hb.job)
        return Answer(202, json.dumps({"events": [e.id for e in events]}).encode(), world)


_HELD = (
    "database unavailable: this heartbeat's events are held in memory and "
    "recorded in order once it answers; send again"
)


class Refusal(NamedTuple):
    """A heartbeat refused, with nothing changed: the status and the error's body."""

    status: int
    payload: dict[str, Any]


class Answer(NamedTuple):
    """A heartbeat taken that changed something: the status, JSON body, and world."""

    status: int
    body: bytes
    world: int | None


@functools.lru_cache(maxsize=4096)  # a job's worlds are few: made once per world
def _no_content_start(world: int | None) -> Message:
    """The 204's start message naming `world` (none: the plain one)."""
    if world is None:
        return _NO_CONTENT_START
    return {"type": "http.response.start", "status": 204, "headers": (job_world_header(world),)}


def _check_times(hb: HostHeartbeat, max_skew_s: float) -> None:
    """Each GPU report's time by the rule of supervisor/agent_time.py."""
    for i, report in enumerate(hb.gpu_reports):
        if report.time is not None:
            agent_time(report.time, ("gpu_reports", i, "time"), max_skew_s=max_skew_s)


def other_node(node: str, own: str) -> str:
    """The message refusing a report for `node` sent with the credential of `own`."""
    return f"node: {node!r} is not the node of this credential ({own!r})"


def error_payload(message: str) -> dict[str, Any]:
    """The error shape of every other route: `message`, and `detail` as FastAPI's."""
    return error_body(message, message)


def invalid(exc: HeartbeatError) -> Refusal:
    """422 naming the field, in the shape of FastAPI's validation errors."""
    where = ".".join(str(p) for p in exc.loc) or "body"
    return Refusal(
        422,
        {
            "message": f"{where}: {exc.message}",
            "detail": [{"loc": ["body", *exc.loc], "msg": exc.message}],
        },
    )


def _error_body(message: str) -> bytes:
    return json.dumps(error_payload(message)).encode()


def is_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json")


async def reply(
    send: Send,
    status: int,
    payload: dict[str, Any],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await send_json(send, status, json.dumps(payload).encode(), headers)
