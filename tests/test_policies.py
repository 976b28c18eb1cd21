"""Unit tests of the shipped policies: plain values in, exact action lists out."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from policies.default import DefaultPolicy
from policies.examples.hot_swap_on_xid import HotSwapOnXid
from policies.examples.never_scale_below import NeverScaleBelow
from policies.examples.periodic_checkpoints_only import PeriodicCheckpointsOnly
from supervisor.domain import (
    DISRUPTIVE_ACTIONS,
    ActionRequest,
    ActionType,
    Event,
    EventType,
    JobView,
    NodeState,
    NodeView,
    WorkerState,
    WorkerView,
)
from supervisor.policy import Policy, PolicyContext, PolicyLimits

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
A = ActionType
E = EventType

# --- builders ---------------------------------------------------------------------------


def node(
    name: str,
    job: str | None = "j",
    *,
    state: NodeState | None = None,
    alive: bool = True,
    cordoned: bool = False,
    flapping: bool = False,
) -> NodeView:
    if state is None:
        state = NodeState.RUNNING if job else NodeState.SPARE
    return NodeView(
        name=name,
        state=state,
        job=job,
        alive=alive,
        last_heartbeat=NOW,
        cordoned=cordoned,
        flapping=flapping,
    )


def spare(name: str, **kw: Any) -> NodeView:
    return node(name, None, **kw)


def job(
    name: str = "j",
    replicas: int = 4,
    *,
    min_replicas: int = 2,
    max_replicas: int = 8,
    per_dp: int = 1,
    placed: int | None = None,
) -> JobView:
    """A job whose pods run on `placed` nodes (default: all it needs)."""
    placed = replicas * per_dp if placed is None else placed
    return JobView(
        name=name,
        num_dp_replicas=replicas,
        min_num_dp_replicas=min_replicas,
        max_num_dp_replicas=max_replicas,
        num_nodes_per_dp=per_dp,
        nodes=tuple(f"{name}-node-{i}" for i in range(placed)),
    )


def ctx(
    nodes: Iterable[NodeView] = (),
    jobs: Iterable[JobView] = (),
    *,
    failures: Mapping[str, int] | None = None,
    in_job_restarts: Mapping[str, int] | None = None,
    recent: Mapping[str, int] | None = None,
    max_in_job_restarts: int = 2,
    max_workload_restarts: int = 1,
    enable_workload_scaling: bool = True,
    max_restarts_in_window: int = 10,
) -> PolicyContext:
    limits = PolicyLimits(
        max_in_job_restarts=max_in_job_restarts,
        max_workload_restarts=max_workload_restarts,
        enable_workload_scaling=enable_workload_scaling,
        restart_window_s=3600.0,
        max_restarts_in_window=max_restarts_in_window,
    )
    counts = {(j, A.RESTART_IN_PLACE): n for j, n in (in_job_restarts or {}).items()}
    return PolicyContext(
        now=NOW,
        limits=limits,
        nodes={n.name: n for n in nodes},
        jobs={j.name: j for j in jobs},
        node_failures=dict(failures or {}),
        action_counts=counts,
        restarts_in_window=dict(recent or {}),
    )


def ev(
    type: EventType,
    node: str | None = None,
    job: str | None = None,
    rank: int | None = None,
    **details: Any,
) -> Event:
    return Event(type=type, time=NOW, node=node, job=job, rank=rank, details=details)


Shape = tuple[ActionType, str | None, str | None, dict[str, Any]]


def shape(result: list[ActionRequest]) -> list[Shape]:
    """The parts of each action that matter, minus the free-text reason."""
    for action in result:
        assert action.reason, f"{action.type} has no reason"
    return [(a.type, a.job, a.node, dict(a.params)) for a in result]


def cp(job: str = "j", *exclude: str) -> Shape:
    return (A.EMERGENCY_CHECKPOINT, job, None, {"exclude_nodes": sorted(exclude)})


def restart_workload(job: str = "j") -> Shape:
    return (A.RESTART_WORKLOAD, job, None, {})


def restart_in_place(node: str | None, job: str = "j") -> Shape:
    return (A.RESTART_IN_PLACE, job, node, {})


def hot_swap(node: str, spare: str, job: str = "j") -> Shape:
    return (A.HOT_SWAP, job, node, {"spare": spare})


def scale_down(to: int, node: str, job: str = "j") -> Shape:
    return (A.SCALE_DOWN, job, None, {"to_replicas": to, "exclude_node": node})


def scale_up(to: int, job: str = "j") -> Shape:
    return (A.SCALE_UP, job, None, {"to_replicas": to})


def cordon(node: str) -> Shape:
    return (A.CORDON, None, node, {})


def decide(event: Event, context: PolicyContext, policy: Policy | None = None) -> list[Shape]:
    result = (policy or DefaultPolicy()).event_policy(event, context)
    assert_checkpoint_before_each_disruption(result)
    return shape(result)


def assert_checkpoint_before_each_disruption(result: list[ActionRequest]) -> None:
    """Rule 1: exactly one checkpoint of the same job right before each disruptive action."""
    for i, action in enumerate(result):
        if action.type in DISRUPTIVE_ACTIONS:
            assert i > 0, f"{action.type} is not preceded by a checkpoint"
            before = result[i - 1]
            assert before.type is A.EMERGENCY_CHECKPOINT
            assert before.job == action.job
            if i > 1:
                assert result[i - 2].type is not A.EMERGENCY_CHECKPOINT
        if action.type is A.EMERGENCY_CHECKPOINT:
            assert i + 1 < len(result) and result[i + 1].type in DISRUPTIVE_ACTIONS


# --- worker failures (rule 3) -----------------------------------------------------------


def test_worker_exit_code_zero_is_completion() -> None:
    c = ctx([node("n1")], [job()])
    assert decide(ev(E.WORKER_EXITED, "n1", "j", rank=3, exit_code=0), c) == []


@pytest.mark.parametrize("job_in_event", ["j", None])
def test_worker_exit_restarts_in_place_while_budget(job_in_event: str | None) -> None:
    c = ctx([node("n1")], [job()], in_job_restarts={"j": 1})
    event = ev(E.WORKER_EXITED, "n1", job_in_event, rank=3, exit_code=1)
    assert decide(event, c) == [cp("j", "n1"), restart_in_place("n1")]


def test_worker_exit_without_exit_code_is_a_failure() -> None:
    c = ctx([node("n1")], [job()])
    assert decide(ev(E.WORKER_EXITED, "n1", "j"), c) == [cp("j", "n1"), restart_in_place("n1")]


def test_worker_exit_in_job_budget_exhausted_restarts_workload() -> None:
    c = ctx([node("n1")], [job()], in_job_restarts={"j": 2})
    event = ev(E.WORKER_EXITED, "n1", "j", exit_code=-9)
    assert decide(event, c) == [cp("j", "n1"), restart_workload()]


def test_worker_heartbeat_lost_follows_the_same_ladder() -> None:
    event = ev(E.WORKER_HEARTBEAT_LOST, "n1", "j", rank=0)
    fresh = ctx([node("n1")], [job()])
    spent = ctx([node("n1")], [job()], in_job_restarts={"j": 5})
    assert decide(event, fresh) == [cp("j", "n1"), restart_in_place("n1")]
    assert decide(event, spent) == [cp("j", "n1"), restart_workload()]


def test_worker_failure_with_no_job_does_nothing() -> None:
    c = ctx([spare("s1")])
    assert decide(ev(E.WORKER_EXITED, "s1", None, exit_code=1), c) == []


def test_zero_in_job_restarts_goes_straight_to_workload_restart() -> None:
    c = ctx([node("n1")], [job()], max_in_job_restarts=0)
    event = ev(E.WORKER_EXITED, "n1", "j", exit_code=1)
    assert decide(event, c) == [cp("j", "n1"), restart_workload()]


# --- hang (rule 4) ----------------------------------------------------------------------


def test_hang_restarts_in_place_excluding_the_suspect() -> None:
    c = ctx([node("n1"), node("n2")], [job()])
    assert decide(ev(E.HANG, "n2", "j"), c) == [cp("j", "n2"), restart_in_place("n2")]


def test_hang_without_suspect() -> None:
    c = ctx([node("n1")], [job()])
    assert decide(ev(E.HANG, None, "j"), c) == [cp("j"), restart_in_place(None)]


def test_hang_in_job_budget_exhausted_restarts_workload() -> None:
    c = ctx([node("n1")], [job()], in_job_restarts={"j": 2})
    assert decide(ev(E.HANG, "n1", "j"), c) == [cp("j", "n1"), restart_workload()]


def test_hang_without_job_does_nothing() -> None:
    assert decide(ev(E.HANG, "n1", None), ctx([node("n1")])) == []


# --- node failures (rule 5) -------------------------------------------------------------


@pytest.mark.parametrize(
    "event_type",
    [E.HOST_HEARTBEAT_LOST, E.GPU_XID, E.GPU_ECC, E.NODE_NOT_READY],
)
def test_node_failure_restart_rung(event_type: EventType) -> None:
    c = ctx([node("n3"), spare("s1")], [job()], failures={"n3": 1})
    assert decide(ev(event_type, "n3", None, code=13), c) == [cp("j", "n3"), restart_workload()]


def test_node_failure_hot_swaps_to_first_spare_after_restart_rung() -> None:
    nodes = [node("n3"), spare("s9"), spare("s2"), spare("s1", cordoned=True)]
    c = ctx(nodes, [job()], failures={"n3": 2})
    result = DefaultPolicy().event_policy(ev(E.GPU_XID, "n3", "j", code=79), c)
    assert shape(result) == [cp("j", "n3"), hot_swap("n3", "s2")]
    assert (
        result[1].reason
        == "gpu_xid 79 on n3: 2 failures > max_workload_restarts=1, spare s2 available"
    )


def test_node_failure_ignores_unusable_spares() -> None:
    nodes = [
        node("n3"),
        spare("s1", cordoned=True),
        spare("s2", flapping=True),
        spare("s3", alive=False),
        node("s4", None, state=NodeState.FAILED),
    ]
    c = ctx(nodes, [job(replicas=4)], failures={"n3": 2})
    assert decide(ev(E.GPU_ECC, "n3", "j"), c) == [cp("j", "n3"), scale_down(3, "n3")]


def test_node_failure_scales_down_without_spare() -> None:
    c = ctx([node("n3")], [job(replicas=3, min_replicas=2)], failures={"n3": 2})
    assert decide(ev(E.HOST_HEARTBEAT_LOST, "n3", "j"), c) == [cp("j", "n3"), scale_down(2, "n3")]


def test_scale_down_respects_min_replicas() -> None:
    c = ctx([node("n3")], [job(replicas=2, min_replicas=2)], failures={"n3": 2})
    assert decide(ev(E.GPU_XID, "n3", "j", code=31), c) == [cp("j", "n3"), restart_workload()]


def test_scale_down_needs_scaling_enabled() -> None:
    c = ctx([node("n3")], [job()], failures={"n3": 2}, enable_workload_scaling=False)
    assert decide(ev(E.GPU_XID, "n3", "j", code=31), c) == [cp("j", "n3"), restart_workload()]


def test_scale_down_needs_a_job_view() -> None:
    c = ctx([node("n3")], [], failures={"n3": 2})
    assert decide(ev(E.GPU_XID, "n3", "j", code=31), c) == [cp("j", "n3"), restart_workload()]


def test_restart_rung_counts_the_current_failure() -> None:
    # max_workload_restarts=0: the first failure already goes past the restart rung.
    c = ctx([node("n3"), spare("s1")], [job()], failures={"n3": 1}, max_workload_restarts=0)
    assert decide(ev(E.GPU_XID, "n3", "j", code=79), c) == [cp("j", "n3"), hot_swap("n3", "s1")]


def test_flapping_node_skips_restart_rung() -> None:
    nodes = [node("n3", flapping=True), spare("s1")]
    c = ctx(nodes, [job()], failures={"n3": 1}, max_workload_restarts=5)
    assert decide(ev(E.NODE_FLAPPING, "n3", "j"), c) == [cp("j", "n3"), hot_swap("n3", "s1")]


def test_a_node_cut_off_from_its_peers_is_swapped_out_at_once() -> None:
    """Its ranks would stall at their first collective again: no restart in place, even
    on its first failure; nor in a job whose restart budget is spent (not its fault)."""
    event = ev(E.NODE_CUT_OFF, "n3", "j")
    first = ctx([node("n3"), spare("s1")], [job()], failures={"n3": 1}, max_workload_restarts=5)
    assert decide(event, first) == [cp("j", "n3"), hot_swap("n3", "s1")]
    room = ctx([node("n3")], [job(replicas=4)], failures={"n3": 1}, max_workload_restarts=5)
    assert decide(event, room) == [cp("j", "n3"), scale_down(3, "n3")]
    placed = "j-node-0"  # a node the job's view holds
    spent = ctx(
        [node(placed), spare("s1")],
        [job()],
        failures={placed: 4},
        recent={"j": 3},
        max_restarts_in_window=3,
    )
    swapped = decide(ev(E.NODE_CUT_OFF, placed, "j"), spent)
    assert swapped == [cp("j", placed), hot_swap(placed, "s1")]


def test_flapping_node_scales_down_then_restarts() -> None:
    event = ev(E.NODE_FLAPPING, "n3", "j")
    room = ctx([node("n3")], [job(replicas=4)], failures={"n3": 1}, max_workload_restarts=5)
    floor = ctx([node("n3")], [job(replicas=2)], failures={"n3": 1}, max_workload_restarts=5)
    assert decide(event, room) == [cp("j", "n3"), scale_down(3, "n3")]
    assert decide(event, floor) == [cp("j", "n3"), restart_workload()]


@pytest.mark.parametrize("event_type", [E.GPU_XID, E.GPU_ECC, E.NODE_FLAPPING])
def test_bad_spare_is_cordoned(event_type: EventType) -> None:
    c = ctx([spare("s1"), node("n1")], [job()], failures={"s1": 1})
    assert decide(ev(event_type, "s1", None, code=79), c) == [cordon("s1")]


def test_already_cordoned_spare_is_not_cordoned_again() -> None:
    c = ctx([spare("s1", cordoned=True)], failures={"s1": 3})
    assert decide(ev(E.GPU_XID, "s1", None, code=79), c) == []


@pytest.mark.parametrize("event_type", [E.HOST_HEARTBEAT_LOST, E.NODE_NOT_READY])
def test_spare_losing_heartbeat_is_left_alone(event_type: EventType) -> None:
    c = ctx([spare("s1")], failures={"s1": 1})
    assert decide(ev(event_type, "s1", None), c) == []


def test_unknown_node_without_job_is_cordoned_on_xid() -> None:
    assert decide(ev(E.GPU_XID, "ghost", None, code=79), ctx()) == [cordon("ghost")]


def test_node_failure_without_node_does_nothing() -> None:
    assert decide(ev(E.GPU_XID, None, "j", code=79), ctx([], [job()])) == []


# --- restart budget (rule 2) ------------------------------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        ev(E.WORKER_EXITED, "n3", "j", exit_code=1),
        ev(E.WORKER_HEARTBEAT_LOST, "n3", "j"),
        ev(E.HANG, "n3", "j"),
        ev(E.HOST_HEARTBEAT_LOST, "n3", "j"),
        ev(E.NODE_NOT_READY, "n3", "j"),
        ev(E.WORKLOAD_DOWN, None, "j"),
        ev(E.SPARE_AVAILABLE, "s1"),
        ev(E.NODE_RECOVERED, "s1"),
    ],
    ids=lambda e: e.type.value,
)
def test_restart_budget_exhausted_takes_no_disruptive_action(event: Event) -> None:
    nodes = [node("n3"), spare("s1")]
    c = ctx(nodes, [job()], failures={"n3": 1}, recent={"j": 3}, max_restarts_in_window=3)
    assert decide(event, c) == []


@pytest.mark.parametrize("event_type", [E.GPU_XID, E.GPU_ECC, E.NODE_FLAPPING])
def test_restart_budget_exhausted_still_cordons_bad_hardware(event_type: EventType) -> None:
    nodes = [node("n3"), spare("s1")]
    c = ctx(nodes, [job()], failures={"n3": 4}, recent={"j": 3}, max_restarts_in_window=3)
    assert decide(ev(event_type, "n3", "j", code=79), c) == [cordon("n3")]


def test_restart_budget_is_per_job() -> None:
    c = ctx([node("n3")], [job()], recent={"other": 99, "j": 2}, max_restarts_in_window=3)
    event = ev(E.WORKER_EXITED, "n3", "j", exit_code=1)
    assert decide(event, c) == [cp("j", "n3"), restart_in_place("n3")]


# --- scale up (rule 6) ------------------------------------------------------------------


@pytest.mark.parametrize("event_type", [E.SPARE_AVAILABLE, E.NODE_RECOVERED])
def test_spare_scales_up_a_job_below_max(event_type: EventType) -> None:
    c = ctx([spare("s1")], [job(replicas=3, max_replicas=4)])
    assert decide(ev(event_type, "s1"), c) == [cp("j"), scale_up(4)]


def test_a_job_that_kept_its_nodes_but_runs_nothing_since_its_remedy_failed_restarts_on_them() -> (
    None
):
    """Its whole restart failed on a node that was down (scaling off, no spare): when that
    node is back, every node it holds alive and no worker of it running, it restarts
    there; not while a node of it is still down, nor while a worker of it runs."""
    held = job("j", replicas=2, max_replicas=2)
    a, b = held.nodes

    def worker(state: WorkerState) -> WorkerView:
        return WorkerView(rank=0, local_rank=0, pid=1, state=state, step=5)

    exited = replace(node(a), workers=(worker(WorkerState.EXITED),))
    back = replace(
        ctx([exited, node(b)], [held], enable_workload_scaling=False),
        failed_last_remedy=frozenset({"j"}),
    )
    assert decide(ev(E.NODE_RECOVERED, b), back) == [cp("j"), restart_workload("j")]
    down = replace(back, nodes={a: exited, b: node(b, alive=False)})
    assert decide(ev(E.NODE_RECOVERED, a), down) == []
    runs = replace(node(b), workers=(worker(WorkerState.RUNNING),))
    assert decide(ev(E.NODE_RECOVERED, b), replace(back, nodes={a: exited, b: runs})) == []


@pytest.mark.parametrize(
    "event_type", [E.WORKER_EXITED, E.WORKER_HEARTBEAT_LOST, E.HANG], ids=lambda t: t.value
)
def test_after_a_failed_remedy_a_node_of_the_job_that_is_down_goes_before_the_restart(
    event_type: EventType,
) -> None:
    """A whole restart of a job whose last remedy failed would fail again on a node of
    it that is down: a spare takes that node's place, every rank started afresh; with no
    spare it scales down without it, and only then the last resort restarts it whole. With
    every node alive, the whole restart as before."""
    held = job("j", replicas=2, max_replicas=2, min_replicas=1)
    a, b = held.nodes
    event = ev(event_type, a, "j", rank=0, exit_code=1)
    nodes = [node(a), node(b, alive=False), spare("s1")]
    with_spare = replace(ctx(nodes, [held]), failed_last_remedy=frozenset({"j"}))
    swap = (A.HOT_SWAP, "j", b, {"spare": "s1", "in_process": False})
    assert decide(event, with_spare) == [cp("j", b), swap]
    no_spare = replace(with_spare, nodes={a: node(a), b: node(b, alive=False)})
    assert decide(event, no_spare) == [cp("j", b), scale_down(1, b)]
    fixed = replace(no_spare, limits=replace(no_spare.limits, enable_workload_scaling=False))
    assert decide(event, fixed) == [cp("j", b), restart_workload("j")]
    alive = replace(with_spare, nodes={a: node(a), b: node(b), "s1": spare("s1")})
    assert decide(event, alive) == [cp("j", a), restart_workload("j")]


def test_spares_a_job_short_of_nodes_will_take_do_not_scale_another_up() -> None:
    """A JobSet just recreated by a scale down has no pod placed yet: the node it is about
    to take (its own, seen as a spare meanwhile) is no capacity to scale up with."""
    recreated = job("j", replicas=1, max_replicas=2, placed=0)
    assert decide(ev(E.SPARE_AVAILABLE, "s1"), ctx([spare("s1")], [recreated])) == []
    # One spare more than it lacks: that one is capacity.
    two = ctx([spare("s1"), spare("s2")], [recreated])
    assert decide(ev(E.SPARE_AVAILABLE, "s2"), two) == [cp("j"), scale_up(2)]


@pytest.mark.parametrize("event_type", [E.SPARE_AVAILABLE, E.NODE_RECOVERED])
def test_a_job_nothing_runs_since_its_last_remedy_failed_is_restarted_once_nodes_are_back(
    event_type: EventType,
) -> None:
    """Its last-resort restart failed (its node was down): when the node is back as a
    spare, the job starts again on it; not while spares would not hold it, not when
    something runs it, nor past its budget."""
    stranded = job("j", replicas=1, max_replicas=2, placed=0)
    back = replace(ctx([spare("s1")], [stranded]), failed_last_remedy=frozenset({"j"}))
    assert decide(ev(event_type, "s1"), back) == [cp("j"), restart_workload("j")]
    # Without the failed remedy it is a JobSet whose pods are about to be placed: wait.
    assert decide(ev(event_type, "s1"), replace(back, failed_last_remedy=frozenset())) == []
    two = replace(back, jobs={"j": job("j", replicas=2, max_replicas=2, placed=0)})
    assert decide(ev(event_type, "s1"), two) == []  # two nodes needed, one spare
    running = replace(back, jobs={"j": job("j", replicas=1, max_replicas=2)})
    assert decide(ev(event_type, "s1"), running) == [cp("j"), scale_up(2)]
    spent = replace(back, restarts_in_window={"j": 10})
    assert decide(ev(event_type, "s1"), spent) == []


def test_scale_up_respects_max_replicas() -> None:
    c = ctx([spare("s1")], [job(replicas=4, max_replicas=4)])
    assert decide(ev(E.SPARE_AVAILABLE, "s1"), c) == []


def test_scale_up_needs_a_whole_replica_of_spares() -> None:
    event = ev(E.SPARE_AVAILABLE, "s1")
    short = ctx([spare("s1")], [job(replicas=1, per_dp=2)])
    enough = ctx([spare("s1"), spare("s2")], [job(replicas=1, per_dp=2)])
    unusable = ctx([spare("s1"), spare("s2", cordoned=True)], [job(replicas=1, per_dp=2)])
    assert decide(event, short) == []
    assert decide(event, enough) == [cp("j"), scale_up(2)]
    assert decide(event, unusable) == []


def test_scale_up_needs_scaling_enabled() -> None:
    c = ctx([spare("s1")], [job(replicas=1)], enable_workload_scaling=False)
    assert decide(ev(E.SPARE_AVAILABLE, "s1"), c) == []


def test_two_jobs_do_not_claim_the_same_spares() -> None:
    jobs = [job("b", 1, per_dp=2), job("a", 1, per_dp=2), job("c", 1, per_dp=1)]
    nodes = [spare("s1"), spare("s2"), spare("s3")]
    # "a" (first by name) takes two spares; "b" needs two but one is left; "c" takes it.
    result = decide(ev(E.SPARE_AVAILABLE, "s3"), ctx(nodes, jobs))
    assert result == [cp("a"), scale_up(2, "a"), cp("c"), scale_up(2, "c")]


def test_two_jobs_both_scale_up_with_enough_spares() -> None:
    jobs = [job("a", 1), job("b", 1)]
    result = decide(ev(E.NODE_RECOVERED, "s1"), ctx([spare("s1"), spare("s2")], jobs))
    assert result == [cp("a"), scale_up(2, "a"), cp("b"), scale_up(2, "b")]


def test_scale_up_skips_job_without_budget_and_leaves_it_the_spares() -> None:
    jobs = [job("a", 1), job("b", 1)]
    c = ctx([spare("s1")], jobs, recent={"a": 10}, max_restarts_in_window=10)
    assert decide(ev(E.SPARE_AVAILABLE, "s1"), c) == [cp("b"), scale_up(2, "b")]


# --- workload down, pod stuck (rule 7) --------------------------------------------------


def test_workload_down_restarts_workload() -> None:
    c = ctx([node("n1")], [job()])
    assert decide(ev(E.WORKLOAD_DOWN, None, "j"), c) == [cp("j"), restart_workload()]


def test_workload_down_without_job_does_nothing() -> None:
    assert decide(ev(E.WORKLOAD_DOWN), ctx()) == []


def test_pod_stuck_terminating_without_a_pod_name_takes_no_action() -> None:
    c = ctx([node("n1")], [job()])
    assert decide(ev(E.POD_STUCK_TERMINATING, "n1", "j"), c) == []


@pytest.mark.parametrize("second", [E.NODE_NOT_READY, E.HOST_HEARTBEAT_LOST, E.GPU_XID])
def test_a_node_already_swapped_out_of_its_job_is_not_swapped_again(second: EventType) -> None:
    # The first failure swapped n1 for s1: n1 is cordoned and the job runs on n2 and s1.
    moved = JobView("j", 4, 2, 8, 1, nodes=("n2", "s1"))
    nodes = [node("n1", cordoned=True, alive=False), node("n2"), spare("s2")]
    c = ctx(nodes, [moved], failures={"n1": 2})
    assert decide(ev(second, "n1", "j", code=79), c) == []


def test_a_cordoned_node_still_running_its_job_is_remedied() -> None:
    # An operator cordoned n1 (no new pods), but the job still runs there: act on failure.
    still = JobView("j", 4, 2, 8, 1, nodes=("n1", "n2"))
    c = ctx([node("n1", cordoned=True), node("n2"), spare("s1")], [still], failures={"n1": 2})
    assert decide(ev(E.HOST_HEARTBEAT_LOST, "n1", "j"), c) == [cp("j", "n1"), hot_swap("n1", "s1")]


# --- reasons and shape ------------------------------------------------------------------


def test_checkpoint_reason_names_the_remedy() -> None:
    c = ctx([node("n3")], [job()], failures={"n3": 1})
    result = DefaultPolicy().event_policy(ev(E.GPU_XID, "n3", "j", code=79), c)
    assert result[0].reason.startswith("save healthy workers before restart_workload: ")
    assert result[1].reason == "gpu_xid 79 on n3: 1 failure <= max_workload_restarts=1"


def test_default_policy_name() -> None:
    assert DefaultPolicy.name == "default"
    assert DefaultPolicy().name == "default"


# --- examples: HotSwapOnXid -------------------------------------------------------------


@pytest.mark.parametrize("code", [48, 79, "79"])
def test_hot_swap_on_fatal_xid_skips_restart_rung(code: int | str) -> None:
    c = ctx([node("n3"), spare("s1")], [job()], failures={"n3": 1}, max_workload_restarts=3)
    event = ev(E.GPU_XID, "n3", "j", code=code)
    assert decide(event, c, HotSwapOnXid()) == [cp("j", "n3"), hot_swap("n3", "s1")]
    assert decide(event, c) == [cp("j", "n3"), restart_workload()]


def test_hot_swap_on_fatal_xid_without_spare_scales_down() -> None:
    c = ctx([node("n3")], [job(replicas=4)], failures={"n3": 1}, max_workload_restarts=3)
    event = ev(E.GPU_XID, "n3", "j", code=48)
    assert decide(event, c, HotSwapOnXid()) == [cp("j", "n3"), scale_down(3, "n3")]


@pytest.mark.parametrize("details", [{"code": 13}, {"code": "bogus"}, {}])
def test_hot_swap_other_xids_fall_through_to_default(details: dict[str, Any]) -> None:
    c = ctx([node("n3"), spare("s1")], [job()], failures={"n3": 1}, max_workload_restarts=3)
    event = ev(E.GPU_XID, "n3", "j", **details)
    assert decide(event, c, HotSwapOnXid()) == [cp("j", "n3"), restart_workload()]


def test_hot_swap_on_xid_keeps_default_elsewhere() -> None:
    policy = HotSwapOnXid()
    assert policy.immediate_xids == frozenset({48, 79})
    spare_ctx = ctx([spare("s1")], failures={"s1": 1})
    assert decide(ev(E.GPU_XID, "s1", None, code=79), spare_ctx, policy) == [cordon("s1")]
    broke = ctx([node("n3"), spare("s1")], [job()], recent={"j": 10}, max_restarts_in_window=10)
    assert decide(ev(E.GPU_XID, "n3", "j", code=79), broke, policy) == [cordon("n3")]
    c = ctx([node("n3"), spare("s1")], [job()], failures={"n3": 1}, max_workload_restarts=3)
    assert decide(ev(E.GPU_ECC, "n3", "j"), c, policy) == [cp("j", "n3"), restart_workload()]


def test_hot_swap_immediate_xids_can_be_overridden() -> None:
    class OnlyDbe(HotSwapOnXid):
        immediate_xids = frozenset({48})

    c = ctx([node("n3"), spare("s1")], [job()], failures={"n3": 1}, max_workload_restarts=3)
    xid79 = ev(E.GPU_XID, "n3", "j", code=79)
    assert decide(xid79, c, OnlyDbe()) == [cp("j", "n3"), restart_workload()]


# --- examples: NeverScaleBelow ----------------------------------------------------------


def test_never_scale_below_replaces_scale_down_under_floor() -> None:
    c = ctx([node("n3")], [job(replicas=3, min_replicas=1)], failures={"n3": 2})
    event = ev(E.GPU_XID, "n3", "j", code=31)
    assert decide(event, c) == [cp("j", "n3"), scale_down(2, "n3")]
    result = NeverScaleBelow().event_policy(event, c)
    assert shape(result) == [cp("j", "n3"), restart_workload()]
    assert_checkpoint_before_each_disruption(result)
    assert "floor=3" in result[1].reason


def test_never_scale_below_allows_scale_down_to_floor() -> None:
    c = ctx([node("n3")], [job(replicas=4, min_replicas=1)], failures={"n3": 2})
    event = ev(E.GPU_XID, "n3", "j", code=31)
    assert decide(event, c, NeverScaleBelow()) == [cp("j", "n3"), scale_down(3, "n3")]


def test_never_scale_below_floor_can_be_overridden() -> None:
    class Floor5(NeverScaleBelow):
        floor = 5

    c = ctx([node("n3")], [job(replicas=5, min_replicas=1)], failures={"n3": 2})
    event = ev(E.NODE_FLAPPING, "n3", "j")
    assert decide(event, c, Floor5()) == [cp("j", "n3"), restart_workload()]


def test_never_scale_below_passes_other_decisions_through() -> None:
    policy = NeverScaleBelow()
    c = ctx([node("n3"), spare("s1")], [job(replicas=1)], failures={"n3": 2})
    assert decide(ev(E.GPU_XID, "n3", "j", code=79), c, policy) == [
        cp("j", "n3"),
        hot_swap("n3", "s1"),
    ]
    assert decide(ev(E.SPARE_AVAILABLE, "s1"), c, policy) == [cp("j"), scale_up(2)]
    assert decide(ev(E.WORKER_EXITED, "n3", "j", exit_code=0), c, policy) == []


# --- XIDs by meaning ---------------------------------------------------------------------


def xid_event(
    code: int,
    node_name: str = "n3",
    job_name: str | None = "j",
    overrides: Mapping[Any, Any] | None = None,
) -> Event:
    """A `gpu_xid` event as the sensor raises it: with the XID table's class."""
    from supervisor.xid import classify

    return ev(E.GPU_XID, node_name, job_name, code=code, **classify(code, overrides).details())


