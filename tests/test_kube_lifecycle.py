"""The Kubernetes backend and the JobSet controller's own restarts, on the real control
plane (tests/control_plane.py): the real API server, Job and JobSet controllers and
scheduler, kwok playing the kubelets, the backend as the chart's ServiceAccount.

- no double restarts: a restart decided for an event acts on the pods and Jobs that
  existed at the event's time; when the JobSet controller has restarted the JobSet by
  itself since (its failure policy, after a worker crash), the action is a no-op that
  says so, and the new generation is never evicted;
- spares the policy can see: schedulable GPU nodes running no workload pod, whose host
  monitor is alive, are spares to the policy whatever their host monitor last reported.

Each test keeps to nodes of its own pool and a JobSet of its own name (`lc-...`).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, TypeVar

import pytest

from supervisor.actuator.backend import ActionError
from supervisor.domain import ActionType, Event, EventType, NodeState, utcnow
from supervisor.kube import objects as o
from supervisor.kube.backend import KubeBackend
from supervisor.kube.generations import reference_time
from tests.conftest import SettingsFactory
from tests.control_plane import ControlPlane, Identity
from tests.kube.harness import Hooks, action, jobset
from tests.kube_real import (
    JOBSETS,
    NS,
    backend_on,
    events_about,
    fail_pod,
    get,
    merge_patch,
    node,
    pool_nodes,
    running,
    start_jobset,
    unmanage,
    until,
    wait_running,
)
from tests.kube_real_supervising import (
    OPERATOR,
    SUPERVISED,
    SWAP_SETTINGS,
    Sent,
    crash,
    finished_action,
    jobset_controller_paused,
    manage,
    supervising,
    swap_scene,
    wait,
)
from tests.timing import scaled

T = TypeVar("T")
RESTARTED_1 = "already restarted by the JobSet controller (restart-attempt 1)"


def uids(pods: list[dict[str, Any]] | None) -> set[str]:
    return {p["metadata"]["uid"] for p in pods or []}


def restarts(plane: ControlPlane, name: str) -> int:
    return o.jobset_restarts(get(plane, f"{JOBSETS}/{name}") or {})


def not_none(value: T | None) -> T:
    assert value is not None
    return value


def running_seen(backend: KubeBackend, name: str) -> set[str]:
    """The UIDs of the JobSet's running pods, as the backend's watches see them."""
    return {o.uid_of(p) for p in backend.discovery.pods_of(name) if o.pod_running(p)}


def failed_in_cache(backend: KubeBackend, name: str, pod: str) -> bool:
    """The backend's watches saw the pod fail, and its Job with it (separate streams)."""
    cached = backend.discovery.informers["Pod"].items.get(f"{NS}/{pod}")
    jobs = backend.discovery.child_jobs(name)
    return bool(cached and o.pod_finished(cached) and any(o.job_failed(j) for j in jobs))


# --- no double restarts -----------------------------------------------------------------------


