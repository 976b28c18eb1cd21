"""The Kubernetes backend and the JobSet controller's own restarts, through the official
client against the fake API server (tests/kube):

- no double restarts: a restart decided for an event acts on the pods and Jobs that
  existed at the event's time; when the JobSet controller has restarted the JobSet by
  itself since (its failure policy, after a worker crash), the action is a no-op that
  says so, and the new generation is never evicted;
- spares the policy can see: schedulable GPU nodes running no workload pod, whose host
  monitor is alive, are spares to the policy whatever their host monitor last reported.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import httpx
import pytest

from supervisor.actuator.backend import ActionError
from supervisor.api import create_app
from supervisor.config import Settings
from supervisor.domain import ActionType, Event, EventType, NodeState, utcnow
from supervisor.kube import objects as o
from supervisor.kube.backend import KubeBackend
from supervisor.kube.generations import reference_time
from supervisor.runtime import Supervisor
from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN, SettingsFactory
from tests.kube import FakeKube
from tests.kube.harness import (
    GPU,
    Hooks,
    action,
    jobset,
    kube_settings,
    mutations,
    pods_running,
    running_pods,
    setup_cluster,
    started,
)

AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(time_scale=0.01, bookmark_interval=0.1, tick=0.02) as k:
        yield k


async def until(backend: KubeBackend, predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    assert await backend.discovery.wait_until(predicate, timeout), "condition not met"


async def wait(predicate: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.02)


def events_about(kube: FakeKube, name: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in kube.objects("Event")
        if e["involvedObject"]["name"] == name and e["reason"] == reason
    ]


def generation(kube: FakeKube, attempt: int, count: int = 2) -> list[dict[str, Any]]:
    """The JobSet's pods, all running, all of restart `attempt` (else [])."""
    pods = pods_running(kube, count)
    ok = all(p["metadata"]["labels"][o.RESTART_ATTEMPT] == str(attempt) for p in pods)
    return pods if ok else []


def uids(pods: list[dict[str, Any]]) -> set[str]:
    return {p["metadata"]["uid"] for p in pods}


def disruptions(kube: FakeKube, since: int) -> list[tuple[str, str]]:
    """Evictions and deletions (of pods, Jobs, JobSets) sent from request `since` on."""
    return [
        (method, path)
        for method, path in mutations(kube, since)
        if method == "DELETE" or path.endswith("/eviction")
    ]


def crash(hooks: Hooks, event_id: int, node: str) -> Event:
    """The supervisor records a worker_exited event on `node` (its time: now)."""
    event = Event(
        EventType.WORKER_EXITED,
        utcnow(),
        node=node,
        job="train",
        rank=0,
        details={"exit_code": 1},
        id=event_id,
    )
    hooks.recorded[event_id] = event
    return event


def pause_jobset_controller(kube: FakeKube, monkeypatch: pytest.MonkeyPatch) -> None:
    """The JobSet controller stops reconciling (a slow one) until monkeypatch.undo().
    Returns once the controller loop has run without it: a pass begun before may still
    have held the real one."""
    passes: list[None] = []
    monkeypatch.setattr(kube.cluster.jobsets, "reconcile", lambda: passes.append(None))
    kube.wait_for(lambda: len(passes) >= 2, 10)


def failed_in_cache(backend: KubeBackend, pod: str) -> bool:
    """The backend's watches saw the pod fail, and its Job with it (separate streams)."""
    cached = backend.discovery.informers["Pod"].items.get(f"default/{pod}")
    jobs = backend.discovery.child_jobs("train")
    return bool(cached and o.pod_finished(cached) and any(o.job_failed(j) for j in jobs))


RESTARTED_1 = "already restarted by the JobSet controller (restart-attempt 1)"


# --- no double restarts -----------------------------------------------------------------------


