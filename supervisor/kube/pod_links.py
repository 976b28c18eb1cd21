"""What the host monitors of a JobSet's nodes must know of its pods, kept told: the
torch.distributed world of each pod of a JobSet that heals in-process, and each node's
checkpoint partner (the peer tier).

**Worlds.** A JobSet annotated `resiliency.supervisor.io/in-process-restart: "true"` has a
current world (worlds.py). Its pods bound to a node are assigned that world, by its number
(the pod's `restart-attempt` plus the attempt), through their
node's host monitor (POST /v1/workers/world, for the pod's UID and each of its ranks: a
pod runs `resiliency.supervisor.io/nproc-per-node` of them), once per rank and world:
the survivors of an in-process heal learn the new world when the heal moves the JobSet to
it, a replacement pod when it is scheduled. Its workers wait for it (WORLD_WAIT_S), so that
no worker starts in a world the others have left (see `_world_requests`).

**Partners.** As in local mode, the node of rank r sends copies of its RAM checkpoints to
the node of the same shard in the next data-parallel replica (the next rank's, with one
replica), so that losing a whole replica loses no shard; each node's host monitor is told
its partner (PUT /v1/checkpoint-peer) whenever the placement changes. After an in-process
heal the survivors keep their nodes, so the replacement's partner is the node that holds
the copies of its rank.

Level-triggered: every change seen by the watches (and every `RESYNC_S`) compares what
should be known with what was told, and tells the difference; a host monitor that did not
answer is told again on the next round. What was told is kept in memory only: a new
leader tells everything once more (both requests are idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx
from pydantic import BaseModel

from resiliency_protocol.launch import ranks_of
from resiliency_protocol.node_commands import AssignWorldRequest, CheckpointPeer, NodeStatus
from resiliency_protocol.states import WorkerState
from supervisor.actuator.backend import Fenced
from supervisor.kube import objects as o
from supervisor.kube.discovery import Discovery
from supervisor.kube.objects import Obj
from supervisor.kube.worlds import current_world

log = logging.getLogger(__name__)

RESYNC_S = 30.0  # partners are told again this often (a restarted host monitor forgets)
REQUEST_TIMEOUT_S = 5.0
RETRY_S = 1.0


def live_pods(discovery: Discovery, jobset: str) -> list[Obj]:
    """The JobSet's pods bound to a node, neither finished nor being deleted."""
    return [
        p
        for p in discovery.pods_of(jobset)
        if o.node_of(p) and not o.pod_finished(p) and not o.terminating(p)
    ]