@pytest.mark.parametrize("code", [13, 31, 43, 45])
def test_an_application_xid_restarts_the_workload_and_keeps_the_node(code: int) -> None:
    # Spares at hand and no restart left on the node: still a restart, never a swap.
    c = ctx([node("n3"), spare("s1")], [job()], failures={"n3": 5}, max_workload_restarts=0)
    result = DefaultPolicy().event_policy(xid_event(code), c)
    assert shape(result) == [cp("j", "n3"), restart_workload()]
    assert "the node stays in service" in result[1].reason


def test_an_application_xid_on_a_node_without_job_cordons_nothing() -> None:
    assert decide(xid_event(13, "s1", None), ctx([spare("s1")], [job()])) == []


@pytest.mark.parametrize("code", [48, 63, 64, 74, 79, 92, 94, 95, 119, 120])
def test_a_hardware_xid_hot_swaps_at_once(code: int) -> None:
    # A restart on the same GPU cannot help, whatever max_workload_restarts allows.
    c = ctx([node("n3"), spare("s1")], [job()], failures={"n3": 1}, max_workload_restarts=5)
    assert decide(xid_event(code), c) == [cp("j", "n3"), hot_swap("n3", "s1")]


def test_an_xid_not_in_the_table_takes_the_node_failure_ladder() -> None:
    c = ctx([node("n3"), spare("s1")], [job()], failures={"n3": 1}, max_workload_restarts=1)
    assert decide(xid_event(999), c) == [cp("j", "n3"), restart_workload()]
    c = ctx([node("n3"), spare("s1")], [job()], failures={"n3": 2}, max_workload_restarts=1)
    assert decide(xid_event(999), c) == [cp("j", "n3"), hot_swap("n3", "s1")]


