"""The Kubernetes backend: actions on JobSets, their pods and the nodes, through the
official client.

This class is the lifecycle (the watches, sensing, node recovery, what host monitors are
told) and the views the supervisor reads; `execute` hands each action to the module of
its family (restart.py, in_process.py, eviction.py, nodes.py, scale.py, emergency.py),
and the API errors that reach it back to the actuator as `ActionError`s.

Idempotency: every action writes a journal entry, keyed by its idempotency key, into an
annotation (`resiliency.supervisor.io/actions`) of the object it is about (the JobSet,
or the Node for node actions), with the exact targets it chose (pod and Job UIDs),
before it touches anything; the write carries the resourceVersion it read (409 ->
read again). A repeat after a crash reads the entry and acts on the same targets; their
UID preconditions make a second delete or eviction of an object that was already
replaced a no-op. A finished entry is answered from the journal without any write.

Worlds: the job's world is its JobSet's restart count plus its in-process attempt
(worlds.py); the supervisor is told it at every JobSet change the watch sees, and refuses
reports of older worlds (supervisor/sensor/worlds.py).

Generations: a disruptive action acts on the pods or Jobs that existed at the time of
the event it answers, never on those the JobSet controller created since; if the JobSet
has restarted by itself meanwhile, the action is skipped (see `generations.py`).

How each action is done (and why) is in docs/kubernetes.md.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Mapping
from typing import Any, ClassVar

import httpx
from kubernetes import client

from supervisor.actuator.backend import (
    ActionError,
    ActionTable,
    Backend,
    BackendHooks,
    ClusterNode,
    WorldStarted,
    dispatch,
)
from supervisor.actuator.leader_epoch import stamp
from supervisor.config import Settings
from supervisor.domain import ActionRecord, ActionType, JobView
from supervisor.kube import emergency, eviction, nodes, restart
from supervisor.kube import objects as o
from supervisor.kube.action_context import ActionContext
from supervisor.kube.calls import Calls
from supervisor.kube.discovery import Discovery
from supervisor.kube.errors import KubeError
from supervisor.kube.events import EventRecorder
from supervisor.kube.in_process import InProcessHealing
from supervisor.kube.objects import Obj
from supervisor.kube.pod_links import PodLinks
from supervisor.kube.recovery import NodeRecovery
from supervisor.kube.scale import Rescaling
from supervisor.kube.sensing import KubeSensing
from supervisor.kube.worlds import fenced_world

log = logging.getLogger(__name__)

#: How long execute() waits for the watches' first lists.
SYNC_TIMEOUT_S = 30.0
#: How often that wait looks for a JobSet list refused for want of the CRD.
SYNC_CHECK_S = 0.5


class KubeBackend(Backend):
    name = "kubernetes"

    def __init__(
        self,
        settings: Settings,
        api: client.ApiClient | None = None,
        *,
        request_timeout_s: float = 10.0,
        watch_timeout_s: int = 300,
        api_attempts: int = 4,
        api_backoff_s: tuple[float, float] = (0.2, 5.0),
        eviction_patience_s: float | None = None,
        controller_patience_s: float | None = None,
        read_only: bool = False,
    ) -> None:
        #: Watch the cluster and never change it, nor tell host monitors anything (the
        #: backend under a dry-run supervisor, which may run beside the acting one).
        self.read_only = read_only
        if api is None:
            from supervisor.kube.client import api_client

            api = api_client(settings)
        self.settings = settings
        self.api = api
        self.calls = Calls(
            request_timeout_s=request_timeout_s, attempts=api_attempts, backoff_s=api_backoff_s
        )
        self.discovery = Discovery(
            api,
            settings.kubernetes,
            settings.workload,
            watch_timeout_s=watch_timeout_s,
            request_timeout_s=request_timeout_s,
        )
        self.events = EventRecorder(api, self.calls, host=socket.gethostname())
        self.sensing: KubeSensing | None = None
        self.recovery: NodeRecovery | None = None
        self._started = False
        token = settings.host_monitor_actuator_token
        headers = {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}
        self._http = httpx.AsyncClient(headers=headers, verify=settings.host_monitor_ssl_context())
        self.ctx = ActionContext(
            settings=settings,
            calls=self.calls,
            core=client.CoreV1Api(api),
            batch=client.BatchV1Api(api),
            custom=client.CustomObjectsApi(api),
            discovery=self.discovery,
            events=self.events,
            http=self._http,
            eviction_patience_s=(
                settings.eviction_patience_s if eviction_patience_s is None else eviction_patience_s
            ),
            controller_patience_s=(
                settings.controller_patience_s
                if controller_patience_s is None
                else controller_patience_s
            ),
        )
        #: What the host monitors must know of the pods: worlds, checkpoint partners.
        self.links = PodLinks(
            self.discovery, self._http, self.ctx.host_monitor_url, lambda: self.calls.fence()
        )
        self.in_process = InProcessHealing(self.ctx, self.links)
        self.rescaling = Rescaling(self.ctx)
        self.discovery.listeners.append(self._jobset_changed)

    # --- worlds ---------------------------------------------------------------------------

    def follow_worlds(self, started: WorldStarted) -> None:
        super().follow_worlds(started)
        for js in self.discovery.jobsets().values():
            self._tell_world(js)

    def _jobset_changed(self, kind: str, type_: str, obj: Obj, _before: Obj | None) -> None:
        # Each JobSet restart the watch sees, and each in-process heal completed (ours,
        # or a previous leader's), moves the job's world on: reports of older ones are
        # refused from then on. Level-triggered, so a new leader knows it from its first
        # list.
        if kind == "JobSet" and type_ != "DELETED":
            self._tell_world(obj)

    def _tell_world(self, js: Obj) -> None:
        self.world_started(o.name_of(js), fenced_world(js), o.uid_of(js))

    # --- lifecycle ------------------------------------------------------------------------

    def act_in_epoch(self, epoch: int | None) -> None:
        stamp(self._http, epoch)

    async def start(self, hooks: BackendHooks) -> None:
        self.ctx.hooks = hooks
        self.calls.fence = hooks.fence
        self.sensing = KubeSensing(self.discovery, self.settings.kubernetes, hooks.raise_events)
        self.sensing.start()
        self._start_watches()
        self.recovery = NodeRecovery(
            self.discovery,
            self.settings.kubernetes,
            hooks.request_action,
            hooks.node_heartbeating,
            hooks.raise_events,
        )
        self.recovery.start()
        if not self.read_only:
            self.links.start()
        if not await self._synced():
            # Not a reason to exit: a restarted supervisor would meet the same cluster
            # (a crash loop); every action says why it cannot run until it is fixed.
            if (missing := self.discovery.jobset_crd_missing()) is not None:
                log.error("kubernetes backend: %s", missing)
            else:
                log.warning("kubernetes watches not synced after %.0fs; going on", SYNC_TIMEOUT_S)

    async def _synced(self) -> bool:
        """Wait for the watches' first lists, but not for a JobSet list the API server
        answers 404 (no JobSet CRD): that one will not come before someone installs it."""
        for _ in range(int(SYNC_TIMEOUT_S / SYNC_CHECK_S)):
            if self.discovery.jobset_crd_missing() is not None:
                return False
            if await self.discovery.synced(SYNC_CHECK_S):
                return True
        return False

    def _start_watches(self) -> None:
        if not self._started:
            self._started = True
            self.discovery.start()

    async def close(self) -> None:
        await self.links.close()
        if self.recovery is not None:
            await self.recovery.close()
        if self.sensing is not None:
            self.sensing.close()
        if self._started:
            await self.discovery.stop()
        await self._http.aclose()
        await asyncio.to_thread(self.api.close)

    # --- views ----------------------------------------------------------------------------

    def job_views(self) -> Mapping[str, JobView]:
        views = {}
        for name, shape in self.discovery.shapes().items():
            views[name] = JobView(
                name=name,
                num_dp_replicas=shape.num_dp_replicas,
                min_num_dp_replicas=shape.min_num_dp_replicas,
                max_num_dp_replicas=shape.max_num_dp_replicas,
                num_nodes_per_dp=shape.num_nodes_per_dp,
                nodes=tuple(self.discovery.nodes_of(name)),
            )
        return views

    def cluster_nodes(self) -> Mapping[str, ClusterNode]:
        spares = set(self.discovery.spares())
        key = self.settings.kube_taint_key
        return {
            name: ClusterNode(cordoned=o.cordoned(node, key), spare=name in spares)
            for name, node in self.discovery.nodes().items()
        }

    # --- dispatch -------------------------------------------------------------------------

    async def execute(self, action: ActionRecord) -> Mapping[str, Any]:
        if self.read_only:
            raise ActionError(f"{action.type.value}: this backend only watches (dry run)")
        self._start_watches()
        if not await self._synced():
            if (missing := self.discovery.jobset_crd_missing()) is not None:
                raise ActionError(missing)  # until a cluster admin installs it
            raise ActionError("the Kubernetes watches have not listed yet", retryable=True)
        try:
            return await dispatch(self.name, self.actions, self, action)
        except KubeError as exc:
            raise ActionError(str(exc), retryable=exc.retryable) from None

    #: Each action type to the function of its family.
    actions: ClassVar[ActionTable[KubeBackend]] = {
        ActionType.EMERGENCY_CHECKPOINT: lambda b, a: emergency.emergency_checkpoint(b.ctx, a),
        ActionType.RESTART_IN_PLACE: lambda b, a: restart.restart_in_place(
            b.ctx, a, heal=b.in_process.heal
        ),
        ActionType.RESTART_WORKLOAD: lambda b, a: restart.restart_workload(b.ctx, a),
        ActionType.HOT_SWAP: lambda b, a: nodes.hot_swap(b.ctx, a, heal=b.in_process.heal),
        ActionType.SCALE_DOWN: lambda b, a: b.rescaling.scale(a),
        ActionType.SCALE_UP: lambda b, a: b.rescaling.scale(a),
        ActionType.CORDON: lambda b, a: nodes.cordon(b.ctx, a),
        ActionType.UNCORDON: lambda b, a: nodes.uncordon(b.ctx, a),
        ActionType.FORCE_DELETE_POD: lambda b, a: eviction.force_delete_pod(b.ctx, a),
    }