async def test_restart_after_the_jobset_restarted_itself_is_skipped(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """The failure policy of docs/kubernetes.md: a crashed worker fails its Job (backoffLimit 0) and
    the JobSet controller restarts the JobSet (restart-attempt 1). The restart the policy
    asked for the same crash, in place or of the workload, finds that done since the
    event: a no-op with its reason, an Event on the JobSet, the new pods untouched. A
    restart for a later event acts on the new generation, as it should."""
    pods = setup_cluster(kube)
    crashed = pods[0]
    node = crashed["spec"]["nodeName"]
    hooks = Hooks()
    settings = kube_settings(make_settings)
    async with started(kube, settings, hooks) as backend:
        await until(backend, lambda: node in backend.discovery.nodes_of("train"))
        crash(hooks, 7, node)
        kube.fail_pod(crashed["metadata"]["name"])
        fresh = kube.wait_for(lambda: generation(kube, 1), 10)
        await until(
            backend,
            lambda: (
                uids([p for p in backend.discovery.pods_of("train") if o.pod_running(p)])
                == uids(fresh)
            ),
        )

        before = len(kube.requests)
        in_place = action(ActionType.RESTART_IN_PLACE, node=node, event_id=7, reason="exited")
        assert await backend.execute(in_place) == {"skipped": RESTARTED_1}
        workload = action(ActionType.RESTART_WORKLOAD, key="k2", id_=2, event_id=7)
        assert await backend.execute(workload) == {"skipped": RESTARTED_1}
        assert disruptions(kube, before) == []
        assert uids(running_pods(kube)) == uids(fresh)
        assert kube.get("JobSet", "train")["status"]["restarts"] == 1
        messages = sorted(e["message"] for e in events_about(kube, "train", "AlreadyRestarted"))
        assert messages == [
            f"restart_in_place not done: {RESTARTED_1} (supervisor action 1: exited)",
            f"restart_workload not done: {RESTARTED_1} (supervisor action 2: test)",
        ]
        # Journalled like any action: the same key again writes nothing.
        before = len(kube.requests)
        again = await backend.execute(in_place)
        assert again == {"repeated": True, "skipped": RESTARTED_1}
        assert mutations(kube, before) == []

        # A crash of the new generation, a while after it started, is acted on.
        await asyncio.sleep(2 * settings.heartbeat_polling_period_s)
        target = fresh[0]
        crash(hooks, 8, target["spec"]["nodeName"])
        later = action(
            ActionType.RESTART_IN_PLACE,
            node=target["spec"]["nodeName"],
            key="k3",
            id_=3,
            event_id=8,
        )
        assert await backend.execute(later) == {"pods": {target["metadata"]["name"]: "evicted"}}
        kube.wait_for(lambda: generation(kube, 2), 10)


async def test_a_restart_under_way_is_not_done_again(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """The JobSet controller restarted (restart-attempt 1) but an old pod is still
    terminating, so the new Jobs wait: a restart in place or of the workload is skipped;
    a hot-swap of that pod's node still cordons and taints it but has nothing to evict.
    Once the old pod is gone, the new generation runs, off the swapped-out node."""
    pods = setup_cluster(kube)
    crashed, slow = pods
    slow_node = slow["spec"]["nodeName"]
    settings = kube_settings(make_settings)
    kube.stick_pod(slow["metadata"]["name"])
    hooks = Hooks()
    async with started(kube, settings, hooks) as backend:
        await until(backend, lambda: len(backend.discovery.nodes_of("train")) == 2)
        crash(hooks, 7, crashed["spec"]["nodeName"])
        kube.fail_pod(crashed["metadata"]["name"])

        def restarting() -> bool:
            js = backend.discovery.jobset("train")
            pod = backend.discovery.informers["Pod"].items.get(f"default/{o.name_of(slow)}")
            return (
                js is not None and o.jobset_restarts(js) == 1 and bool(pod and o.terminating(pod))
            )

        await until(backend, restarting)
        before = len(kube.requests)
        in_place = action(ActionType.RESTART_IN_PLACE, node=slow_node, event_id=7)
        assert await backend.execute(in_place) == {"skipped": RESTARTED_1}
        workload = action(ActionType.RESTART_WORKLOAD, key="k2", id_=2, event_id=7)
        assert await backend.execute(workload) == {"skipped": RESTARTED_1}
        swap = action(ActionType.HOT_SWAP, node=slow_node, key="k3", id_=3, event_id=7)
        result = await backend.execute(swap)
        assert result["pods"] == {} and result["skipped"] == f"no pod to move: {RESTARTED_1}"
        assert disruptions(kube, before) == []
        node = kube.get("Node", slow_node)
        assert node["spec"]["unschedulable"] is True
        assert o.has_taint(node, settings.kube_taint_key)
        assert len(events_about(kube, "train", "AlreadyRestarted")) == 3

        kube.delete("Pod", o.name_of(slow), gracePeriodSeconds=0)
        fresh = kube.wait_for(lambda: generation(kube, 1), 10)
        assert slow_node not in {p["spec"]["nodeName"] for p in fresh}
        assert kube.get("JobSet", "train")["status"]["restarts"] == 1


async def test_a_restart_waits_for_the_jobset_controller_to_react(
    kube: FakeKube, make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pod has failed, and its Job with it, but the JobSet controller has not reacted
    yet: the restarts wait for it (by watching, up to controller_patience_s) instead of
    deleting Jobs it is about to delete, then find the JobSet restarted and do nothing."""
    pods = setup_cluster(kube)
    crashed = pods[0]
    node = crashed["spec"]["nodeName"]
    hooks = Hooks()
    async with started(
        kube, kube_settings(make_settings), hooks, controller_patience_s=30.0
    ) as backend:
        await until(backend, lambda: node in backend.discovery.nodes_of("train"))
        pause_jobset_controller(kube, monkeypatch)
        crash(hooks, 7, node)
        kube.fail_pod(crashed["metadata"]["name"])
        await until(backend, lambda: failed_in_cache(backend, o.name_of(crashed)))
        before = len(kube.requests)
        in_place = asyncio.create_task(
            backend.execute(action(ActionType.RESTART_IN_PLACE, node=node, event_id=7))
        )
        workload = asyncio.create_task(
            backend.execute(action(ActionType.RESTART_WORKLOAD, key="k2", id_=2, event_id=7))
        )
        await asyncio.sleep(0.5)
        assert not in_place.done() and not workload.done()
        monkeypatch.undo()  # the JobSet controller catches up: restart-attempt 1
        assert await asyncio.wait_for(in_place, 20) == {"skipped": RESTARTED_1}
        assert await asyncio.wait_for(workload, 20) == {"skipped": RESTARTED_1}
        assert disruptions(kube, before) == []
        kube.wait_for(lambda: generation(kube, 1), 10)


async def test_a_restart_with_nothing_to_act_on_fails_after_its_patience(
    kube: FakeKube, make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody replaces the failed pod within controller_patience_s: the restart in place
    fails (retryable: the actuator tries again) naming what it did not find."""
    pods = setup_cluster(kube)
    crashed = pods[0]
    node = crashed["spec"]["nodeName"]
    hooks = Hooks()
    async with started(
        kube, kube_settings(make_settings), hooks, controller_patience_s=0.5
    ) as backend:
        await until(backend, lambda: node in backend.discovery.nodes_of("train"))
        pause_jobset_controller(kube, monkeypatch)
        crash(hooks, 7, node)
        kube.fail_pod(crashed["metadata"]["name"])
        await until(backend, lambda: failed_in_cache(backend, o.name_of(crashed)))
        with pytest.raises(ActionError, match=f"no running pod of train on {node}") as e:
            await backend.execute(action(ActionType.RESTART_IN_PLACE, node=node, event_id=7))
        assert e.value.retryable


async def test_a_pod_its_job_replaced_is_not_restarted_again(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """backoffLimit 1: the Job itself replaces the crashed pod (same restart-attempt, no
    JobSet restart). The replacement was created after the event: not evicted."""
    for i in range(2):
        kube.add_node(f"gpu-{i}", gpus=8, labels=GPU)
    body = jobset()
    body["spec"]["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] = 1
    kube.create(body)
    pods = kube.wait_for(lambda: pods_running(kube, 2), 10)
    crashed = pods[0]
    node = crashed["spec"]["nodeName"]
    hooks = Hooks()
    async with started(kube, kube_settings(make_settings), hooks) as backend:
        await until(backend, lambda: node in backend.discovery.nodes_of("train"))
        crash(hooks, 7, node)
        kube.fail_pod(crashed["metadata"]["name"])
        replacement = kube.wait_for(
            lambda: [
                p
                for p in running_pods(kube)
                if p["spec"]["nodeName"] == node
                and p["metadata"]["uid"] != crashed["metadata"]["uid"]
            ],
            10,
        )
        await until(
            backend,
            lambda: any(
                o.uid_of(p) == replacement[0]["metadata"]["uid"] and o.pod_running(p)
                for p in backend.discovery.pods_of("train")
            ),
        )
        before = len(kube.requests)
        result = await backend.execute(action(ActionType.RESTART_IN_PLACE, node=node, event_id=7))
        assert result == {
            "skipped": f"already replaced: the pods of train on {node} were created after"
            " the event (restart-attempt 0)"
        }
        assert disruptions(kube, before) == []
        assert kube.get("JobSet", "train")["status"].get("restarts", 0) == 0


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


class Beats:
    """Host monitors heartbeating through the API: what each node says, every 0.2 s."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.says: dict[str, dict[str, Any]] = {}
        self.step = 0

    def running(self, node: str, rank: int, **worker: Any) -> None:
        state = {"rank": rank, "local_rank": 0, "pid": 10 + rank, "state": "running"} | worker
        # Port 9 (discard) is closed here: emergency checkpoints fail fast.
        self.says[node] = {
            "node": node,
            "state": "running",
            "job": "train",
            "workers": [state],
            "address": "http://127.0.0.1:9",
        }

    async def send(self) -> None:
        self.step += 1
        for body in list(self.says.values()):
            for worker in body.get("workers") or []:
                if worker["state"] == "running":
                    worker["step"] = self.step
            r = await self.http.post("/api/v1/heartbeats", json=body, headers=AGENT)
            assert r.status_code < 300, r.text

    async def run(self) -> None:
        while True:
            await self.send()
            await asyncio.sleep(0.2)


@asynccontextmanager
async def supervising(
    kube: FakeKube, settings: Settings, **options: Any
) -> AsyncIterator[tuple[Supervisor, httpx.AsyncClient, Beats]]:
    backend = KubeBackend(
        settings, kube.client(), request_timeout_s=2.0, watch_timeout_s=2, **options
    )
    supervisor = Supervisor(settings, backend=backend)
    app = create_app(settings, supervisor)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            beats = Beats(http)
            task = asyncio.create_task(beats.run())
            try:
                yield supervisor, http, beats
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


async def finished_action(http: httpx.AsyncClient, type_: str) -> dict[str, Any]:
    async def done() -> list[dict[str, Any]]:
        r = await http.get("/api/v1/actions", params={"type": type_}, headers=OPERATOR)
        assert r.status_code == 200, r.text
        return [a for a in r.json()["items"] if a["status"] in ("succeeded", "failed")]

    for _ in range(400):
        if found := await done():
            return found[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no finished {type_} action")


async def test_a_crash_the_jobset_restarts_by_itself_is_not_restarted_twice(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """The real app with the Kubernetes backend. A worker crashes: the kubelet fails its
    pod, the JobSet controller restarts the JobSet (an old pod is slow to terminate),
    and the host monitor reports the exit. The default policy's restart in place for
    that worker_exited event succeeds as a no-op: one restart of the job, not two."""
    pods = setup_cluster(kube)
    crashed, slow = pods
    node = crashed["spec"]["nodeName"]
    settings = kube_settings(
        make_settings,
        heartbeat_timeout_s=3.0,
        heartbeat_polling_period_s=0.2,
        emergency_checkpoint_timeout_s=1.0,
    )
    async with supervising(kube, settings) as (supervisor, http, beats):
        for rank, pod in enumerate(pods):
            beats.running(pod["spec"]["nodeName"], rank)
        await wait(lambda: supervisor.sensor.has_node(node))
        kube.stick_pod(slow["metadata"]["name"])
        kube.fail_pod(crashed["metadata"]["name"])
        kube.wait_for(
            lambda: kube.get("Pod", crashed["metadata"]["name"])["status"]["phase"] == "Failed"
        )
        beats.running(node, 0, state="exited", exit_code=1)

        done = await finished_action(http, "restart_in_place")
        assert done["status"] == "succeeded", done
        assert done["result"] == {"skipped": RESTARTED_1}
        assert done["event_id"] is not None and done["node"] == node
        assert not [r for r in kube.requests if r.path.endswith("/eviction")]

        kube.delete("Pod", slow["metadata"]["name"], gracePeriodSeconds=0)
        kube.wait_for(lambda: generation(kube, 1), 10)
        assert kube.get("JobSet", "train")["status"]["restarts"] == 1
        message = events_about(kube, "train", "AlreadyRestarted")[0]["message"]
        assert f"supervisor action {done['id']}" in message


# --- spares the policy can see ---------------------------------------------------------------


async def test_the_cluster_says_which_nodes_are_spares_and_cordoned(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """What the policy sees (its context, through the supervisor): an idle, schedulable
    GPU node whose host monitor still reports its last job is a spare; one whose host
    monitor went silent is not; a GPU node with no host monitor is not invented; a node
    cordoned in Kubernetes is cordoned to the policy, whatever its heartbeats say."""
    pods = setup_cluster(kube, nodes=5)
    used = sorted(p["spec"]["nodeName"] for p in pods)
    idle = sorted({f"gpu-{i}" for i in range(5)} - set(used))
    stale, silent, unmonitored = idle
    settings = kube_settings(make_settings, heartbeat_timeout_s=1.5, heartbeat_polling_period_s=0.2)
    async with supervising(kube, settings) as (supervisor, _http, beats):
        for rank, name in enumerate(used):
            beats.running(name, rank)
        # Its workers were moved off; its host monitor still names the job.
        beats.says[stale] = {"node": stale, "state": "complete", "job": "train"}
        beats.says[silent] = {"node": silent, "state": "spare"}
        await wait(lambda: {stale, silent} <= set(supervisor.sensor.node_names()))
        del beats.says[silent]
        await wait(lambda: not supervisor.sensor.node_view(silent).alive)

        context = await supervisor.controller.context()
        assert context.spares == (stale,)
        view = context.nodes[stale]
        assert view.state is NodeState.SPARE and view.job is None and not view.cordoned
        assert supervisor.sensor.node_view(stale).state is NodeState.COMPLETE
        assert unmonitored not in context.nodes
        assert {context.nodes[n].state for n in used} == {NodeState.RUNNING}

        # A node Kubernetes has placed a pod on is no spare, even while its host monitor,
        # which has not heard of the pod's workers yet, says it is.
        beats.says[used[0]] = {"node": used[0], "state": "spare"}
        await wait(lambda: supervisor.sensor.node_view(used[0]).state is NodeState.SPARE)
        context = await supervisor.controller.context()
        assert context.spares == (stale,)
        beats.running(used[0], 0)

        kube.patch("Node", stale, {"spec": {"unschedulable": True}})  # kubectl cordon

        async def cordoned() -> bool:
            ctx = await supervisor.controller.context()
            return ctx.nodes[stale].cordoned and ctx.spares == ()

        for _ in range(200):
            if await cordoned():
                break
            await asyncio.sleep(0.05)
        assert await cordoned()


async def test_the_policy_hot_swaps_onto_a_spare_only_kubernetes_knows(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """The spare's host monitor still reports the job it ran (no "spare" heartbeat), so
    the sensor alone knows no spare and the default policy would restart the workload;
    Kubernetes says the node is schedulable and idle: the policy hot-swaps onto it."""
    pods = setup_cluster(kube, nodes=3, annotations={o.MIN_REPLICAS: "1"})
    used = sorted(p["spec"]["nodeName"] for p in pods)
    spare = next(n for n in ("gpu-0", "gpu-1", "gpu-2") if n not in used)
    bad = used[0]
    settings = kube_settings(
        make_settings,
        heartbeat_timeout_s=1.5,
        heartbeat_polling_period_s=0.2,
        max_workload_restarts=0,
        emergency_checkpoint_timeout_s=1.0,
    )
    async with supervising(kube, settings) as (supervisor, http, beats):
        for rank, name in enumerate(used):
            beats.running(name, rank)
        beats.says[spare] = {"node": spare, "state": "complete", "job": "train"}
        await wait(lambda: {*used, spare} <= set(supervisor.sensor.node_names()))
        assert supervisor.sensor.node_view(spare).state is NodeState.COMPLETE
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
        await wait(
            lambda: {p["spec"]["nodeName"] for p in pods_running(kube, 2)} == {used[1], spare}
        )
        r = await http.get("/api/v1/actions", params={"type": "restart_workload"}, headers=OPERATOR)
        assert r.json()["items"] == []