class PodLinks:
    def __init__(
        self,
        discovery: Discovery,
        http: httpx.AsyncClient,
        host_monitor_url: Callable[[str], str | None],
        fence: Callable[[], None],
    ) -> None:
        self.discovery = discovery
        self._http = http
        self._url = host_monitor_url
        self._fence = fence
        self._worlds_told: dict[tuple[str, int], int] = {}  # (pod UID, rank) -> world number
        # JobSet -> (world, node rank -> the UID of its member pod)
        self._members: dict[str, tuple[int, dict[int, str]]] = {}
        self._partners_told: dict[str, tuple[str, str, float]] = {}  # node -> partner, url, when
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # --- what should be known ---------------------------------------------------------------

    def _pods(self, js: Obj) -> tuple[dict[int, Obj], o.JobShape]:
        """(node rank -> pod, shape) of the JobSet's live pods: a pod is a node of the job,
        running the ranks `ranks_of(node rank, nproc_per_node)`."""
        shape = self.discovery.shape(js)
        rjob = o.dp_replicated_job(js) or {}
        pods: dict[int, Obj] = {}
        for pod in live_pods(self.discovery, o.name_of(js)):
            if o.labels_of(pod).get(o.REPLICATED_JOB_NAME) not in (None, rjob.get("name")):
                continue
            node_rank = o.pod_rank(pod, shape.num_nodes_per_dp)
            if node_rank is not None:
                pods[node_rank] = pod
        return pods, shape

    def _world_requests(self) -> list[tuple[str, AssignWorldRequest]]:
        """(node, body) of each world to tell.

        A world has one pod per rank, its members: the first pod of each rank seen while
        the world is current, but for the pods the heal into it replaces. A pod that
        comes later for a rank that has a member (the replacement of a lost pod) joins
        only the next world, which the in-process heal creates: told the current one, it
        would meet the survivors' failed process group.
        When no member of the world is left at all (the JobSet was restarted whole), the
        pods that come join it afresh.
        """
        todo = []
        for name, js in self.discovery.jobsets().items():
            if not o.in_process_enabled(js):
                continue
            pods, shape = self._pods(js)
            world = current_world(js, list(pods.values()))
            attempt, members = self._members.get(name, (world.attempt, {}))
            present = {o.uid_of(p) for p in self.discovery.pods_of(name) if not o.pod_finished(p)}
            if attempt != world.attempt or not set(members.values()) & present:
                members = {}
            self._members[name] = (world.attempt, members)
            for node_rank, pod in sorted(pods.items()):
                uid = o.uid_of(pod)
                if uid in world.replaced:
                    continue  # being replaced: its replacement is the member
                if members.setdefault(node_rank, uid) != uid:
                    continue  # a replacement: it joins the next world
                number = world.number(o.restart_attempt(pod))
                for rank in ranks_of(node_rank, shape.nproc_per_node):
                    if self._worlds_told.get((uid, rank)) == number:
                        continue
                    body = AssignWorldRequest(
                        request_id=f"{uid}-{rank}-{number}",
                        job=name,
                        rank=rank,
                        instance=uid,
                        attempt=str(number),
                        env=world.env(shape.world_size, o.restart_attempt(pod)),
                    )
                    todo.append((str(o.node_of(pod)), body))
        return todo

    def partners(self) -> dict[str, str]:
        """node -> the node that keeps copies of its RAM checkpoints."""
        out: dict[str, str] = {}
        for js in self.discovery.jobsets().values():
            pods, shape = self._pods(js)
            nodes = shape.num_dp_replicas * shape.num_nodes_per_dp
            offset = shape.num_nodes_per_dp if shape.num_dp_replicas > 1 else 1
            for node_rank, pod in pods.items():
                partner_pod = pods.get((node_rank + offset) % max(1, nodes))
                node, partner = o.node_of(pod), o.node_of(partner_pod) if partner_pod else None
                if node and partner and partner != node:
                    out[node] = partner
        return out

    def _partner_requests(self) -> list[tuple[str, CheckpointPeer]]:
        todo = []
        now = time.monotonic()
        for node, partner in sorted(self.partners().items()):
            url = self._url(partner)
            if url is None:
                continue
            told = self._partners_told.get(node)
            if told is not None and told[:2] == (partner, url) and now - told[2] < RESYNC_S:
                continue
            todo.append((node, CheckpointPeer(node=partner, url=url)))
        return todo

    def pending(self) -> bool:
        return bool(self._world_requests() or self._partner_requests())

    # --- telling ------------------------------------------------------------------------------

    async def sync(self) -> bool:
        """Tell what is not known yet; False when a host monitor failed (it is told next
        round)."""
        worlds, partners = self._world_requests(), self._partner_requests()
        told = await asyncio.gather(
            *(self._tell_world(node, body) for node, body in worlds),
            *(self._tell_partner(node, body) for node, body in partners),
        )
        informer = self.discovery.informers.get("Pod")
        live = {o.uid_of(p) for p in informer.items.values()} if informer else set()
        for key in [k for k in self._worlds_told if k[0] not in live]:
            del self._worlds_told[key]
        return all(told)

    async def _call(self, node: str, method: str, path: str, body: BaseModel) -> bool:
        url = self._url(node)
        if url is None:
            return False
        self._fence()
        try:
            response = await self._http.request(
                method,
                f"{url}{path}",
                json=body.model_dump(mode="json", exclude_unset=True),
                timeout=REQUEST_TIMEOUT_S,
            )
        except httpx.HTTPError as exc:
            log.info("host monitor of %s: %s %s failed: %s", node, method, path, exc)
            return False
        if response.status_code != 200:
            log.warning(
                "host monitor of %s: %s %s answered %d: %s",
                node,
                method,
                path,
                response.status_code,
                response.text[:200],
            )
            return False
        return True

    async def _tell_world(self, node: str, body: AssignWorldRequest) -> bool:
        if not await self._call(node, "POST", "/v1/workers/world", body):
            return False
        self._worlds_told[(body.instance, body.rank)] = int(body.attempt)
        log.info(
            "JobSet %s: rank %d (pod %s on %s) is in world %s",
            body.job,
            body.rank,
            body.instance,
            node,
            body.attempt,
        )
        return True

    async def _tell_partner(self, node: str, body: CheckpointPeer) -> bool:
        if not await self._call(node, "PUT", "/v1/checkpoint-peer", body):
            return False
        self._partners_told[node] = (body.node, body.url, time.monotonic())
        log.info("node %s keeps its checkpoint copies on %s", node, body.node)
        return True

    def ended_member(self, jobset: str, attempt: int) -> str | None:
        """A pod of world `attempt` that ended (failed, or went away) before the world
        trained: the world cannot form any more, as the next pod of its rank joins only the
        next world. Its name (its UID when it is gone), else None."""
        world, members = self._members.get(jobset, (None, {}))
        if world != attempt:
            return None
        pods = {o.uid_of(p): p for p in self.discovery.pods_of(jobset)}
        for uid in members.values():
            pod = pods.get(uid)
            if pod is None:
                return uid
            if o.pod_finished(pod):
                return o.name_of(pod)
        return None

    async def joined(self, jobset: str, attempt: int) -> list[int]:
        """The ranks not yet training in world `attempt`, as their host monitors say."""
        js = self.discovery.jobset(jobset)
        if js is None:
            return []
        pods, shape = self._pods(js)
        waiting = set(range(shape.world_size))
        nodes = sorted({str(o.node_of(p)) for p in pods.values()})
        # What each node's ranks report training in world `attempt`: its world number.
        numbers = {str(o.node_of(p)): str(attempt + o.restart_attempt(p)) for p in pods.values()}

        async def status(node: str) -> NodeStatus | None:
            url = self._url(node)
            if url is None:
                return None
            try:
                response = await self._http.get(f"{url}/v1/status", timeout=REQUEST_TIMEOUT_S)
                if response.status_code != 200:
                    return None
                return NodeStatus.model_validate_json(response.content)
            except (httpx.HTTPError, ValueError):  # ValidationError is a ValueError
                return None

        answers = await asyncio.gather(*(status(n) for n in nodes))
        for node, answer in zip(nodes, answers, strict=True):
            if answer is None or answer.job != jobset:
                continue
            for worker in answer.workers:
                if worker.attempt == numbers[node] and worker.state == WorkerState.RUNNING:
                    waiting.discard(worker.rank)
        return sorted(waiting)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kube-pod-links")

    async def close(self) -> None:
        self._closing = True
        task, self._task = self._task, None
        # Python 3.11's wait_for may swallow a cancellation that meets its own timeout:
        # cancel until the task has ended (the flag ends its loop too).
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                task.result()

    async def _run(self) -> None:
        while not self._closing:
            try:
                await self.discovery.wait_until(self.pending, 1.0)
                if not await self.sync():
                    await asyncio.sleep(RETRY_S)  # a host monitor failed: not in a tight loop
            except asyncio.CancelledError:
                raise
            except Fenced:  # not the leader (any more): the new one tells them
                await asyncio.sleep(1.0)
                continue
            except Exception:  # never let one bad round stop the loop
                log.exception("telling host monitors about pods failed; retrying")
                await asyncio.sleep(1.0)
                continue
            await asyncio.sleep(0.05)  # the round's own answers may change what is pending
