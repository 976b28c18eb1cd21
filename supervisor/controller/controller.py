"""The controller: runs the policy on each event and hands the chosen actions to the
actuator.

Work is serialised per job (one lane each), so the policy for a job's next event sees
the result of what was done for the previous one, while jobs proceed independently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta

from resiliency_protocol.backoff import Backoff
from supervisor.actuator import Actuator, Fenced
from supervisor.config_parts import RemediationSettings
from supervisor.controller.budget import Budgets, usage_error
from supervisor.controller.incidents import Incidents
from supervisor.domain import (
    ActionRecord,
    ActionRequest,
    ActionStatus,
    Event,
    JobView,
    NodeView,
    utcnow,
)
from supervisor.metrics import Metrics
from supervisor.policy import Policy, PolicyContext
from supervisor.store import UNAVAILABLE, BudgetRecord
from supervisor.store.roles import ControllerRecords

log = logging.getLogger(__name__)

Snapshot = Callable[[], tuple[dict[str, NodeView], dict[str, JobView]]]
CLUSTER_LANE = ""


@dataclass(frozen=True, slots=True)
class _HandleEvent:
    event: Event


@dataclass(frozen=True, slots=True)
class _RunActions:
    actions: tuple[ActionRecord, ...]


_Work = _HandleEvent | _RunActions


class Controller:
    def __init__(
        self,
        settings: RemediationSettings,
        policy: Policy,
        store: ControllerRecords,
        actuator: Actuator,
        snapshot: Snapshot,
        metrics: Metrics | None = None,
        *,
        incident_lag_s: float = 0.0,
        raise_event: Callable[[Event], None] | None = None,
    ) -> None:
        """`incident_lag_s`: how late an old worker's failure may be seen after its
        remedy finished and still be attached to it (controller/incidents.py);
        `raise_event`: records an event of the supervisor's own (a job given up)."""
        self.settings = settings
        self.incidents = Incidents(incident_lag_s)
        #: Each job's remedies without progress, and the jobs given up (budget.py).
        self.budgets = Budgets()
        self._raise_event = raise_event
        self.metrics = metrics or Metrics()
        self.metrics.jobs_given_up.set_function(lambda: self.budgets.given_up_count)
        self.policy = policy
        self.store = store
        self.actuator = actuator
        self._snapshot = snapshot
        self._limits = settings.limits
        self._lanes: dict[str, asyncio.Queue[_Work]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._busy = 0
        #: One writer of the budgets and incidents at a time: a state is never
        #: overwritten by an older one.
        self._keeping = asyncio.Lock()
        #: The leader epoch this supervisor writes them in (`restore`).
        self._epoch: int | None = None

    # --- intake -------------------------------------------------------------------------

    def submit_event(self, event: Event) -> None:
        self._lane(event.job).put_nowait(_HandleEvent(event))

    def submit_actions(self, actions: list[ActionRecord]) -> None:
        by_job: dict[str | None, list[ActionRecord]] = {}
        for action in actions:
            by_job.setdefault(action.job, []).append(action)
        for job, group in by_job.items():
            self._lane(job).put_nowait(_RunActions(tuple(group)))

    @property
    def idle(self) -> bool:
        return self._busy == 0 and all(q.empty() for q in self._lanes.values())

    async def drain(self) -> None:
        """Wait until every submitted piece of work is done (used by tests and shutdown)."""
        while not self.idle:
            await asyncio.gather(*(q.join() for q in list(self._lanes.values())))

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()

    # --- what is kept in the store --------------------------------------------------------

    async def restore(self, epoch: int | None) -> None:
        """Read back the budgets and incidents a previous supervisor kept (before any
        work is submitted); from now on they are written in leader `epoch` (None: a dry
        run's), and refused once a newer leader wrote them. An incident whose remedy
        finished without its closing being written (that supervisor stopped in between)
        is closed as its action ended."""
        self._epoch = epoch
        budgets = await asyncio.to_thread(self.store.load_budgets)
        incidents = await asyncio.to_thread(self.store.load_incidents)
        self.budgets.restore(budgets)
        self.incidents.restore(incidents)
        for job, incident in incidents.items():
            if incident.finished_at is not None:
                continue
            action = await asyncio.to_thread(self.store.get_action, incident.action_id)
            if action is None or action.status.finished:
                ended = action.finished_at if action is not None else None
                record = replace(
                    incident,
                    finished_at=ended or utcnow(),
                    failed=action is not None and action.status is ActionStatus.FAILED,
                )
                self.incidents.restore({job: record})
                await self._save(self.store.save_incident, job, record)
        if budgets or incidents:
            log.info("restored %d jobs' budgets and %d incidents", len(budgets), len(incidents))

    async def keep(self) -> None:
        """Write the budgets and incidents changed since they were last written (each
        job's in a transaction of its own), then raise what waited for them: a job given
        up is said once it is kept. Raises what the store raises (UNAVAILABLE): what was
        not written stays changed, and is written by the next call."""
        async with self._keeping:
            for job, budget in self.budgets.changed().items():
                await self._save(self.store.save_budget, job, budget)
                self.budgets.kept(job, budget)
            for job, incident in self.incidents.changed().items():
                await self._save(self.store.save_incident, job, incident)
                self.incidents.kept(job, incident)
            for given_up in self.budgets.unsaid():
                assert given_up.job is not None
                log.warning(
                    "giving up on job %s: %s", given_up.job, self.budgets.given_up(given_up.job)
                )
                if self._raise_event is not None:
                    self._raise_event(given_up)

    async def _save(self, save: Callable[..., bool], job: str, record: object) -> None:
        """One job's record written in this supervisor's epoch; Fenced when a newer
        leader wrote it (this replica is no longer the leader)."""
        if not await asyncio.to_thread(lambda: save(job, record, epoch=self._epoch)):
            raise Fenced(f"job {job}'s budget or incident was written by a newer leader")

    async def reset_budget(self, job: str) -> Event:
        """An operator starts the job's budget over: kept in the store first (nothing
        changes when it cannot be), then the `job_budget_reset` event to record."""
        async with self._keeping:
            fresh = BudgetRecord(reset_at=utcnow())
            await self._save(self.store.save_budget, job, fresh)
            return self.budgets.reset(job, fresh)

    def _lane(self, job: str | None) -> asyncio.Queue[_Work]:
        key = job or CLUSTER_LANE
        queue = self._lanes.get(key)
        if queue is None:
            queue = asyncio.Queue()
            self._lanes[key] = queue
            self._tasks[key] = asyncio.create_task(self._work(queue), name=f"lane:{key}")
        return queue

    async def _work(self, queue: asyncio.Queue[_Work]) -> None:
        while True:
            item = await queue.get()
            self._busy += 1
            try:
                await self._until_stored(item)
            except asyncio.CancelledError:
                raise
            except Fenced:
                pass  # this replica is stepping down; the leader takes the work over
            except Exception:
                log.exception("controller lane failed on %r", item)
            finally:
                self._busy -= 1
                queue.task_done()

    async def _until_stored(self, item: _Work) -> None:
        """Carry out one piece of work; while the database is unavailable, again and
        again (backing off), so that the lane goes on in order once it is back. Both
        are safe to repeat: handling an event again returns the actions recorded the
        first time, and an action already finished is returned as it is."""
        backoff = Backoff(0.1, 5.0)
        retry = False
        while True:
            try:
                if isinstance(item, _HandleEvent):
                    await self.handle(item.event)
                else:
                    for action in item.actions:
                        if retry:  # as it stands now: it may have finished meanwhile
                            stored = await asyncio.to_thread(self.store.get_action, action.id)
                            action = stored if stored is not None else action
                        self.incidents.carried_out(await self.actuator.run(action))
                    await self.keep()
                return
            except UNAVAILABLE:
                if not retry:
                    log.warning("database unavailable: %r waits for it", item)
                retry = True
                await asyncio.sleep(backoff.next())

    # --- decisions -------------------------------------------------------------------

    async def context(self) -> PolicyContext:
        now = utcnow()
        window_start = now - timedelta(seconds=self.settings.restart_window_s)
        counts = await asyncio.to_thread(self.store.policy_counts, window_start)
        restarts = dict(counts.restarts_in_window)
        for job, reset_at in self.budgets.reset_times().items():
            if reset_at > window_start:  # an operator started its budget over since
                since = await asyncio.to_thread(self.store.policy_counts, reset_at)
                restarts[job] = since.restarts_in_window.get(job, 0)
        nodes, jobs = self._snapshot()
        for job in jobs:
            self.budgets.observe(job, nodes, jobs)
        return PolicyContext(
            now=now,
            limits=self._limits,
            nodes=nodes,
            jobs=jobs,
            node_failures=counts.node_failures,
            action_counts=counts.action_counts,
            restarts_in_window=restarts,
            no_progress_restarts=self.budgets.counts(),
            failed_last_remedy=counts.failed_last_remedy,
        )

    def decide(self, event: Event, context: PolicyContext) -> list[ActionRequest]:
        """Run the policy; a policy that raises or returns garbage decides nothing."""
        return self._decide(event, context)[0]

    def _decide(
        self, event: Event, context: PolicyContext
    ) -> tuple[list[ActionRequest], str | None]:
        """The actions, and what the policy raised or returned that was not an action
        (recorded with the event, and counted, so that it is seen beyond the log)."""
        try:
            decided = self.policy.event_policy(event, context)
        except Exception as exc:
            log.exception("policy %s raised on event %s", self.policy.name, event.id)
            self.metrics.policy_errors.labels(event.type.value).inc()
            return [], f"{type(exc).__name__}: {exc}"
        requests = [r for r in decided if isinstance(r, ActionRequest)]
        if len(requests) != len(decided):
            log.error("policy %s returned non-actions for event %s", self.policy.name, event.id)
            self.metrics.policy_errors.labels(event.type.value).inc()
            wrong = next(r for r in decided if not isinstance(r, ActionRequest))
            return requests, f"returned {type(wrong).__name__}, not an ActionRequest"
        return requests, None

    def _judge_budget(
        self,
        event: Event,
        context: PolicyContext,
        actions: list[ActionRecord],
        unmendable: str | None,
    ) -> None:
        """Count a remedy of the job; a failure left without one for a spent budget, or
        one no remedy mends: the supervisor gives up on the job and says so
        (controller/budget.py)."""
        assert event.job is not None
        if actions:
            self.budgets.remedied(event, actions, context.nodes, context.jobs)
            return
        self.budgets.give_up(event, context, unmendable)  # said once kept (keep)

    async def handle(self, event: Event) -> list[ActionRecord]:
        """Decide on one persisted event, record the decision, then carry it out."""
        if event.id is None:
            raise ValueError("only persisted events can be handled")
        incident = self.incidents.incident_of(event)
        if incident is not None:
            self.actuator.fence()
            attached = await asyncio.to_thread(
                self.store.attach_event, event.id, incident.action_id
            )
            if attached is not None:
                self.actuator.changed(attached)
            log.info(
                "event %s %s node=%s job=%s -> attached to the incident of action %s",
                event.id,
                event.type.value,
                event.node,
                event.job,
                incident.action_id,
                extra=event_log_fields(event),
            )
            return []
        context = await self.context()
        unmendable = usage_error(event, context)
        requests, error = ([], None) if unmendable else self._decide(event, context)
        self.actuator.fence()  # only the leader records decisions (a policy may be slow)
        actions = await asyncio.to_thread(
            lambda: self.store.handle_event(event.id or 0, requests, policy_error=error)
        )
        for action in actions:
            self.actuator.changed(action)
        log.info(
            "event %s %s node=%s job=%s -> %s",
            event.id,
            event.type.value,
            event.node,
            event.job,
            ", ".join(a.type.value for a in actions) or "no action",
            extra=event_log_fields(event),
        )
        if event.job is not None:
            mine = [a for a in actions if a.job == event.job]
            self._judge_budget(event, context, mine, unmendable)
        opened = self.incidents.opened(event, actions, dict(context.nodes))
        await self.keep()  # before the remedy runs: its incident outlives this supervisor
        done: list[ActionRecord] = []
        try:
            for action in actions:
                done.append(await self.actuator.run(action))
        finally:
            if opened is not None:
                healer = next((a for a in done if a.id == opened.action_id), None)
                failed = healer is not None and healer.status is ActionStatus.FAILED
                self.incidents.closed(opened, failed=failed)
        await self.keep()
        return done


def event_log_fields(event: Event) -> dict[str, object]:
    """An event's fields for a structured log line (resiliency_protocol.logs)."""
    return {
        "event": event.id,
        "event_type": event.type.value,
        "job": event.job,
        "node": event.node,
        "rank": event.rank,
        "fault_id": event.fault_id,
    }
