"""Property-based run of the HTTP API against its own OpenAPI document (Schemathesis).

Every operation but the stream gets requests generated from its schema, valid and
invalid, with the token it needs, against the real app (uvicorn in a thread, the dry-run
backend, fault injection on) holding a few nodes, a job, a fault and its actions, so
that path parameters and bodies name existing records some of the time. Every response
goes through all of Schemathesis' checks: no 5xx, status code, content type, headers
and body as documented, invalid input refused, valid input accepted. The run is
derandomized and bounded, so it finds the same things every time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.core.result import Ok

from resiliency_protocol.heartbeat_batch import BATCH_PATH
from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN, SettingsFactory
from tests.test_api import heartbeat
from tests.test_stream import running

#: Operations that take the agent token; every other one takes the operator's.
AGENT_OPERATIONS = {
    ("POST", "/api/v1/heartbeats"),
    ("POST", "/api/v1/heartbeats/batch"),
    ("POST", "/api/v1/checkpoints"),
    ("POST", "/api/v1/local/hosts"),
    ("GET", "/api/v1/nodes/{node}/probe-targets"),
}
#: Server-sent events: the response never ends, so no check can read it whole
#: (tests/test_stream.py covers it).
NOT_FUZZED = {("GET", "/api/v1/stream")}
#: Operations with rules that span fields, which JSON Schema does not state: a request
#: valid by its schema may break one and gets a 422 naming it, which the check of valid
#: input accepted must take. Every other operation must accept every valid request.
CROSS_FIELD_RULES = {
    # A running node names its job, a spare none and no workers; no rank twice.
    ("POST", "/api/v1/heartbeats"),
    # The node or job each type needs, its params; no NUL character in params.
    ("POST", "/api/v1/actions"),
    # Exactly one of kind and schedule, and the fields each kind takes.
    ("POST", "/api/v1/faults"),
    # A maintenance window's end after its start, and not past.
    ("POST", "/api/v1/maintenance"),
    # `parameters` with `hosts`; `hosts` when the job has no node.
    ("GET", "/api/v1/jobs/{job}/advice"),
}
ACCEPTED_VALID = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]


def _config(token: str) -> schemathesis.Config:
    """Schemathesis' settings with the bearer token for every operation (the security
    scheme is one for both tokens, so each token gets a schema of its own)."""
    accepted = [*ACCEPTED_VALID, "422"]
    return schemathesis.Config.from_dict(
        {
            "auth": {"openapi": {"HTTPBearer": {"bearer": token}}},
            "operations": [
                {
                    "include-method": method,
                    "include-path": path,
                    "checks": {"positive_data_acceptance": {"expected-statuses": accepted}},
                }
                for method, path in sorted(CROSS_FIELD_RULES)
            ],
        }
    )


#: Generated cases per operation and mode (valid, invalid): enough to reach every
#: documented answer, small enough to run in about a minute on slow CPUs. The same
#: (derandomized) cases on SQLite, fewer: the service's code answers the same on both,
#: and PostgreSQL, the production database, gets them all.
EXAMPLES = {"postgresql": 40, "sqlite": 15}


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _populate(url: str) -> dict[str, list[Any]]:
    """A job on two nodes, a spare, a fault and what it caused; the names and ids to use
    in path parameters and bodies."""
    agent, operator = _bearer(AGENT_TOKEN), _bearer(OPERATOR_TOKEN)
    with httpx.Client(base_url=url, timeout=10) as client:
        for body in (heartbeat("n1"), heartbeat("n2"), heartbeat("s1", job=None)):
            r = client.post("/api/v1/heartbeats", json=body, headers=agent)
            assert r.status_code in (202, 204), r.text
        fault = client.post(
            "/api/v1/faults", json={"kind": "xid", "node": "n1", "code": 79}, headers=operator
        )
        assert fault.status_code == 201, fault.text
        deadline = time.monotonic() + 20
        while not (actions := client.get("/api/v1/actions", headers=operator).json()["items"]):
            assert time.monotonic() < deadline, "the fault caused no action"
            time.sleep(0.05)
        events = client.get("/api/v1/events", headers=operator).json()["items"]
        # Cursors are the server's own: a valid request carries one it handed out.
        cursors = [
            client.get(path, params={"limit": 1}, headers=operator).json()["next_cursor"]
            for path in ("/api/v1/events", "/api/v1/actions")
        ]
    return {
        "name": ["n1", "n2", "s1", "j1"],
        "job": ["j1"],
        "node": ["n1", "n2", "s1"],
        "event_id": [e["id"] for e in events],
        "action_id": [a["id"] for a in actions],
        "fault_id": [fault.json()["id"]],
        "cursor": [c for c in cursors if c is not None],
    }


def _issued_cursor(case: Case[Any], known: dict[str, list[Any]], pick: st.DataObject) -> None:
    """A cursor the server handed out in place of a generated one, or none."""
    if case.query and "cursor" in case.query:
        if known["cursor"]:
            case.query["cursor"] = pick.draw(st.sampled_from(known["cursor"]))
        else:
            del case.query["cursor"]


def _existing(case: Case[Any], known: dict[str, list[Any]], pick: st.DataObject) -> None:
    """Path parameters and body fields of the case made to name existing records."""
    for name in list(case.path_parameters or {}):
        if known.get(name):
            assert case.path_parameters is not None
            case.path_parameters[name] = pick.draw(st.sampled_from(known[name]))
    if isinstance(case.body, dict):
        for name in ("node", "job"):
            if name in case.body and known.get(name):
                case.body[name] = pick.draw(st.sampled_from(known[name]))


@pytest.fixture
def served(database_url: str, make_settings: SettingsFactory) -> Iterator[tuple[str, int]]:
    # No deadline fires during the run: the nodes stay as the requests left them.
    settings = make_settings(
        database_url=database_url, heartbeat_polling_period_s=5, heartbeat_timeout_s=600
    )
    with running(settings) as (url, _):
        yield url, EXAMPLES[database_url.split(":", 1)[0].split("+", 1)[0]]


def _fuzz(
    operation: APIOperation[Any, Any, Any, Any],
    mode: GenerationMode,
    known: dict[str, list[Any]],
    session: requests.Session,
    seen: set[int],
    examples: int,
) -> None:
    """Requests of one mode for one operation, each response through every check."""
    valid = mode is GenerationMode.POSITIVE

    @given(
        case=operation.as_strategy(mode),
        # Known names and ids would make an invalid request valid: valid ones only.
        existing=st.booleans() if valid else st.just(False),
        pick=st.data(),
    )
    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    def fuzz(case: Case[Any], existing: bool, pick: st.DataObject) -> None:
        if valid:
            _issued_cursor(case, known, pick)
        if existing:
            _existing(case, known, pick)
        response = case.call_and_validate(session=session)
        seen.add(response.status_code)

    fuzz()


def test_every_operation_answers_as_documented(served: tuple[str, int]) -> None:
    base, examples = served
    known = _populate(base)
    url = f"{base}/openapi.json"
    schema = schemathesis.openapi.from_url(url, config=_config(OPERATOR_TOKEN))
    agent_schema = schemathesis.openapi.from_url(url, config=_config(AGENT_TOKEN))
    session = requests.Session()
    failures: list[str] = []
    statuses: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        operation = result.ok()
        key = (operation.method.upper(), operation.path)
        if key in NOT_FUZZED:
            continue
        if key in AGENT_OPERATIONS:
            operation = agent_schema[operation.path][operation.method]
        seen = statuses.setdefault(f"{key[0]} {key[1]}", set())
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _fuzz(operation, mode, known, session, seen, examples)
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # it takes no input to make invalid
            except (Exception, schemathesis.errors.FailureGroup) as exc:
                failures.append(f"{key[0]} {key[1]} ({mode.value}):\n{exc}")
    assert not failures, "\n\n".join(failures)
    # A wrong token would pass every check with 401s: each operation must get past it.
    refused = sorted(op for op, codes in statuses.items() if codes <= {401})
    assert not refused, f"only 401 for {refused}"


def _request_body(schema: dict[str, Any], path: str) -> tuple[dict[str, Any], Any]:
    """The JSON request body's schema of POST `path`, resolved, and its example, which the
    schema must take."""
    media = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    name = media["schema"]["$ref"].rsplit("/", 1)[1]
    body = schema["components"]["schemas"][name]
    # Against the whole document, where its `$ref`s point.
    jsonschema.validate(media["example"], {**schema, **media["schema"]})
    return body, media["example"]


def test_both_heartbeat_routes_are_documented_and_take_their_examples(
    sqlite_url: str, make_settings: SettingsFactory
) -> None:
    """The heartbeat routes bypass FastAPI: /openapi.json states them all the same, their
    bodies as the protocol's types, with examples that the routes take."""
    with running(make_settings(database_url=sqlite_url)) as (url, _):
        schema = httpx.get(f"{url}/openapi.json", timeout=10).json()
        single, beat = _request_body(schema, "/api/v1/heartbeats")
        batch, carried = _request_body(schema, BATCH_PATH)
        assert {"node", "state"} <= set(single["required"])
        assert batch["required"] == ["heartbeats"]
        entry = schema["components"]["schemas"]["RelayedHeartbeat"]
        assert set(entry["required"]) == {"credential", "heartbeat"}
        assert entry["properties"]["credential"]["maxLength"] == 8192
        answers = {
            path: schema["paths"][path]["post"]["responses"]
            for path in ("/api/v1/heartbeats", BATCH_PATH)
        }
        assert set(answers["/api/v1/heartbeats"]) >= {"202", "204", "401", "413", "415", "422"}
        assert set(answers[BATCH_PATH]) >= {"200", "401", "413", "415", "422", "503"}
        results = answers[BATCH_PATH]["200"]["content"]["application/json"]["schema"]
        assert results == {"$ref": "#/components/schemas/BatchAnswer"}
        result = schema["components"]["schemas"]["HeartbeatResult"]
        assert result["required"] == ["status"] and "body" in result["properties"]

        # The batch's example, its entry with a real credential: the node registers.
        agent = _bearer(AGENT_TOKEN)
        (example,) = carried["heartbeats"]
        relayed = {"heartbeats": [{**example, "credential": AGENT_TOKEN}]}
        r = httpx.post(f"{url}{BATCH_PATH}", json=relayed, headers=agent, timeout=10)
        assert r.status_code == 200, r.text
        (answer,) = r.json()["results"]
        assert answer["status"] == 202 and set(answer["body"]) == {"events"}, answer
        # The single route's example, the same node's heartbeat: taken, nothing new.
        r = httpx.post(f"{url}/api/v1/heartbeats", json=beat, headers=agent, timeout=10)
        assert r.status_code == 204, r.text
        node = httpx.get(
            f"{url}/api/v1/nodes/{beat['node']}", headers=_bearer(OPERATOR_TOKEN), timeout=10
        )
        assert node.status_code == 200 and node.json()["state"] == beat["state"], node.text
