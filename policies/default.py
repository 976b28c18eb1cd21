"""The default remediation policy: the escalation ladder of Google's resiliency supervisor.

Ladder, per event (see `DefaultPolicy`):

* worker exited (non-zero), worker heartbeat lost, hang: restart in place while the job has
  in-job restarts left (`max_in_job_restarts`), then restart the whole workload;
* node failure (host heartbeat lost, GPU XID/ECC, flapping, node not ready): restart the
  workload while the node has failed at most `max_workload_restarts` times, then hot-swap it
  for a spare, else scale the job down by one data-parallel replica (when scaling is enabled
  and the job is above its minimum), else restart the workload as a last resort. A flapping
  node, and an XID that says the GPU needs a reset or service, skip the restart rung. A
  failing node that serves no job, or a job that has finished, is cordoned when its
  hardware is bad, else left alone;
* an XID of the application's own (or a driver transient; see `supervisor.xid`): restart
  the workload; the node stays in service and the XID does not count against it. An XID
  whose response is `ignore` is only recorded;
* spare available / node recovered: restart a job that nothing runs since its latest
  remedy failed (a last-resort restart on a node that was down) once the spares would hold
  it; scale jobs below their maximum back up, one replica each, as long as there are
  enough spares;
* workload down: restart the workload, or scale it down by one replica when its pods are
  pending for lack of nodes (scaling enabled, above the minimum);
* pod stuck terminating: force-delete that pod (grace period 0);
* straggler (a rank slow for `straggler_window_s`): hot-swap its node when a spare exists
  (emergency checkpoint first); without a spare it is only recorded: a slow node still
  trains, and restarting the job would not make it faster.

A node failure on a node already cordoned and no longer among its job's nodes was handled
when the node first failed (a dead node is both silent and NotReady): nothing more is done.

Beyond Google's resiliency supervisor: every action that stops workers is preceded by an
emergency checkpoint of the healthy workers, and a job that used up its restart budget is
left alone instead of being restarted forever: `max_no_progress_restarts` remedies in a
row not followed by training progress (judged like NVIDIA's `max_no_progress_cycles`),
or, as a safety net, `max_restarts_in_window` disruptive actions within
`restart_window_s`. A node failure that is not the job's own fault (a lost node, bad
hardware) is still hot-swapped to a spare, whatever the budget: the job is not broken,
its node is. The supervisor says when it gives up (a `job_given_up` event).
"""

from __future__ import annotations

from supervisor.domain import (
    DISRUPTIVE_ACTIONS,
    NODE_FAILURE_EVENTS,
    ActionRequest,
    Event,
    EventType,
    WorkerState,
)
from supervisor.event_details import (
    GpuClassDetails,
    GpuXidDetails,
    PodStuckTerminatingDetails,
    StragglerDetails,
    WorkerExitedDetails,
    WorkloadDownDetails,
    details_of,
)
from supervisor.policy import Policy, PolicyContext, actions, handles
from supervisor.xid import XidResponse, response_of

#: Node failures that say the hardware itself is bad: such a node is cordoned when no job
#: can be remedied (spare node, or restart budget spent). A lost heartbeat or a NotReady
#: node may just be a network blip, so it is not cordoned.
HARDWARE_FAULTS = frozenset({EventType.GPU_XID, EventType.GPU_ECC, EventType.NODE_FLAPPING})
#: Node failures that are the node's, not the job's: a spare heals them whatever the
#: job's restart budget.
NOT_THE_JOBS_FAULT = HARDWARE_FAULTS | {
    EventType.HOST_HEARTBEAT_LOST,
    EventType.NODE_NOT_READY,
    EventType.NODE_CUT_OFF,
}


def describe(event: Event) -> str:
    """A short human description of an event, the start of every action's reason."""
    text = event.type.value
    if event.type is EventType.GPU_XID and (code := GpuXidDetails.of(event).code) is not None:
        text += f" {code}"
    if event.type is EventType.WORKER_EXITED:
        text += f" (exit code {WorkerExitedDetails.of(event).exit_code})"
    if event.node:
        text += f" on {event.node}"
    if event.rank is not None:
        text += f" rank {event.rank}"
    if event.job and not event.node:
        text += f" in {event.job}"
    return text


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