def test_xid_responses_overridden_in_settings_are_followed() -> None:
    from supervisor.xid import XidResponse

    c = ctx([node("n3"), spare("s1")], [job()], failures={"n3": 1}, max_workload_restarts=0)
    keep = xid_event(94, overrides={94: XidResponse.RESTART_WORKLOAD})
    assert decide(keep, c) == [cp("j", "n3"), restart_workload()]
    assert decide(xid_event(63, overrides={63: XidResponse.IGNORE}), c) == []


# --- stragglers ---------------------------------------------------------------------------


def straggler(node_name: str = "n3") -> Event:
    return ev(E.STRAGGLER, node_name, "j", slowdown_pct=50.0, for_s=30.0, score=1.5)


def test_a_straggler_is_hot_swapped_when_a_spare_exists() -> None:
    c = ctx([node("n3"), spare("s1")], [job()])
    result = DefaultPolicy().event_policy(straggler(), c)
    assert shape(result) == [cp("j", "n3"), hot_swap("n3", "s1")]
    assert "50.0% slower than its job for 30.0s, spare s1 available" in result[1].reason


def test_a_straggler_without_a_spare_is_only_recorded() -> None:
    assert decide(straggler(), ctx([node("n3")], [job()])) == []
    assert decide(ev(E.STRAGGLER_RECOVERED, "n3", "j"), ctx([node("n3")], [job()])) == []


