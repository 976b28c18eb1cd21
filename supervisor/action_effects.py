"""What a finished action changes in the sensor's picture, one entry per action type:
the backend changed the world, and the sensor would hear of it only later, if at all.
Every type is listed, those that change nothing too (tests/test_action_dispatch.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

from supervisor.action_params import InvalidParams, ScaleDownParams, ScaleUpParams, check_params
from supervisor.domain import DISRUPTIVE_ACTIONS, ActionRecord, ActionType
from supervisor.sensor import Changes, Sensor

#: The sensor's changes that one action makes (its records, events of spares).
Effect = Callable[[Sensor, ActionRecord], list[Changes]]


def _nothing(sensor: Sensor, action: ActionRecord) -> list[Changes]:
    return []


def _cordoned(sensor: Sensor, action: ActionRecord) -> list[Changes]:
    return [sensor.set_cordoned(action.node, True)] if action.node else []


def _uncordoned(sensor: Sensor, action: ActionRecord) -> list[Changes]:
    return [sensor.set_cordoned(action.node, False)] if action.node else []


def _scaled(sensor: Sensor, action: ActionRecord) -> list[Changes]:
    batch: list[Changes] = []
    if not action.job:
        return batch
    with contextlib.suppress(InvalidParams):  # a dry run "succeeds" any params
        scale = check_params(action.type, action.params)
        assert isinstance(scale, ScaleDownParams | ScaleUpParams)
        job = sensor.set_replicas(action.job, scale.to_replicas)
        batch.append(Changes(jobs=[job] if job is not None else []))
        if isinstance(scale, ScaleDownParams) and scale.exclude_node:
            batch.append(sensor.set_cordoned(scale.exclude_node, True))
    return batch


EFFECTS: Mapping[ActionType, Effect] = {
    ActionType.EMERGENCY_CHECKPOINT: _nothing,
    ActionType.RESTART_IN_PLACE: _nothing,
    ActionType.RESTART_WORKLOAD: _nothing,
    ActionType.HOT_SWAP: _cordoned,  # the old node is out of service
    ActionType.SCALE_DOWN: _scaled,
    ActionType.SCALE_UP: _scaled,
    ActionType.CORDON: _cordoned,
    ActionType.UNCORDON: _uncordoned,
    ActionType.FORCE_DELETE_POD: _nothing,
}


def apply_effects(sensor: Sensor, action: ActionRecord) -> Changes:
    """Tell the sensor what `action` changed; the changes to record."""
    if action.type in DISRUPTIVE_ACTIONS and action.job:
        sensor.job_restarted(action.job)
    return Changes.merged(EFFECTS[action.type](sensor, action))
