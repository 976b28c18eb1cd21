"""What the lifecycle and sensing tests on the real control plane (tests/control_plane.py)
share beside tests/kube_real.py: the requests the backend sent (as its client sent them),
a JobSet controller held back, a kubelet that goes and comes back, and the supervisor's
app (create_app, its lifespan, SQLite) with the Kubernetes backend as the chart's
ServiceAccount, host monitors heartbeating through its HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx

from supervisor.api import create_app
from supervisor.domain import Event, EventType, utcnow
from supervisor.kube import objects as o
from supervisor.kube.backend import KubeBackend
from supervisor.runtime import Supervisor
from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN, SettingsFactory
from tests.control_plane import KWOK_NODE_LABEL, KWOK_NODE_VALUE, ControlPlane, Identity
from tests.kube.harness import Hooks
from tests.kube_real import (
    merge_patch,
    pool_nodes,
    real_backend,
    real_settings,
    start_jobset,
    wait_running,
)
from tests.timing import scaled

AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
#: The label of a test's JobSet that its supervisor selects: other tests' JobSets share
#: the namespace, and the policy must not act on them.
SUPERVISED = "tests.resiliency-supervisor.io/supervised-by"


class Sent:
    """Every request the backend's client sent to the API server, (method, path), in
    order, and its body (`bodies`, in the same order): the calls are passed on unchanged,
    only written down."""

    def __init__(self, backend: KubeBackend) -> None:
        self.requests: list[tuple[str, str]] = []
        self.bodies: list[Any] = []
        lock = threading.Lock()  # the watches send from threads of their own
        rest = backend.api.rest_client
        send: Callable[..., Any] = rest.request

        def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
            with lock:
                self.requests.append((method, urlsplit(url).path))
                self.bodies.append(kwargs.get("body"))
            return send(method, url, *args, **kwargs)

        setattr(rest, "request", request)  # noqa: B010  # one client's, not its class's

    def __len__(self) -> int:
        return len(self.requests)

    def writes(self, since: int = 0) -> list[tuple[str, str]]:
        return [r for r in self.requests[since:] if r[0] in ("POST", "PUT", "PATCH", "DELETE")]

    def disruptions(self, since: int = 0) -> list[tuple[str, str]]:
        """Evictions and deletions (of pods, Jobs, JobSets) sent from request `since` on."""
        return [
            (method, path)
            for method, path in self.writes(since)
            if method == "DELETE" or path.endswith("/eviction")
        ]


@contextlib.contextmanager
def jobset_controller_paused(plane: ControlPlane) -> Iterator[None]:
    """The JobSet controller stopped (SIGSTOP: a controller fallen behind) until the block
    ends. Its webhooks stop with it: nothing in the block may write a JobSet."""
    pid = plane.procs["jobset-controller"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def manage(plane: ControlPlane, node: str) -> None:
    """kwok plays the node's kubelet again (tests/kube_real.py's `unmanage` undone): the
    pods deleted meanwhile end, as a kubelet that comes back ends them."""
    labels = {KWOK_NODE_LABEL: KWOK_NODE_VALUE}
    merge_patch(plane, f"/api/v1/nodes/{node}", {"metadata": {"labels": labels}})


def crash(hooks: Hooks, event_id: int, node: str, job: str) -> Event:
    """The supervisor records a worker_exited event on `node` (its time: now)."""
    event = Event(
        EventType.WORKER_EXITED,
        utcnow(),
        node=node,
        job=job,
        rank=0,
        details={"exit_code": 1},
        id=event_id,
    )
    hooks.recorded[event_id] = event
    return event


async def wait(predicate: Callable[[], Any], what: str, within: float = 30.0) -> Any:
    """The predicate's first true value, polled, for scaled(within) seconds at most."""
    deadline = asyncio.get_running_loop().time() + scaled(within)
    while not (value := predicate()):
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {within} s"
        await asyncio.sleep(0.05)
    return value


class Beats:
    """Host monitors heartbeating through the API: what each node says, every 0.2 s."""

    def __init__(self, http: httpx.AsyncClient, job: str) -> None:
        self.http = http
        self.job = job
        self.says: dict[str, dict[str, Any]] = {}
        self.step = 0

    def running(self, node: str, rank: int, **worker: Any) -> None:
        state = {"rank": rank, "local_rank": 0, "pid": 10 + rank, "state": "running"} | worker
        # Port 9 (discard) is closed here: emergency checkpoints fail fast.
        self.says[node] = {
            "node": node,
            "state": "running",
            "job": self.job,
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
    plane: ControlPlane, who: Identity, make_settings: SettingsFactory, pool: str, **overrides: Any
) -> AsyncIterator[tuple[Supervisor, httpx.AsyncClient, Beats, Sent]]:
    """The supervisor's app with the Kubernetes backend as `who`, seeing the nodes of
    `pool` as its GPU nodes and the JobSet `pool` (labelled SUPERVISED) as its job; host
    monitors heartbeat for the nodes `Beats.says` names."""
    settings = real_settings(
        who, make_settings, pool, kube_jobset_selector=f"{SUPERVISED}={pool}", **overrides
    )
    backend = real_backend(settings)
    sent = Sent(backend)
    supervisor = Supervisor(settings, backend=backend)
    app = create_app(settings, supervisor)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            beats = Beats(http, pool)
            task = asyncio.create_task(beats.run())
            try:
                yield supervisor, http, beats, sent
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


#: A hot-swap's settings: a node silent for 3 s is lost, no workload restart is left to
#: try first, and an emergency checkpoint that cannot be taken gives up within 1 s. The
#: beats go in rounds through the app in the test's own process: beside two CPU burners a
#: round once took 1.7 s at the scene's start, and a node still beating was lost (1.5 s).
SWAP_SETTINGS: dict[str, Any] = {
    "heartbeat_timeout_s": 3.0,
    "heartbeat_polling_period_s": 0.2,
    "max_workload_restarts": 0,
    "emergency_checkpoint_timeout_s": 1.0,
}


def swap_scene(plane: ControlPlane, name: str) -> tuple[list[dict[str, Any]], list[str], str]:
    """Three nodes in the pool `name` and the JobSet `name` (labelled SUPERVISED, at least
    one replica) running on two of them: its pods, their nodes sorted, and the spare."""
    nodes = pool_nodes(plane, name, 3)
    labels = {SUPERVISED: name}
    start_jobset(plane, name, name, labels, annotations={o.MIN_REPLICAS: "1"})
    pods = wait_running(plane, name, 2, "0")
    used = sorted(p["spec"]["nodeName"] for p in pods)
    (spare,) = set(nodes) - set(used)
    return pods, used, spare


async def listed(http: httpx.AsyncClient, path: str, **params: Any) -> list[dict[str, Any]]:
    r = await http.get(path, params=params, headers=OPERATOR)
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["items"]
    return items


async def finished_action(http: httpx.AsyncClient, type_: str) -> dict[str, Any]:
    """The first action of `type_` to succeed or fail, waited for."""
    deadline = asyncio.get_running_loop().time() + scaled(60)
    while asyncio.get_running_loop().time() < deadline:
        items = await listed(http, "/api/v1/actions", type=type_)
        if done := [a for a in items if a["status"] in ("succeeded", "failed")]:
            return done[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no finished {type_} action")