class DefaultPolicy(Policy):
    """Restart in place, restart the workload, hot-swap, scale down; checkpoint before each."""

    name = "default"
    #: Save the healthy workers before anything stops them. Turn off only to measure
    #: what it saves (bench) or for workloads that cannot checkpoint on a signal.
    emergency_checkpoints: bool = True

    # --- helpers ------------------------------------------------------------------------

    @staticmethod
    def budget_exhausted(ctx: PolicyContext, job: str | None) -> bool:
        """True when the job's last `max_no_progress_restarts` remedies were not followed by
        progress, or it took `max_restarts_in_window` disruptive actions in the window.

        Such a job is considered broken: it gets no further disruptive action (but a
        hot swap of a node that failed it) until an operator resets its budget, or older
        restarts leave the window, so a job that cannot be healed is not restarted forever.
        """
        limits = ctx.limits
        return (
            ctx.restarts_without_progress(job) >= limits.max_no_progress_restarts
            or ctx.recent_restarts(job) >= limits.max_restarts_in_window
        )

    def remedy(
        self,
        ctx: PolicyContext,
        action: ActionRequest,
        *,
        failed_node: str | None = None,
        whatever_the_budget: bool = False,
    ) -> list[ActionRequest]:
        """`action`, preceded by an emergency checkpoint when it stops workers.

        The checkpoint is taken by the job's healthy workers, i.e. without `failed_node`.
        Returns nothing when the job's restart budget is spent (unless
        `whatever_the_budget`: a node that failed the job, swapped for a spare).
        """
        if action.type not in DISRUPTIVE_ACTIONS:
            return [action]
        if self.budget_exhausted(ctx, action.job) and not whatever_the_budget:
            return []
        if not self.emergency_checkpoints:
            return [action]
        checkpoint = actions.emergency_checkpoint(
            action.job,
            exclude_nodes=(failed_node,) if failed_node else (),
            reason=f"save healthy workers before {action.type.value}: {action.reason}",
        )
        return [checkpoint, action]

    def _in_job_ladder(
        self, event: Event, ctx: PolicyContext, job: str, node: str | None
    ) -> list[ActionRequest]:
        """Restart in place while the job has in-job restarts left, else the workload.
        After a remedy of the job that failed, the workload: an in-job restart needs the
        rest of the job alive, and nothing says it is; but first off a node of it that is
        down, where that restart would fail again."""
        used, limit = ctx.in_job_restarts(job), ctx.limits.max_in_job_restarts
        what = describe(event)
        if job in ctx.failed_last_remedy:
            down = self._held_down(ctx, job)
            if down is not None:
                return self._off_the_down_node(event, ctx, job, down)
            action = actions.restart_workload(
                job, reason=f"{what}: the job's last remedy failed, restarting it whole"
            )
        elif used < limit:
            action = actions.restart_in_place(
                job, node, reason=f"{what}: in-job restart {used + 1} of {limit}"
            )
        else:
            action = actions.restart_workload(
                job, reason=f"{what}: {used} in-job restarts >= max_in_job_restarts={limit}"
            )
        return self.remedy(ctx, action, failed_node=node)

    def evict(
        self, event: Event, ctx: PolicyContext, job: str, node: str, why: str
    ) -> list[ActionRequest]:
        """Get the job off `node`: hot-swap to a spare, else scale down, else restart.
        A hook for subclasses, with `node_failure_in_job` (policies/examples/).

        `why` says why the node must go; it starts each reason after the event description.
        """
        what = f"{describe(event)}: {why}"
        spares = [s for s in ctx.spares if s != node]
        if spares:
            spare = spares[0]
            action = actions.hot_swap(
                job, node, spare=spare, reason=f"{what}, spare {spare} available"
            )
            return self.remedy(ctx, action, failed_node=node)
        view = ctx.job(job)
        if not ctx.limits.enable_workload_scaling:
            fallback = "no spare and workload scaling disabled"
        elif view is None:
            fallback = f"no spare and job {job} unknown"
        elif view.num_dp_replicas > view.min_num_dp_replicas:
            to = view.num_dp_replicas - 1
            action = actions.scale_down(
                job,
                to_replicas=to,
                exclude_node=node,
                reason=f"{what}, no spare: scaling {job} from {view.num_dp_replicas} to {to}"
                " data-parallel replicas",
            )
            return self.remedy(ctx, action, failed_node=node)
        else:
            fallback = f"no spare and {job} at its minimum of {view.min_num_dp_replicas} replicas"
        action = actions.restart_workload(job, reason=f"{what}, {fallback}: last resort")
        return self.remedy(ctx, action, failed_node=node)

    def _off_the_down_node(
        self, event: Event, ctx: PolicyContext, job: str, down: str
    ) -> list[ActionRequest]:
        """The job's last remedy failed and `down`, a node it holds, is not alive: swap a
        spare in and start every rank afresh (nothing says any still runs, to heal
        in-process), else `evict`'s scale down or last resort."""
        why = f"the job's last remedy failed and its node {down} is down"
        spares = [s for s in ctx.spares if s != down]
        if not spares:
            return self.evict(event, ctx, job, down, why)
        action = actions.hot_swap(
            job,
            down,
            spare=spares[0],
            reason=f"{describe(event)}: {why}, spare {spares[0]} available",
            in_process=False,
        )
        return self.remedy(ctx, action, failed_node=down)

    def node_failure_in_job(
        self, event: Event, ctx: PolicyContext, job: str, node: str
    ) -> list[ActionRequest]:
        """A node failure of a job that can be remedied (not a spare, budget not spent,
        not finished): the restart rung, then `evict`. The hook subclasses override to
        change the ladder for some events (policies/examples/hot_swap_on_xid.py)."""
        failures, limit = ctx.failures_of(node), ctx.limits.max_workload_restarts
        if event.type is EventType.NODE_FLAPPING:
            return self.evict(event, ctx, job, node, "a flapping node must go")
        if event.type is EventType.NODE_CUT_OFF:
            # Restarting on the same nodes would stall at the first collective again.
            return self.evict(event, ctx, job, node, "its ranks cannot reach their peers")
        gpu = details_of(event)
        hardware = isinstance(gpu, GpuClassDetails) and gpu.origin == "hardware"
        if response_of(event) is XidResponse.REPLACE_NODE and hardware:
            assert isinstance(gpu, GpuClassDetails)
            meaning = gpu.meaning or ""
            return self.evict(event, ctx, job, node, f"{meaning}: the GPU needs service")
        if failures <= limit:
            action = actions.restart_workload(
                job,
                reason=f"{describe(event)}: {_plural(failures, 'failure')}"
                f" <= max_workload_restarts={limit}",
            )
            return self.remedy(ctx, action, failed_node=node)
        why = f"{_plural(failures, 'failure')} > max_workload_restarts={limit}"
        return self.evict(event, ctx, job, node, why)

    # --- handlers -----------------------------------------------------------------------

    @handles(EventType.WORKER_EXITED, EventType.WORKER_HEARTBEAT_LOST)
    def on_worker_failure(self, event: Event, ctx: PolicyContext) -> list[ActionRequest]:
        if event.type is EventType.WORKER_EXITED and WorkerExitedDetails.of(event).exit_code == 0:
            return []  # normal completion
        view = ctx.node(event.node)
        job = event.job or (view.job if view else None)
        if job is None:
            return []
        return self._in_job_ladder(event, ctx, job, event.node)

    @handles(EventType.HANG)
    def on_hang(self, event: Event, ctx: PolicyContext) -> list[ActionRequest]:
        # `event.node`, when set, names the suspect: the node with the lowest step.
        if event.job is None:
            return []
        return self._in_job_ladder(event, ctx, event.job, event.node)

    @handles(*NODE_FAILURE_EVENTS)
    def on_node_failure(self, event: Event, ctx: PolicyContext) -> list[ActionRequest]:
        node = event.node
        if node is None:
            return []
        view = ctx.node(node)
        job = event.job or (view.job if view else None)
        response = response_of(event)
        if response is XidResponse.IGNORE:
            return []
        if response is XidResponse.RESTART_WORKLOAD:
            return self._restart_for_application_xid(event, ctx, job, node)
        bad_hardware = event.type in HARDWARE_FAULTS and not (view and view.cordoned)
        job_view = ctx.job(job)
        if job_view is not None and job_view.phase == "finished":
            job = None  # it trained to its end: nothing of it to save or move
        if view is not None and view.cordoned and job_view and node not in job_view.nodes:
            # Already taken out of the job (hot-swapped, or scaled out) for an earlier
            # failure: a dead node is both silent and NotReady, and one swap is enough.
            return []
        if job is None:
            # A spare or idle node: keep the scheduler off bad hardware, nothing else to do.
            if not bad_hardware:
                return []
            return [actions.cordon(node, reason=f"{describe(event)}: bad hardware, no job")]
        if self.budget_exhausted(ctx, job):
            spares = [s for s in ctx.spares if s != node]
            not_its_fault = bad_hardware or event.type in NOT_THE_JOBS_FAULT
            if not_its_fault and spares and job_view is not None and node in job_view.nodes:
                action = actions.hot_swap(
                    job,
                    node,
                    spare=spares[0],
                    reason=f"{describe(event)}: the node failed, not the job; restart budget"
                    f" spent, spare {spares[0]} available",
                )
                return self.remedy(ctx, action, failed_node=node, whatever_the_budget=True)
            if not bad_hardware:
                return []
            reason = f"{describe(event)}: bad hardware; {job} left alone, restart budget spent"
            return [actions.cordon(node, reason=reason)]
        return self.node_failure_in_job(event, ctx, job, node)

    def _restart_for_application_xid(
        self, event: Event, ctx: PolicyContext, job: str | None, node: str
    ) -> list[ActionRequest]:
        """The program (or a driver transient) failed, not the GPU: run the job again on
        the same nodes; no cordon, and it does not count against the node."""
        if job is None or self.budget_exhausted(ctx, job):
            return []
        gpu = details_of(event)
        origin, meaning = (
            (gpu.origin, gpu.meaning) if isinstance(gpu, GpuClassDetails) else (None, None)
        )
        action = actions.restart_workload(
            job, reason=f"{describe(event)}: {meaning} ({origin}), the node stays in service"
        )
        return self.remedy(ctx, action, failed_node=node)

    @handles(EventType.SPARE_AVAILABLE, EventType.NODE_RECOVERED)
    def on_capacity(self, event: Event, ctx: PolicyContext) -> list[ActionRequest]:
        """Scale jobs below their maximum up by one replica while spares suffice: spares
        beyond those that jobs short of nodes will take (a JobSet just recreated by a scale
        has no pod placed yet: its own nodes look like spares)."""
        out = self._restart_the_stranded(event, ctx)
        if not ctx.limits.enable_workload_scaling:
            return out
        short = sum(
            max(0, view.num_dp_replicas * view.num_nodes_per_dp - len(view.nodes))
            for view in ctx.jobs.values()
            if view.phase != "finished"
        )
        free = list(ctx.spares)[short:]
        for name in sorted(ctx.jobs):
            view = ctx.jobs[name]
            if view.phase == "finished" or self._stranded(ctx, name):
                continue
            need = max(1, view.num_nodes_per_dp)
            if view.num_dp_replicas >= view.max_num_dp_replicas or len(free) < need:
                continue
            if self.budget_exhausted(ctx, name):
                continue
            promised, free = free[:need], free[need:]
            to = view.num_dp_replicas + 1
            action = actions.scale_up(
                name,
                to_replicas=to,
                reason=f"{describe(event)}: spares {', '.join(promised)} available, scaling"
                f" {name} from {view.num_dp_replicas} to {to} data-parallel replicas",
            )
            out += self.remedy(ctx, action)
        return out

    def _restart_the_stranded(self, event: Event, ctx: PolicyContext) -> list[ActionRequest]:
        """Restart each job that nothing runs since its latest remedy failed (a last-resort
        restart on a node that was down), once nodes would hold it: spares for a job left
        with no node, its own nodes all alive again for one that kept them. No other
        event would ever start it again."""
        out: list[ActionRequest] = []
        for name in sorted(n for n in ctx.failed_last_remedy if self._stranded(ctx, n)):
            view = ctx.jobs[name]
            if view.nodes:
                held = all((node := ctx.node(n)) is not None and node.alive for n in view.nodes)
            else:
                held = len(ctx.spares) >= view.num_dp_replicas * max(1, view.num_nodes_per_dp)
            if not held:
                continue
            reason = (
                f"{describe(event)}: nothing runs {name} since its last remedy failed;"
                " nodes are back: restarting it"
            )
            out += self.remedy(ctx, actions.restart_workload(name, reason=reason))
        return out

    @staticmethod
    def _held_down(ctx: PolicyContext, job: str) -> str | None:
        """The first node the job holds that is known and not alive."""
        view = ctx.job(job)
        held = view.nodes if view is not None else ()
        return next((n for n in held if (node := ctx.node(n)) is not None and not node.alive), None)

    @staticmethod
    def _stranded(ctx: PolicyContext, name: str) -> bool:
        """Nothing runs the job since its latest remedy failed: it holds no node, or no
        worker of it runs on the nodes it holds."""
        view = ctx.jobs.get(name)
        if name not in ctx.failed_last_remedy or view is None or view.phase == "finished":
            return False
        nodes = [ctx.node(n) for n in view.nodes]
        return all(node is not None for node in nodes) and not any(
            worker.state in (WorkerState.STARTING, WorkerState.RUNNING, WorkerState.FINISHING)
            for node in nodes
            if node is not None
            for worker in node.workers
        )

    @handles(EventType.WORKLOAD_DOWN)
    def on_workload_down(self, event: Event, ctx: PolicyContext) -> list[ActionRequest]:
        """Restart it; but when pods wait for nodes that do not exist, a restart cannot
        help: scale down by one replica instead (when scaling is on, above the minimum)."""
        if event.job is None:
            return []
        view = ctx.job(event.job)
        unschedulable = WorkloadDownDetails.of(event).unschedulable_pods or 0
        if (
            unschedulable
            and ctx.limits.enable_workload_scaling
            and view is not None
            and view.num_dp_replicas > view.min_num_dp_replicas
        ):
            to = view.num_dp_replicas - 1
            action = actions.scale_down(
                event.job,
                to_replicas=to,
                reason=f"{describe(event)}: {unschedulable} pods pending for lack of nodes,"
                f" scaling {event.job} from {view.num_dp_replicas} to {to} data-parallel replicas",
            )
            return self.remedy(ctx, action)
        action = actions.restart_workload(event.job, reason=f"{describe(event)}: restarting")
        return self.remedy(ctx, action)

    @handles(EventType.STRAGGLER)
    def on_straggler(self, event: Event, ctx: PolicyContext) -> list[ActionRequest]:
        node, job = event.node, event.job
        if node is None or job is None or self.budget_exhausted(ctx, job):
            return []
        view = ctx.node(node)
        if view is None or view.cordoned or view.job != job:
            return []  # already moved off, or no longer in that job
        spares = [s for s in ctx.spares if s != node]
        if not spares:
            return []
        straggler = StragglerDetails.of(event)
        action = actions.hot_swap(
            job,
            node,
            spare=spares[0],
            reason=f"{describe(event)}: {straggler.slowdown_pct}% slower than its job for"
            f" {straggler.for_s}s, spare {spares[0]} available",
        )
        return self.remedy(ctx, action, failed_node=node)

    @handles(EventType.POD_STUCK_TERMINATING)
    def on_pod_stuck(self, event: Event, ctx: PolicyContext) -> list[ActionRequest]:
        """Its kubelet will not finish the graceful termination: delete it with grace 0."""
        stuck = PodStuckTerminatingDetails.of(event)
        if not stuck.pod:
            return []
        return [
            actions.force_delete_pod(
                event.job,
                event.node,
                pod=stuck.pod,
                namespace=stuck.namespace,
                uid=stuck.uid,
                reason=f"{describe(event)}: pod {stuck.pod} terminating for"
                f" {stuck.terminating_for_s}s",
            )
        ]
