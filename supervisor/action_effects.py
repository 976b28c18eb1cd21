"""What a finished action changes in the sensor's picture, one entry per action type:
the backend changed the world, and the sensor would hear of it only later, if at all.
Every type is listed, those that change nothing too (tests/test_action_dispatch.py).

A dry run's action changed nothing: it moves no node and resizes no job. Only what it
would have cordoned is marked, which the API shows apart (`dry_run_cordoned`), so that
the dry run goes on deciding as the acting supervisor would."""

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


def _out_of_job(sensor: Sensor, node: str, dry_run: bool) -> Changes:
    """`node` taken out of its job; a dry run's only marked as it would be, nothing moved."""
    return sensor.set_cordoned(node, True) if dry_run else sensor.swapped_out(node)


def _swapped_out(sensor: Sensor, action: ActionRecord) -> list[Changes]:
    return [_out_of_job(sensor, action.node, action.dry_run)] if action.node else []


def _uncordoned(sensor: Sensor, action: ActionRecord) -> list[Changes]:
    return [sensor.set_cordoned(action.node, False)] if action.node else []


def _scaled(sensor: Sensor, action: ActionRecord) -> list[Changes]:
    batch: list[Changes] = []
    if not action.job:
        return batch
    with contextlib.suppress(InvalidParams):  # a dry run "succeeds" any params
        scale = check_params(action.type, action.params)
        assert isinstance(scale, ScaleDownParams | ScaleUpParams)
        if not action.dry_run:
            job = sensor.set_replicas(action.job, scale.to_replicas)
            batch.append(Changes(jobs=[job] if job is not None else []))
        if isinstance(scale, ScaleDownParams) and scale.exclude_node:
            batch.append(_out_of_job(sensor, scale.exclude_node, action.dry_run))
    return batch


EFFECTS: Mapping[ActionType, Effect] = {
    ActionType.EMERGENCY_CHECKPOINT: _nothing,
    ActionType.RESTART_IN_PLACE: _nothing,
    ActionType.RESTART_WORKLOAD: _nothing,
    ActionType.HOT_SWAP: _swapped_out,  # the old node is out of service and of the job
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