def test_a_straggler_already_moved_off_is_left_alone() -> None:
    c = ctx([node("n3", None, cordoned=True), spare("s1")], [job()])
    assert decide(straggler(), c) == []


# --- purity -----------------------------------------------------------------------------

POLICY_DIR = Path(__file__).resolve().parent.parent / "policies"
# The domain (with its XID table and the event details and action params models), the
# policy API, the default policy to build on.
ALLOWED = {
    "supervisor.domain",
    "supervisor.event_details",
    "supervisor.action_params",
    "supervisor.xid",
    "supervisor.policy",
    "policies.default",
    "__future__",
}


@pytest.mark.parametrize(
    "path", sorted(POLICY_DIR.rglob("*.py")), ids=lambda p: str(p.relative_to(POLICY_DIR))
)
def test_policies_import_only_domain_policy_and_stdlib(path: Path) -> None:
    for stmt in ast.walk(ast.parse(path.read_text())):
        if isinstance(stmt, ast.Import):
            names = [alias.name for alias in stmt.names]
        elif isinstance(stmt, ast.ImportFrom):
            names = [stmt.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            assert name in ALLOWED or top in sys.stdlib_module_names, f"{path}: imports {name}"


def test_periodic_checkpoints_only_skips_the_emergency_checkpoint() -> None:
    event = Event(
        EventType.WORKER_EXITED, NOW, node="n1", job="j1", rank=0, details={"exit_code": 1}, id=1
    )
    decided = PeriodicCheckpointsOnly().event_policy(event, _ctx_for_flag())
    assert [a.type for a in decided] == [ActionType.RESTART_IN_PLACE]
    default = DefaultPolicy().event_policy(event, _ctx_for_flag())
    assert [a.type for a in default] == [
        ActionType.EMERGENCY_CHECKPOINT,
        ActionType.RESTART_IN_PLACE,
    ]


def _ctx_for_flag() -> PolicyContext:
    limits = PolicyLimits(
        max_in_job_restarts=3,
        max_workload_restarts=0,
        enable_workload_scaling=False,
        restart_window_s=3600,
        max_restarts_in_window=10,
    )
    return PolicyContext(now=NOW, limits=limits)
