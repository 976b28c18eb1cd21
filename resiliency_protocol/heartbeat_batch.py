"""A batch of heartbeats, as a relay sends them, and the supervisor's answer to each.

One HTTP request per heartbeat costs more in the server's stack than the heartbeat itself
(docs/benchmarks.md); a relay beside a rack's nodes (`host-monitor relay`) takes their
heartbeats for a short interval and sends them as one request to
`POST /api/v1/heartbeats/batch`. A node speaks only for itself, whoever carries its
heartbeat: each entry is the node's own heartbeat with the node's own credential (the
bearer token its host monitor would send the single route), checked by the supervisor
as the single route checks it. The relay authenticates the request with its own
credential, which lets it carry heartbeats and speak for no node; an entry whose
credential is not its heartbeat's node's is refused alone, and the others are taken.

Each entry's heartbeat is kept as its JSON bytes (`msgspec.Raw`) and decoded on its own
by `parse_heartbeat`, the single route's decoder: a bad one is refused (422 naming its
field) without failing the rest. The answer has one result per entry, in order: the
status, world header and body the single route would have answered that heartbeat with,
so the relay hands each host monitor exactly what a direct request would have got.
Imports nothing from supervisor, host_monitor or training.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from resiliency_protocol.heartbeat import HeartbeatError, split_error

BATCH_PATH = "/api/v1/heartbeats/batch"
#: Heartbeats in one batch at most: a rack's nodes, and more.
MAX_BATCH = 256
#: A credential's length at most (a service account token is a JWT of about 1 KiB).
MAX_CREDENTIAL = 8192
#: A batch's body at most: MAX_BATCH heartbeats of 8 workers fit in a tenth of it.
MAX_BATCH_BODY = 8 << 20


class RelayedHeartbeat(msgspec.Struct, forbid_unknown_fields=True, frozen=True, gc=False):
    """One node's heartbeat and that node's own credential."""

    credential: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=MAX_CREDENTIAL,
            description="The bearer token the node's host monitor would send the single route.",
        ),
    ]
    heartbeat: Annotated[
        msgspec.Raw,
        msgspec.Meta(
            description="A `HostHeartbeat`, the single route's body: decoded on its own, so "
            "one that is not valid is refused alone (its result 422 naming the field).",
        ),
    ]


class HeartbeatBatch(msgspec.Struct, forbid_unknown_fields=True, frozen=True, gc=False):
    """A relay's request: the heartbeats it carries, each with its node's credential."""

    heartbeats: Annotated[list[RelayedHeartbeat], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]


class HeartbeatResult(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """What the single route would have answered the entry: `status`, the job's newest
    world (its `x-job-world` header; none: absent), and its JSON body (absent: none, as
    a 204's)."""

    status: int
    world: int | None = None
    # UNSET, not an empty Raw: a schema (/openapi.json) cannot state a Raw default.
    body: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class BatchAnswer(msgspec.Struct, frozen=True, gc=False):
    """The results, one per entry of the batch, in its order."""

    results: list[HeartbeatResult]


_decoder = msgspec.json.Decoder(HeartbeatBatch)
_answer_decoder = msgspec.json.Decoder(BatchAnswer)
_encoder = msgspec.json.Encoder()


def parse_batch(body: bytes) -> HeartbeatBatch:
    """The batch in `body`; raises HeartbeatError naming the field. The entries'
    heartbeats are left as bytes: `parse_heartbeat` decodes each on its own."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise HeartbeatError(*split_error(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise HeartbeatError((), f"invalid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise HeartbeatError((), f"invalid UTF-8: {exc.reason} at byte {exc.start}") from None


def encode_batch(entries: list[tuple[str, bytes]]) -> bytes:
    """The body of a batch of (credential, heartbeat JSON) entries."""
    return _encoder.encode(
        HeartbeatBatch([RelayedHeartbeat(c, msgspec.Raw(hb)) for c, hb in entries])
    )


def refused(status: int, error: dict[str, Any]) -> HeartbeatResult:
    """The result of an entry refused with `status` and the JSON body `error`."""
    return HeartbeatResult(status, body=msgspec.Raw(_encoder.encode(error)))


def encode_answer(results: list[HeartbeatResult]) -> bytes:
    return _encoder.encode(BatchAnswer(results))


def parse_answer(body: bytes) -> BatchAnswer:
    """The supervisor's answer to a batch; raises ValueError if it is not one."""
    try:
        return _answer_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"not a batch's answer: {exc}") from None
