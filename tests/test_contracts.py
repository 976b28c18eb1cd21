"""The typed contracts of events and actions: the details model of each event type, the
params model of each action type, the tables of docs/http-api.md that list them, the
OpenAPI document that names them, and the API refusing params that do not fit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from supervisor.action_params import (
    ACTION_PARAMS,
    InvalidParams,
    ScaleDownParams,
    check_params,
    params_of,
)
from supervisor.api.app import create_app
from supervisor.config import Settings
from supervisor.domain import ActionRequest, ActionType, Event, EventType, utcnow
from supervisor.event_details import (
    EVENT_DETAILS,
    GpuXidDetails,
    WorkerExitedDetails,
    details_of,
)
from supervisor.policy import actions

DOC = Path(__file__).resolve().parent.parent / "docs" / "http-api.md"


def _table(section: str) -> list[list[str]]:
    text = DOC.read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def _names(cell: str) -> list[str]:
    return re.findall(r"`([a-z_]+)`", cell)


def test_the_event_table_lists_each_types_details_fields() -> None:
    seen: set[EventType] = set()
    for row in _table("Events"):
        types = [EventType(name) for name in _names(row[0])]
        fields = _names(row[-1])
        for type_ in types:
            model = EVENT_DETAILS[type_]
            assert sorted(fields) == sorted(model.model_fields), f"{type_.value}: {fields}"
        seen.update(types)
    assert seen == set(EventType)


def test_the_action_table_lists_each_types_params() -> None:
    seen: set[ActionType] = set()
    for row in _table("Actions"):
        (name,) = _names(row[0])
        type_ = ActionType(name)
        model = ACTION_PARAMS[type_]
        cell = row[-1]
        assert sorted(_names(cell)) == sorted(model.model_fields), f"{name}: {cell}"
        required = [f for f, info in model.model_fields.items() if info.is_required()]
        assert re.findall(r"`([a-z_]+)` \(required\)", cell) == required, name
        assert (cell == "none") == (not model.model_fields), name
        seen.add(type_)
    assert seen == set(ActionType)


def test_every_event_and_action_type_has_a_model() -> None:
    assert set(EVENT_DETAILS) == set(EventType)
    assert set(ACTION_PARAMS) == set(ActionType)
    for type_, details in EVENT_DETAILS.items():
        assert type_ in details.event_types
    for action_type, params in ACTION_PARAMS.items():
        assert params.action_type is action_type


def test_details_are_built_from_their_model_and_read_back_typed() -> None:
    details = WorkerExitedDetails(exit_code=3, pid=12, step=None)
    assert details.mapping() == {"exit_code": 3, "pid": 12}
    with pytest.raises(ValueError, match="exitcode"):
        WorkerExitedDetails(exitcode=3)  # type: ignore[call-arg]
    event = Event(EventType.WORKER_EXITED, utcnow(), node="n1", details=details.mapping())
    assert WorkerExitedDetails.of(event).exit_code == 3
    assert details_of(event) == details
    with pytest.raises(TypeError, match="worker_exited"):
        GpuXidDetails.of(event)
    # What is stored is read tolerantly: a field this version does not know, or a value of
    # the wrong type, is left out rather than failing the reader.
    stored = Event(EventType.GPU_XID, utcnow(), details={"code": "x", "gpu": 1, "later": 2})
    assert GpuXidDetails.of(stored) == GpuXidDetails(gpu=1)


def test_policy_constructors_build_params_from_their_models() -> None:
    request = actions.scale_down("j", to_replicas=2, exclude_node="n3")
    assert request.params == {"to_replicas": 2, "exclude_node": "n3"}
    assert params_of(request, ScaleDownParams) == ScaleDownParams(to_replicas=2, exclude_node="n3")
    assert actions.hot_swap("j", "n1").params == {}
    assert actions.emergency_checkpoint("j", exclude_nodes=("b", "a")).params == {
        "exclude_nodes": ["a", "b"]
    }
    with pytest.raises(TypeError):
        params_of(ActionRequest(ActionType.SCALE_UP, params={"to_replicas": 2}), ScaleDownParams)


@pytest.mark.parametrize(
    ("type_", "params", "field"),
    [
        (ActionType.SCALE_UP, {"to_replicas": "3"}, "params.to_replicas"),
        (ActionType.SCALE_UP, {"to_replicas": True}, "params.to_replicas"),
        (ActionType.SCALE_DOWN, {}, "params.to_replicas"),
        (ActionType.SCALE_DOWN, {"to_replicas": -1}, "params.to_replicas"),
        (ActionType.SCALE_UP, {"to_replicas": 2**63}, "params.to_replicas"),
        (ActionType.HOT_SWAP, {"spare": 3}, "params.spare"),
        (ActionType.RESTART_IN_PLACE, {"in_process": "yes"}, "params.in_process"),
        (ActionType.EMERGENCY_CHECKPOINT, {"exclude_nodes": "n1"}, "params.exclude_nodes"),
        (ActionType.FORCE_DELETE_POD, {"pod": ""}, "params.pod"),
    ],
)
def test_params_that_do_not_fit_are_refused_naming_the_field(
    type_: ActionType, params: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidParams, match=re.escape(field)):
        check_params(type_, params)


def test_the_openapi_document_names_the_fields_per_type() -> None:
    schema = create_app(Settings(database_url="sqlite://")).openapi()
    components = schema["components"]["schemas"]
    details = components["EventOut"]["properties"]["details"]["x-fields-by-type"]
    assert set(details) == {t.value for t in EventType}
    ref = details["worker_exited"]["$ref"].rsplit("/", 1)[1]
    assert set(components[ref]["properties"]) == set(WorkerExitedDetails.model_fields)
    for model in ("ActionIn", "ActionOut"):
        by_type = components[model]["properties"]["params"]["x-fields-by-type"]
        assert set(by_type) == {t.value for t in ActionType}
    scale = components["ScaleDownParams"]
    assert scale["required"] == ["to_replicas"]
    assert scale["properties"]["exclude_node"]["description"]