async def test_restart_after_the_jobset_restarted_itself_is_skipped(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """The failure policy of docs/kubernetes.md: a crashed worker fails its Job (backoffLimit 0) and
    the real JobSet controller restarts the JobSet (restart-attempt 1). The restart the
    policy asked for the same crash, in place or of the workload, finds that done since
    the event: a no-op with its reason, an Event on the JobSet, the new pods untouched. A
    restart for a later event acts on the new generation, as it should."""
    name = "lc-skip"
    pool_nodes(control_plane, name, 2)
    start_jobset(control_plane, name, name)
    crashed = wait_running(control_plane, name, 2, "0")[0]
    where = crashed["spec"]["nodeName"]
    hooks = Hooks()
    async with backend_on(control_plane, kube_supervisor, make_settings, name, hooks) as backend:
        sent = Sent(backend)
        await until(backend, lambda: where in backend.discovery.nodes_of(name), "the pods seen")
        crash(hooks, 7, where, name)
        fail_pod(control_plane, crashed)
        fresh = wait_running(control_plane, name, 2, "1")
        await until(backend, lambda: running_seen(backend, name) == uids(fresh), "the new pods")

        before = len(sent)
        in_place = action(
            ActionType.RESTART_IN_PLACE, job=name, node=where, event_id=7, reason="exited"
        )
        assert await backend.execute(in_place) == {"skipped": RESTARTED_1}
        workload = action(ActionType.RESTART_WORKLOAD, job=name, key="k2", id_=2, event_id=7)
        assert await backend.execute(workload) == {"skipped": RESTARTED_1}
        assert sent.disruptions(before) == []
        assert uids(running(control_plane, name, 2, "1")) == uids(fresh)
        assert restarts(control_plane, name) == 1
        messages = sorted(
            e["message"] for e in events_about(control_plane, name, "AlreadyRestarted")
        )
        assert messages == [
            f"restart_in_place not done: {RESTARTED_1} (supervisor action 1: exited)",
            f"restart_workload not done: {RESTARTED_1} (supervisor action 2: test)",
        ]
        # Journalled like any action: the same key again writes nothing.
        before = len(sent)
        again = await backend.execute(in_place)
        assert again == {"repeated": True, "skipped": RESTARTED_1}
        assert sent.writes(before) == []

        # A crash of the new generation, a while after it started, is acted on.
        await asyncio.sleep(2 * backend.settings.heartbeat_polling_period_s)
        target = fresh[0]
        crash(hooks, 8, target["spec"]["nodeName"], name)
        later = action(
            ActionType.RESTART_IN_PLACE,
            job=name,
            node=target["spec"]["nodeName"],
            key="k3",
            id_=3,
            event_id=8,
        )
        assert await backend.execute(later) == {"pods": {target["metadata"]["name"]: "evicted"}}
        wait_running(control_plane, name, 2, "2")


async def test_a_restart_under_way_is_not_done_again(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """The JobSet controller restarted (restart-attempt 1) but an old pod is still
    terminating (its kubelet is gone), so the new Jobs wait for the old ones (deleted in
    the foreground): a restart in place or of the workload is skipped; a hot-swap of that
    pod's node still cordons and taints it but has nothing to evict. Once the old pod is
    gone (its kubelet back), the new generation runs, off the swapped-out node."""
    name = "lc-underway"
    pool_nodes(control_plane, name, 4)
    start_jobset(control_plane, name, name)
    crashed, slow = wait_running(control_plane, name, 2, "0")
    slow_node = slow["spec"]["nodeName"]
    unmanage(control_plane, slow_node)
    hooks = Hooks()
    async with backend_on(control_plane, kube_supervisor, make_settings, name, hooks) as backend:
        sent = Sent(backend)
        await until(backend, lambda: len(backend.discovery.nodes_of(name)) == 2, "the pods seen")
        crash(hooks, 7, crashed["spec"]["nodeName"], name)
        fail_pod(control_plane, crashed)

        def restarting() -> bool:
            js = backend.discovery.jobset(name)
            pod = backend.discovery.informers["Pod"].items.get(f"{NS}/{o.name_of(slow)}")
            return (
                js is not None and o.jobset_restarts(js) == 1 and bool(pod and o.terminating(pod))
            )

        await until(backend, restarting, "the restart under way")
        before = len(sent)
        in_place = action(ActionType.RESTART_IN_PLACE, job=name, node=slow_node, event_id=7)
        assert await backend.execute(in_place) == {"skipped": RESTARTED_1}
        workload = action(ActionType.RESTART_WORKLOAD, job=name, key="k2", id_=2, event_id=7)
        assert await backend.execute(workload) == {"skipped": RESTARTED_1}
        swap = action(ActionType.HOT_SWAP, job=name, node=slow_node, key="k3", id_=3, event_id=7)
        result = await backend.execute(swap)
        assert result["pods"] == {} and result["skipped"] == f"no pod to move: {RESTARTED_1}"
        assert sent.disruptions(before) == []
        swapped = node(control_plane, slow_node)
        assert swapped["spec"]["unschedulable"] is True
        assert o.has_taint(swapped, backend.settings.kube_taint_key)
        assert len(events_about(control_plane, name, "AlreadyRestarted")) == 3

        manage(control_plane, slow_node)
        fresh = wait_running(control_plane, name, 2, "1")
        assert slow_node not in {p["spec"]["nodeName"] for p in fresh}
        assert restarts(control_plane, name) == 1


async def test_a_restart_waits_for_the_jobset_controller_to_react(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """The pod has failed, and its Job with it, but the JobSet controller (held back) has
    not reacted yet: the restarts wait for it (by watching, up to controller_patience_s)
    instead of deleting Jobs it is about to delete, then find the JobSet restarted and do
    nothing."""
    name = "lc-wait"
    pool_nodes(control_plane, name, 2)
    start_jobset(control_plane, name, name)
    crashed = wait_running(control_plane, name, 2, "0")[0]
    where = crashed["spec"]["nodeName"]
    hooks = Hooks()
    async with backend_on(control_plane, kube_supervisor, make_settings, name, hooks) as backend:
        sent = Sent(backend)
        await until(backend, lambda: where in backend.discovery.nodes_of(name), "the pods seen")
        with jobset_controller_paused(control_plane):
            crash(hooks, 7, where, name)
            fail_pod(control_plane, crashed)
            await until(
                backend, lambda: failed_in_cache(backend, name, o.name_of(crashed)), "the failure"
            )
            before = len(sent)
            in_place = asyncio.create_task(
                backend.execute(
                    action(ActionType.RESTART_IN_PLACE, job=name, node=where, event_id=7)
                )
            )
            workload = asyncio.create_task(
                backend.execute(
                    action(ActionType.RESTART_WORKLOAD, job=name, key="k2", id_=2, event_id=7)
                )
            )
            await asyncio.sleep(1.0)
            assert not in_place.done() and not workload.done()
        # The JobSet controller catches up: restart-attempt 1.
        assert await asyncio.wait_for(in_place, 60) == {"skipped": RESTARTED_1}
        assert await asyncio.wait_for(workload, 60) == {"skipped": RESTARTED_1}
        assert sent.disruptions(before) == []
        wait_running(control_plane, name, 2, "1")


async def test_a_restart_with_nothing_to_act_on_fails_after_its_patience(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """Nobody replaces the failed pod within controller_patience_s (the JobSet controller
    held back): the restart in place fails (retryable: the actuator tries again) naming
    what it did not find."""
    name = "lc-patience"
    pool_nodes(control_plane, name, 2)
    start_jobset(control_plane, name, name)
    crashed = wait_running(control_plane, name, 2, "0")[0]
    where = crashed["spec"]["nodeName"]
    hooks = Hooks()
    async with backend_on(
        control_plane, kube_supervisor, make_settings, name, hooks, controller_patience_s=0.5
    ) as backend:
        await until(backend, lambda: where in backend.discovery.nodes_of(name), "the pods seen")
        with jobset_controller_paused(control_plane):
            crash(hooks, 7, where, name)
            fail_pod(control_plane, crashed)
            await until(
                backend, lambda: failed_in_cache(backend, name, o.name_of(crashed)), "the failure"
            )
            began = asyncio.get_running_loop().time()
            with pytest.raises(ActionError, match=f"no running pod of {name} on {where}") as e:
                await asyncio.wait_for(
                    backend.execute(
                        action(ActionType.RESTART_IN_PLACE, job=name, node=where, event_id=7)
                    ),
                    scaled(30),
                )
            assert asyncio.get_running_loop().time() - began >= 0.5  # its patience, spent
            assert e.value.retryable


async def test_a_pod_its_job_replaced_is_not_restarted_again(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """backoffLimit 1: the real Job controller itself replaces the crashed pod (same
    restart-attempt, no JobSet restart). The replacement was created after the event:
    not evicted."""
    name = "lc-replaced"
    pool_nodes(control_plane, name, 2)
    body = jobset(name)
    body["metadata"]["namespace"] = NS
    job = body["spec"]["replicatedJobs"][0]["template"]["spec"]
    job["backoffLimit"] = 1
    job["template"]["spec"]["nodeSelector"] = {"pool": name}
    control_plane.apply(body)
    crashed = wait_running(control_plane, name, 2, "0")[0]
    where = crashed["spec"]["nodeName"]
    hooks = Hooks()
    async with backend_on(control_plane, kube_supervisor, make_settings, name, hooks) as backend:
        sent = Sent(backend)
        await until(backend, lambda: where in backend.discovery.nodes_of(name), "the pods seen")
        crash(hooks, 7, where, name)
        fail_pod(control_plane, crashed)
        # The Job controller waits its back-off (10 s) before it makes the replacement.
        (replacement,) = await wait(
            lambda: [
                p
                for p in running(control_plane, name, 2) or []
                if p["spec"]["nodeName"] == where
                and p["metadata"]["uid"] != crashed["metadata"]["uid"]
            ],
            "the Job's replacement pod running",
            45,
        )
        await until(
            backend, lambda: o.uid_of(replacement) in running_seen(backend, name), "it seen"
        )
        before = len(sent)
        result = await backend.execute(
            action(ActionType.RESTART_IN_PLACE, job=name, node=where, event_id=7)
        )
        assert result == {
            "skipped": f"already replaced: the pods of {name} on {where} were created after"
            " the event (restart-attempt 0)"
        }
        assert sent.disruptions(before) == []
        assert restarts(control_plane, name) == 0


def test_the_reference_time_is_the_earliest_the_failure_can_have_happened() -> None:
    """A lost heartbeat: the node's last heartbeat. An event a heartbeat carried: one
    heartbeat period before it was recorded. A hang: when the job stalled. Else: when
    the event was recorded."""
    now = utcnow()
    last = now - timedelta(seconds=15)
    lost = Event(
        EventType.HOST_HEARTBEAT_LOST, now, node="n", details={"last_heartbeat": last.isoformat()}
    )
    assert reference_time(lost, 5.0) == last
    exited = Event(EventType.WORKER_EXITED, now, node="n", details={"exit_code": 1})
    assert reference_time(exited, 5.0) == now - timedelta(seconds=5)
    hang = Event(EventType.HANG, now, job="j", details={"stalled_for_s": 120.5})
    assert reference_time(hang, 5.0) == now - timedelta(seconds=120.5)
    down = Event(EventType.WORKLOAD_DOWN, now, job="j")
    assert reference_time(down, 5.0) == now
    garbled = Event(EventType.HOST_HEARTBEAT_LOST, now, details={"last_heartbeat": "yesterday"})
    assert reference_time(garbled, 5.0) == now


# --- through the supervisor's HTTP API ----------------------------------------------------------


async def test_a_crash_the_jobset_restarts_by_itself_is_not_restarted_twice(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """The real app with the Kubernetes backend. A worker crashes: its kubelet fails its
    pod, the real JobSet controller restarts the JobSet (an old pod is slow to
    terminate: its kubelet is gone), and the host monitor reports the exit. The default
    policy's restart in place for that worker_exited event succeeds as a no-op: one
    restart of the job, not two."""
    name = "lc-twice"
    pool_nodes(control_plane, name, 4)
    start_jobset(control_plane, name, name, labels={SUPERVISED: name})
    pods = wait_running(control_plane, name, 2, "0")
    crashed, slow = pods
    where = crashed["spec"]["nodeName"]
    async with supervising(
        control_plane,
        kube_supervisor,
        make_settings,
        name,
        heartbeat_timeout_s=3.0,
        heartbeat_polling_period_s=0.2,
        emergency_checkpoint_timeout_s=1.0,
    ) as (supervisor, http, beats, sent):
        for rank, pod in enumerate(pods):
            beats.running(pod["spec"]["nodeName"], rank)
        await wait(lambda: supervisor.sensor.has_node(where), "the host monitors heard")
        unmanage(control_plane, slow["spec"]["nodeName"])
        fail_pod(control_plane, crashed)
        beats.running(where, 0, state="exited", exit_code=1)

        done = await finished_action(http, "restart_in_place")
        assert done["status"] == "succeeded", done
        assert done["result"] == {"skipped": RESTARTED_1}
        assert done["event_id"] is not None and done["node"] == where
        assert not [path for _, path in sent.requests if path.endswith("/eviction")]

        manage(control_plane, slow["spec"]["nodeName"])
        wait_running(control_plane, name, 2, "1")
        assert restarts(control_plane, name) == 1
        message = events_about(control_plane, name, "AlreadyRestarted")[0]["message"]
        assert f"supervisor action {done['id']}" in message


# --- spares the policy can see ---------------------------------------------------------------


async def test_the_cluster_says_which_nodes_are_spares_and_cordoned(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """What the policy sees (its context, through the supervisor): an idle, schedulable
    GPU node whose host monitor still reports its last job is a spare; one whose host
    monitor went silent is not; a GPU node with no host monitor is not invented; a node
    cordoned in Kubernetes is cordoned to the policy, whatever its heartbeats say."""
    name = "lc-spares"
    nodes = pool_nodes(control_plane, name, 5)
    start_jobset(control_plane, name, name, labels={SUPERVISED: name})
    used = sorted(p["spec"]["nodeName"] for p in wait_running(control_plane, name, 2, "0"))
    stale, silent, unmonitored = sorted(set(nodes) - set(used))
    async with supervising(
        control_plane,
        kube_supervisor,
        make_settings,
        name,
        heartbeat_timeout_s=1.5,
        heartbeat_polling_period_s=0.2,
    ) as (supervisor, _http, beats, _sent):
        for rank, each in enumerate(used):
            beats.running(each, rank)
        # Its workers were moved off; its host monitor still names the job.
        beats.says[stale] = {"node": stale, "state": "complete", "job": name}
        beats.says[silent] = {"node": silent, "state": "spare"}
        await wait(lambda: {stale, silent} <= set(supervisor.sensor.node_names()), "heard")
        del beats.says[silent]
        await wait(lambda: not not_none(supervisor.sensor.node_view(silent)).alive, "silent lost")

        async def context_when(ok: Any) -> Any:
            deadline = asyncio.get_running_loop().time() + scaled(30)
            while not ok(context := await supervisor.controller.context()):
                assert asyncio.get_running_loop().time() < deadline, context
                await asyncio.sleep(0.05)
            return context

        context = await supervisor.controller.context()
        assert context.spares == (stale,)
        view = context.nodes[stale]
        assert view.state is NodeState.SPARE and view.job is None and not view.cordoned
        assert not_none(supervisor.sensor.node_view(stale)).state is NodeState.COMPLETE
        assert unmonitored not in context.nodes
        assert {context.nodes[n].state for n in used} == {NodeState.RUNNING}

        # A node Kubernetes has placed a pod on is no spare, even while its host monitor,
        # which has not heard of the pod's workers yet, says it is.
        beats.says[used[0]] = {"node": used[0], "state": "spare"}
        await wait(
            lambda: not_none(supervisor.sensor.node_view(used[0])).state is NodeState.SPARE, "said"
        )
        context = await supervisor.controller.context()
        assert context.spares == (stale,)
        beats.running(used[0], 0)

        merge_patch(control_plane, f"/api/v1/nodes/{stale}", {"spec": {"unschedulable": True}})
        await context_when(lambda c: c.nodes[stale].cordoned and c.spares == ())


async def test_the_policy_hot_swaps_onto_a_spare_only_kubernetes_knows(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """The spare's host monitor still reports the job it ran (no "spare" heartbeat), so
    the sensor alone knows no spare and the default policy would restart the workload;
    Kubernetes says the node is schedulable and idle: the policy hot-swaps onto it."""
    name = "lc-swap"
    pods, used, spare = swap_scene(control_plane, name)
    bad = used[0]
    async with supervising(
        control_plane,
        kube_supervisor,
        make_settings,
        name,
        **SWAP_SETTINGS,
    ) as (supervisor, http, beats, _sent):
        for rank, each in enumerate(used):
            beats.running(each, rank)
        beats.says[spare] = {"node": spare, "state": "complete", "job": name}
        await wait(lambda: {*used, spare} <= set(supervisor.sensor.node_names()), "heard")
        assert not_none(supervisor.sensor.node_view(spare)).state is NodeState.COMPLETE
        r = await http.post(
            "/api/v1/faults", json={"kind": "heartbeat_loss", "node": bad}, headers=OPERATOR
        )
        assert r.status_code == 201, r.text

        swap = await finished_action(http, "hot_swap")
        assert swap["status"] == "succeeded", swap
        assert swap["node"] == bad and swap["params"]["spare"] == spare
        assert f"spare {spare} available" in swap["reason"]
        on_bad = next(p for p in pods if p["spec"]["nodeName"] == bad)
        assert swap["result"]["pods"] == {on_bad["metadata"]["name"]: "evicted"}
        moved = wait_running(control_plane, name, 2, "1")
        assert {p["spec"]["nodeName"] for p in moved} == {used[1], spare}
        r = await http.get("/api/v1/actions", params={"type": "restart_workload"}, headers=OPERATOR)
        assert r.json()["items"] == []
