"""The fault kinds' one table (`resiliency_protocol.faults.FAULTS`): every kind has a row,
every place that acts faults out has a handler for each kind it takes, and every list of
kinds the API, the CLI and the host monitor show is the table's view. Starts nothing."""

from __future__ import annotations

import random
import re
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from host_monitor.fault_actor import FaultActor
from resiliency_protocol import faults
from resiliency_protocol.fault_params import params_model
from resiliency_protocol.faults import FAULTS, FaultKind, SimulatedFault
from resiliency_protocol.node_commands import FaultOutcome, ProcessFault
from supervisor import dashboard
from supervisor.api import drill_schemas
from supervisor.api.schemas import faults as api_faults
from supervisor.config import Settings
from supervisor.fault_injection import DRILL_PARAMS, RANDOM_KINDS, FaultInjector
from supervisor.local.backend import LocalBackend
from supervisor.ops import drills as cli_drills
from supervisor.sensor import Sensor
from supervisor.simulate.fault_acts import SIMULATED_ACTS

ALL = tuple(kind.value for kind in FaultKind)
PROCESS = {kind for kind, spec in FAULTS.items() if spec.on_processes}
SENSOR = {kind for kind, spec in FAULTS.items() if spec.through_sensor}
DRILLABLE = tuple(kind.value for kind, spec in FAULTS.items() if spec.drillable)
#: A valid value of each required parameter (a new one: add it here).
REQUIRED_SAMPLES = {"code": 79, "count": 1}


def required(kind: FaultKind) -> set[str]:
    model = params_model(kind)
    fields = model.model_fields if model is not None else {}
    return {name for name, field in fields.items() if field.is_required()}


def test_every_kind_has_a_row_and_is_acted_out_somewhere() -> None:
    assert list(FAULTS) == list(FaultKind)
    unacted = [kind for kind, spec in FAULTS.items() if not spec.on_processes | spec.through_sensor]
    assert not unacted, f"kinds nothing can act out: {unacted}"
    assert [kind for kind, spec in FAULTS.items() if spec.agent_exits] == [FaultKind.NODE_DOWN]


def test_every_row_has_a_handler_wherever_faults_are_acted_out() -> None:
    """The host monitor acts out the process kinds, the fault injector the sensor kinds,
    a drill draws the required parameters of its kinds, the simulator acts out each of
    its own kinds; the local backend takes every process kind."""
    assert set(FaultActor.acts) == PROCESS
    assert set(FaultInjector.sensor_acts) == SENSOR
    assert LocalBackend.process_faults == PROCESS
    assert set(DRILL_PARAMS) == {FaultKind(k) for k in DRILLABLE if required(FaultKind(k))}
    assert set(SIMULATED_ACTS) == set(SimulatedFault)
    handlers: list[Callable[..., Any]] = [
        *FaultActor.acts.values(),
        *FaultInjector.sensor_acts.values(),
        *DRILL_PARAMS.values(),
        *SIMULATED_ACTS.values(),
    ]
    assert all(callable(handler) for handler in handlers)


def test_the_lists_of_kinds_are_the_tables_view() -> None:
    assert typing.get_args(api_faults.FaultKind) == ALL
    assert typing.get_args(drill_schemas.DrillKind) == DRILLABLE
    assert cli_drills.DRILL_KINDS == DRILLABLE
    assert set(typing.get_args(faults.ProcessFaultKind)) == PROCESS
    assert set(RANDOM_KINDS) <= set(faults.DRILL_KINDS)
    names = re.match(r"\^\(([^)]*)\),", drill_schemas.SCHEDULE_PATTERN)
    assert names is not None and names[1].split("|") == ["random", *DRILLABLE]
    for kind in ALL:
        matched = re.match(drill_schemas.SCHEDULE_PATTERN, f"{kind},120") is not None
        assert matched == (kind in DRILLABLE), kind
    # ... and what the OpenAPI documents of each body
    fault_in = api_faults.FaultIn.model_json_schema()
    assert fault_in["properties"]["kind"]["anyOf"][0]["enum"] == list(ALL)
    drill = drill_schemas.DrillIn.model_json_schema()
    assert drill["properties"]["kinds"]["items"]["enum"] == list(DRILLABLE)
    for model in (ProcessFault, FaultOutcome):
        kind = model.model_json_schema()["properties"]["kind"]
        assert set(kind["enum"]) == {k.value for k in PROCESS}, model


def test_each_kinds_parameters_are_fields_of_the_bodies_that_carry_them() -> None:
    for kind, spec in FAULTS.items():
        fields = set(m.model_fields) if (m := params_model(kind)) is not None else set()
        assert fields <= set(api_faults.FaultIn.model_fields), kind
        if spec.on_processes:
            assert fields <= set(ProcessFault.model_fields), kind
        assert required(kind) <= set(REQUIRED_SAMPLES), kind


@pytest.mark.parametrize("kind", list(FaultKind))
def test_the_api_checks_a_kinds_parameters_by_its_row(kind: FaultKind) -> None:
    body: dict[str, Any] = {"kind": kind.value, "node": "n1"}
    for name in sorted(required(kind)):
        with pytest.raises(ValidationError, match=f"{name} is required for an? {kind} fault"):
            api_faults.FaultIn.model_validate(body)
        body[name] = REQUIRED_SAMPLES[name]
    api_faults.FaultIn.model_validate(body)
    model = params_model(kind)
    for name, value in (("slowdown", 0.5), ("duration_s", 5.0)):
        if model is not None and name in model.model_fields:
            api_faults.FaultIn.model_validate({**body, name: value})
        else:
            with pytest.raises(ValidationError, match=f"{name} applies to .* only"):
                api_faults.FaultIn.model_validate({**body, name: value})


async def test_a_drills_parameters_are_valid_for_its_kind(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    sensor = Sensor(settings.sensing, settings.workload, lambda changes: None)
    try:
        for kind, draw in DRILL_PARAMS.items():
            model = params_model(kind)
            assert model is not None, kind
            model.model_validate(draw(sensor, "n1", random.Random()))
    finally:
        sensor.close()


def test_the_dashboards_fault_form_has_a_field_for_each_parameter_and_no_other() -> None:
    """The form shows a kind's fields by `/api/v1/info`'s `fault_params` (the table's
    models): an input named otherwise would never show, a parameter without one never
    be given from the page."""
    page = (Path(dashboard.__file__).parent / "static" / "index.html").read_text()
    start = page.index('<form id="fault-form"')
    form = page[start : page.index("</form>", start)]
    inputs = set(
        re.findall(
            r'<div class="field" data-param>\s*<label[^>]*>[^<]*</label>\s*'
            r'<input [^>]*name="([a-z_]+)"',
            form,
        )
    )
    params = {
        name for kind in FaultKind if (model := params_model(kind)) for name in model.model_fields
    }
    assert inputs == params
