"""/openapi.json's description of the two heartbeat routes: `POST /api/v1/heartbeats` and
a relay's `POST /api/v1/heartbeats/batch`.

Both are served ahead of FastAPI's router (app.SupervisorApp: at thousands of requests a
second the framework costs more than the heartbeat), so FastAPI does not see them. Their
bodies' schemas are those of the protocol's msgspec types, as msgspec states them
(HostHeartbeat; HeartbeatBatch and its answer, BatchAnswer), and the examples are built
of those types; the answers and their status codes are the routes' own.
"""

from __future__ import annotations

from typing import Any

import msgspec

from resiliency_protocol.heartbeat import HostHeartbeat, heartbeat_json_schema
from resiliency_protocol.heartbeat_batch import (
    BATCH_PATH,
    MAX_BATCH,
    MAX_BATCH_BODY,
    BatchAnswer,
    HeartbeatBatch,
    RelayedHeartbeat,
)
from resiliency_protocol.states import NodeState
from resiliency_protocol.worlds import JOB_WORLD_HEADER
from supervisor.api.routes.heartbeats import MAX_BODY
from supervisor.api.routes.heartbeats import PATH as HEARTBEATS

#: A spare node's heartbeat, and a relay's batch carrying it: the requests' examples.
EXAMPLE_HEARTBEAT = HostHeartbeat(node="node-0", state=NodeState.SPARE)
EXAMPLE_BATCH = HeartbeatBatch(
    [
        RelayedHeartbeat(
            "<node-0's bearer token>", msgspec.Raw(msgspec.json.encode(EXAMPLE_HEARTBEAT))
        )
    ]
)

_WORLD_HEADER = {
    JOB_WORLD_HEADER: {
        "description": "The newest world the supervisor started for the heartbeat's job; "
        "absent while it knows none. Peer copies of an older world are refused from then on.",
        "schema": {"type": "integer", "minimum": 0},
    }
}
_ERROR_OUT = {"$ref": "#/components/schemas/ErrorOut"}
#: Not ready: what `GET /readyz` answers (`status`, `detail`); else ErrorOut.
_NOT_READY = {"type": "object", "required": ["detail"]}
_EVENTS = {
    "type": "object",
    "properties": {"events": {"type": "array", "items": {"type": "integer"}}},
    "required": ["events"],
}


def heartbeat_paths(components: dict[str, Any]) -> dict[str, Any]:
    """The two routes' path items; the schemas they name are added to `components`."""
    heartbeat, definitions = heartbeat_json_schema()
    components.update(definitions)
    (batch, answer), definitions = msgspec.json.schema_components(
        [HeartbeatBatch, BatchAnswer], ref_template="#/components/schemas/{name}"
    )
    components.update(definitions)
    single = _operation(
        "post_heartbeat",
        "Report a host heartbeat (its workers and GPU errors)",
        heartbeat,
        EXAMPLE_HEARTBEAT,
        {
            "204": {
                "description": "Accepted; nothing changed, so no event was raised.",
                "headers": _WORLD_HEADER,
            },
            "202": {
                "description": "Accepted; it raised events, already stored: their ids.",
                "headers": _WORLD_HEADER,
                "content": {"application/json": {"schema": _EVENTS}},
            },
            "401": _error("Missing or invalid agent credential."),
            "403": _error(
                "The credential is another node's: `message` names the field `node` and the "
                "credential's node. Nothing was recorded."
            ),
            "409": _error(
                "A worker claims a rank of its job that another alive node reports running: "
                "`message` names the rank and that node; or (`code` `stale_world`) live "
                "workers of an older world than the job's newest (`world`): the host monitor "
                "stops `ranks` and reports again. Nothing was recorded."
            ),
            "413": _error(f"Body larger than {MAX_BODY} bytes."),
            "422": _error("Invalid heartbeat; `message` names the field."),
            "503": _error(
                "Not ready: a standby replica (`detail` names the leader), or starting; or a "
                "service account token that cannot be reviewed now; or the database does not "
                "answer. Nothing was acknowledged; send it again.",
                _NOT_READY,
            ),
        },
    )
    relayed = _operation(
        "post_heartbeat_batch",
        "Report many nodes' heartbeats at once (a relay)",
        batch,
        EXAMPLE_BATCH,
        {
            "200": {
                "description": "One result per entry, in order: the status, world and body "
                "the single route would have answered that heartbeat with (a refused entry "
                "is refused alone, the others taken).",
                "content": {"application/json": {"schema": answer}},
            },
            "401": _error(
                "Missing or invalid relay credential (the request's own; each entry's is "
                "checked in its result)."
            ),
            "413": _error(f"Body larger than {MAX_BATCH_BODY} bytes."),
            "422": _error(
                f"Not a batch (at most {MAX_BATCH} entries); `message` names the field. "
                "Nothing was recorded."
            ),
            "503": _error(
                "Not ready, or a service account token that cannot be reviewed now; send it again.",
                _NOT_READY,
            ),
        },
    )
    return {HEARTBEATS: single, BATCH_PATH: relayed}


def _operation(
    operation_id: str, summary: str, body: dict[str, Any], example: Any, answers: dict[str, Any]
) -> dict[str, Any]:
    """A POST with the agent's bearer token and the JSON `body`; `answers` and a 415."""
    return {
        "post": {
            "tags": ["sensor"],
            "summary": summary,
            "operationId": operation_id,
            "security": [{"HTTPBearer": []}],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": body,
                        "example": msgspec.json.decode(msgspec.json.encode(example)),
                    }
                },
            },
            "responses": {**answers, "415": _error("A Content-Type other than JSON.")},
        }
    }


def _error(description: str, schema: dict[str, Any] = _ERROR_OUT) -> dict[str, Any]:
    """A refusal, its body `ErrorOut` (`message` and `detail`) unless `schema` says else."""
    return {"description": description, "content": {"application/json": {"schema": schema}}}
