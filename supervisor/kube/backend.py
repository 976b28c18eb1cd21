"""The Kubernetes backend: actions on JobSets, their pods and the nodes, through the
official client.

Idempotency: every action writes a journal entry, keyed by its idempotency key, into an
annotation (`resiliency.supervisor.io/actions`) of the object it is about (the JobSet,
or the Node for node actions), with the exact targets it chose (pod and Job UIDs),
before it touches anything; the write carries the resourceVersion it read (409 ->
read again). A repeat after a crash reads the entry and acts on the same targets; their
UID preconditions make a second delete or eviction of an object that was already
replaced a no-op. A finished entry is answered from the journal without any write.

Generations: a disruptive action acts on the pods or Jobs that existed at the time of
the event it answers, never on those the JobSet controller created since; if the JobSet
has restarted by itself meanwhile, the action is skipped (see `generations.py`).

How each action is done (and why) is in docs/kubernetes.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import httpx
from kubernetes import client

from resiliency_protocol.emergency import emergency_checkpoint
from supervisor.actuator.backend import ActionError, Backend, BackendHooks, ClusterNode
from supervisor.backoff import Backoff
from supervisor.config import Settings
from supervisor.domain import ActionRecord, ActionType, JobView
from supervisor.kube import objects as o
from supervisor.kube.calls import Calls
from supervisor.kube.discovery import Discovery
from supervisor.kube.errors import ApiError, Conflict, KubeError, NotFound, TooManyRequests
from supervisor.kube.events import EventRecorder, event_name
from supervisor.kube.failure_policy import eviction_restart_refusal
from supervisor.kube.generations import (
    Verdict,
    jobs_to_restart,
    pods_to_restart,
    reference_time,
)
from supervisor.kube.in_process import InProcessHealing
from supervisor.kube.journal import (
    JournalEntry,
    Target,
    entry_of,
    journal_of,
    set_journal,
    target_of,
)
from supervisor.kube.objects import Obj
from supervisor.kube.pod_links import PodLinks
from supervisor.kube.recovery import NodeRecovery
from supervisor.kube.sensing import KubeSensing

log = logging.getLogger(__name__)

#: Attempts at a read-modify-write that keeps hitting 409 Conflict.
CONFLICT_ATTEMPTS = 8
#: Reason of the Event recorded before a JobSet is deleted to be recreated (scaling).
RESCALING = "Rescaling"
#: How long execute() waits for the watches' first lists.
SYNC_TIMEOUT_S = 30.0
#: Reason of the Event saying an action was skipped: the JobSet had restarted already.
ALREADY_RESTARTED = "AlreadyRestarted"


class _Unsettled(Exception):
    """A restart's generation is still being replaced by a controller: wait on."""


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns `old` into `new` (dicts only at the top)."""
    patch: Obj = {}
    for key in old.keys() | new.keys():
        if key not in new:
            patch[key] = None
        elif key not in old:
            patch[key] = new[key]
        elif isinstance(old[key], dict) and isinstance(new[key], dict):
            if sub := merge_patch(old[key], new[key]):
                patch[key] = sub
        elif old[key] != new[key]:
            patch[key] = new[key]
    return patch


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
        #: How long an eviction refused by a PodDisruptionBudget (429) is retried before
        #: the pod is deleted instead.
        self.eviction_patience_s = (
            settings.eviction_patience_s if eviction_patience_s is None else eviction_patience_s
        )
        #: How long a restart waits for the Job and JobSet controllers to react to pods
        #: or Jobs of its generation that have failed (they restart the JobSet
        #: themselves), before it acts, or fails for want of anything to act on.
        self.controller_patience_s = (
            settings.controller_patience_s
            if controller_patience_s is None
            else controller_patience_s
        )
        self.ns = settings.kube_namespace
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.calls = Calls(
            request_timeout_s=request_timeout_s, attempts=api_attempts, backoff_s=api_backoff_s
        )
        self.discovery = Discovery(
            api, settings, watch_timeout_s=watch_timeout_s, request_timeout_s=request_timeout_s
        )
        self.events = EventRecorder(api, self.calls, host=socket.gethostname())
        self.sensing: KubeSensing | None = None
        self.recovery: NodeRecovery | None = None
        self._hooks: BackendHooks | None = None
        self._started = False
        token = settings.host_monitor_actuator_token
        headers = {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}
        self._http = httpx.AsyncClient(headers=headers, verify=settings.host_monitor_ssl_context())
        # Bodies of JobSets being recreated (scale), by action key: a copy of what is
        # also kept in the old JobSet's annotation while it is being deleted.
        self._recreating: dict[str, Obj] = {}
        #: What the host monitors must know of the pods: worlds, checkpoint partners.
        self.links = PodLinks(
            self.discovery, self._http, self._host_monitor_url, lambda: self.calls.fence()
        )
        self.in_process = InProcessHealing(self)

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self, hooks: BackendHooks) -> None:
        self._hooks = hooks
        self.calls.fence = hooks.fence
        self.sensing = KubeSensing(self.discovery, self.settings, hooks.raise_events)
        self.sensing.start()
        self._start_watches()
        self.recovery = NodeRecovery(
            self.discovery,
            self.settings,
            hooks.request_action,
            hooks.node_heartbeating,
            hooks.raise_events,
        )
        self.recovery.start()
        if not self.read_only:
            self.links.start()
        if not await self.discovery.synced(SYNC_TIMEOUT_S):
            log.warning("kubernetes watches not synced after %.0fs; going on", SYNC_TIMEOUT_S)

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
        if not await self.discovery.synced(SYNC_TIMEOUT_S):
            raise ActionError("the Kubernetes watches have not listed yet", retryable=True)
        try:
            return await self._dispatch(action)
        except KubeError as exc:
            raise ActionError(str(exc), retryable=exc.retryable) from None

    async def _dispatch(self, action: ActionRecord) -> dict[str, Any]:
        match action.type:
            case ActionType.EMERGENCY_CHECKPOINT:
                return await self._emergency_checkpoint(action)
            case ActionType.RESTART_IN_PLACE:
                return await self._restart_in_place(action)
            case ActionType.RESTART_WORKLOAD:
                return await self._restart_workload(action)
            case ActionType.HOT_SWAP:
                return await self._hot_swap(action)
            case ActionType.SCALE_DOWN | ActionType.SCALE_UP:
                return await self._scale(action)
            case ActionType.CORDON:
                return await self._node_action(action, self._cordon_node, "Cordon")
            case ActionType.UNCORDON:
                return await self._node_action(action, self._restore_node, "Uncordon")
            case ActionType.FORCE_DELETE_POD:
                return await self._force_delete_pod(action)
        raise ActionError(f"the kubernetes backend cannot {action.type.value}")

    # --- reading and writing objects ------------------------------------------------------

    async def _read(self, kind: str, name: str) -> Obj:
        if kind == "Node":
            response = await self.calls.run(
                f"get node {name}", self.core.read_node, name, _preload_content=False
            )
        else:
            response = await self.calls.run(
                f"get jobset {name}",
                self.custom.get_namespaced_custom_object,
                o.JOBSET_GROUP,
                o.JOBSET_VERSION,
                self.ns,
                o.JOBSET_PLURAL,
                name,
                _preload_content=False,
            )
        obj: Obj = json.loads(response.data)
        return obj

    async def _patch(self, kind: str, name: str, patch: Obj) -> Obj:
        """Patch (merge patch on the JobSet; on the Node the client sends a strategic merge
        patch, which for labels, annotations, `unschedulable` and the atomic `taints`
        list means the same). `metadata.resourceVersion` in the patch is a precondition:
        409 Conflict if the object changed since it was read."""
        if kind == "Node":
            response = await self.calls.run(
                f"patch node {name}", self.core.patch_node, name, patch, _preload_content=False
            )
        else:
            response = await self.calls.run(
                f"patch jobset {name}",
                self.custom.patch_namespaced_custom_object,
                o.JOBSET_GROUP,
                o.JOBSET_VERSION,
                self.ns,
                o.JOBSET_PLURAL,
                name,
                patch,
                _preload_content=False,
            )
        written: Obj = json.loads(response.data)
        return written

    async def _modify(self, kind: str, name: str, change: Callable[[Obj], bool]) -> Obj:
        """Read, `change` a copy in place (returns whether it changed anything), send the
        difference as a patch conditional on the resourceVersion read; again on 409."""
        for _ in range(CONFLICT_ATTEMPTS):
            obj = await self._read(kind, name)
            changed = copy.deepcopy(obj)
            if not change(changed):
                return obj
            patch = merge_patch(obj, changed)
            if not patch:
                return obj
            patch.setdefault("metadata", {})["resourceVersion"] = o.meta(obj)["resourceVersion"]
            try:
                return await self._patch(kind, name, patch)
            except Conflict:
                continue
        raise ActionError(f"{kind} {name} kept changing under us (409 Conflict)", retryable=True)

    async def _plan(
        self,
        kind: str,
        name: str,
        key: str,
        plan: Callable[[Obj], JournalEntry],
        also: Callable[[Obj], bool] | None = None,
    ) -> tuple[Obj, JournalEntry]:
        """The journal entry of `key` on the object: the existing one, or `plan(obj)`,
        written together with whatever `also` changes on the object."""

        def change(obj: Obj) -> bool:
            changed = also(obj) if also is not None else False
            journal = journal_of(obj)
            if key not in journal:
                journal[key] = plan(obj)
                set_journal(obj, journal)
                changed = True
            return changed

        obj = await self._modify(kind, name, change)
        return obj, journal_of(obj)[key]

    async def _finish(self, kind: str, name: str, key: str, result: dict[str, Any]) -> None:
        def change(obj: Obj) -> bool:
            journal = journal_of(obj)
            entry = journal.get(key) or JournalEntry()
            if entry.done:
                return False
            journal[key] = entry.finished(result)
            set_journal(obj, journal)
            return True

        # NotFound: e.g. the JobSet was deleted meanwhile; nothing left to remember it on.
        with contextlib.suppress(NotFound):
            await self._modify(kind, name, change)

    async def _event(
        self,
        obj: Obj,
        kind: str,
        action: ActionRecord,
        reason: str,
        what: str,
        *,
        warning: bool = False,
        annotations: dict[str, str] | None = None,
    ) -> bool:
        api_version = {"Node": "v1", "Pod": "v1", "JobSet": o.JOBSET_API_VERSION}[kind]
        message = f"{what} (supervisor action {action.id}: {action.reason or action.type.value})"
        return await self.events.record(
            obj,
            kind=kind,
            api_version=api_version,
            key=action.idempotency_key,
            reason=reason,
            message=message,
            warning=warning,
            annotations=annotations,
        )

    def _jobset_name(self, action: ActionRecord) -> str:
        if not action.job:
            raise ActionError(f"{action.type.value} needs a job (a JobSet name)")
        return action.job

    def _node_name(self, action: ActionRecord) -> str:
        if not action.node:
            raise ActionError(f"{action.type.value} needs a node")
        return action.node

    # --- generations: act on what existed at the event, once ----------------------------------

    async def _reference_time(self, action: ActionRecord) -> datetime:
        """What a disruptive action is decided against: its event's reference time (see
        `generations.reference_time`), else its own creation (an operator's request)."""
        hooks = self._hooks
        if action.event_id is not None and hooks is not None and hooks.event is not None:
            try:
                event = await hooks.event(action.event_id)
            except Exception as exc:  # the store is down: try again later
                raise ActionError(
                    f"cannot read event {action.event_id}: {exc}", retryable=True
                ) from exc
            if event is not None:
                return reference_time(event, self.settings.heartbeat_polling_period_s)
        return action.created_at

    async def _plan_restart(
        self,
        action: ActionRecord,
        when: datetime,
        decide: Callable[[Obj], Verdict],
        how: Callable[[Obj, JournalEntry], JournalEntry] | None = None,
    ) -> tuple[Obj, JournalEntry]:
        """The journal entry of a restart: its targets, or why it is skipped.

        While pods or Jobs of its generation have failed and the Job or JobSet controller
        has not reacted yet (a JobSet restart makes the action a no-op), it waits for
        them, by watching, up to `controller_patience_s`; then it acts, or fails (for
        want of anything to act on). `how` adds what the JobSet says of the way to act
        to an entry with targets. An entry already journalled is taken as it is."""
        jobset, key = self._jobset_name(action), action.idempotency_key
        deadline = time.monotonic() + self.controller_patience_s

        def settled() -> bool:
            js = self.discovery.jobset(jobset)
            return js is None or key in journal_of(js) or not decide(js).wait

        def plan(js: Obj) -> JournalEntry:
            verdict = decide(js)
            if verdict.wait and time.monotonic() < deadline:
                raise _Unsettled()
            entry = JournalEntry(
                type=action.type.value,
                since=when.isoformat(),
                restart_attempt=verdict.generation.at_event,
            )
            if verdict.skipped:
                return dataclasses.replace(entry, skipped=verdict.skipped)
            if not verdict.targets:
                raise ActionError(verdict.error or "nothing to restart", retryable=verdict.wait)
            entry = dataclasses.replace(entry, targets=tuple(verdict.targets))
            return how(js, entry) if how else entry

        while True:
            # The watches' streams are separate (a Job may be seen failed before its pod):
            # what the cache said settled may look unsettled on the fresh read.
            await self.discovery.wait_until(settled, max(0.0, deadline - time.monotonic()))
            try:
                return await self._plan("JobSet", jobset, key, plan)
            except _Unsettled:
                await asyncio.sleep(self.calls.backoff_s[0])  # the cache lags the read

    async def _skip(self, js: Obj, action: ActionRecord, entry: JournalEntry) -> dict[str, Any]:
        result = {"skipped": str(entry.skipped)}
        what = f"{action.type.value} not done: {result['skipped']}"
        await self._event(js, "JobSet", action, ALREADY_RESTARTED, what)
        await self._finish("JobSet", o.name_of(js), action.idempotency_key, result)
        return result

    # --- pods: eviction, with delete as the fallback ---------------------------------------------

    async def _evict(self, name: str, uid: str) -> str:
        """Evict one pod (policy/v1, honours PDBs, marks DisruptionTarget); when eviction is
        impossible (a PDB refusing, 429, for `eviction_patience_s`; 500 with several PDBs),
        delete it with `pod_deletion_grace_period_s`. UID preconditions: a pod that was
        replaced meanwhile is left alone. Returns what happened."""
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": self.ns},
            "deleteOptions": {"preconditions": {"uid": uid}},
        }
        deadline = time.monotonic() + self.eviction_patience_s
        backoff = Backoff(*self.calls.backoff_s)
        while True:
            try:
                await self.calls.run(
                    f"evict pod {name}",
                    self.core.create_namespaced_pod_eviction,
                    name,
                    self.ns,
                    body,
                    retry_429=False,
                )
                return "evicted"
            except (NotFound, Conflict):
                return "gone"
            except TooManyRequests as exc:
                # A PDB refuses for now; it may allow it once another pod is back.
                why = str(exc)
                if time.monotonic() + backoff.peek() > deadline:
                    break
                await asyncio.sleep(backoff.next())
            except ApiError as exc:
                # 500: the pod is covered by more than one PDB, which eviction does not
                # support. Other transient statuses (and no answer at all): the API
                # server is unreachable or overloaded; the action is retried.
                if exc.retryable and exc.status != 500:
                    raise
                why = str(exc)
                break
        log.warning("eviction of %s impossible (%s); deleting it instead", name, why)
        options = client.V1DeleteOptions(
            grace_period_seconds=self.settings.pod_deletion_grace_period_s,
            preconditions=client.V1Preconditions(uid=uid),
        )
        try:
            await self.calls.run(
                f"delete pod {name}", self.core.delete_namespaced_pod, name, self.ns, body=options
            )
        except (NotFound, Conflict):
            return "gone"
        return "deleted"

    async def _evict_targets(
        self, action: ActionRecord, targets: Sequence[Target], reason: str, what: str
    ) -> dict[str, str]:
        """Evict the pods together: one eviction_patience_s for all, not one each."""

        async def one(name: str, uid: str) -> str:
            pod = self.discovery.informers["Pod"].items.get(f"{self.ns}/{name}")
            outcome = await self._evict(name, uid)
            if pod is not None and outcome != "gone":
                await self._event(pod, "Pod", action, reason, f"{what}: {outcome}")
            return outcome

        results = await asyncio.gather(*(one(name, uid) for name, uid in targets))
        return {name: result for (name, _), result in zip(targets, results, strict=True)}

    def _running_pods(self, jobset: str, node: str | None) -> list[Target]:
        return sorted(
            target_of(p)
            for p in self.discovery.pods_of(jobset)
            if (node is None or o.node_of(p) == node)
            and not o.terminating(p)
            and not o.pod_finished(p)
        )

    # --- emergency checkpoint -------------------------------------------------------------------

    def _host_monitor_url(self, node: str) -> str | None:
        if self._hooks is not None and (address := self._hooks.node_address(node)):
            return address.rstrip("/")
        obj = self.discovery.node(node)
        ip = o.internal_ip(obj) if obj else None
        if ip is None:
            return None
        host = f"[{ip}]" if ":" in ip else ip
        return f"{self.settings.host_monitor_scheme}://{host}:{self.settings.host_monitor_port}"

    async def _emergency_checkpoint(self, action: ActionRecord) -> dict[str, Any]:
        jobset = self._jobset_name(action)
        exclude = {str(n) for n in action.params.get("exclude_nodes", ())}
        nodes = [n for n in self.discovery.nodes_of(jobset) if n not in exclude]
        if not nodes:
            raise ActionError(f"no running pod of {jobset} outside {sorted(exclude)}")
        # Leave some of the actuator's time for the answers to come back.
        budget = max(0.5, self.settings.emergency_checkpoint_timeout_s * 0.9)
        checkpoint = await emergency_checkpoint(
            self._http,
            {node: self._host_monitor_url(node) for node in nodes},
            request_id=action.idempotency_key,
            timeout_s=budget,
            http_timeout_s=budget + 2,
            before_each=lambda: self.calls.fence(),
        )
        js = self.discovery.jobset(jobset)
        if not checkpoint.succeeded:
            what = f"emergency checkpoint incomplete: {checkpoint.failure}"
            if js is not None:
                await self._event(
                    js, "JobSet", action, "EmergencyCheckpointFailed", what, warning=True
                )
            raise ActionError(what)
        saved, steps = checkpoint.saved, checkpoint.steps
        if js is not None:
            await self._event(
                js,
                "JobSet",
                action,
                "EmergencyCheckpoint",
                f"{len(saved)} workers on {len(nodes)} nodes saved step(s) {steps}",
            )
        return {"nodes": nodes, "acked_ranks": [str(r) for r in sorted(saved)], "steps": steps}

    # --- restart in place: evict the pods of one node ---------------------------------------

    async def _restart_in_place(self, action: ActionRecord) -> dict[str, Any]:
        if action.node and (healed := await self.in_process.heal(action, swap=False)):
            return healed
        jobset, key = self._jobset_name(action), action.idempotency_key
        when = await self._reference_time(action)

        def decide(js: Obj) -> Verdict:
            return pods_to_restart(self.discovery, js, action.node, when)

        js, entry = await self._plan_restart(action, when, decide)
        if entry.done:
            return {"repeated": True, **(entry.result or {})}
        if entry.skipped is not None:
            return await self._skip(js, action, entry)
        outcome = await self._evict_targets(
            action, entry.targets or (), "RestartInPlace", "restarting the pod's workers"
        )
        result = {"pods": outcome}
        await self._event(js, "JobSet", action, "RestartInPlace", f"pods {outcome}")
        await self._finish("JobSet", jobset, key, result)
        return result

    # --- workload restart: a JobSet restart by eviction, or recreated child Jobs -----------

    async def _restart_workload(self, action: ActionRecord) -> dict[str, Any]:
        """Restart every worker of the JobSet, as the JobSet controller would after a
        failure: with the failure policy of "JobSet requirements", evict the pods of its
        current Jobs, which fails them, and the controller restarts the JobSet without
        counting it toward maxRestarts (`restart-attempt` goes up: workers keyed on it
        start afresh). Without that policy, delete the child Jobs for the controller to
        recreate (`restart-attempt` stays, maxRestarts is untouched either way)."""
        jobset, key = self._jobset_name(action), action.idempotency_key
        when = await self._reference_time(action)

        def decide(js: Obj) -> Verdict:
            # Jobs already being deleted (a restart under way) are waited for like the
            # others: a second restart right after the first would be one too many.
            return jobs_to_restart(self.discovery, js, when)

        def how(js: Obj, entry: JournalEntry) -> JournalEntry:
            refusal = eviction_restart_refusal(js)
            return dataclasses.replace(
                entry,
                method="delete_jobs" if refusal else "evict",
                why=refusal or None,
                restarts_before=o.jobset_restarts(js),
            )

        js, entry = await self._plan_restart(action, when, decide, how)
        if entry.done:
            return {"repeated": True, **(entry.result or {})}
        if entry.skipped is not None:
            return await self._skip(js, action, entry)
        targets = entry.targets or ()
        old = {uid for _, uid in targets}
        restarts_before = entry.restarts_before or 0
        pods = sorted(
            target_of(p)
            for p in self.discovery.pods_of(jobset)
            if o.owner_uid(p) in old and not o.terminating(p) and not o.pod_finished(p)
        )
        # No pod left to evict (say, a repeat after the evictions): wait for the restart
        # where it is done or under way (a failed Job); else nothing would fail the Jobs,
        # so they are deleted instead.
        current = self.discovery.jobset(jobset) or js
        under_way = o.jobset_restarts(current) > restarts_before or any(
            o.job_failed(j) for j in self.discovery.child_jobs(jobset) if o.uid_of(j) in old
        )
        by_eviction = entry.method == "evict" and (bool(pods) or under_way)
        result: dict[str, Any]
        if by_eviction:
            outcome = await self._evict_targets(
                action, pods, "RestartWorkload", "restarting the JobSet's workers"
            )
            result = {"method": "evict", "pods": outcome}
        else:
            await self._delete_jobs(targets)
            result = {"method": "delete_jobs", "deleted_jobs": [n for n, _ in targets]}
        expected_jobs = sum(
            int(r.get("replicas", 1)) for r in js.get("spec", {}).get("replicatedJobs") or []
        )

        def replaced() -> bool:
            current = self.discovery.jobset(jobset)
            if by_eviction and (current is None or o.jobset_restarts(current) <= restarts_before):
                return False
            jobs = self.discovery.child_jobs(jobset)
            fresh = [j for j in jobs if o.uid_of(j) not in old and not o.terminating(j)]
            return not any(o.uid_of(j) in old for j in jobs) and len(fresh) >= expected_jobs

        limit = self.settings.pod_termination_threshold_s
        if not await self.discovery.wait_until(replaced, limit):
            left = sorted(
                o.name_of(j) for j in self.discovery.child_jobs(jobset) if o.uid_of(j) in old
            )
            raise ActionError(
                f"JobSet {jobset}: old Jobs {left} not replaced within"
                f" pod_termination_threshold_s={limit:g}s",
                retryable=True,
            )
        current = self.discovery.jobset(jobset) or js
        result["restart_attempt"] = o.jobset_restarts(current)
        if by_eviction:
            what = (
                f"evicted the pods of its Jobs {result['pods']}; the JobSet controller"
                f" restarted it (restart-attempt {result['restart_attempt']})"
            )
        else:
            what = (
                f"deleted child Jobs {result['deleted_jobs']}; the JobSet controller"
                f" recreated them (restart-attempt stays {result['restart_attempt']}:"
                f" {entry.why})"
            )
        await self._event(js, "JobSet", action, "RestartWorkload", what)
        await self._finish("JobSet", jobset, key, result)
        return result

    async def _delete_jobs(self, targets: Sequence[Target]) -> None:
        for name, uid in targets:
            # Foreground: the Job stays until its pods are gone, so the JobSet controller
            # recreates it only then, and old and new workers never run side by side.
            options = client.V1DeleteOptions(
                propagation_policy="Foreground", preconditions=client.V1Preconditions(uid=uid)
            )
            # 404/409: gone already, or already replaced by a new Job of that name.
            with contextlib.suppress(NotFound, Conflict):
                await self.calls.run(
                    f"delete job {name}",
                    self.batch.delete_namespaced_job,
                    name,
                    self.ns,
                    body=options,
                )

    # --- nodes: cordon, swap out, restore -----------------------------------------------------

    def _set_health(self, node: Obj, value: str) -> bool:
        labels = o.meta(node).setdefault("labels", {})
        if labels.get(self.settings.kube_node_health_label) == value:
            return False
        labels[self.settings.kube_node_health_label] = value
        return True

    def _cordon_node(self, node: Obj) -> bool:
        spec = node.setdefault("spec", {})
        changed = not spec.get("unschedulable")
        spec["unschedulable"] = True
        label = o.labels_of(node).get(self.settings.kube_node_health_label)
        if label != o.PENDING_REPLACEMENT:
            changed = self._set_health(node, o.UNSCHEDULABLE) or changed
        return changed

    def _swap_out_node(self, node: Obj) -> bool:
        """Cordon, our NoExecute taint, health label UnschedulablePendingReplacement."""
        spec = node.setdefault("spec", {})
        changed = not spec.get("unschedulable")
        spec["unschedulable"] = True
        # spec.taints is an atomic list: the whole list is written back, other taints kept.
        if not o.has_taint(node, self.settings.kube_taint_key):
            taint = {
                "key": self.settings.kube_taint_key,
                "value": "hot-swap",
                "effect": "NoExecute",
                "timeAdded": o.rfc3339(),
            }
            spec["taints"] = [*(spec.get("taints") or []), taint]
            changed = True
        return self._set_health(node, o.PENDING_REPLACEMENT) or changed

    def _restore_node(self, node: Obj) -> bool:
        spec = node.setdefault("spec", {})
        changed = bool(spec.pop("unschedulable", False))
        taints = spec.get("taints") or []
        kept = [t for t in taints if t.get("key") != self.settings.kube_taint_key]
        if len(kept) != len(taints):
            spec["taints"] = kept
            changed = True
        return self._set_health(node, o.SCHEDULABLE) or changed

    async def _node_action(
        self, action: ActionRecord, change: Callable[[Obj], bool], reason: str
    ) -> dict[str, Any]:
        name, key = self._node_name(action), action.idempotency_key
        node, entry = await self._plan(
            "Node", name, key, lambda _: JournalEntry(type=action.type.value), also=change
        )
        if entry.done:
            return {"repeated": True, **(entry.result or {})}
        spec = node.get("spec", {})
        result = {
            "unschedulable": bool(spec.get("unschedulable")),
            "health": o.labels_of(node).get(self.settings.kube_node_health_label),
        }
        await self._event(node, "Node", action, reason, f"node {name}: {result}")
        await self._finish("Node", name, key, result)
        return result

    async def _hot_swap(self, action: ActionRecord) -> dict[str, Any]:
        if healed := await self.in_process.heal(action, swap=True):
            return healed
        name, key = self._node_name(action), action.idempotency_key
        jobset = action.job
        when = await self._reference_time(action)

        def plan(_: Obj) -> JournalEntry:
            # Every pod on the node goes, those created after the event too: the node is
            # bad, and our NoExecute taint would evict them anyway. Pods elsewhere are
            # never touched, whatever their generation.
            skipped = None
            if jobset is not None:
                targets = self._running_pods(jobset, name)
                js = self.discovery.jobset(jobset)
                if not targets and js is not None:
                    # Nothing of the job left on the node: restarted elsewhere already?
                    verdict = pods_to_restart(self.discovery, js, None, when)
                    skipped = verdict.skipped or None
            else:
                targets = sorted(
                    target_of(p)
                    for p in self.discovery.pods_on(name)
                    if o.jobset_of(p) in self.discovery.jobsets() and not o.terminating(p)
                )
            return JournalEntry(type=action.type.value, targets=tuple(targets), skipped=skipped)

        node, entry = await self._plan("Node", name, key, plan, also=self._swap_out_node)
        if entry.done:
            return {"repeated": True, **(entry.result or {})}
        spare = action.params.get("spare")
        outcome = await self._evict_targets(
            action, entry.targets or (), "HotSwap", f"moving off {name} to a spare"
        )
        result = {"node": name, "spare": spare, "pods": outcome, "spares": self.discovery.spares()}
        taint = f"{self.settings.kube_taint_key}:NoExecute"
        what = f"node {name} cordoned, tainted {taint}; pods {outcome}"
        if entry.skipped:
            result["skipped"] = f"no pod to move: {entry.skipped}"
            what = f"{what}; {result['skipped']}"
        await self._event(node, "Node", action, "HotSwap", what)
        js = self.discovery.jobset(jobset) if jobset else None
        if js is not None:
            await self._event(js, "JobSet", action, "HotSwap", what)
            if entry.skipped:
                await self._event(js, "JobSet", action, ALREADY_RESTARTED, what)
        await self._finish("Node", name, key, result)
        return result

    # --- force delete ---------------------------------------------------------------------------

    async def _force_delete_pod(self, action: ActionRecord) -> dict[str, Any]:
        pod_name = action.params.get("pod")
        if not isinstance(pod_name, str) or not pod_name:
            raise ActionError("force_delete_pod needs params.pod")
        ns = str(action.params.get("namespace") or self.ns)
        uid = action.params.get("uid")
        cached = self.discovery.informers["Pod"].items.get(f"{ns}/{pod_name}")
        if cached is None or (uid and o.uid_of(cached) != uid):
            return {"pod": pod_name, "outcome": "gone"}
        options = client.V1DeleteOptions(
            grace_period_seconds=0,
            preconditions=client.V1Preconditions(uid=uid) if uid else None,
        )
        try:
            await self.calls.run(
                f"force delete pod {pod_name}",
                self.core.delete_namespaced_pod,
                pod_name,
                ns,
                body=options,
            )
        except (NotFound, Conflict):
            return {"pod": pod_name, "outcome": "gone"}
        js = self.discovery.jobset(action.job) if action.job else None
        if js is not None:
            await self._event(
                js,
                "JobSet",
                action,
                "ForceDeletePod",
                f"pod {pod_name} deleted with grace period 0",
            )
        return {"pod": pod_name, "outcome": "deleted"}

    # --- scale down / up: recreate the JobSet -----------------------------------------------------

    def _rescaled(self, js: Obj, to: int, action: ActionRecord) -> Obj:
        """The new JobSet: the original spec with `to` data-parallel replicas (the original
        itself when `to` is its replica count), our annotations, the journal carried over."""
        shape = self.discovery.shape(js)
        annotations = o.annotations_of(js)
        annotations.pop(o.RECREATE, None)
        if o.ORIGINAL_SPEC in annotations:
            original = json.loads(annotations[o.ORIGINAL_SPEC])
        else:
            original = copy.deepcopy(js.get("spec", {}))
        spec = copy.deepcopy(original)
        if to == shape.original_replicas:
            annotations.pop(o.ORIGINAL_SPEC, None)
            annotations.pop(o.NUM_DP_REPLICAS, None)
        else:
            annotations[o.ORIGINAL_SPEC] = json.dumps(original, sort_keys=True)
            annotations[o.NUM_DP_REPLICAS] = str(to)
            rjob = o.dp_replicated_job({"metadata": js.get("metadata", {}), "spec": spec})
            assert rjob is not None
            for target in spec["replicatedJobs"]:
                if target.get("name") != rjob.get("name"):
                    continue
                target["replicas"] = to
                pod_spec = target.setdefault("template", {}).setdefault("spec", {})
                pod_spec = pod_spec.setdefault("template", {}).setdefault("spec", {})
                env = {
                    o.ENV_NUM_DP_REPLICAS: str(to),
                    o.ENV_NNODES: str(to * shape.num_nodes_per_dp),
                }
                for container in pod_spec.get("containers") or []:
                    kept = [e for e in container.get("env") or [] if e.get("name") not in env]
                    container["env"] = kept + [{"name": k, "value": v} for k, v in env.items()]
        m = js.get("metadata", {})
        body: Obj = {
            "apiVersion": o.JOBSET_API_VERSION,
            "kind": "JobSet",
            "metadata": {
                "name": m.get("name"),
                "namespace": m.get("namespace", self.ns),
                "labels": dict(m.get("labels") or {}),
                "annotations": annotations,
            },
            "spec": spec,
        }
        if m.get("ownerReferences"):
            body["metadata"]["ownerReferences"] = m["ownerReferences"]
        journal = journal_of(js)
        journal[action.idempotency_key] = JournalEntry(
            type=action.type.value,
            done=True,
            result={"num_dp_replicas": to, "from_replicas": shape.num_dp_replicas},
        )
        set_journal(body, journal)
        return body

    async def _body_from_event(self, jobset: str, key: str) -> Obj | None:
        name = event_name("JobSet", jobset, key, RESCALING)
        annotations = await self.events.annotations(self.ns, name)
        note = (annotations or {}).get(o.RECREATE)
        if not note:
            return None
        body: Obj = json.loads(note)["body"]
        return body

    async def _scale(self, action: ActionRecord) -> dict[str, Any]:
        jobset, key = self._jobset_name(action), action.idempotency_key
        try:
            to = int(action.params["to_replicas"])
        except (KeyError, TypeError, ValueError):
            raise ActionError("scale needs params.to_replicas (an integer)") from None
        try:
            js: Obj | None = await self._read("JobSet", jobset)
        except NotFound:
            js = None
        body = self._recreating.get(key)
        if js is not None and not o.terminating(js):
            entry = entry_of(js, key)
            if entry is not None and entry.done:
                return {"repeated": True, **(entry.result or {})}
            shape = self.discovery.shape(js)
            low, high = shape.min_num_dp_replicas, shape.max_num_dp_replicas
            if not low <= to <= high:
                raise ActionError(f"to_replicas={to} outside [{low}, {high}] for {jobset}")
            exclude = action.params.get("exclude_node")
            if isinstance(exclude, str) and exclude:
                # Keep the new pods off the bad node until it has recovered.
                await self._modify("Node", exclude, self._swap_out_node)
            pending = o.annotations_of(js).get(o.RECREATE)
            if pending and json.loads(pending).get("key") == key:
                body = json.loads(pending)["body"]
            else:
                body = self._rescaled(js, to, action)
                note = json.dumps({"key": key, "body": body}, sort_keys=True)

                def mark(obj: Obj) -> bool:
                    o.meta(obj).setdefault("annotations", {})[o.RECREATE] = note
                    return True

                js = await self._modify("JobSet", jobset, mark)
            self._recreating[key] = body
            # The new body rides on this Event too: the only copy that outlives the old
            # JobSet if the supervisor dies between the deletion and the creation.
            await self._event(
                js,
                "JobSet",
                action,
                RESCALING,
                f"recreating {jobset} with {to} data-parallel replicas"
                f" (was {shape.num_dp_replicas})",
                annotations={o.RECREATE: json.dumps({"key": key, "body": body})},
            )
            options = client.V1DeleteOptions(
                propagation_policy="Foreground",
                preconditions=client.V1Preconditions(uid=o.uid_of(js)),
            )
            with contextlib.suppress(NotFound, Conflict):
                await self.calls.run(
                    f"delete jobset {jobset}",
                    self.custom.delete_namespaced_custom_object,
                    o.JOBSET_GROUP,
                    o.JOBSET_VERSION,
                    self.ns,
                    o.JOBSET_PLURAL,
                    jobset,
                    body=options,
                )
        elif js is not None:  # being deleted: by this action before a crash, or by someone
            pending = o.annotations_of(js).get(o.RECREATE)
            if pending and json.loads(pending).get("key") == key:
                body = json.loads(pending)["body"]
                self._recreating[key] = body
        if body is None:
            body = await self._body_from_event(jobset, key)
        if body is None:
            raise ActionError(
                f"JobSet {jobset} is gone or being deleted by someone else; nothing to recreate"
            )
        old_uid = o.uid_of(js) if js is not None else None

        def old_gone() -> bool:
            current = self.discovery.jobset(jobset)
            if current is not None and o.uid_of(current) == old_uid:
                return False
            return not [p for p in self.discovery.pods_of(jobset) if not o.pod_finished(p)]

        limit = self.settings.pod_termination_threshold_s
        if not await self.discovery.wait_until(old_gone, limit):
            left = sorted(o.name_of(p) for p in self.discovery.pods_of(jobset))
            raise ActionError(
                f"old pods of {jobset} still there after pod_termination_threshold_s="
                f"{limit:g}s: {left}",
                retryable=True,
            )
        try:
            response = await self.calls.run(
                f"create jobset {jobset}",
                self.custom.create_namespaced_custom_object,
                o.JOBSET_GROUP,
                o.JOBSET_VERSION,
                self.ns,
                o.JOBSET_PLURAL,
                body,
                _preload_content=False,
            )
            created: Obj = json.loads(response.data)
        except Conflict:
            created = await self._read("JobSet", jobset)
            entry = entry_of(created, key)
            if entry is None or not entry.done:
                raise ActionError(
                    f"JobSet {jobset} exists again but not from this action", retryable=True
                ) from None
        self._recreating.pop(key, None)
        result = dict(journal_of(body)[key].result or {})
        await self._event(
            created,
            "JobSet",
            action,
            "ScaleDown" if action.type is ActionType.SCALE_DOWN else "ScaleUp",
            f"recreated with {to} data-parallel replicas",
        )
        return result
