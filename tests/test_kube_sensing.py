"""The default policy's answers to what Kubernetes-side sensing reports: a pod stuck
terminating is force-deleted; a JobSet down is restarted, or scaled down when pods lack
nodes and scaling is on. The sensing itself, and the whole loop through the supervisor's
HTTP API, run on the real control plane (tests/test_kube_sensing_real.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from policies.default import DefaultPolicy
from supervisor.domain import ActionType, Event, EventType, JobView
from supervisor.policy import PolicyContext, PolicyLimits


def context(*, scaling: bool, replicas: int = 3) -> PolicyContext:
    return PolicyContext(
        now=datetime.now(UTC),
        limits=PolicyLimits(
            max_in_job_restarts=3,
            max_workload_restarts=0,
            enable_workload_scaling=scaling,
            restart_window_s=3600,
            max_restarts_in_window=10,
        ),
        jobs={"train": JobView("train", replicas, 1, 3, 1)},
    )


def test_default_policy_force_deletes_a_stuck_pod() -> None:
    event = Event(
        EventType.POD_STUCK_TERMINATING,
        datetime.now(UTC),
        node="gpu-0",
        job="train",
        details={"pod": "p-1", "namespace": "default", "uid": "u-1", "terminating_for_s": 61},
    )
    [a] = DefaultPolicy().event_policy(event, context(scaling=False))
    assert a.type is ActionType.FORCE_DELETE_POD and a.job == "train" and a.node == "gpu-0"
    assert a.params == {"pod": "p-1", "namespace": "default", "uid": "u-1"}


def test_default_policy_on_workload_down_restarts_or_scales_down() -> None:
    down = Event(EventType.WORKLOAD_DOWN, datetime.now(UTC), job="train", details={})
    starved = Event(
        EventType.WORKLOAD_DOWN, datetime.now(UTC), job="train", details={"unschedulable_pods": 2}
    )
    policy = DefaultPolicy()
    types = [a.type for a in policy.event_policy(down, context(scaling=True))]
    assert types == [ActionType.EMERGENCY_CHECKPOINT, ActionType.RESTART_WORKLOAD]
    types = [a.type for a in policy.event_policy(starved, context(scaling=False))]
    assert types == [ActionType.EMERGENCY_CHECKPOINT, ActionType.RESTART_WORKLOAD]
    actions = policy.event_policy(starved, context(scaling=True))
    assert [a.type for a in actions] == [ActionType.EMERGENCY_CHECKPOINT, ActionType.SCALE_DOWN]
    assert actions[1].params == {"to_replicas": 2}
    at_minimum = policy.event_policy(starved, context(scaling=True, replicas=1))
    assert at_minimum[-1].type is ActionType.RESTART_WORKLOAD
