"""The OpenAPI document: FastAPI's, plus what FastAPI cannot see.

The heartbeat routes are served ahead of the router (they are the hot path), so they and
their msgspec types are added here (heartbeat_openapi.py). So are the error answers that
come from dependencies and from the app itself rather than from a route's signature: 400
and 413 where there is a body, 401 where a token is checked, 403 where fault injection
may be off or a report may name another node than the agent's, 404 where a path, a
filter or a body names a record, 503 while the replica is not ready. All of them, and
422, have the body `ErrorOut`. And the fields of an event's `details` and an action's
`params` per type.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from resiliency_protocol.errors import ErrorOut
from supervisor.action_params import ACTION_PARAMS
from supervisor.api.heartbeat_openapi import heartbeat_paths
from supervisor.api.routes.heartbeats import MAX_BODY
from supervisor.event_details import EVENT_DETAILS

#: Bodies the API takes, at most: the heartbeat's limit, for every route.
MAX_BODY_BYTES = MAX_BODY

#: Operations whose body, or whose `node` or `job` filter, names a node or job the
#: supervisor may not know (routes.common.check_known).
_NAMES_A_RECORD = {
    ("post", "/api/v1/actions"),
    ("post", "/api/v1/faults"),
    ("get", "/api/v1/events"),
    ("get", "/api/v1/actions"),
    ("get", "/api/v1/checkpoints"),
    ("get", "/api/v1/notifications"),
}
_ERROR_OUT = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}}
#: Stored ids and steps are SQL BIGINTs; no documented integer bound lies beyond them.
_INT64 = (-(2**63), 2**63 - 1)


def build(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorOut"] = ErrorOut.model_json_schema(ref_template="#/components/schemas/{model}")
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            _document_errors(path, method, operation)
    schema["paths"] = {**heartbeat_paths(components), **schema["paths"]}
    _fields_by_type(components)
    _exact_integer_bounds(schema)
    app.openapi_schema = schema
    return schema


def _fields_by_type(components: dict[str, Any]) -> None:
    """An event's `details` and an action's `params` are objects whose fields depend on
    its `type`: each models' schema becomes a component, and the property names them per
    type under `x-fields-by-type` (the schema keeps accepting any object: events stored
    by older versions, and params an operator adds, are served as they are)."""

    def ref(model: type[BaseModel]) -> dict[str, str]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    by_event = {t.value: ref(m) for t, m in EVENT_DETAILS.items()}
    by_action = {t.value: ref(m) for t, m in ACTION_PARAMS.items()}
    for name, prop, by_type in (
        ("EventOut", "details", by_event),
        ("ActionOut", "params", by_action),
        ("ActionIn", "params", by_action),
    ):
        components[name]["properties"][prop]["x-fields-by-type"] = by_type


def _document_errors(path: str, method: str, operation: dict[str, Any]) -> None:
    responses: dict[str, Any] = operation.setdefault("responses", {})

    def add(code: int, description: str) -> None:
        responses.setdefault(str(code), {"description": description, "content": _ERROR_OUT})

    if "422" in responses:
        # Our handlers answer every 422 as ErrorOut: validation errors with `detail` as
        # FastAPI's list, the routes' own checks (a bad cursor, since >= until) a string.
        responses["422"]["content"] = _ERROR_OUT

    if operation.get("security"):
        add(401, "Missing or wrong bearer token.")
    if path.startswith("/api/v1/faults"):
        add(403, "Fault injection is off (`enable_fault_injection`).")
    if (method, path) == ("post", "/api/v1/checkpoints"):
        add(403, "A report names another node than the credential's; nothing was recorded.")
    if "{" in path or (method, path) in _NAMES_A_RECORD:
        add(404, "No such record, node or job; `message` names it.")
    if "requestBody" in operation:
        add(400, "The body could not be read (not UTF-8 text); nothing was recorded.")
        add(413, f"Body larger than {MAX_BODY_BYTES} bytes; nothing was recorded.")
    if path.startswith("/api/"):
        add(503, "Not ready: a standby replica (names the leader), starting or stopping.")


def _exact_integer_bounds(node: Any) -> None:
    """FastAPI's OpenAPI model holds bounds as floats: 2**63 - 1 comes out as 2**63, and
    a client (or a fuzzer) that trusts it sends a value that gets a 422. Integer bounds
    are made integers again, those past SQL's BIGINT back to its limits."""
    if isinstance(node, list):
        for item in node:
            _exact_integer_bounds(item)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "integer":
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = node.get(key)
            if isinstance(value, float) and value.is_integer():
                node[key] = min(max(int(value), _INT64[0]), _INT64[1])
    for value in node.values():
        _exact_integer_bounds(value)
